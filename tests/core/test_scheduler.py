"""core/scheduler.py without torch: admission, growth, preemption by recompute, the plan.

The engine and the simulated workers both run this Scheduler, so these tests pin the
policy itself; the sweeps (tests/sim/test_simulation.py) judge it under faults, and
tests/engine/test_engine.py checks that the engine's tokens do not change when it preempts.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.batching import BatchLimits
from core.blocks import BlockManager, blocks_for
from core.scheduler import Scheduler
from core.states import SchedulerMisuse, SeqState

SIZE = 4
LIMITS = BatchLimits(4, 64, 12, 8, 16)


def scheduler(blocks: int, limits: BatchLimits = LIMITS) -> Scheduler:
    return Scheduler(BlockManager(blocks, SIZE), limits)


def prefill_all(s: Scheduler) -> None:
    """Run plans until nothing prefills (the callers' part: say what each step computed)."""
    for _ in range(100):
        plan = s.schedule().plan
        if not plan.prefill:
            return
        for key, count in plan.prefill:
            s.prefilled(key, count)
    raise AssertionError("prefill never ended")


def test_admission_is_first_come_and_nobody_overtakes_the_head() -> None:
    s = scheduler(6)  # 24 positions
    s.add(1, range(10), whole=12)  # 3 blocks
    s.add(2, range(100, 114), whole=16)  # 4 blocks: does not fit beside 1 (+1 spare)
    s.add(3, range(200, 202), whole=4)  # would fit, but waits behind 2
    first = s.schedule()
    assert first.admitted == ((1, 0),)
    assert s.waiting == (2, 3)
    assert first.plan.prefill == ((1, 10),)  # nothing decodes: an idle step's chunk
    assert s.state(1) is SeqState.PREFILLING and s.state(2) is SeqState.WAITING


def test_a_sequence_that_can_never_fit_is_refused_even_behind_a_blocked_head() -> None:
    s = scheduler(4)
    s.add(1, range(10), whole=16)
    s.add(2, range(50, 60), whole=17)  # beyond the whole pool (16 positions)
    s.add(3, range(70, 72), whole=65)  # beyond max_context
    schedule = s.schedule()
    assert schedule.refused == (2, 3)
    assert s.state(2) is SeqState.GONE and s.waiting == ()


def test_a_cached_prefix_is_shared_but_its_last_token_is_computed() -> None:
    s = scheduler(16)
    prompt = list(range(8))  # two whole blocks
    s.add(1, prompt, whole=12)
    prefill_all(s)
    s.pool.commit(1, prompt)  # type: ignore[attr-defined]
    s.add(2, prompt, whole=12)
    [(key, found)] = s.schedule().admitted
    assert key == 2 and found == 4  # the second block holds the last token: computed
    assert s.progress(2) == (4, 8)


def test_growth_takes_a_block_at_each_boundary_only() -> None:
    s = scheduler(8)
    s.add(1, range(4), whole=20)
    prefill_all(s)
    table = s.pool.table(1)
    assert len(table) == 1
    s.emitted(1, 99)  # 5 tokens: the next step writes position 4, in a second block
    s.schedule()
    assert len(s.pool.table(1)) == 2
    for token in range(3):  # positions 5, 6, 7: still the second block
        s.emitted(1, token)
        s.schedule()
        assert len(s.pool.table(1)) == 2
    s.emitted(1, 7)
    s.schedule()
    assert len(s.pool.table(1)) == 3


def test_the_newest_is_preempted_keeps_its_tokens_and_waits_first() -> None:
    s = scheduler(3)  # 12 positions
    s.add(1, range(4), whole=12)
    s.add(2, range(10, 14), whole=12)
    prefill_all(s)
    assert s.running == 2  # one block each, one spare
    s.add(3, range(20, 22), whole=4)  # waits: no spare block beside two growing sequences
    for key in (1, 2):
        s.emitted(key, 50 + key)
    schedule = s.schedule()  # 1 grows into the spare block; 2 finds none: preempted
    assert schedule.preempted == (2,)
    assert s.waiting[0] == 2 and s.state(2) is SeqState.WAITING
    assert s.recomputed_tokens == 1 and s.preemptions == 1
    s.remove(1)  # 1 ends: its blocks come back, and 2 is admitted before 3
    again = s.schedule()
    assert [k for k, _ in again.admitted][:1] == [2]
    assert s.tokens(2) == [10, 11, 12, 13, 52]  # its output kept: recomputed, not redone
    assert s.progress(2)[1] == 5


def test_a_preempted_prefill_goes_back_too() -> None:
    s = scheduler(4)
    s.add(1, range(4), whole=16)
    prefill_all(s)
    s.add(2, range(10, 18), whole=12)  # two blocks, and one spare for 1: admitted
    assert s.schedule().admitted == ((2, 0),)  # its prefill is planned; never reported
    for token in range(4):  # 1 grows into the last free block (positions 4-7)
        s.emitted(1, token)
        assert s.schedule().preempted == ()
    s.emitted(1, 4)  # position 8: a third block, and the pool is out: 2 (newest) goes
    assert s.schedule().preempted == (2,)
    assert s.state(2) is SeqState.WAITING and s.progress(1) == (4, 4)


def test_a_prefill_waits_for_the_blocks_a_running_prefill_is_writing() -> None:
    s = scheduler(16)
    shared = list(range(12))
    s.add(1, shared, whole=16)
    s.schedule()  # 1 prefills its first 8 of 12
    s.add(2, [*shared, 40], whole=16)
    assert s.schedule().admitted == ()  # its next block is being written by 1
    s.pool.commit(1, shared[:8])  # type: ignore[attr-defined]


def test_stopping_returns_every_block() -> None:
    s = scheduler(8)
    s.add(1, range(6), whole=12)
    s.add(2, range(20, 26), whole=12)
    s.schedule()
    s.remove(1)
    s.remove(2)
    s.remove(2)  # again: nothing to do
    pool = s.pool
    assert isinstance(pool, BlockManager)
    assert pool.holders() == 0 and pool.available == 8
    assert not s.has_work()


def test_misuse_is_an_error_of_ours() -> None:
    s = scheduler(8)
    s.add(1, range(4), whole=8)
    with pytest.raises(SchedulerMisuse):
        s.add(1, range(4), whole=8)
    with pytest.raises(SchedulerMisuse):
        s.emitted(1, 3)  # waiting: it cannot have emitted
    s.schedule()
    with pytest.raises(SchedulerMisuse):
        s.prefilled(1, 9)  # more than its context
    with pytest.raises(SchedulerMisuse):
        s.add(2, [], whole=8)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 12), st.integers(1, 12), st.integers(0, 3)),
        min_size=1,
        max_size=8,
    ),
    st.integers(4, 10),
)
def test_every_sequence_finishes_exactly_once_with_its_own_tokens(
    requests: list[tuple[int, int, int]], extra_blocks: int
) -> None:
    """Random prompts (some sharing a prefix) on a tight pool: every sequence ends
    with exactly its own tokens in order, whatever was preempted, and every block
    comes back."""
    longest = max(p + n for p, n, _ in requests)
    pool = BlockManager(blocks_for(longest, SIZE) + extra_blocks // 3, SIZE)
    s = Scheduler(pool, BatchLimits(3, 64, 8, 4, 8))
    want: dict[int, list[int]] = {}
    for key, (prompt, new, family) in enumerate(requests):
        tokens = [family * 100 + i for i in range(prompt)]
        want[key] = tokens + [1000 * key + i for i in range(new)]
        s.add(key, tokens, whole=prompt + new)
    done: dict[int, list[int]] = {}
    for _ in range(2000):
        if not s.has_work():
            break
        schedule = s.schedule()
        assert not schedule.refused
        plan = schedule.plan
        for key in plan.decode:
            tokens = s.tokens(key)
            pool.commit(key, tokens)  # the step wrote every position so far
            nxt = want[key][len(tokens)]
            s.emitted(key, nxt)
            if len(s.tokens(key)) == len(want[key]):
                done[key] = list(s.tokens(key))
                s.remove(key)
        for key, count in plan.prefill:
            if s.prefilled(key, count):
                pool.commit(key, s.tokens(key))
                first = (
                    want[key][len(s.tokens(key))] if len(s.tokens(key)) < len(want[key]) else None
                )
                if first is None:
                    done[key] = list(s.tokens(key))
                    s.remove(key)
                else:
                    s.emitted(key, first)
                    if len(s.tokens(key)) == len(want[key]):
                        done[key] = list(s.tokens(key))
                        s.remove(key)
    assert done == want
    assert pool.holders() == 0 and pool.available == pool.num_blocks


def test_lookahead_takes_only_spare_blocks_and_settle_gives_back_what_was_not_kept() -> None:
    s = scheduler(6)  # blocks of 4 positions
    s.add(1, [1, 2, 3], 20)
    s.add(2, [4, 5, 6], 20)
    prefill_all(s)
    pool = s.pool
    assert len(pool.table(1)) == len(pool.table(2)) == 1 and pool.available == 4
    with pytest.raises(SchedulerMisuse):
        s.lookahead(99, 3)
    # 3 positions past the next: its block holds one, a second block the rest
    assert s.lookahead(1, 3) == 3 and len(pool.table(1)) == 2 and pool.available == 3
    # far more: only what leaves a block for each running sequence's growth (one more)
    assert s.lookahead(2, 30) == 1 + 4 and pool.available == 2
    s.emitted(1, 7)  # one token kept of its guesses: 4 positions, one block
    s.settle(1)
    s.settle(2)
    assert len(pool.table(1)) == len(pool.table(2)) == 1 and pool.available == 4
