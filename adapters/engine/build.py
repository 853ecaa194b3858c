"""From EngineOptions to an Engine, with each decision made once and in order.

Serve, worker and the benches build their engines here. The order matters:
torch's CPU threads are set first, so that choosing the weight format measures
what serving will run; the format is chosen next (adapters/engine/choose.py,
which runs the quality gate and so builds engines of its own: that is why the
Engine itself takes a concrete format and never chooses); the served context
is options.py's served_context of the model's own; then the Engine sizes its
KV pool (and may cut the context to it, logged). The threads the engine's
stepping thread takes are decided last, because the native format wants every
core (options.serving_threads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from adapters.engine.choose import choose
from adapters.engine.console import say
from adapters.engine.engine import Engine
from adapters.engine.model import LoadedModel, load_model
from adapters.engine.options import (
    EngineOptions,
    default_threads,
    served_context,
    serving_threads,
)
from adapters.engine.speculative import SPECULATIVE_KINDS, SpeculativeOptions
from adapters.engine.weights import NATIVE
from core.batching import BatchLimits


@dataclass(frozen=True)
class BuiltEngine:
    """An engine as serving runs it, and the CPU threads its stepping thread sets
    (None: torch's own, as on a GPU)."""

    engine: Engine
    threads: int | None


def weight_format(loaded: LoadedModel, requested: str, rows: int) -> str:
    """The format to load `loaded` in: `requested`, or for "auto" the one choose()
    measures for `rows` rows (its reason logged)."""
    if requested != "auto":
        return requested
    choice = choose(loaded, rows, say)
    say(choice.reason)
    return choice.format


def build_engine(loaded: LoadedModel, options: EngineOptions, **engine: Any) -> BuiltEngine:
    """The Engine `options` describe on a loaded model; `engine`: Engine's other
    keywords (block_size, grammar_tokenizer, kv_cache_share), for benches and tests."""
    device = loaded.device.type
    threads = options.threads if options.threads is not None else default_threads(device)
    if threads is not None:
        torch.set_num_threads(threads)
    fmt = weight_format(loaded, options.weights, options.slots)
    limits = BatchLimits(
        max_seqs=options.slots, max_context=served_context(loaded.max_context, options.max_context)
    )
    speculative, draft = speculation(loaded, options, fmt)
    built = Engine(
        loaded,
        limits,
        fmt,
        prefix_caching=options.prefix_caching,
        kv_cache_tokens=options.kv_cache_tokens,
        decode=options.decode,
        attention=options.attention,
        speculative=speculative,
        draft=draft,
        **engine,
    )
    if options.threads is None and fmt in NATIVE:
        threads = serving_threads(device, fmt)
        say(f"weights {fmt}: the engine takes all {threads} CPU threads")
    return BuiltEngine(built, threads)


def speculation(
    loaded: LoadedModel, options: EngineOptions, fmt: str
) -> tuple[SpeculativeOptions | None, tuple[LoadedModel, str] | None]:
    """The speculative decoding `options` ask for on a model loaded in `fmt`, and the
    draft model (loaded, and its format) when it drafts. "auto" is the draft when one is
    given; else n-gram lookup on the native formats, where it measured 2.1-2.4x on an
    editing task and no slower on chat (engine.md, "Speculative decoding"), and where
    a prefilled position equals a decoded one bit for bit; else none (torch's formats,
    the GPU's among them, are not measured yet)."""
    kind = options.speculative
    if kind not in SPECULATIVE_KINDS:
        raise ValueError(
            f"unknown speculative kind {kind!r}; one of {', '.join(SPECULATIVE_KINDS)}"
        )
    if kind == "auto":
        kind = "draft" if options.draft_model else "ngram" if fmt in NATIVE else "none"
        if kind == "none":
            say(f"speculative decoding: off (auto on {fmt}; --speculative ngram turns it on)")
        elif kind == "ngram":
            say(f"speculative decoding: n-gram (auto on {fmt}; --speculative none turns it off)")
    if kind == "none":
        if options.draft_model:
            raise ValueError("--draft-model needs --speculative draft (or auto)")
        return None, None
    chosen = SpeculativeOptions(kind, options.speculative_tokens)
    if kind == "ngram":
        if options.draft_model:
            raise ValueError("--draft-model is for --speculative draft, not ngram")
        return chosen, None
    if not options.draft_model:
        raise ValueError("--speculative draft needs --draft-model")
    model = load_model(options.draft_model, quiet=True, max_context=loaded.max_context)
    if model.device != loaded.device:
        raise ValueError(f"the draft model loads on {model.device}, the model on {loaded.device}")
    return chosen, (model, weight_format(model, "auto", options.slots))


def load_engine(options: EngineOptions, quiet: bool = False) -> BuiltEngine:
    """Load options.model (its context cut once, served_context) and build its engine."""
    loaded = load_model(options.model, quiet=quiet, max_context=options.max_context)
    return build_engine(loaded, options)
