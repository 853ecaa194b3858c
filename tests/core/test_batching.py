"""The continuous-batching policy, without torch."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from core.batching import BatchLimits, Running, plan_step

LIMITS = BatchLimits(
    max_seqs=4, max_context=100, max_step_tokens=10, max_prefill_tokens=4, max_idle_prefill_tokens=7
)


def test_running_decodes_always_run_and_prefill_is_chunked() -> None:
    running = [Running(1, 5, 5), Running(2, 30, 0), Running(3, 3, 3)]
    plan = plan_step(running, LIMITS)
    assert plan.decode == (1, 3)
    assert plan.prefill == ((2, 4),)  # a 30-token prompt goes in chunks of 4


def test_prefill_shares_the_step_budget_oldest_first() -> None:
    running = [Running(0, 3, 3), Running(1, 9, 2), Running(2, 9, 0), Running(3, 9, 0)]
    plan = plan_step(running, LIMITS)
    assert plan.decode == (0,)
    assert plan.prefill == ((1, 4), (2, 4), (3, 1))
    assert plan.tokens == LIMITS.max_step_tokens


def test_a_step_with_nothing_to_decode_prefills_its_larger_idle_budget() -> None:
    running = [Running(1, 9, 2), Running(2, 9, 0), Running(3, 9, 0)]
    plan = plan_step(running, LIMITS)
    assert plan.decode == ()
    assert plan.prefill == ((1, 7),)  # chunks as large as the idle budget, oldest first
    both = plan_step([Running(1, 3, 0), Running(2, 3, 0), Running(3, 3, 0)], LIMITS)
    assert both.prefill == ((1, 3), (2, 3), (3, 1))  # several prompts in one idle step


def test_the_last_chunk_is_what_remains() -> None:
    assert plan_step([Running(1, 9, 7)], LIMITS).prefill == ((1, 2),)


def test_limits_must_leave_room_for_prefill() -> None:
    with pytest.raises(ValueError, match="max_step_tokens"):
        BatchLimits(max_seqs=8, max_step_tokens=8)
    with pytest.raises(ValueError):
        BatchLimits(max_prefill_tokens=0)


@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 40)), max_size=12),
    st.integers(1, 8),
    st.integers(1, 16),
)
def test_every_plan_respects_the_budget_and_makes_progress(
    seqs: list[tuple[int, int]], prefill_chunk: int, extra: int
) -> None:
    limits = BatchLimits(
        max_seqs=12,
        max_step_tokens=12 + extra,
        max_prefill_tokens=prefill_chunk,
        max_idle_prefill_tokens=prefill_chunk + extra,
    )
    running = [Running(i, prompt, min(done, prompt)) for i, (prompt, done) in enumerate(seqs)]
    plan = plan_step(running, limits)
    idle = not any(s.decoding for s in running)
    chunk_limit = limits.max_idle_prefill_tokens if idle else prefill_chunk
    assert plan.tokens <= (limits.max_idle_prefill_tokens if idle else limits.max_step_tokens)
    assert set(plan.decode) == {s.key for s in running if s.decoding}
    for key, count in plan.prefill:
        seq = running[key]
        assert 0 < count <= min(chunk_limit, seq.prompt_tokens - seq.prefilled)
    if any(not s.decoding for s in running):
        assert plan.prefill, "a prefilling sequence got no tokens: prefill starved"
