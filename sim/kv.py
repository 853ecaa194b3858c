"""A simulated worker's paged KV cache: core.blocks deciding, the simulator checking.

Each simulated worker process keeps a core.blocks.BlockManager exactly as the
torch engine does (allocate at admission, commit what was written, release at
the end), so the simulator exercises the real bookkeeping, and a prefill
costs only what the cache lacks (a sequence admitted with cached tokens
starts with them prefilled).

What the simulator knows and the manager does not is what each block really
holds: the exact context up to the block's end, recorded here when a
sequence writes the block full. Two checks follow, each the observable harm
of a bookkeeping bug: a block handed out fresh while another live sequence's
table still holds it (its keys and values would be overwritten under that
reader), and a block shared with a sequence whose own context up to that
block's end differs (it would attend over someone else's prefix).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from itertools import chain

from core.blocks import BlockError, BlockManager, blocks_for
from core.protocol import CacheReport

SUMMARY_KEYS = 64  # chain keys per heartbeat report


class KvModel:
    """A core.scheduler.Pool: the BlockManager's answers, each change checked."""

    def __init__(
        self, num_blocks: int, block_size: int, violation: Callable[[str], None], name: str
    ) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.prefix_caching = True
        self._violation = violation
        self._name = name
        self._tables: dict[int, list[int]] = {}  # key -> its table as handed out
        self._readers: dict[int, set[int]] = {}  # block -> keys whose table holds it
        self._written: dict[int, int] = {}  # key -> positions recorded so far
        self._content: dict[int, tuple[int, ...]] = {}  # block -> context up to its end
        self.prompt_tokens = 0
        self.computed_tokens = 0

    # --- the pool's questions: the manager's answers ---

    @property
    def available(self) -> int:
        return self.manager.available

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        return self.manager.cached_prefix(tokens)

    def needed(self, tokens: Sequence[int], positions: int) -> int:
        return self.manager.needed(tokens, positions)

    def table(self, key: int) -> list[int]:
        return self.manager.table(key)

    # --- the pool's changes, checked ---

    def allocate(self, key: int, context: Sequence[int], positions: int) -> int:
        """Blocks for a sequence's `positions` positions; returns the cached tokens
        (the sequence starts with those prefilled)."""
        manager = self.manager
        try:
            cached = manager.allocate(key, context, positions)
        except BlockError as error:
            self._violation(f"{self._name}: block manager refused what it said fits: {error}")
            raise
        if cached >= len(context):
            # The last context token's logits come from a forward pass: it is computed.
            self._violation(
                f"{self._name}: sequence {key} admitted with all {len(context)} context "
                "tokens cached: nothing left to compute its first logits from"
            )
        table = list(manager.table(key))
        shared = cached // self.block_size
        size = self.block_size
        for index, block in enumerate(table):
            if index < shared:
                held = self._content.get(block)
                if held != tuple(context[: (index + 1) * size]):
                    self._violation(
                        f"{self._name}: block {block} shared at position {index * size} "
                        f"holds another context ({'unwritten' if held is None else 'differs'})"
                    )
                self._readers.setdefault(block, set()).add(key)
            else:
                self._fresh(key, block)
        self._tables[key] = table
        self._written[key] = cached
        self.prompt_tokens += len(context)
        self.computed_tokens += len(context) - cached
        return cached

    def extend(self, key: int, positions: int) -> bool:
        grown = self.manager.extend(key, positions)
        table = self.manager.table(key)
        known = self._tables[key]
        if len(table) != len(known):  # new blocks at the end (check() sees any other change)
            for block in table[len(known) :]:
                self._fresh(key, block)
            self._tables[key] = list(table)
        return grown

    def trim(self, key: int, positions: int) -> None:
        self.manager.trim(key, positions)
        table = self.manager.table(key)
        for block in self._tables[key][len(table) :]:
            self._readers.get(block, set()).discard(key)
            self._content.pop(block, None)
        self._tables[key] = list(table)
        self._written[key] = min(self._written[key], positions)

    def _fresh(self, key: int, block: int) -> None:
        readers = self._readers.setdefault(block, set())
        if readers:
            self._violation(
                f"{self._name}: block {block} handed out fresh while sequences "
                f"{sorted(readers)} still hold it"
            )
        self._content.pop(block, None)  # whatever it held is being overwritten
        readers.add(key)

    def written(self, key: int) -> int:
        """Positions of the sequence written since its (re)admission, in order."""
        return self._written.get(key, 0)

    def check(self) -> None:
        """Block accounting balances: every block is free, cached or held, each held
        one as often as the tables hold it, and each table as the manager has it."""
        manager = self.manager
        tables = self._tables
        for key, table in tables.items():
            if manager.table(key) != table:
                self._violation(f"{self._name}: sequence {key}'s table changed behind its back")
        held = Counter(chain.from_iterable(tables.values()))
        free, cached = manager.free_blocks(), manager.cached_blocks()
        if len(held) + free + cached != self.num_blocks or manager.holders() != len(self._tables):
            self._violation(
                f"{self._name}: {len(held)} blocks held, {free} free and {cached} cached of "
                f"{self.num_blocks}; {manager.holders()} holders, {len(self._tables)} tables"
            )
        wrong = [b for b, n in held.items() if manager.refs(b) != n]
        if wrong:
            self._violation(f"{self._name}: blocks {wrong[:5]} referenced other than held")

    def wrote(self, key: int, tokens: Sequence[int]) -> None:
        """The sequence has written positions 0..len(tokens)-1 (these token ids)."""
        table = self._tables.get(key)
        if table is None:
            return
        size = self.block_size
        before = self._written[key] // size
        full = min(len(tokens) // size, len(table))
        for index in range(before, full):
            self._content[table[index]] = tuple(tokens[: (index + 1) * size])
        self._written[key] = max(self._written[key], len(tokens))
        self.manager.commit(key, tokens)

    def release(self, key: int) -> None:
        table = self._tables.pop(key, None)
        if table is None:
            return
        self._written.pop(key, None)
        for block in table:
            readers = self._readers.get(block)
            if readers is not None:
                readers.discard(key)
        self.manager.release(key)

    def release_all(self) -> None:
        for key in list(self._tables):
            self.release(key)

    def report(self) -> CacheReport:
        manager = self.manager
        return CacheReport(
            self.block_size,
            manager.summary(SUMMARY_KEYS),
            0.0,
            self.prompt_tokens,
            self.computed_tokens,
            manager.num_blocks,
            manager.free_blocks(),
            manager.cached_blocks(),
        )


def pool_blocks(slots: int, largest_request: int, block_size: int) -> int:
    """A pool where `slots` of the largest request always fit at once (so nothing is
    ever preempted and the router's slot count stays the only limit) and half of one
    more is left for cached blocks, so that eviction comes often. Half the seeds give
    a worker a share of this instead (Decoders.pool_share, sim/decoders.py): then it preempts."""
    per_request = blocks_for(largest_request, block_size)
    return slots * per_request + per_request // 2
