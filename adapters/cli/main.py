"""`fencepost`: the table of commands, the parser built from it, and the dispatch.

A command is a module with `add_arguments(parser)` and `run(args) -> int`;
adding one is a row in COMMANDS. The parser records the chosen command's name
and `main` hands the parsed arguments to that module's `run`, so no command's
flags are known here.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Protocol

from adapters.cli import bench, certs, cluster, mutants, serve, sim, worker
from adapters.engine.errors import ModelError


class Command(Protocol):
    """What a command module offers: its flags, and running with them."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


COMMANDS: tuple[tuple[str, str, Command], ...] = (
    ("sim", "deterministic simulation under injected faults (one seed, or a sweep)", sim),
    ("mutants", "patch core/ with known bugs and show the simulator catches each", mutants),
    ("serve", "the OpenAI-compatible HTTP server (default: embedded default model)", serve),
    ("worker", "run a worker process that serves routers over TCP", worker),
    ("cluster", "routers, workers and a balancer as processes on this machine", cluster),
    ("certs", "make a CA and certificates for mutual TLS on the worker links", certs),
    ("bench", "print performance figures", bench),
)


# The commands whose work is printing (traces, reports) and that own no sockets.
PRINTERS = frozenset({"sim", "mutants"})
# Commands that end the process as soon as they return: a worker that has drained
# holds nothing and has flushed and closed its links, and the interpreter's own
# teardown (freeing the model's tensors one by one) took 0.7-1.8 s of a rollout's
# time between SIGTERM and exit.
QUICK_EXIT = frozenset({"worker"})


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="fencepost", description="OpenAI-compatible LLM serving on fenced state machines."
    )
    commands = top.add_subparsers(dest="command", required=True)
    for name, summary, module in COMMANDS:
        module.add_arguments(commands.add_parser(name, help=summary))
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if argv is None and args.command in PRINTERS:  # the command itself, not a call from Python
        # Die quietly when the reader of a long trace goes away (`| head`). Only these:
        # a server or worker with SIGPIPE's default would be killed, silently, by its
        # first write to a socket whose peer had gone (a client, a refused TLS peer).
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    [module] = [module for name, _, module in COMMANDS if name == args.command]
    try:
        code = module.run(args)
    except ModelError as error:  # a model that cannot be served: one line, no traceback
        print(f"fencepost {args.command}: {error}", file=sys.stderr, flush=True)
        return 2
    if argv is None and args.command in QUICK_EXIT:  # (a call from Python keeps its process)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
