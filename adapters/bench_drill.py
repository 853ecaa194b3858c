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

import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

import trio

from adapters.bench_serve import PROMPTS, Server, free_port, percentile, scrape
from adapters.loadgen import FAST, StreamResult, stream_chat


def main(model_path: str | None, clients: int, duration_s: float, kill_at_s: float,
         tokens: int) -> int:  # fmt: skip
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"fencepost-drill-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    http, workers_port = free_port(), free_port()
    cli = [sys.executable, "-m", "adapters.cli"]
    fake = model_path is None
    serve = [*cli, "serve", "--port", str(http), "--no-local-worker",
             "--heartbeat-timeout", "2", "--worker-listen", f"127.0.0.1:{workers_port}",
             "--served-model-name", "drill"]  # fmt: skip
    serve += ["--fake"] if fake else ["--model", model_path]  # type: ignore[list-item]
    worker = [*cli, "worker", "--connect", f"127.0.0.1:{workers_port}", "--slots", "16",
              "--heartbeat-interval", "0.25"]  # fmt: skip
    worker += (["--fake", "--fake-step-ms", "20", "--fake-prefill-ms", "300"] if fake
               else ["--model", model_path])  # type: ignore[list-item]  # fmt: skip
    print(f"fencepost bench drill: {clients} streaming clients for {duration_s:.0f}s, "
          f"{'fake' if fake else model_path} workers, kill -9 one at {kill_at_s:.0f}s; "
          f"logs in {logs}", flush=True)  # fmt: skip
    server = Server("fencepost", serve, http, logs / "serve.log")
    victims = [Server(f"w{i}", [*worker, "--worker-id", f"w{i}"], http, logs / f"w{i}.log")
               for i in (1, 2)]  # fmt: skip
    try:
        server.wait_ready(600)
        deadline = time.monotonic() + 600
        while (
            trio.run(scrape, http, ("fencepost_healthy_workers",)).get(
                "fencepost_healthy_workers", 0
            )
            < 2
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("the workers never registered")
            time.sleep(0.2)
        counters = ("fencepost_attempt_retries", "fencepost_stream_resumes")
        before = trio.run(scrape, http, counters)
        results = trio.run(_load, http, clients, duration_s, kill_at_s, tokens, victims[0])
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


async def _load(port: int, clients: int, duration_s: float, kill_at_s: float, tokens: int,
                victim: Server) -> list[StreamResult]:  # fmt: skip
    results: list[StreamResult] = []
    stop_at = trio.current_time() + duration_s

    async def client(i: int) -> None:
        n = 0
        while trio.current_time() < stop_at:
            messages = [{"role": "user", "content": PROMPTS[(i + n) % len(PROMPTS)]}]
            body = {"model": "drill", "messages": messages, "max_tokens": tokens,
                    "temperature": 0}  # fmt: skip
            results.append(await stream_chat("127.0.0.1", port, body, FAST, duration_s + 60))
            n += 1

    async def killer() -> None:
        await trio.sleep(kill_at_s)
        victim.process.send_signal(signal.SIGKILL)
        print(f"  killed worker w1 (pid {victim.process.pid}) at {kill_at_s:.0f}s", flush=True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(killer)
        for i in range(clients):
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
