"""Router microbenchmark: fenced token deliveries per second through Router.handle.

Builds a router with a few registered workers and many streaming requests,
pre-builds the token events (interleaved across requests, as a busy batch
would send them), then times only the handle() calls on one core. A second
pass feeds every event twice, so half of the calls take the fence's drop
path, and reports both rates side by side.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from core.config import RouterConfig
from core.protocol import (
    Assignment,
    DeliverToken,
    FromWorkerMessage,
    GenerationRequest,
    Heartbeat,
    OfferResult,
    RouterEvent,
    SendToWorker,
    Submit,
    Token,
)
from core.router import Router


@dataclass(frozen=True)
class RouterBenchResult:
    deliveries: int
    delivered_per_s: float
    calls_with_duplicates_per_s: float
    rounds: int


def _streaming_router(
    workers: int, requests: int, tokens: int
) -> tuple[Router, list[tuple[str, Assignment]]]:
    """A router with `requests` accepted assignments, as (worker id, assignment)."""
    router = Router(RouterConfig(queue_limit=requests))
    slots = -(-requests // workers)
    for w in range(workers):
        hb = Heartbeat(f"w{w}", 0, 1, slots, slots, 1 << 20)
        router.handle(FromWorkerMessage(f"w{w}", hb), 0.0)
    assignments = []
    for r in range(requests):
        request = GenerationRequest(f"req-{r}", (1, 2, 3), tokens)
        [send, _] = router.handle(Submit(request), 0.0)
        assert isinstance(send, SendToWorker)
        worker_id = send.worker_id
        assignment = Assignment(request.request_id, 1)
        router.handle(FromWorkerMessage(worker_id, OfferResult(worker_id, 0, assignment, True)), 0)
        assignments.append((worker_id, assignment))
    return router, assignments


def _token_events(
    assignments: list[tuple[str, Assignment]], tokens: int, repeat: int
) -> list[RouterEvent]:
    events: list[RouterEvent] = []
    for index in range(tokens):
        for worker_id, a in assignments:
            event = FromWorkerMessage(worker_id, Token(a, index, 1000 + index))
            events.extend([event] * repeat)
    return events


def _timed_pass(workers: int, requests: int, tokens: int, repeat: int) -> tuple[int, int, float]:
    """(handle calls, tokens delivered, seconds) for one pass over pre-built events."""
    router, assignments = _streaming_router(workers, requests, tokens)
    events = _token_events(assignments, tokens, repeat)
    handle = router.handle
    delivered = 0
    start = time.perf_counter()
    for event in events:
        for effect in handle(event, 1.0):
            if type(effect) is DeliverToken:
                delivered += 1
    elapsed = time.perf_counter() - start
    return len(events), delivered, elapsed


def run(
    workers: int = 4, requests: int = 64, tokens: int = 1000, rounds: int = 5
) -> RouterBenchResult:
    clean: list[float] = []
    noisy: list[float] = []
    for _ in range(rounds):
        calls, delivered, elapsed = _timed_pass(workers, requests, tokens, repeat=1)
        if delivered != requests * tokens:
            raise RuntimeError(f"delivered {delivered} of {requests * tokens} tokens")
        clean.append(delivered / elapsed)
        calls, delivered, elapsed = _timed_pass(workers, requests, tokens, repeat=2)
        if delivered != requests * tokens:
            raise RuntimeError(f"with duplicates delivered {delivered} of {requests * tokens}")
        noisy.append(calls / elapsed)
    return RouterBenchResult(
        deliveries=requests * tokens,
        delivered_per_s=statistics.median(clean),
        calls_with_duplicates_per_s=statistics.median(noisy),
        rounds=rounds,
    )


def main(workers: int, requests: int, tokens: int, rounds: int) -> int:
    print(
        f"router bench: {workers} workers, {requests} streaming requests x {tokens} tokens, "
        f"median of {rounds} rounds, one core"
    )
    result = run(workers, requests, tokens, rounds)
    print(f"  fenced token deliveries/s through Router.handle: {result.delivered_per_s:,.0f}")
    print(
        f"  handle() calls/s with every token sent twice (half fenced as duplicates): "
        f"{result.calls_with_duplicates_per_s:,.0f}"
    )
    goal = 200_000
    verdict = "meets" if result.delivered_per_s >= goal else "misses"
    print(f"  goal {goal:,}/s: {verdict} ({result.delivered_per_s / goal:.2f}x)")
    return 0
