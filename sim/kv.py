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

from collections.abc import Callable, Sequence

from core.blocks import BlockError, BlockManager, blocks_for
from core.protocol import CacheReport

SUMMARY_KEYS = 64  # chain keys per heartbeat report


class KvModel:
    def __init__(
        self, num_blocks: int, block_size: int, violation: Callable[[str], None], name: str
    ) -> None:
        self.manager = BlockManager(num_blocks, block_size)
        self.block_size = block_size
        self._violation = violation
        self._name = name
        self._tables: dict[int, list[int]] = {}  # key -> its table as handed out
        self._readers: dict[int, set[int]] = {}  # block -> keys whose table holds it
        self._written: dict[int, int] = {}  # key -> positions recorded so far
        self._content: dict[int, tuple[int, ...]] = {}  # block -> context up to its end
        self.prompt_tokens = 0
        self.computed_tokens = 0

    def admit(self, key: int, context: Sequence[int], positions: int) -> int:
        """Blocks for a sequence's `positions` positions; returns the cached tokens
        (the sequence starts with those prefilled). -1 if the pool cannot hold it now."""
        manager = self.manager
        if manager.needed(context, positions) > manager.available:
            return -1
        try:
            cached = manager.allocate(key, context, positions)
        except BlockError as error:
            self._violation(f"{self._name}: block manager refused what it said fits: {error}")
            return -1
        table = list(manager.table(key))
        shared = cached // self.block_size
        size = self.block_size
        for index, block in enumerate(table):
            readers = self._readers.setdefault(block, set())
            if index < shared:
                held = self._content.get(block)
                if held != tuple(context[: (index + 1) * size]):
                    self._violation(
                        f"{self._name}: block {block} shared at position {index * size} "
                        f"holds another context ({'unwritten' if held is None else 'differs'})"
                    )
            elif readers:
                self._violation(
                    f"{self._name}: block {block} handed out fresh while sequences "
                    f"{sorted(readers)} still hold it"
                )
            readers.add(key)
        self._tables[key] = table
        self._written[key] = cached
        self.prompt_tokens += len(context)
        self.computed_tokens += len(context) - cached
        return cached

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
    """A pool where `slots` of the largest request always fit at once (so admission
    never waits for blocks: the router's slot count stays the only limit) and
    half of one more is left for cached blocks, so that eviction comes often."""
    per_request = blocks_for(largest_request, block_size)
    return slots * per_request + per_request // 2
