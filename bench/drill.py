"""`fencepost bench drill`: kill -9 a worker, or a router, under load and count what happened.

A multi-process cluster on 127.0.0.1: `fencepost serve --no-local-worker
--worker-listen` and two `fencepost worker` processes (the fake decoder with
a per-token delay and a prefill delay by default, so some requests are always
waiting for their first token; --model for the real model). Streaming
clients send requests back to back for --duration seconds; at --kill-at one
worker gets SIGKILL. Reported: requests completed, attempts failed over
before their first token (the router's retries), streams ended with
worker_lost, other errors, clients that hung, and what the server still holds
once the load stops (must be nothing).

With --routers N (N > 1) there are N routers, each worker linked to every
one, the clients split evenly between them, and at --kill-at router r1 gets
SIGKILL instead. Its clients' streams are cut (the router that held them is
gone); a client whose request was cut before its first token sends it again
to a live router, as a client behind a load balancer would, and from then on
sends everything there. A stream cut after its first token is not retried:
its client has shown part of an answer. Reported per router: requests
completed, failed by kind, cut, retried elsewhere, hung, resumed streams; the
point of the drill is the last line: the clients of the surviving routers
saw no error at all. The drill exits 1 when they did.
"""

from __future__ import annotations

import signal
from collections import Counter
from dataclasses import dataclass

import trio

from bench.harness import (
    FENCEPOST,
    PROMPTS,
    Server,
    free_port,
    log_folder,
    percentile,
    scrape,
    settled_scrape,
    wait_for_workers,
)
from bench.loadgen import FAST, StreamResult, stream_chat


@dataclass(frozen=True)
class Drill:
    """One drill: whose workers, how much load, and when the kill comes."""

    model_path: str | None  # None: fake workers
    clients: int
    duration_s: float  # of the load
    kill_at_s: float  # into the load
    tokens: int  # max_tokens of each request
    routers: int = 1  # more than one: a router is killed, not a worker


def main(drill: Drill) -> int:
    if drill.routers > 1:
        return main_routers(drill)
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
        # the router settles: w1's loss seen (heartbeat timeout 2 s), every slot back
        after = trio.run(settled_scrape, http, counters, 1)
    finally:
        server.stop()
        for victim in victims:
            victim.stop()

    def grew(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    report(results, grew("fencepost_attempt_retries"), grew("fencepost_stream_resumes"), after)
    return 0


def _chat(drill: Drill, client: int, n: int) -> tuple[dict[str, object], float]:
    """The body of a client's n-th streaming chat request, and its timeout."""
    messages = [{"role": "user", "content": PROMPTS[(client + n) % len(PROMPTS)]}]
    body = {"model": "drill", "messages": messages, "max_tokens": drill.tokens, "temperature": 0}
    return body, drill.duration_s + 60


def _kill(victim: Server, name: str, drill: Drill) -> None:
    victim.process.send_signal(signal.SIGKILL)
    print(f"  killed {name} (pid {victim.process.pid}) at {drill.kill_at_s:.0f}s", flush=True)


async def _load(port: int, drill: Drill, victim: Server) -> list[StreamResult]:
    results: list[StreamResult] = []
    stop_at = trio.current_time() + drill.duration_s

    async def client(i: int) -> None:
        n = 0
        while trio.current_time() < stop_at:
            body, timeout_s = _chat(drill, i, n)
            results.append(await stream_chat("127.0.0.1", port, body, FAST, timeout_s))
            n += 1

    async def killer() -> None:
        await trio.sleep(drill.kill_at_s)
        _kill(victim, "worker w1", drill)

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


# --- several routers: a router dies ---


@dataclass
class Sent:
    """One request as a client saw it: which router, and whether it was a retry."""

    router: int
    result: StreamResult
    retry: bool = False


def main_routers(drill: Drill) -> int:
    logs = log_folder("drill")
    routers = [(free_port(), free_port()) for _ in range(drill.routers)]  # (http, workers)
    served = "fake" if drill.model_path is None else drill.model_path
    model = ["--fake"] if drill.model_path is None else ["--model", drill.model_path]
    fake = ["--fake-step-ms", "20", "--fake-prefill-ms", "300"] if drill.model_path is None else []
    servers = [
        Server(f"r{i + 1}", [*FENCEPOST, "serve", *model, "--port", str(http),
               "--no-local-worker", "--heartbeat-timeout", "2", "--worker-listen",
               f"127.0.0.1:{listen}", "--served-model-name", "drill",
               "--router-id", f"r{i + 1}"], http, logs / f"r{i + 1}.log")
        for i, (http, listen) in enumerate(routers)
    ]  # fmt: skip
    connect = [flag for _, listen in routers for flag in ("--connect", f"127.0.0.1:{listen}")]
    workers = [
        Server(f"w{i}", [*FENCEPOST, "worker", *model, *fake, *connect, "--slots", "16",
               "--heartbeat-interval", "0.25", "--worker-id", f"w{i}"], 0, logs / f"w{i}.log")
        for i in (1, 2)
    ]  # fmt: skip
    print(f"fencepost bench drill: {drill.clients} streaming clients for {drill.duration_s:.0f}s "
          f"split over {drill.routers} routers, 2 {served} workers linked to every router, "
          f"kill -9 router r1 at {drill.kill_at_s:.0f}s; logs in {logs}", flush=True)  # fmt: skip
    counters = ("fencepost_attempt_retries", "fencepost_stream_resumes")
    ports = [http for http, _ in routers]
    try:
        for server in servers:
            server.wait_ready(600)
        for port in ports:
            wait_for_workers(port, 2, timeout_s=600)
        before = [trio.run(scrape, port, counters) for port in ports]
        sent, at_kill = trio.run(_load_routers, ports, drill, servers[0])
        # the surviving routers settle: every slot back, both workers healthy
        after = [at_kill] + [trio.run(settled_scrape, port, counters, 2) for port in ports[1:]]
    finally:
        for server in [*servers, *workers]:
            server.stop()
    return report_routers(drill, sent, before, after)


async def _load_routers(
    ports: list[int], drill: Drill, victim: Server
) -> tuple[list[Sent], dict[str, float]]:
    sent: list[Sent] = []
    stop_at = trio.current_time() + drill.duration_s
    killed = trio.Event()
    at_kill: dict[str, float] = {}

    async def client(i: int) -> None:
        router, n = i % len(ports), 0
        while trio.current_time() < stop_at:
            body, timeout_s = _chat(drill, i, n)
            result = await stream_chat("127.0.0.1", ports[router], body, FAST, timeout_s)
            sent.append(Sent(router, result))
            n += 1
            if router == 0 and killed.is_set() and result.error is not None:
                router = 1 + i % (len(ports) - 1)  # the balancer sends us to a live router
                if result.ttft_s is None:  # nothing shown yet: safe to send again
                    retried = await stream_chat("127.0.0.1", ports[router], body, FAST, timeout_s)
                    sent.append(Sent(router, retried, retry=True))

    async def killer() -> None:
        await trio.sleep(drill.kill_at_s)
        counters = ("fencepost_attempt_retries", "fencepost_stream_resumes")
        at_kill.update(await scrape(ports[0], counters))
        _kill(victim, "router r1", drill)
        killed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(killer)
        for i in range(drill.clients):
            nursery.start_soon(client, i)
    return sent, at_kill


def outcome(result: StreamResult) -> str:
    if result.error is None and result.done:
        return "completed"
    if result.error is not None and "timed out" in result.error:
        return "hung (client timeout)"
    if result.error_code is not None:
        return f"error: {result.error_code}"
    if result.ttft_s is None:
        return "cut before the first token"
    return "cut mid-stream"


def report_routers(
    drill: Drill, sent: list[Sent], before: list[dict[str, float]], after: list[dict[str, float]]
) -> int:
    survivors_failed = 0
    for router in range(drill.routers):
        mine = [s for s in sent if s.router == router]
        kinds = Counter(outcome(s.result) for s in mine if not s.retry)
        state = "killed" if router == 0 else "survived"
        print(f"  router r{router + 1} ({state}): {len(mine)} requests")
        for kind, count in sorted(kinds.items()):
            print(f"    {kind:40} {count}")
        retries = [s for s in mine if s.retry]
        if retries:
            ok = sum(outcome(s.result) == "completed" for s in retries)
            print(f"    {'retries of requests cut on r1':40} {len(retries)} ({ok} completed)")

        def grew(name: str, r: int = router) -> float:
            return after[r].get(name, 0) - before[r].get(name, 0)

        print(f"    attempts failed over before their first token: "
              f"{grew('fencepost_attempt_retries'):.0f}")  # fmt: skip
        print(f"    started streams resumed on another worker: "
              f"{grew('fencepost_stream_resumes'):.0f}")  # fmt: skip
        if router > 0:
            survivors_failed += sum(outcome(s.result) != "completed" for s in mine)
            left = after[router]
            print(f"    afterwards: {left.get('fencepost_active_requests', 0):.0f} open "
                  f"requests, {left.get('fencepost_slots_used', 0):.0f} slots held, "
                  f"{left.get('fencepost_healthy_workers', 0):.0f} healthy worker(s)")  # fmt: skip
    if survivors_failed:
        print(f"  FAILED: the surviving routers' clients saw {survivors_failed} failed requests")
        return 1
    print("  the surviving routers' clients saw no error")
    return 0
