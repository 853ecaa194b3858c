"""The fake decoder's prefix-cache model: what a request sharing a prefix saves, in time
and in computed tokens, as a router and the benches see it (CacheReport)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from adapters.runtime.worker_host import FakeDecoder
from core.blocks import chain_hashes
from core.protocol import Assignment, Decoded, DecodeDone, DecoderEvent, GenerationRequest

PREFILL_S = 0.1
PER_TOKEN_S = 0.001
STEP_S = 0.01


class Driven:
    """A FakeDecoder running under trio, each request's first-token delay and output."""

    def __init__(self, decoder: FakeDecoder) -> None:
        self.decoder = decoder
        self.first_token_s: dict[str, float] = {}
        self.outputs: dict[str, list[int]] = {}
        self._started: dict[str, float] = {}
        self._done: dict[str, trio.Event] = {}

    def emit(self, events: list[DecoderEvent]) -> None:
        now = trio.current_time()
        for event in events:
            rid = event.assignment.request_id
            if isinstance(event, Decoded):
                self.first_token_s.setdefault(rid, now - self._started[rid])
                self.outputs[rid].append(event.token_id)
            elif isinstance(event, DecodeDone):
                self._done[rid].set()

    def start(self, request: GenerationRequest) -> trio.Event:
        rid = request.request_id
        self._started[rid] = trio.current_time()
        self.outputs[rid] = []
        self._done[rid] = trio.Event()
        self.decoder.start(Assignment(rid, 1), request)
        return self._done[rid]

    async def serve(self, request: GenerationRequest) -> list[int]:
        await self.start(request).wait()
        return self.outputs[request.request_id]


Scenario = Callable[[Driven], Awaitable[None]]


def drive(decoder: FakeDecoder, scenario: Scenario) -> Driven:
    driven = Driven(decoder)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(decoder.run, driven.emit)
            with trio.fail_after(60):
                await scenario(driven)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return driven


def decoder(prefix_caching: bool = True, kv_cache_tokens: int = 32768) -> FakeDecoder:
    return FakeDecoder(
        STEP_S,
        PREFILL_S,
        ignore_eos=True,
        prefill_s_per_token=PER_TOKEN_S,
        prefix_caching=prefix_caching,
        kv_cache_tokens=kv_cache_tokens,
    )


FIRST = tuple(range(1, 101))  # 100 tokens: 6 full blocks of 16
SECOND = (*FIRST[:96], *range(500, 520))  # shares those 6 blocks, then 20 of its own


async def two_requests(driven: Driven) -> None:
    await driven.serve(GenerationRequest("a", FIRST, 4))
    await driven.serve(GenerationRequest("b", SECOND, 4))


def test_a_shared_prefix_brings_the_first_token_sooner_by_its_prefill_time() -> None:
    driven = drive(decoder(), two_requests)
    assert driven.first_token_s["a"] == pytest.approx(PREFILL_S + 100 * PER_TOKEN_S)
    assert driven.first_token_s["b"] == pytest.approx(PREFILL_S + 20 * PER_TOKEN_S)
    report = driven.decoder.cache_report()
    assert report is not None
    assert (report.prompt_tokens, report.computed_tokens) == (216, 120)
    assert report.block_size == 16 and report.prefill_rate == pytest.approx(1 / PER_TOKEN_S)
    # both prompts' full blocks are cached and reported; the newest release first
    keys = set(report.keys)
    assert set(chain_hashes(FIRST, 16)) <= keys and set(chain_hashes(SECOND, 16)) <= keys


def test_with_caching_off_every_context_token_is_computed() -> None:
    driven = drive(decoder(prefix_caching=False), two_requests)
    assert driven.first_token_s["b"] == pytest.approx(PREFILL_S + 116 * PER_TOKEN_S)
    report = driven.decoder.cache_report()
    assert report is not None
    assert (report.prompt_tokens, report.computed_tokens) == (216, 216)
    assert report.keys == ()


def test_the_next_turn_reuses_the_blocks_of_the_previous_answer() -> None:
    prompt = tuple(range(1, 41))  # 40 tokens: 2 full blocks

    async def conversation(driven: Driven) -> None:
        answer = await driven.serve(GenerationRequest("turn-1", prompt, 40))
        # 40 + 39 written positions: 4 full blocks, 2 of them the answer's
        follow_up = (*prompt, *answer, *range(900, 910))
        await driven.serve(GenerationRequest("turn-2", follow_up, 4))

    driven = drive(decoder(), conversation)
    report = driven.decoder.cache_report()
    assert report is not None
    assert report.computed_tokens == 40 + (90 - 64)
    assert driven.first_token_s["turn-2"] == pytest.approx(PREFILL_S + 26 * PER_TOKEN_S)


def test_a_continuation_counts_its_output_prefix_as_context() -> None:
    prompt = tuple(range(1, 33))

    async def resumed(driven: Driven) -> None:
        full = await driven.serve(GenerationRequest("r", prompt, 40))
        again = GenerationRequest("r2", prompt, 40, output_prefix=tuple(full[:20]))
        rest = await driven.serve(again)
        assert rest == full[20:]  # the cache model changes timing, never tokens

    driven = drive(decoder(), resumed)
    report = driven.decoder.cache_report()
    assert report is not None
    # the second: 52 context tokens, 3 full blocks found (the third is the answer's)
    assert (report.prompt_tokens, report.computed_tokens) == (32 + 52, 32 + 52 - 48)


def test_a_full_pool_admits_uncached_and_never_fails() -> None:
    small = decoder(kv_cache_tokens=64)  # 4 blocks; each request below wants 3

    async def crowded(driven: Driven) -> None:
        first = driven.start(GenerationRequest("x", FIRST[:30], 10))
        second = driven.start(GenerationRequest("y", FIRST[:30], 10))
        await first.wait()
        await second.wait()
        third = driven.start(GenerationRequest("z", FIRST[:30], 10))
        await third.wait()

    driven = drive(small, crowded)
    assert [len(driven.outputs[r]) for r in "xyz"] == [10, 10, 10]
    assert small.uncached_admissions == 1
    report = small.cache_report()
    assert report is not None
    # x computes all 30, y too (no room: admitted uncached); z finds x's first block
    assert (report.prompt_tokens, report.computed_tokens) == (90, 30 + 30 + 14)
    assert small.blocks.holders() == 0  # every block released when its request ended


def test_stop_releases_the_blocks_and_the_report_follows() -> None:
    async def stopped(driven: Driven) -> None:
        driven.start(GenerationRequest("s", FIRST, 1000))
        await trio.sleep(1.0)
        before = driven.decoder.cache_report()
        driven.decoder.stop(Assignment("s", 1))
        after = driven.decoder.cache_report()
        assert before is not after and driven.decoder.blocks.holders() == 0
        assert after is driven.decoder.cache_report()  # unchanged: the same snapshot
        assert after is not None and set(chain_hashes(FIRST, 16)) <= set(after.keys)

    drive(decoder(), stopped)
