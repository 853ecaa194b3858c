"""The `fencepost` command line."""

from __future__ import annotations

import argparse
import signal
import sys

from sim.simulator import Scenario


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fencepost", description="OpenAI-compatible LLM serving on fenced state machines."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    sim = commands.add_parser(
        "sim", help="deterministic simulation under injected faults (one seed, or a sweep)"
    )
    which = sim.add_mutually_exclusive_group(required=True)
    which.add_argument("--seed", type=_natural, help="run this one root seed")
    which.add_argument("--seeds", type=_positive, metavar="COUNT", help="sweep COUNT seeds")
    sim.add_argument("--start", type=_natural, default=0, help="first seed of a sweep")
    sim.add_argument("--trace", action="store_true", help="print every event of the run")
    sim.add_argument("--workers", type=_positive, default=Scenario.workers)
    sim.add_argument("--requests", type=_positive, default=Scenario.requests)
    sim.add_argument(
        "--determinism-every",
        type=_positive,
        default=50,
        help="run every Nth seed of a sweep twice and compare trace hashes",
    )

    mutants = commands.add_parser(
        "mutants", help="patch core/ with known bugs and show the simulator catches each"
    )
    mutants.add_argument("--seeds", type=_positive, default=500, help="most seeds per mutant")
    mutants.add_argument("--start", type=_natural, default=0)
    mutants.add_argument("--timeout", type=_positive, default=600, help="seconds per mutant")

    serve = commands.add_parser(
        "serve", help="the OpenAI-compatible HTTP server (default: embedded default model)"
    )
    from adapters import serve_command

    serve_command.add_arguments(serve)

    worker = commands.add_parser(
        "worker", help="run a worker process that serves a router over TCP"
    )
    from adapters import worker_command

    worker_command.add_arguments(worker)

    bench = commands.add_parser("bench", help="print performance figures")
    benches = bench.add_subparsers(dest="bench", required=True)
    router = benches.add_parser("router", help="fenced token deliveries/s through Router.handle")
    router.add_argument("--workers", type=_positive, default=4)
    router.add_argument("--requests", type=_positive, default=64)
    router.add_argument("--tokens", type=_positive, default=1000)
    router.add_argument("--rounds", type=_positive, default=5)
    runtime = benches.add_parser(
        "runtime", help="delivered tokens/s through the trio runtime, instant fake decoder"
    )
    runtime.add_argument("--requests", type=_positive, default=64)
    runtime.add_argument("--tokens", type=_positive, default=500)
    runtime.add_argument("--rounds", type=_positive, default=3)
    runtime.add_argument("--workers", default="1,4", help="comma-separated worker counts")
    serve_bench = benches.add_parser(
        "serve", help="streaming clients against a served model: latency, throughput, RSS"
    )
    serve_bench.add_argument("--model", default=None, help="HF directory or .gguf")
    serve_bench.add_argument("--fake", action="store_true", help="the fake model (harness check)")
    serve_bench.add_argument("--concurrency", default="1,8,16")
    serve_bench.add_argument("--tokens", type=_positive, default=128)
    serve_bench.add_argument("--rounds", type=_positive, default=1, help="requests per client")
    serve_bench.add_argument("--time-limit", type=_positive, default=600, help="seconds a run")
    serve_bench.add_argument("--mixed", action="store_true", help="add slow and hang-up clients")
    serve_bench.add_argument("--baselines", action="store_true", help="naive and HF servers too")
    serve_bench.add_argument("--threads", type=_positive, default=None)
    drill = benches.add_parser("drill", help="kill -9 a worker under load; count outcomes")
    drill.add_argument("--model", default=None, help="real-model workers (default: fake)")
    drill.add_argument("--clients", type=_positive, default=16)
    drill.add_argument("--duration", type=_positive, default=20, help="seconds of load")
    drill.add_argument("--kill-at", type=_positive, default=6, help="seconds into the load")
    drill.add_argument("--tokens", type=_positive, default=100)
    naive = benches.add_parser("naive-server", help="(baseline) sequential HF generate server")
    naive.add_argument("--port", type=_positive, required=True)
    naive.add_argument("--model", default=None)
    naive.add_argument("--threads", type=_positive, default=None)
    engine = benches.add_parser("engine", help="decode engine vs HF generate, tokens/s")
    engine.add_argument("--model", default=None, help="HF directory or .gguf (default: embedded)")
    engine.add_argument("--tokens", type=_positive, default=128, help="new tokens per request")
    engine.add_argument("--concurrency", default="1,4,8,16", help="comma-separated stream counts")
    engine.add_argument("--threads", type=_positive, default=None, help="torch CPU threads")
    engine.add_argument(
        "--weights",
        choices=("float", "int8"),
        default="float",
        help="engine weights: as loaded, or int8 (CPU; faster, visibly less accurate)",
    )
    return parser


def _natural(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _positive(text: str) -> int:
    value = _natural(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def main(argv: list[str] | None = None) -> int:
    # Die quietly when the reader of a long trace goes away (`| head`).
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    args = _parser().parse_args(argv)
    if args.command == "sim":
        from adapters import sim_command

        scenario = Scenario(workers=args.workers, requests=args.requests)
        if args.seed is not None:
            return sim_command.run_one(args.seed, scenario, args.trace)
        return sim_command.run_sweep(args.start, args.seeds, scenario, args.determinism_every)
    if args.command == "serve":
        from adapters import serve_command

        return serve_command.main(args)
    if args.command == "worker":
        from adapters import worker_command

        return worker_command.main(args)
    if args.command == "mutants":
        from adapters import mutants as mutation_check

        return mutation_check.main(args.seeds, args.start, args.timeout)
    if args.command == "bench" and args.bench == "router":
        from adapters import bench_router

        return bench_router.main(args.workers, args.requests, args.tokens, args.rounds)
    if args.command == "bench" and args.bench == "runtime":
        from adapters import bench_runtime

        counts = [int(n) for n in args.workers.split(",")]
        return bench_runtime.main(args.requests, args.tokens, args.rounds, counts)
    if args.command == "bench" and args.bench == "serve":
        from adapters import bench_serve

        levels = [int(n) for n in args.concurrency.split(",")]
        return bench_serve.main(
            args.model, args.fake, levels, args.tokens, args.rounds, args.time_limit,
            args.mixed, args.baselines, args.threads,
        )  # fmt: skip
    if args.command == "bench" and args.bench == "drill":
        from adapters import bench_drill

        return bench_drill.main(args.model, args.clients, args.duration, args.kill_at, args.tokens)
    if args.command == "bench" and args.bench == "naive-server":
        from adapters import bench_naive

        return bench_naive.main(args.port, args.model, args.threads)
    if args.command == "bench" and args.bench == "engine":
        from adapters import bench_engine

        levels = [int(n) for n in args.concurrency.split(",")]
        return bench_engine.main(args.model, args.tokens, levels, args.threads, args.weights)
    raise AssertionError(f"unhandled command {args}")


if __name__ == "__main__":
    sys.exit(main())
