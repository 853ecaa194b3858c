"""`fencepost cluster`: several routers and workers on this machine, one address in front.

It starts --routers `fencepost serve` processes (no local worker, each with
its own HTTP and worker port) and --workers `fencepost worker` processes,
each linked to every router, all on 127.0.0.1, and a small TCP balancer on
--port: each client connection goes to the next router, round robin, skipping
one that refuses the connection (a dead router), and bytes are spliced both
ways. Logs go to one folder, printed at start. What it shows is the shape of
issue 19: any router may die and the others keep serving, with every worker.

Secured like a deployment when asked: --api-key / --api-key-file go to every
router (FENCEPOST_API_KEYS reaches them from the environment anyway), and
--tls makes a CA and certificates in the log folder (`certs/`, as `fencepost
certs` would: one for the routers, valid for 127.0.0.1, and one per worker
id) and links every worker to every router by mutual TLS.

SIGTERM or SIGINT stops it: the balancer takes no new connections, the
routers drain (their open requests finish), then the workers; whatever is
still running after its bounded wait is killed, so no process is left behind.
Each child also gets SIGTERM if this process dies without cleaning up (Linux
parent-death signal).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from adapters.cli import add_key_arguments, add_model_argument, positive
from adapters.engine.options import DEFAULT_SLOTS

log = logging.getLogger("fencepost.cluster")

READY_POLL_S = 0.25
CONNECT_TIMEOUT_S = 2.0
SPLICE_BYTES = 65_536


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--routers", type=positive, default=2)
    parser.add_argument("--workers", type=positive, default=2)
    model = parser.add_mutually_exclusive_group()
    model.add_argument("--fake", action="store_true", help="fake workers (no model)")
    add_model_argument(model)
    parser.add_argument("--port", type=int, default=8000, help="the balancer's port (0: any)")
    parser.add_argument(
        "--slots", type=positive, default=DEFAULT_SLOTS, help="concurrent sequences a worker"
    )
    parser.add_argument("--fake-step-ms", type=float, default=0.0)
    parser.add_argument("--logs", type=Path, default=None, help="log folder (default: a new one)")
    add_key_arguments(parser)  # given to every router
    parser.add_argument(
        "--tls", action="store_true",
        help="mutual TLS on every worker link, with a CA and certificates made in LOGS/certs",
    )  # fmt: skip
    parser.add_argument(
        "--ready-timeout", type=float, default=600.0, metavar="SECONDS",
        help="give up when the cluster is not serving after this (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--drain-timeout", type=float, default=5.0, metavar="SECONDS",
        help="each process's drain on stop (default %(default)s)",
    )  # fmt: skip


@dataclass
class Child:
    name: str
    command: list[str]
    log_path: Path
    http_port: int | None = None  # a router's
    process: subprocess.Popen[bytes] | None = None


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="fencepost-cluster-"))
    logs.mkdir(parents=True, exist_ok=True)
    routers, workers = plan(args, logs)
    return trio.run(_run, args, logs, routers, workers)


def plan(args: argparse.Namespace, logs: Path) -> tuple[list[Child], list[Child]]:
    """The command lines of every router and worker, on ports free right now."""
    base = [sys.executable, "-m", "adapters.cli"]
    model = ["--fake"] if args.fake else ["--model", args.model] if args.model else []
    drain = ["--drain-timeout", str(args.drain_timeout)]
    keys = [*_repeated("--api-key", args.api_key), *_repeated("--api-key-file", args.api_key_file)]
    names = [f"w{i}" for i in range(1, args.workers + 1)]
    tls: dict[str, list[str]] = {name: [] for name in ["router", *names]}
    if args.tls:
        from adapters.runtime.tls import make_certificates

        folder = logs / "certs"
        make_certificates(folder, ["127.0.0.1", "localhost"], names, days=30)
        for name in tls:
            cert, key, ca = (str(folder / f) for f in (f"{name}.crt", f"{name}.key", "ca.crt"))
            tls[name] = ["--tls-cert", cert, "--tls-key", key, "--tls-ca", ca]
    routers: list[Child] = []
    worker_ports: list[int] = []
    for i in range(1, args.routers + 1):
        http, listen = free_port(), free_port()
        worker_ports.append(listen)
        command = [*base, "serve", *model, "--port", str(http), "--no-local-worker",
                   "--worker-listen", f"127.0.0.1:{listen}", "--router-id", f"r{i}",
                   *drain, *keys, *tls["router"]]  # fmt: skip
        routers.append(Child(f"r{i}", command, logs / f"r{i}.log", http_port=http))
    connect = [flag for port in worker_ports for flag in ("--connect", f"127.0.0.1:{port}")]
    fake = ["--fake-step-ms", str(args.fake_step_ms)] if args.fake else []
    workers: list[Child] = []
    for name in names:
        command = [*base, "worker", *model, *fake, *connect, "--worker-id", name,
                   "--slots", str(args.slots), "--health-listen", f"127.0.0.1:{free_port()}",
                   *drain, *tls[name]]  # fmt: skip
        workers.append(Child(name, command, logs / f"{name}.log"))
    return routers, workers


def _repeated(flag: str, values: list[Any]) -> list[str]:
    return [part for value in values for part in (flag, str(value))]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the cluster process dies (Linux)."""
    # Not Linux: no such call, and the normal stop still reaps every child.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start(child: Child) -> None:
    env = os.environ | {"HF_HUB_OFFLINE": "1"}
    with child.log_path.open("wb") as out:
        child.process = subprocess.Popen(
            child.command, stdout=out, stderr=out, env=env, preexec_fn=_die_with_parent
        )
    log.info("started %s pid %d; log %s", child.name, child.process.pid, child.log_path)


async def _run(
    args: argparse.Namespace, logs: Path, routers: list[Child], workers: list[Child]
) -> int:
    children = [*routers, *workers]
    code = 0
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        try:
            async with trio.open_nursery() as nursery:

                async def stop_on_signal() -> None:
                    async for signum in signals:
                        log.info("%s: stopping the cluster", signal.Signals(signum).name)
                        nursery.cancel_scope.cancel()
                        return

                nursery.start_soon(stop_on_signal)
                for child in children:
                    start(child)
                with trio.move_on_after(args.ready_timeout) as waiting:
                    await _wait_ready(routers, len(workers))
                if waiting.cancelled_caught:
                    log.error(
                        "not serving after %.0fs; see the logs in %s", args.ready_timeout, logs
                    )
                    code = 1
                    nursery.cancel_scope.cancel()
                    return code
                ports = [child.http_port for child in routers if child.http_port is not None]
                port = await nursery.start(_balance, args.port, ports)
                print(
                    f"cluster ready: http://127.0.0.1:{port}/v1 ({len(routers)} routers, "
                    f"{len(workers)} workers); logs in {logs}",
                    file=sys.stderr,
                    flush=True,
                )
                nursery.start_soon(_watch, children)
        finally:
            with trio.CancelScope(shield=True):
                await _stop(routers, args.drain_timeout + 5)
                await _stop(workers, args.drain_timeout + 5)
    log.info("cluster stopped")
    return code


async def _wait_ready(routers: list[Child], workers: int) -> None:
    """Until every router counts every worker healthy (or a router exits)."""
    while True:
        counts = []
        for child in routers:
            assert child.process is not None
            if child.process.poll() is not None:
                raise RuntimeError(f"{child.name} exited; see {child.log_path}")
            counts.append(await trio.to_thread.run_sync(_healthy_workers, child.http_port))
        if all(count >= workers for count in counts):
            return
        await trio.sleep(READY_POLL_S)


def _healthy_workers(port: int | None) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
            return int(json.loads(reply.read())["healthy_workers"])
    except urllib.error.HTTPError as error:  # 503 until a worker registers
        return int(json.loads(error.read()).get("healthy_workers", 0))
    except (OSError, ValueError, KeyError):
        return 0


async def _watch(children: list[Child]) -> None:
    """Say when a child exits on its own (nothing restarts it: that is a drill's job)."""
    reported: set[str] = set()
    while len(reported) < len(children):
        for child in children:
            if child.process is not None and child.name not in reported:
                code = child.process.poll()
                if code is not None:
                    reported.add(child.name)
                    log.warning("%s exited with %d; see %s", child.name, code, child.log_path)
        await trio.sleep(1.0)


async def _stop(children: list[Child], wait_s: float) -> None:
    """SIGTERM each child, wait up to wait_s for all, then SIGKILL the rest."""
    running = [c.process for c in children if c.process is not None and c.process.poll() is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    with trio.move_on_after(wait_s):
        while any(process.poll() is None for process in running):
            await trio.sleep(0.05)
    for process in running:
        if process.poll() is None:
            log.warning("pid %d did not stop within %.0fs: killed", process.pid, wait_s)
            process.kill()
            process.wait(5)


async def _balance(
    port: int, routers: list[int], *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
) -> None:
    """Accept on 127.0.0.1:port; each connection goes to the next router that answers."""
    turn = itertools.cycle(range(len(routers)))
    listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    task_status.started(int(listeners[0].socket.getsockname()[1]))

    async def handler(client: trio.SocketStream) -> None:
        upstream = None
        for _ in routers:  # each router at most once
            router = routers[next(turn)]
            with trio.move_on_after(CONNECT_TIMEOUT_S):
                try:
                    upstream = await trio.open_tcp_stream("127.0.0.1", router)
                    break
                except OSError:
                    continue  # refused: that router is down, try the next
        if upstream is None:
            await client.aclose()
            return
        async with client, upstream:
            await splice(client, upstream)

    await trio.serve_listeners(handler, listeners)


async def splice(a: trio.SocketStream, b: trio.SocketStream) -> None:
    """Copy bytes both ways until both directions end (or either breaks)."""

    async def copy(source: trio.SocketStream, sink: trio.SocketStream) -> None:
        while data := await source.receive_some(SPLICE_BYTES):
            await sink.send_all(data)
        await sink.send_eof()  # half-close: the other direction may still run

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(copy, a, b)
            nursery.start_soon(copy, b, a)
    except* (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # one side went away; closing both ends the other
