"""One decoder's continuous batching: who waits, who runs, who is preempted, what a step computes.

The torch engine (adapters/engine/engine.py) and every simulated worker
(sim/decoders.py) drive this one Scheduler over their KV pool (core/blocks.py's
BlockManager, or the simulator's checking model of it), so the policy the
sweeps judge is the policy that serves. Those callers own the tensors (or
the fake decoder): they say what a step computed (`prefilled`, `emitted`),
and ask what the next one computes (`schedule`).

A sequence's tokens are its prompt and its output so far; its context is what
its next prefill must put in the cache (prompt and output prefix at the
start; everything so far after a preemption). Each step, in this order:

1. growth: every decoding sequence, oldest first, gets the block its next
   position needs; when the pool is out, the most recently admitted sequence
   is preempted by recompute: its blocks go back (the ones it committed stay
   cached, so its recompute mostly finds them), its tokens are kept, and it
   waits at the head of the queue with its context = all its tokens. Nothing
   it emitted is emitted again: its next token is the next index.
2. admission, first come first served: a waiting sequence that can never fit
   (beyond max_context, or the whole pool) is refused; the head is admitted
   when a row is free and the pool has the blocks its context needs, with a
   block to spare for each running sequence's growth; nobody overtakes a head
   that does not fit. A cached prefix is shared, never its last token (that
   position is computed to give the first logits). A sequence whose next
   uncached block a running prefill is writing waits for it (n choices of
   one prompt share it instead of computing it twice).
3. the plan (core/batching.plan_step): decodes first, then prefill chunks in
   admission order within the step's token budget.

Every move of a sequence goes through core/states.py's SEQUENCE table.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from msgspec import Struct

from core.batching import BatchLimits, Running, StepPlan, plan_step
from core.blocks import blocks_for, chain_hashes
from core.states import SEQUENCE, SchedulerMisuse, SeqEvent, SeqState


class Pool(Protocol):
    """What the scheduler asks of a KV pool (core.blocks.BlockManager has it all)."""

    block_size: int
    num_blocks: int
    prefix_caching: bool

    @property
    def available(self) -> int: ...

    def cached_prefix(self, tokens: Sequence[int]) -> int: ...

    def needed(self, tokens: Sequence[int], positions: int) -> int: ...

    def allocate(self, key: int, tokens: Sequence[int], positions: int) -> int: ...

    def extend(self, key: int, positions: int) -> bool: ...

    def table(self, key: int) -> list[int]: ...

    def trim(self, key: int, positions: int) -> None: ...

    def release(self, key: int) -> None: ...


class Schedule(Struct, frozen=True):
    """What one call to `schedule` decided, for the caller to carry out."""

    plan: StepPlan
    batch: tuple[Running, ...]  # the running sequences the plan was made for, in order
    admitted: tuple[tuple[int, int], ...]  # (key, context tokens found cached)
    refused: tuple[int, ...]  # can never fit: the caller fails them (they are gone here)
    preempted: tuple[int, ...]  # sent back to wait, to be recomputed


class _Entry:
    __slots__ = ("chain", "context", "key", "prefilled", "state", "tokens", "whole")

    def __init__(self, key: int, tokens: Sequence[int], whole: int) -> None:
        self.key = key
        self.tokens = list(tokens)  # prompt + output so far
        self.context = len(self.tokens)  # what the next prefill puts in the cache
        self.whole = whole  # prompt + max new tokens: the most it will ever hold
        self.prefilled = 0  # context tokens in the cache (found cached or computed)
        self.state = SeqState.WAITING
        self.chain: list[int] | None = None  # the context's chain keys, once asked for


class Scheduler:
    def __init__(self, pool: Pool, limits: BatchLimits) -> None:
        self.pool = pool
        self.limits = limits
        self._waiting: dict[int, _Entry] = {}  # in queue order
        self._running: dict[int, _Entry] = {}  # in admission order
        self.preemptions = 0  # over the scheduler's life
        self.recomputed_tokens = 0  # output tokens put back into a context by preemption

    # --- what the caller says ---

    def add(self, key: int, tokens: Sequence[int], whole: int) -> None:
        """A sequence joins the queue: its prompt (and output prefix), and the most
        tokens it may hold."""
        if key in self._waiting or key in self._running:
            raise SchedulerMisuse(f"sequence {key} is already scheduled")
        if not tokens:
            raise SchedulerMisuse(f"sequence {key} has no tokens to start from")
        self._waiting[key] = _Entry(key, tokens, whole)

    def remove(self, key: int) -> None:
        """The sequence stopped (ended, cancelled, dropped): its blocks go back."""
        entry = self._waiting.pop(key, None) or self._running.pop(key, None)
        if entry is None:
            return  # already gone (refused, or stopped before)
        entry.state = SEQUENCE.next(entry.state, SeqEvent.STOPPED)
        self.pool.release(key)

    def prefilled(self, key: int, count: int) -> bool:
        """The step computed `count` more context tokens of a running sequence; True
        when its context is complete (its first token follows from this step)."""
        entry = self._entry(key)
        if entry.state is not SeqState.PREFILLING or count > entry.context - entry.prefilled:
            raise SchedulerMisuse(f"sequence {key} cannot prefill {count} tokens now")
        entry.prefilled += count
        if entry.prefilled < entry.context:
            return False
        entry.state = SEQUENCE.next(entry.state, SeqEvent.PREFILLED)
        return True

    def emitted(self, key: int, token: int) -> None:
        """A running sequence produced its next output token."""
        entry = self._entry(key)
        if entry.state is not SeqState.DECODING:
            raise SchedulerMisuse(f"sequence {key} emitted a token while {entry.state}")
        entry.tokens.append(token)

    def lookahead(self, key: int, extra: int) -> int:
        """Blocks for up to `extra` positions past a decoding sequence's next one (its
        speculative tokens, verified in one pass), taken only where the pool has them
        to spare: a block is left for each running sequence's growth and nobody is
        preempted. Never past the most the sequence may hold. Returns how many of
        the `extra` positions its table covers now; `settle` gives the rest back."""
        entry = self._entry(key)
        if entry.state is not SeqState.DECODING:
            raise SchedulerMisuse(f"sequence {key} cannot look ahead while {entry.state}")
        pool = self.pool
        positions = len(entry.tokens)  # the next position written is positions - 1
        want = min(positions + max(extra, 0), entry.whole)
        have = len(pool.table(key))
        spare = max(pool.available - len(self._running), 0)
        blocks = min(blocks_for(want, pool.block_size), have + spare)
        if blocks > have and not pool.extend(key, blocks * pool.block_size):
            blocks = have
        return max(min(want, blocks * pool.block_size) - positions, 0)

    def settle(self, key: int) -> None:
        """After a verification: a decoding sequence keeps the blocks its next position
        needs, and the ones looked ahead past it go back to the pool."""
        entry = self._entry(key)
        self.pool.trim(key, len(entry.tokens))

    # --- what the caller asks ---

    def tokens(self, key: int) -> list[int]:
        """Prompt + output so far (read only: the caller slices what it writes)."""
        return self._entry(key).tokens

    def progress(self, key: int) -> tuple[int, int]:
        """(context tokens in the cache, context tokens) of a running sequence."""
        entry = self._entry(key)
        return entry.prefilled, entry.context

    def state(self, key: int) -> SeqState:
        entry = self._waiting.get(key) or self._running.get(key)
        return SeqState.GONE if entry is None else entry.state

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> tuple[int, ...]:
        return tuple(self._waiting)

    def schedule(self) -> Schedule:
        preempted = self._grow()
        admitted, refused = self._admit()
        batch = tuple(Running(e.key, e.context, e.prefilled) for e in self._running.values())
        return Schedule(plan_step(batch, self.limits), batch, admitted, refused, preempted)

    # --- the policy ---

    def _grow(self) -> tuple[int, ...]:
        """The block each decoding sequence's next position needs, oldest first;
        when the pool is out, preempt the most recently admitted."""
        preempted: list[int] = []
        pool = self.pool
        for key in list(self._running):
            entry = self._running.get(key)
            if entry is None or entry.state is not SeqState.DECODING:
                continue  # preempted just now, or prefilling (its context's blocks are held)
            positions = len(entry.tokens)  # the last token's position is written next
            had = len(pool.table(key))
            if blocks_for(positions, pool.block_size) <= had:
                continue  # within its last block: nothing to grow
            while not pool.extend(key, positions):
                victim = next(reversed(self._running))
                self._preempt(victim)
                preempted.append(victim)
                if victim == key:
                    break
            if key in self._running and len(pool.table(key)) > had:
                entry.state = SEQUENCE.next(entry.state, SeqEvent.GREW)
        return tuple(preempted)

    def _preempt(self, key: int) -> None:
        entry = self._running.pop(key)
        entry.state = SEQUENCE.next(entry.state, SeqEvent.PREEMPTED)
        self.pool.release(key)
        self.recomputed_tokens += len(entry.tokens) - entry.context
        entry.context = len(entry.tokens)
        entry.prefilled, entry.chain = 0, None
        self._waiting = {key: entry, **self._waiting}
        self.preemptions += 1

    def _admit(self) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
        pool, limits = self.pool, self.limits
        admitted: list[tuple[int, int]] = []
        refused: list[int] = []
        blocked = False
        coming = self._coming_blocks()
        for key, entry in list(self._waiting.items()):
            whole = entry.whole
            if whole > limits.max_context or blocks_for(whole, pool.block_size) > pool.num_blocks:
                del self._waiting[key]
                entry.state = SEQUENCE.next(entry.state, SeqEvent.REFUSED)
                refused.append(key)
                continue
            if blocked or len(self._running) >= limits.max_seqs:
                continue  # nobody overtakes the head; later ones may still be refused
            context = entry.tokens[: entry.context]
            if coming and self._next_block(entry, context) in coming:
                continue  # a running prefill is writing its next block: share it, soon
            if pool.needed(context, entry.context) + len(self._running) > pool.available:
                blocked = True
                continue
            del self._waiting[key]
            found = pool.allocate(key, context, entry.context)
            entry.prefilled = found
            entry.state = SEQUENCE.next(entry.state, SeqEvent.ADMITTED)
            if pool.prefix_caching:
                coming.update(self._chain(entry)[found // pool.block_size :])
            self._running[key] = entry
            admitted.append((key, found))
        return tuple(admitted), tuple(refused)

    def _coming_blocks(self) -> set[int]:
        """Chain keys of the full blocks that running prefills will write and have not
        committed yet."""
        if not (self.pool.prefix_caching and self._waiting):
            return set()
        size = self.pool.block_size
        coming: set[int] = set()
        for entry in self._running.values():
            if entry.prefilled < entry.context:
                coming.update(self._chain(entry)[entry.prefilled // size :])
        return coming

    def _chain(self, entry: _Entry) -> list[int]:
        if entry.chain is None:
            entry.chain = chain_hashes(entry.tokens[: entry.context], self.pool.block_size)
        return entry.chain

    def _next_block(self, entry: _Entry, context: Sequence[int]) -> int | None:
        """The chain key of the first full block of the context not in the cache."""
        found = self.pool.cached_prefix(context) // self.pool.block_size
        chain = self._chain(entry)
        return chain[found] if len(chain) > found else None

    def _entry(self, key: int) -> _Entry:
        entry = self._running.get(key)
        if entry is None:
            raise SchedulerMisuse(f"sequence {key} is not running")
        return entry
