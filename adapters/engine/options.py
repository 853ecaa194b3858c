"""What a caller asks of an engine, before anything is loaded: one struct that serve,
worker, the benches and the tests fill, and the one rule for a served context.

Kept free of torch so that the command line can build it (and show its defaults)
without importing the engine. adapters/engine/build.py turns it into an Engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_KV_CACHE_TOKENS = 16 * 2048  # the memory of 16 sequences of 2048 tokens
DEFAULT_SLOTS = 16


@dataclass(frozen=True)
class EngineOptions:
    """model: an HF directory, a .gguf file or a hub id in the local cache (None: the
    embedded default). max_context: the longest context served (None: the model's own,
    cut to what the KV cache holds). slots: sequences decoded together. threads: torch
    CPU threads (None: decided by build.py from the device and the weight format).
    weights: a format of weights.py, or "auto" (measured at start on CPU, bf16 on CUDA).
    kv_cache_tokens: positions the KV pool holds (None: sized from free memory).
    decode and attention: Engine's decode path and fixed-shape attention.
    speculative: "auto", "none", "ngram" or "draft" (build.py resolves auto);
    draft_model: the draft's HF directory or .gguf (its tokenizer the model's);
    speculative_tokens: the most tokens a sequence proposes in one step."""

    model: str | None = None
    max_context: int | None = None
    slots: int = DEFAULT_SLOTS
    threads: int | None = None
    weights: str = "auto"
    decode: str = "auto"
    attention: str = "auto"
    kv_cache_tokens: int | None = None
    prefix_caching: bool = True
    speculative: str = "auto"
    draft_model: str | None = None
    speculative_tokens: int = 8


def served_context(trained: int, asked: int | None) -> int:
    """The context a model serves: what was asked, never more than it was trained for
    (None: all of it). Every place that loads a model or its tokenizer cuts here."""
    return trained if asked is None else min(asked, trained)


def default_threads(device_type: str) -> int | None:
    """torch CPU threads when the engine shares the machine with the event loop.

    On CPU, torch's default (every core) leaves the event loop, the HTTP layer
    and the sockets to preempt the matrix work, and every preemption stalls a
    whole parallel op: measured on 2 cores, serving lost 28-46% of the engine's
    own throughput that way, against 4-13% with one core left free (engine.md).
    """
    if device_type != "cpu":
        return None
    return max(1, (os.cpu_count() or 2) - 1)


# weights.NATIVE, named again so that this module needs no torch (a test keeps them alike).
NATIVE_FORMATS = ("w4a16", "w4a8")


def serving_threads(device_type: str, weights: str) -> int | None:
    """The engine's threads when serving in the weight format `weights` and none were
    given: every core for the native format, whose threads meet a handful of times a
    layer and lose little to the event loop (engine.md: 1.5-1.6x over one thread on 2
    cores); default_threads for torch's formats."""
    if device_type == "cpu" and weights in NATIVE_FORMATS:
        return os.cpu_count() or 1
    return default_threads(device_type)
