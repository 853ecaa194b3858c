"""`fencepost bench NAME`: every bench's flags, and the way into bench.

The flags live here, in one table with a runner per bench, so that building
the command line imports no bench: each runner imports its module from
bench only once that bench is chosen, and turns the parsed flags
into the module's own arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adapters.cli import (
    WEIGHT_CHOICES,
    add_decode_arguments,
    add_kv_cache_arguments,
    add_model_argument,
    add_speculative_arguments,
    add_threads_argument,
    add_weights_argument,
    natural,
    positive,
)
from core.protocol import MAX_TOP_LOGPROBS

Flags = Callable[[argparse.ArgumentParser], None]
Runner = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class Bench:
    name: str
    help: str
    add_flags: Flags
    run: Runner


def counts(text: str) -> tuple[int, ...]:
    """A comma-separated list of counts: concurrency levels, worker counts."""
    return tuple(int(n) for n in text.split(","))


def _router_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=positive, default=4)
    parser.add_argument("--requests", type=positive, default=64)
    parser.add_argument("--tokens", type=positive, default=1000)
    parser.add_argument("--rounds", type=positive, default=5)


def _router(args: argparse.Namespace) -> int:
    from bench import router

    return router.main(
        workers=args.workers, requests=args.requests, tokens=args.tokens, rounds=args.rounds
    )


def _runtime_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive, default=64)
    parser.add_argument("--tokens", type=positive, default=500)
    parser.add_argument("--rounds", type=positive, default=3)
    parser.add_argument("--workers", default="1,4", help="comma-separated worker counts")


def _runtime(args: argparse.Namespace) -> int:
    from bench import runtime

    return runtime.main(
        requests=args.requests,
        tokens=args.tokens,
        rounds=args.rounds,
        workers=list(counts(args.workers)),
    )


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--fake", action="store_true", help="the fake model (harness check)")
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--tokens", type=positive, default=128)
    parser.add_argument("--rounds", type=positive, default=1, help="requests per client")
    parser.add_argument(
        "--prompt-tokens", type=positive, default=None, metavar="N",
        help="long prompts of about N tokens (distinct from the first word) instead of "
        "the short chat prompts: time to first token over a prompt",
    )  # fmt: skip
    parser.add_argument("--time-limit", type=positive, default=600, help="seconds a run")
    parser.add_argument("--mixed", action="store_true", help="add slow and hang-up clients")
    parser.add_argument("--baselines", action="store_true", help="naive and HF servers too")
    add_threads_argument(parser)
    add_weights_argument(parser)  # a random-weight model needs one named: no perplexity
    parser.add_argument(
        "--peer-llama-cpp",
        metavar="PYTHON",
        default=None,
        help="also run llama-cpp-python's server with this Python (one with "
        "llama-cpp-python[server] installed) on the same GGUF and load",
    )
    parser.add_argument(
        "--peer-llama-server", metavar="BIN", default=None,
        help="also run llama.cpp's C++ llama-server (this binary; scripts/build-llama-server "
        "builds one) on the same GGUF and load",
    )  # fmt: skip
    parser.add_argument(
        "--peer-threads", metavar="N,N", default=None, type=counts,
        help="llama-server's thread counts, one set of rows each (default: the engine's)",
    )  # fmt: skip
    parser.add_argument(
        "--url", default=None, metavar="http://127.0.0.1:PORT",
        help="drive a server already running here (e.g. fencepost cluster) instead of "
        "starting one",
    )  # fmt: skip
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png",
        help="afterwards, write a PNG of tokens/s, TTFT and ITL (p50/p90/p99) against "
        "concurrency, any peers beside fencepost (needs fencepost[plot]: matplotlib)",
    )  # fmt: skip


def _serve(args: argparse.Namespace) -> int:
    from bench import serve

    if args.plot is not None and (problem := _plot_problem(args.plot)) is not None:
        print(f"fencepost bench serve: {problem}", file=sys.stderr, flush=True)
        return 2
    load = serve.ServeLoad(
        model_path=args.model,
        fake=args.fake,
        concurrency=counts(args.concurrency),
        tokens=args.tokens,
        rounds=args.rounds,
        time_limit_s=args.time_limit,
        mixed=args.mixed,
        baselines=args.baselines,
        threads=args.threads,
        peer_llama_cpp=args.peer_llama_cpp,
        peer_llama_server=args.peer_llama_server,
        peer_threads=tuple(args.peer_threads or ()),
        weights=args.weights,
        url=args.url,
        plot=args.plot,
        prompt_tokens=args.prompt_tokens,
    )
    return serve.main(load)


def _plot_problem(path: Path) -> str | None:
    """Why --plot could not write its file, found before the run rather than after it."""
    from bench import plot

    try:
        plot.require()
    except plot.PlotUnavailable as error:
        return str(error)
    if not path.parent.is_dir():
        return f"--plot {path}: the folder {path.parent} does not exist"
    return None


def _drill_flags(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "real-model workers (default: fake)")
    parser.add_argument("--clients", type=positive, default=16)
    parser.add_argument("--duration", type=positive, default=20, help="seconds of load")
    parser.add_argument("--kill-at", type=positive, default=6, help="seconds into the load")
    parser.add_argument(
        "--tokens", type=positive, default=None,
        help="max_tokens of each request (default 100; --rolling: 1000)",
    )  # fmt: skip
    parser.add_argument(
        "--routers", type=positive, default=1,
        help="routers sharing the workers; above 1, kill -9 a router instead of a worker",
    )  # fmt: skip
    rolling = parser.add_argument_group("--rolling: restart every worker in turn under load")
    rolling.add_argument("--rolling", action="store_true", help="a rollout instead of a kill")
    rolling.add_argument("--workers", type=positive, default=3)
    rolling.add_argument("--streams", type=positive, default=16, help="long streams")
    rolling.add_argument("--steady", type=natural, default=4, help="clients of short requests")
    rolling.add_argument("--steady-tokens", type=positive, default=32)
    rolling.add_argument("--step-ms", type=float, default=25.0, help="the fake decoder's step")
    rolling.add_argument("--drain-mode", choices=("handoff", "finish"), default="handoff")
    rolling.add_argument("--drain-timeout", type=positive, default=30.0, metavar="SECONDS")


def _drill(args: argparse.Namespace) -> int:
    from bench import drill

    if args.rolling:
        from bench import rolling

        return rolling.main(
            rolling.Rolling(
                model_path=args.model,
                workers=args.workers,
                streams=args.streams,
                tokens=args.tokens or 1000,
                steady=args.steady,
                steady_tokens=args.steady_tokens,
                step_ms=args.step_ms,
                drain_mode=args.drain_mode,
                drain_timeout_s=args.drain_timeout,
            )
        )
    return drill.main(
        drill.Drill(
            model_path=args.model,
            clients=args.clients,
            duration_s=args.duration,
            kill_at_s=args.kill_at,
            tokens=args.tokens or 100,
            routers=args.routers,
        )
    )


def _chat_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--conversations", type=positive, default=8)
    parser.add_argument("--turns", type=positive, default=4)
    parser.add_argument("--tokens", type=positive, default=64, help="max_tokens of each answer")
    parser.add_argument("--system-tokens", type=positive, default=300)
    parser.add_argument(
        "--workers", default="2,4", help="comma-separated worker counts of the fake runs"
    )
    parser.add_argument(
        "--real-workers", default="1,2", help="comma-separated worker counts of the real runs"
    )
    parser.add_argument(
        "--routing", default="cache-aware,least-loaded",
        help="comma-separated routings of the fake runs ('default': the server's own)",
    )  # fmt: skip
    only = parser.add_mutually_exclusive_group()
    only.add_argument("--fake-only", action="store_true", help="skip the real model")
    only.add_argument("--real-only", action="store_true", help="skip the fake runs")
    parser.add_argument("--fake-prefill-ms-per-token", type=float, default=0.5, metavar="MS")
    parser.add_argument("--fake-step-ms", type=float, default=10.0, metavar="MS")
    add_model_argument(parser)
    parser.add_argument("--time-limit", type=positive, default=300, help="seconds a run")


def _chat(args: argparse.Namespace) -> int:
    from bench import chat

    load = chat.ChatLoad(
        conversations=args.conversations,
        turns=args.turns,
        tokens=args.tokens,
        system_tokens=args.system_tokens,
        real_workers=() if args.fake_only else counts(args.real_workers),
        fake_workers=() if args.real_only else counts(args.workers),
        routings=tuple(args.routing.split(",")),
        fake_prefill_ms_per_token=args.fake_prefill_ms_per_token,
        fake_step_ms=args.fake_step_ms,
        model_path=args.model,
        time_limit_s=args.time_limit,
    )
    return chat.main(load)


def _naive_server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=positive, required=True)
    add_model_argument(parser)
    add_threads_argument(parser)


def _naive_server(args: argparse.Namespace) -> int:
    from bench import naive_server

    return naive_server.main(port=args.port, model_path=args.model, threads=args.threads)


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--tokens", type=positive, default=128, help="new tokens per request")
    parser.add_argument("--concurrency", default="1,4,8,16", help="comma-separated stream counts")
    add_threads_argument(parser)
    parser.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto",
        help="where the model runs (auto: CUDA when present; bf16 there, the weights "
        "format of --weights on CPU)",
    )  # fmt: skip
    add_weights_argument(parser)
    add_kv_cache_arguments(parser)
    add_decode_arguments(parser)
    parser.add_argument(
        "--block-size", type=positive, default=16, metavar="TOKENS",
        help="positions per KV cache block (default %(default)s, chosen by measurement)",
    )  # fmt: skip
    parser.add_argument(
        "--shared-prefix", type=positive, default=None, metavar="TOKENS",
        help="also time the first token of a request whose TOKENS-token prefix is cached "
        "against one whose prefix is not",
    )  # fmt: skip
    parser.add_argument(
        "--logprobs", type=int, choices=range(MAX_TOP_LOGPROBS + 1), default=None, metavar="K",
        help="also measure each concurrency without and with logprobs (top K), side by side",
    )  # fmt: skip
    parser.add_argument(
        "--constrained", action="store_true",
        help="also compare tokens/s of JSON streams free and constrained to a typical schema",
    )  # fmt: skip
    parser.add_argument(
        "--json-schema", default=None, metavar="FILE",
        help="with --constrained: the JSON Schema to constrain to (default: a typical one)",
    )  # fmt: skip
    add_speculative_arguments(parser)
    parser.add_argument(
        "--draft-weights", choices=WEIGHT_CHOICES, default="auto",
        help="with --speculative draft: the draft model's weight format",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=positive, default=2,
        help="with --speculative: rounds a side, alternating (the best of each is shown)",
    )  # fmt: skip
    parser.add_argument(
        "--position", type=positive, default=512, metavar="TOKENS",
        help="with --speculative: the context length the verification cost is timed at",
    )  # fmt: skip


def _engine(args: argparse.Namespace) -> int:
    from bench import engine

    schema = None
    if args.json_schema is not None:
        schema = json.loads(Path(args.json_schema).read_text())
    elif args.constrained:
        schema = engine.TYPICAL_SCHEMA
    kind = args.speculative
    if kind == "auto":
        kind = "draft" if args.draft_model else "none"
    if args.draft_model and kind != "draft":
        raise SystemExit("--draft-model is for --speculative draft")
    speculative = None
    if kind != "none":  # the side-by-side comparison, in place of the usual rows
        speculative = {
            "kind": kind,
            "speculative_tokens": args.speculative_tokens,
            "draft_model": args.draft_model,
            "draft_weights": args.draft_weights,
            "rounds": args.rounds,
            "position": args.position,
        }
    return engine.main(
        model_path=args.model,
        tokens=args.tokens,
        concurrency=list(counts(args.concurrency)),
        threads=args.threads,
        weights=args.weights,
        prefix_caching=not args.no_prefix_cache,
        kv_cache_tokens=args.kv_cache_tokens,
        shared_prefix=args.shared_prefix,
        device=args.device,
        block_size=args.block_size,
        logprobs=args.logprobs,
        schema=schema,
        decode=args.decode,
        attention=args.decode_attention,
        speculative=speculative,
    )


def _quality_flags(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser)
    parser.add_argument("--tokens", type=positive, default=2048, help="tokens of text scored")
    parser.add_argument("--generate", type=positive, default=48, help="greedy tokens a prompt")
    add_threads_argument(parser)
    parser.add_argument(
        "--formats", type=_format_list, default=None, metavar="F,F",
        help="only these weight formats (fp32, the reference, always runs; default: every "
        "format this CPU runs)",
    )  # fmt: skip


def _format_list(text: str) -> tuple[str, ...]:
    from adapters.engine.weights import FORMATS

    formats = tuple(f.strip() for f in text.split(",") if f.strip())
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise argparse.ArgumentTypeError(f"formats are among {', '.join(FORMATS)}")
    return formats


def _quality(args: argparse.Namespace) -> int:
    from bench import quality

    return quality.main(args.model, args.tokens, args.generate, args.threads, args.formats)


def _memory_flags(parser: argparse.ArgumentParser) -> None:
    add_model_argument(parser, "HF directory, .gguf or hub id (default: embedded)")
    parser.add_argument("--formats", default="fp32,w4a16", help="comma-separated weight formats")
    add_threads_argument(parser)


def _memory(args: argparse.Namespace) -> int:
    from bench import memory

    return memory.main(args.model, args.formats.split(","), args.threads)


def _attack_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--http-rate", type=natural, default=1000, help="keyless requests/s")
    parser.add_argument("--tls-rate", type=natural, default=100, help="failing handshakes/s")
    parser.add_argument("--clients", type=positive, default=4, help="concurrent keyed clients")
    parser.add_argument("--tokens", type=positive, default=16, help="tokens per answer")
    parser.add_argument("--step-ms", type=float, default=2.0, help="the fake's time per token")


def _attack(args: argparse.Namespace) -> int:
    from bench import attack

    return attack.main(
        args.seconds, args.http_rate, args.tls_rate, args.clients, args.tokens, args.step_ms
    )


def _store_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stores", default="memory,sqlite:TEMP",
        help="comma-separated state stores to compare (sqlite:TEMP: a file in a temporary "
        "folder; add a postgresql:// URL to measure PostgreSQL) (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--responses", type=positive, default=1000, help="per kind and store")


def _store(args: argparse.Namespace) -> int:
    from bench import store

    return store.main([s for s in args.stores.split(",") if s], args.responses)


BENCHES = (
    Bench("router", "fenced token deliveries/s through Router.handle", _router_flags, _router),
    Bench(
        "runtime",
        "delivered tokens/s through the trio runtime, instant fake decoder",
        _runtime_flags,
        _runtime,
    ),
    Bench(
        "serve",
        "streaming clients against a served model: latency, throughput, RSS",
        _serve_flags,
        _serve,
    ),
    Bench("drill", "kill -9 a worker under load; count outcomes", _drill_flags, _drill),
    Bench(
        "attack",
        "keyed clients' latency while keyless requests and bad TLS handshakes flood in",
        _attack_flags,
        _attack,
    ),
    Bench(
        "chat",
        "multi-turn conversations sharing a system prompt: TTFT by turn, prefix-cache hits",
        _chat_flags,
        _chat,
    ),
    Bench(
        "naive-server",
        "(baseline) sequential HF generate server",
        _naive_server_flags,
        _naive_server,
    ),
    Bench("engine", "decode engine vs HF generate, tokens/s", _engine_flags, _engine),
    Bench(
        "store",
        "the latency a stored response adds, per state store (memory, SQLite, PostgreSQL)",
        _store_flags,
        _store,
    ),
    Bench(
        "memory",
        "resident memory a model costs as serving loads it, per weight format",
        _memory_flags,
        _memory,
    ),
    Bench(
        "quality",
        "every weight format against fp32: perplexity, greedy agreement, step time",
        _quality_flags,
        _quality,
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", required=True)
    for bench in BENCHES:
        bench.add_flags(benches.add_parser(bench.name, help=bench.help))


def run(args: argparse.Namespace) -> int:
    [chosen] = [bench for bench in BENCHES if bench.name == args.bench]
    return chosen.run(args)
