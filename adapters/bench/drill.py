"""`fencepost bench drill`: kill -9 a worker under load and count what happened.

A multi-process cluster on 127.0.0.1: `fencepost serve --no-local-worker
--worker-listen` and two `fencepost worker` processes (the fake decoder with
a per-token delay and a prefill delay by default, so some requests are always
waiting for their first token; --model for the real model). Streaming
clients send requests back to back for --duration seconds; at --kill-at one
worker gets SIGKILL. Reported: requests completed, attempts failed over
before their first token (the router's retries), streams ended with
worker_lost, other errors, clients that hung, and what the server still holds
once the load stops (must be nothing).
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from dataclasses import dataclass

import trio

from adapters.bench.harness import (
    FENCEPOST,
    PROMPTS,
    Server,
    free_port,
    log_folder,
    percentile,
    scrape,
    wait_for_workers,
)
from adapters.bench.loadgen import FAST, StreamResult, stream_chat


@dataclass(frozen=True)
class Drill:
    """One drill: whose workers, how much load, and when the kill comes."""

    model_path: str | None  # None: fake workers
    clients: int
    duration_s: float  # of the load
    kill_at_s: float  # into the load
    tokens: int  # max_tokens of each request


def main(drill: Drill) -> int:
    logs = log_folder("drill")
    http, workers_port = free_port(), free_port()
    serve = [*FENCEPOST, "serve", "--port", str(http), "--no-local-worker",
             "--heartbeat-timeout", "2", "--worker-listen", f"127.0.0.1:{workers_port}",
             "--served-model-name", "drill"]  # fmt: skip
    worker = [*FENCEPOST, "worker", "--connect", f"127.0.0.1:{workers_port}", "--slots", "16",
              "--heartbeat-interval", "0.25"]  # fmt: skip
    if drill.model_path is None:
        serve += ["--fake"]
        worker += ["--fake", "--fake-step-ms", "20", "--fake-prefill-ms", "300"]
    else:
        serve += ["--model", drill.model_path]
        worker += ["--model", drill.model_path]
    workers = "fake" if drill.model_path is None else drill.model_path
    print(f"fencepost bench drill: {drill.clients} streaming clients for {drill.duration_s:.0f}s, "
          f"{workers} workers, kill -9 one at {drill.kill_at_s:.0f}s; logs in {logs}",
          flush=True)  # fmt: skip
    server = Server("fencepost", serve, http, logs / "serve.log")
    victims = [Server(f"w{i}", [*worker, "--worker-id", f"w{i}"], http, logs / f"w{i}.log")
               for i in (1, 2)]  # fmt: skip
    counters = ("fencepost_attempt_retries", "fencepost_stream_resumes")
    try:
        server.wait_ready(600)
        wait_for_workers(http, 2, timeout_s=600)
        before = trio.run(scrape, http, counters)
        results = trio.run(_load, http, drill, victims[0])
        time.sleep(3)  # the router settles (heartbeat timeout 2 s)
        names = (*counters, "fencepost_active_requests", "fencepost_slots_used",
                 "fencepost_healthy_workers")  # fmt: skip
        after = trio.run(scrape, http, names)
    finally:
        server.stop()
        for victim in victims:
            victim.stop()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    report(results, grew("fencepost_attempt_retries"), grew("fencepost_stream_resumes"), after)
    return 0


async def _load(port: int, drill: Drill, victim: Server) -> list[StreamResult]:
    results: list[StreamResult] = []
    stop_at = trio.current_time() + drill.duration_s

    async def client(i: int) -> None:
        n = 0
        while trio.current_time() < stop_at:
            messages = [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}]
            body = {"model": "drill", "messages": messages, "max_tokens": drill.tokens,
                    "temperature": 0}  # fmt: skip
            timeout_s = drill.duration_s + 60
            results.append(await stream_chat("127.0.0.1", port, body, FAST, timeout_s))
            n += 1

    async def killer() -> None:
        await trio.sleep(drill.kill_at_s)
        victim.process.send_signal(signal.SIGKILL)
        pid = victim.process.pid
        print(f"  killed worker w1 (pid {pid}) at {drill.kill_at_s:.0f}s", flush=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(killer)
        for i in range(drill.clients):
            nursery.start_soon(client, i)
    return results


def report(
    results: list[StreamResult], retried: float, resumed: float, after: dict[str, float]
) -> None:
    kinds: Counter[str] = Counter()
    for r in results:
        if r.error is None and r.done:
            kinds["completed"] += 1
        elif r.error is not None and "timed out" in r.error:
            kinds["hung (client timeout)"] += 1
        else:
            kinds[f"error: {r.error_code or r.error}"] += 1
    print(f"  requests: {len(results)}")
    for kind, count in sorted(kinds.items()):
        print(f"    {kind:40} {count}")
    print(f"  attempts failed over before their first token: {retried:.0f}")
    print(f"  started streams resumed on the other worker: {resumed:.0f}")
    lost = [r for r in results if r.error_code == "worker_lost"]
    if lost:
        chunks = percentile([len(r.gaps_s) + 1.0 for r in lost], 50)
        print(f"  worker_lost streams had received p50 {chunks:.0f} chunks before the error")
    nan = float("nan")
    print(
        f"  afterwards: {after.get('fencepost_active_requests', nan):.0f} open requests, "
        f"{after.get('fencepost_slots_used', nan):.0f} slots held, "
        f"{after.get('fencepost_healthy_workers', nan):.0f} healthy worker(s)"
    )
