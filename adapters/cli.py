"""The `fencepost` command line."""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fencepost", description="OpenAI-compatible LLM serving on fenced state machines."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    bench = commands.add_parser("bench", help="print performance figures")
    benches = bench.add_subparsers(dest="bench", required=True)
    router = benches.add_parser("router", help="fenced token deliveries/s through Router.handle")
    router.add_argument("--workers", type=_positive, default=4)
    router.add_argument("--requests", type=_positive, default=64)
    router.add_argument("--tokens", type=_positive, default=1000)
    router.add_argument("--rounds", type=_positive, default=5)
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive")
    return value


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "bench" and args.bench == "router":
        from adapters import bench_router

        return bench_router.main(args.workers, args.requests, args.tokens, args.rounds)
    raise AssertionError(f"unhandled command {args}")


if __name__ == "__main__":
    sys.exit(main())
