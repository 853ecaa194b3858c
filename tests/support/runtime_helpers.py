"""Shared pieces for the runtime tests: reading streams, waiting on statistics."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from typing import Any

import trio

from adapters.runtime.controller import Controller, ControllerStatistics, RequestStream
from core.protocol import DeliverError, DeliverFinished, DeliverToken


async def collect(stream: RequestStream) -> tuple[list[int], DeliverFinished | DeliverError]:
    """Every token of a stream, checking indices are 0, 1, 2, ...; then its outcome."""
    tokens: list[int] = []
    async for item in stream:
        if isinstance(item, DeliverToken):
            assert item.index == len(tokens), "a delivery out of order or repeated"
            tokens.append(item.token_id)
    assert stream.outcome is not None
    return tokens, stream.outcome


async def wait_until(
    controller: Controller, check: Callable[[ControllerStatistics], bool], timeout_s: float = 10
) -> ControllerStatistics:
    with trio.fail_after(timeout_s):
        while not check(stats := controller.statistics()):
            await trio.sleep(0.01)
    return stats


def healthy(stats: ControllerStatistics) -> dict[str, int]:
    """worker id -> epoch, for the workers the router considers healthy."""
    return {w.worker_id: w.epoch for w in stats.router.workers if w.healthy}


def settled(stats: ControllerStatistics) -> bool:
    """No request left anywhere and no slot held: nothing leaked."""
    router = stats.router
    return (
        stats.open_streams == 0
        and not router.requests_by_phase
        and router.queued == 0
        and all(w.held == 0 for w in router.workers)
    )


async def raw_connection(port: int, payload: bytes, timeout_s: float = 5) -> bytes:
    """Send payload on a fresh connection; what came back before the router closed it."""
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    await sock.send_all(payload)
    received = b""
    with trio.fail_after(timeout_s):
        while chunk := await sock.receive_some(4096):
            received += chunk
    await sock.aclose()
    return received


def kill_all(processes: Iterable[subprocess.Popen[Any] | None]) -> None:
    """Kill what is still running of these processes (None: never started) and reap them."""
    for process in processes:
        if process is None:
            continue
        if process.poll() is None:
            process.kill()
        process.wait(10)
