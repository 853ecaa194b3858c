"""The `fencepost` command line: one module per command, the table in main.py.

Each command module offers `add_arguments(parser)` and `run(args) -> int`.
Building the parser imports every command module, so a module that reaches
the simulator or the benches does it inside `run`: `fencepost serve` and
`fencepost worker` never load either. This package holds the argument types
the commands share.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from adapters.engine.options import DEFAULT_KV_CACHE_TOKENS, DEFAULT_SLOTS, EngineOptions
from core.fake_model import FAKE_CONTEXT

if TYPE_CHECKING:
    from adapters.runtime.tls import TlsFiles

# adapters/engine/weights.py FORMATS, plus "auto" (a test keeps the two alike; named here
# so that building the command line does not import torch).
WEIGHT_CHOICES = ("auto", "fp32", "bf16", "fp16", "int8", "int4", "w4a16", "w4a8")


def add_weights_argument(parser: argparse.ArgumentParser) -> None:
    """--weights, as serve, worker and the engine bench take it."""
    parser.add_argument(
        "--weights",
        choices=WEIGHT_CHOICES,
        default="auto",
        help="weight format; auto: measured at start on CPU (quality gate + speed), bf16 on CUDA",
    )


# adapters/engine/engine.py DECODE_PATHS and paged_attention.py ATTENTIONS plus "auto" (a
# test keeps them alike).
DECODE_CHOICES = ("auto", "eager", "static", "graphs")
ATTENTION_CHOICES = ("auto", "gather", "sdpa", "triton")


def add_decode_arguments(parser: argparse.ArgumentParser) -> None:
    """--decode and --decode-attention, as serve, worker and the engine bench take them."""
    parser.add_argument(
        "--decode", choices=DECODE_CHOICES, default="auto",
        help="how decode steps run: auto = CUDA graphs on a GPU, eager on CPU; static = "
        "the graphs' fixed-shape step without capture",
    )  # fmt: skip
    parser.add_argument(
        "--decode-attention", choices=ATTENTION_CHOICES, default="auto",
        help="attention of the fixed-shape step: auto = the fastest, measured at start",
    )  # fmt: skip


def add_kv_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """--no-prefix-cache and --kv-cache-tokens, as serve, worker and the engine bench take
    them."""
    parser.add_argument(
        "--no-prefix-cache",
        dest="no_prefix_cache",
        action="store_true",
        help="never share KV blocks between requests (each prompt is computed whole)",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=positive,
        default=None,
        metavar="N",
        help="token positions the KV cache holds, all sequences together (default: what "
        "half the memory free after the weights holds, 85%% on a GPU, at most every slot "
        f"at the full context; the fake decoder: {DEFAULT_KV_CACHE_TOKENS})",
    )


MODEL_HELP = "HF directory or .gguf (default: embedded)"


def add_model_argument(parser: argparse._ActionsContainer, help: str = MODEL_HELP) -> None:
    """--model: the model to load, as every command that loads one takes it."""
    parser.add_argument("--model", default=None, help=help)


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """--threads: the engine's torch CPU threads (default: build.py decides)."""
    parser.add_argument("--threads", type=positive, default=None, help="torch CPU threads")


# adapters/engine/speculative.py SPECULATIVE_KINDS (a test keeps them alike).
SPECULATIVE_CHOICES = ("auto", "none", "ngram", "draft")


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """--speculative, --draft-model and --speculative-tokens, as serve, worker and the
    engine bench take them."""
    parser.add_argument(
        "--speculative", choices=SPECULATIVE_CHOICES, default="auto",
        help="speculative decoding (never changes a token): ngram = guesses looked up in "
        "the prompt and output, draft = guesses of --draft-model; auto = draft when a draft "
        "model is given, else ngram on the native CPU formats (measured faster there) and "
        "none on the others",
    )  # fmt: skip
    parser.add_argument(
        "--draft-model", default=None, metavar="PATH",
        help="a smaller model with the same tokenizer that proposes tokens (HF directory or .gguf)",
    )  # fmt: skip
    parser.add_argument(
        "--speculative-tokens", type=positive, default=8, metavar="N",
        help="the most tokens a sequence proposes in one step (fewer while its guesses miss)",
    )  # fmt: skip


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Everything an engine is built from (adapters/engine/options.py's EngineOptions),
    as serve and worker take it: --model, --slots, --max-context, --threads, --weights,
    the KV cache's and the decode path's flags. engine_options(args) reads them."""
    add_model_argument(parser)
    parser.add_argument(
        "--slots", type=positive, default=DEFAULT_SLOTS,
        help="concurrent sequences a worker decodes",
    )  # fmt: skip
    parser.add_argument(
        "--max-context", type=positive, default=None, metavar="TOKENS",
        help="longest context a request may have (default: the model's own, cut to what "
        f"the KV cache holds; the fake model: {FAKE_CONTEXT})",
    )  # fmt: skip
    add_threads_argument(parser)
    add_weights_argument(parser)
    add_kv_cache_arguments(parser)
    add_decode_arguments(parser)
    add_speculative_arguments(parser)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The EngineOptions of a command that called add_engine_arguments."""
    return EngineOptions(
        model=args.model,
        max_context=args.max_context,
        slots=args.slots,
        threads=args.threads,
        weights=args.weights,
        decode=args.decode,
        attention=args.decode_attention,
        kv_cache_tokens=args.kv_cache_tokens,
        prefix_caching=not args.no_prefix_cache,
        speculative=args.speculative,
        draft_model=args.draft_model,
        speculative_tokens=args.speculative_tokens,
    )


def natural(text: str) -> int:
    """An argument that must be a whole number, zero or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def positive(text: str) -> int:
    """An argument that must be a whole number, one or more."""
    value = natural(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def warn_unused(
    args: argparse.Namespace,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    rules: Iterable[tuple[bool, tuple[str, ...], str]],
    log: logging.Logger,
) -> list[str]:
    """One warning line per mode that leaves flags unread: for each (applies, flags,
    why), the flags given a value other than their default. Returns the lines."""
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    lines = []
    for applies, flags, why in rules:
        dests = [(flag, flag.lstrip("-").replace("-", "_")) for flag in flags]
        given = [f for f, d in dests if applies and getattr(args, d) != defaults.get_default(d)]
        if given:
            lines.append(f"ignoring {', '.join(given)}: {why}")
            log.warning("%s", lines[-1])
    return lines


def add_key_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--api-key and --api-key-file: who may use the OpenAI port (serve, cluster)."""
    from adapters.openai.auth import ENV_KEYS

    keys = parser.add_argument_group("API keys (the OpenAI port; default: open, on loopback)")
    keys.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="a key clients must send as 'Authorization: Bearer KEY'; repeat for several "
        f"(also: the {ENV_KEYS} variable, keys separated by commas)",
    )  # fmt: skip
    keys.add_argument(
        "--api-key-file", action="append", default=[], type=Path, metavar="FILE",
        help="keys one per line (a mounted Secret); # starts a comment line",
    )  # fmt: skip
    return keys


def add_tls_arguments(parser: argparse.ArgumentParser, port: str) -> None:
    """--tls-cert, --tls-key and --tls-ca: mutual TLS on the worker links (serve, worker)."""
    group = parser.add_argument_group(
        f"mutual TLS on the worker links ({port}; all three, or none: unauthenticated)"
    )
    group.add_argument("--tls-cert", default=None, metavar="PEM", help="this process's certificate")
    group.add_argument("--tls-key", default=None, metavar="PEM", help="its private key")
    group.add_argument(
        "--tls-ca", default=None, metavar="PEM",
        help="the CA whose certificates the other side must show (`fencepost certs` makes one)",
    )  # fmt: skip


def tls_files(args: argparse.Namespace) -> TlsFiles | None:
    """The three TLS files given, or None; TlsError when only some are."""
    from adapters.runtime.tls import TlsError, TlsFiles

    given = {"--tls-cert": args.tls_cert, "--tls-key": args.tls_key, "--tls-ca": args.tls_ca}
    if not any(given.values()):
        return None
    missing = [flag for flag, value in given.items() if not value]
    if missing:
        raise TlsError(f"mutual TLS needs --tls-cert, --tls-key and --tls-ca; missing {missing}")
    return TlsFiles(Path(args.tls_cert), Path(args.tls_key), Path(args.tls_ca))
