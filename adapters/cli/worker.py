"""`fencepost worker`: one worker process serving one or more routers over TCP.

Each --connect HOST:PORT is a router, or several: a name resolving to several
addresses (a Kubernetes headless Service) links the worker to each, and names
are resolved again every --resolve-interval seconds, so routers that come and
go are followed. Offers from all routers compete for the same slots.
--health-listen HOST:PORT serves /health, /ready and /metrics (health.py).

SIGTERM or SIGINT drains it: it declines new offers at once (its heartbeats
offer no capacity) and, with --drain-mode handoff (the default), gives its
streams back to their routers, which continue each on another worker from
the exact token delivered and cancel it here once that worker has accepted
it; a stream no other worker can take runs on here. With --drain-mode finish
its streams run to their end here. Either way it exits 0 once it holds
nothing, or after --drain-timeout seconds; whatever was still running is then
continued by the router from its delivered prefix when the link closes.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket

import trio

from adapters.cli import (
    add_engine_arguments,
    add_tls_arguments,
    engine_options,
    tls_files,
    warn_unused,
)
from adapters.runtime.health import serve_health
from adapters.runtime.tcp_worker import RemoteWorker
from adapters.runtime.tls import Credentials, TlsError, client_context
from adapters.runtime.worker_host import FakeOptions, make_decoder
from core.worker import WorkerConfig

log = logging.getLogger("fencepost.worker")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--connect", required=True, metavar="HOST:PORT", type=address, action="append",
        help="a router's worker port; repeat for several routers; a name resolving to "
        "several addresses is a router at each",
    )  # fmt: skip
    parser.add_argument(
        "--resolve-interval", type=float, default=5.0, metavar="SECONDS",
        help="resolve the --connect names again this often (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--health-listen", type=listen_address, default=None, metavar="HOST:PORT",
        help="serve GET /health, /ready and /metrics here (default: off)",
    )  # fmt: skip
    parser.add_argument("--worker-id", default=None, help="default: HOSTNAME-PID")
    parser.add_argument(
        "--take-over", action="store_true",
        help="replace a live worker of the same id (default: exit, the id is taken)",
    )  # fmt: skip
    parser.add_argument(
        "--refused-grace", type=float, default=10.0, metavar="SECONDS",
        help="when the router refuses the id, keep asking for this long (a previous "
        "process of ours may not be seen dead yet), then exit 2 (default %(default)s)",
    )  # fmt: skip
    parser.add_argument("--heartbeat-interval", type=float, default=0.5, metavar="SECONDS")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS")
    parser.add_argument(
        "--drain-mode", choices=("handoff", "finish"), default="handoff",
        help="on SIGTERM: hand the streams to other workers at the exact token (default), "
        "or let them finish here",
    )  # fmt: skip
    add_engine_arguments(parser)
    parser.add_argument(
        "--fake", action="store_true", help="a deterministic fake decoder instead of a model"
    )
    parser.add_argument("--fake-step-ms", type=float, default=0.0)
    parser.add_argument("--fake-prefill-ms", type=float, default=0.0)
    parser.add_argument(
        "--fake-prefill-ms-per-token", type=float, default=0.0, metavar="MS",
        help="... and this per context token not found in its prefix cache",
    )  # fmt: skip
    parser.add_argument("--fake-ignore-eos", action="store_true", help="fixed-length outputs")
    parser.add_argument(
        "--fake-hang-after", type=int, default=None, metavar="STEPS",
        help="the fake decoder wedges after STEPS steps while heartbeats go on (for drills)",
    )  # fmt: skip
    add_tls_arguments(parser, "--connect")


def address(text: str, lowest_port: int = 1) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not lowest_port <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


def listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT to listen on; port 0 picks a free one (the log says which)."""
    return address(text, lowest_port=0)


def unused_flag_rules(args: argparse.Namespace) -> list[tuple[bool, tuple[str, ...], str]]:
    """The flags each mode never reads, and why (warn_unused names those given)."""
    engine = ("--model", "--threads", "--weights", "--decode", "--decode-attention")
    fake = ("--fake-step-ms", "--fake-prefill-ms", "--fake-prefill-ms-per-token",
            "--fake-ignore-eos", "--fake-hang-after")  # fmt: skip
    return [
        (args.fake, engine, "--fake loads no model"),
        (not args.fake, fake, "they shape the fake decoder (--fake only)"),
    ]


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    warn_unused(args, add_arguments, unused_flag_rules(args), log)
    worker_id = args.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    try:
        files = tls_files(args)
        tls = None if files is None else Credentials(files, client_context)
    except TlsError as error:
        log.error("%s", error)
        return 2
    if tls is None:
        log.warning("the links to routers are unauthenticated (--tls-cert, --tls-key, --tls-ca)")
    fake = FakeOptions(
        args.fake_step_ms / 1000,
        args.fake_prefill_ms / 1000,
        args.fake_prefill_ms_per_token / 1000,
        args.fake_ignore_eos,
        args.fake_hang_after,
    )
    local = make_decoder(engine_options(args), fake if args.fake else None)
    decoder, max_context = local.decoder, local.max_context
    config = WorkerConfig(
        worker_id,
        slots=args.slots,
        max_context=max_context,
        heartbeat_interval_s=args.heartbeat_interval,
    )
    worker = RemoteWorker(
        args.connect,
        config,
        decoder,
        takeover=args.take_over,
        refused_grace_s=args.refused_grace,
        resolve_interval_s=args.resolve_interval,
        tls=tls,
    )
    trio.run(_serve, worker, args.drain_timeout, args.health_listen, args.drain_mode)
    if worker.refused is not None:
        log.error("worker id %s is taken; exiting: %s", worker_id, worker.refused)
        return 2
    return 0


async def _serve(
    worker: RemoteWorker,
    drain_timeout_s: float,
    health: tuple[str, int] | None,
    drain_mode: str = "handoff",
) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            if health is not None:
                await nursery.start(serve_health, worker, *health)

            async def run_then_stop() -> None:
                await worker.run()  # returns only when a router refused our id
                nursery.cancel_scope.cancel()

            nursery.start_soon(run_then_stop)
            async for signum in signals:
                held = len(worker.host.worker.holds())
                how = "handing off" if drain_mode == "handoff" else "finishing"
                log.info(
                    "%s: draining for up to %.1fs, %s %d stream(s)",
                    signal.Signals(signum).name, drain_timeout_s, how, held,
                )  # fmt: skip
                began = trio.current_time()
                await worker.drain(drain_timeout_s, handoff=drain_mode == "handoff")
                left = len(worker.host.worker.holds())
                log.info(
                    "drained in %.2fs; %d stream(s) still held%s",
                    trio.current_time() - began, left,
                    " (the routers continue them when the link closes)" if left else "",
                )  # fmt: skip
                nursery.cancel_scope.cancel()
                break
    log.info("worker stopped")
