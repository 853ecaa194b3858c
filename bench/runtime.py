"""Runtime overhead: delivered tokens/s through the trio runtime with an instant decoder.

The decoder is FakeDecoder with no delay (a token per running assignment per
step, the loop yields in between) and EOS ignored, so every figure is the cost
of the runtime itself: worker machine, transport, controller, router, and a
client task per request reading its RequestStream. Six shapes, side by side
in one run: in-process workers (one trio loop, no sockets), TCP workers
(separate `fencepost worker --fake` processes on 127.0.0.1), and TCP workers
with mutual TLS on their links (certificates made for the run), 1 and 4
workers. Each shape runs `rounds` times; the median is reported.
"""

from __future__ import annotations

import logging
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from adapters.runtime.controller import Controller
from adapters.runtime.embedded import run_local_worker
from adapters.runtime.tcp_router import serve_workers
from adapters.runtime.tls import Credentials, TlsFiles, make_certificates, server_context
from adapters.runtime.worker_host import FakeDecoder
from bench.harness import FENCEPOST
from core.config import RouterConfig
from core.protocol import DeliverError, GenerationRequest
from core.worker import WorkerConfig


@dataclass(frozen=True)
class Shape:
    transport: str  # "in-process", "tcp" or "tcp+tls"
    workers: int


async def _wait_for_workers(controller: Controller, count: int, timeout_s: float) -> None:
    with trio.fail_after(timeout_s):
        while sum(w.healthy for w in controller.router.statistics().workers) < count:
            await trio.sleep(0.01)


async def _drive(controller: Controller, requests: int, tokens: int, tag: str) -> float:
    """Run `requests` concurrent streams of `tokens` tokens; return delivered tokens/s."""
    delivered = 0

    async def client(i: int) -> None:
        nonlocal delivered
        request = GenerationRequest(f"{tag}-{i}", (1, 2, 3, i), tokens)
        async with controller.submit(request) as stream:
            while True:
                try:
                    await stream.wait()
                except trio.EndOfChannel:
                    break
                items = stream.pending()
                if isinstance(items[-1], DeliverError):
                    raise RuntimeError(f"request failed: {items[-1]}")
                delivered += len(items) - (items[-1] is stream.outcome)

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for i in range(requests):
            nursery.start_soon(client, i)
    elapsed = time.perf_counter() - began
    assert delivered == requests * tokens, (delivered, requests * tokens)
    return delivered / elapsed


async def _measure(
    shape: Shape, requests: int, tokens: int, rounds: int, certs: Path
) -> list[float]:
    config = RouterConfig(queue_limit=max(256, requests))
    controller = Controller(config)
    slots = -(-requests // shape.workers)
    processes: list[subprocess.Popen[bytes]] = []
    rates = []
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            if shape.transport == "in-process":
                for w in range(shape.workers):
                    worker = WorkerConfig(f"w{w}", slots=slots, max_context=1 << 20)
                    decoder = FakeDecoder(ignore_eos=True)
                    await nursery.start(run_local_worker, controller, worker, decoder)
            else:
                tls = None
                if shape.transport == "tcp+tls":
                    files = TlsFiles(certs / "router.crt", certs / "router.key", certs / "ca.crt")
                    tls = Credentials(files, server_context)
                serving = partial(serve_workers, controller, "127.0.0.1", 0, tls=tls)
                port = await nursery.start(serving)
                for w in range(shape.workers):
                    secured = [] if tls is None else _tls_flags(certs, f"w{w}")
                    processes.append(_spawn_worker(port, f"w{w}", slots, secured))
            await _wait_for_workers(controller, shape.workers, 60)
            for r in range(rounds):
                rates.append(await _drive(controller, requests, tokens, f"r{r}"))
            nursery.cancel_scope.cancel()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)
    return rates


def _tls_flags(certs: Path, worker_id: str) -> list[str]:
    return ["--tls-cert", str(certs / f"{worker_id}.crt"), "--tls-key",
            str(certs / f"{worker_id}.key"), "--tls-ca", str(certs / "ca.crt")]  # fmt: skip


def _spawn_worker(
    port: int, worker_id: str, slots: int, flags: list[str]
) -> subprocess.Popen[bytes]:
    command = [
        *FENCEPOST, "worker", "--connect", f"localhost:{port}", "--worker-id", worker_id,
        "--slots", str(slots), "--fake", "--fake-ignore-eos", "--max-context", str(1 << 20),
        *flags,
    ]  # fmt: skip
    return subprocess.Popen(command, stderr=subprocess.DEVNULL)


def main(requests: int, tokens: int, rounds: int, workers: list[int]) -> int:
    logging.getLogger("fencepost").setLevel(logging.ERROR)  # connections closing is expected
    print(
        f"runtime overhead: {requests} concurrent streams x {tokens} tokens, instant fake "
        f"decoder, median of {rounds} rounds"
    )
    shapes = [Shape(t, w) for t in ("in-process", "tcp", "tcp+tls") for w in workers]
    base: float | None = None
    with tempfile.TemporaryDirectory() as folder:
        certs = Path(folder)
        make_certificates(certs, ["localhost"], [f"w{w}" for w in range(max(workers))], days=1)
        for shape in shapes:
            rates = trio.run(_measure, shape, requests, tokens, rounds, certs)
            rate = statistics.median(rates)
            base = base or rate
            print(
                f"  {shape.transport:10} {shape.workers} worker(s): {rate:10,.0f} tokens/s "
                f"({1e6 / rate:5.1f} us/token, {rate / base:4.2f}x the first row)"
            )
    return 0
