"""Cache-aware placement: the router reads workers' prefix-cache reports as hints."""

from __future__ import annotations

from core.blocks import chain_hashes
from core.config import RouterConfig
from core.protocol import (
    Assignment,
    CacheReport,
    FromWorkerMessage,
    GenerationRequest,
    Heartbeat,
    Submit,
    Token,
)
from core.router import Router
from tests.core.test_router_scenarios import offers

SYSTEM = tuple(range(100, 164))  # 64 tokens: four blocks of 16
BLOCK = 16


def report(tokens: tuple[int, ...], rate: float = 1000.0) -> CacheReport:
    return CacheReport(BLOCK, tuple(chain_hashes(tokens, BLOCK)), rate)


def beat(
    router: Router,
    worker: str,
    now: float,
    cache: CacheReport | None = None,
    seq: int = 1,
    epoch: int = 0,
    slots: int = 4,
) -> None:
    hb = Heartbeat(worker, epoch, seq, slots, slots, 4096, (), cache)
    router.handle(FromWorkerMessage(worker, hb), now)


def place(router: Router, rid: str, prompt: tuple[int, ...], now: float) -> str:
    [(worker, _)] = offers(router.handle(Submit(GenerationRequest(rid, prompt, 8)), now))
    return worker


def test_a_request_goes_where_its_prefix_is_cached() -> None:
    router = Router()
    beat(router, "a", 0.0)
    beat(router, "b", 0.0, report(SYSTEM))
    assert place(router, "r1", (*SYSTEM, 1, 2, 3), 0.1) == "b"
    # Another request whose prefix nobody holds goes to the idle worker.
    assert place(router, "r2", (7,) * 70, 0.1) == "a"


def test_least_loaded_routing_ignores_the_reports() -> None:
    router = Router(RouterConfig(routing="least-loaded"))
    beat(router, "a", 0.0)
    beat(router, "b", 0.0, report(SYSTEM))
    assert place(router, "r1", (*SYSTEM, 1, 2, 3), 0.1) == "a"  # fewest holds, then id


def test_a_stale_report_counts_as_empty() -> None:
    router = Router(RouterConfig(cache_report_max_age_s=3.0))
    beat(router, "a", 0.0)
    beat(router, "b", 0.0, report(SYSTEM))
    beat(router, "a", 2.5, seq=2)  # a is fresh; b's report is now 3.5 s old
    assert place(router, "r1", (*SYSTEM, 1, 2, 3), 3.5) == "a"


def test_a_new_epoch_forgets_the_old_process_cache() -> None:
    router = Router()
    beat(router, "a", 0.0)
    beat(router, "b", 0.0, report(SYSTEM))
    router.fleet.assigned["b"] = 1  # the router handed out epoch 1 to b's new process
    beat(router, "b", 0.2, epoch=1, seq=1)  # restarted: its report is empty
    assert place(router, "r1", (*SYSTEM, 1, 2, 3), 0.3) == "a"


def test_work_queued_ahead_spreads_requests_sharing_a_prefix() -> None:
    # Both hold the system prompt; b is faster. Requests with distinct tails pile
    # up on b only while its queued prefill stays under a's.
    router = Router()
    beat(router, "a", 0.0, report(SYSTEM, rate=1000.0), slots=8)
    beat(router, "b", 0.0, report(SYSTEM, rate=2000.0), slots=8)
    placed = [place(router, f"r{i}", SYSTEM + (i,) * 200, 0.1) for i in range(6)]
    assert placed.count("a") >= 2 and placed.count("b") >= 2, placed
    assert placed.count("b") >= placed.count("a"), placed


def test_the_first_token_takes_the_attempt_out_of_the_queue_ahead() -> None:
    router = Router()
    beat(router, "a", 0.0, report(SYSTEM))
    beat(router, "b", 0.0)
    assert place(router, "r1", SYSTEM + (1,) * 500, 0.1) == "a"
    # a now has ~500 tokens of prefill ahead, so the next prefix-sharing request goes to b.
    assert place(router, "r2", SYSTEM + (2,) * 40, 0.1) == "b"
    router.handle(FromWorkerMessage("a", Token(Assignment("r1", 1), 0, 5)), 0.2)
    assert router.fleet.workers["a"].holds[Assignment("r1", 1)].prefill == 0
    assert place(router, "r3", SYSTEM + (3,) * 40, 0.3) == "a"
