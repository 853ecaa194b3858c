"""The paged KV cache's bookkeeping: blocks, block tables, sharing, prefix cache, eviction.

The engine (adapters/engine) owns the key/value tensors, a pool of
`num_blocks` blocks of `block_size` token positions each; this module decides
which block holds what, so the policy is tested (and simulated) without torch.

- A sequence holds a block table: block ids covering its positions in order.
  Position p lives in block table[p // block_size] at offset p % block_size.
- A full block that a sequence has written is *committed*: keyed by its chain
  hash, hash(parent block's hash, the block's token ids), so that a key names
  the whole prefix up to the block's end, not only its own tokens.
- A new sequence looks its context up block by block along the chain and
  shares the longest run of committed blocks (reference counted), prefilling
  only the rest. Shared blocks are full and never written again; a sequence
  writes only its own blocks, so no copy-on-write is needed.
- A block whose last holder lets go keeps its contents while it has a key:
  it is *cached* (reference count 0, in LRU order) and may be shared again,
  or evicted (oldest release first) when a fresh block is needed and the
  free list is empty. A block without a key goes straight to the free list.

Every decision is a pure function of the calls made; the engine calls
allocate (admission), extend (before writing new positions), commit (after
writing them) and release (at the end or on preemption).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

ROOT_HASH = 0
"""The parent of a sequence's first block."""


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """The chain key of one full block: 63 bits of blake2b over the parent key and
    the block's token ids (stable across processes and runs, unlike hash(); 63
    so that it travels as a non-negative int64)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(parent.to_bytes(8, "little"))
    for token in tokens:
        digest.update(token.to_bytes(4, "little"))
    return int.from_bytes(digest.digest(), "little") >> 1


def chain_hashes(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """The chain keys of the full blocks of `tokens`, in order (at most `limit`)."""
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    keys: list[int] = []
    parent = ROOT_HASH
    for index in range(count):
        parent = block_hash(parent, tokens[index * block_size : (index + 1) * block_size])
        keys.append(parent)
    return keys


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class BlockError(Exception):
    """A call that breaks the manager's contract (a bug in the caller)."""


@dataclass
class _Held:
    """One sequence's blocks: the table, and how many of them are committed."""

    table: list[int] = field(default_factory=list)
    committed: int = 0  # table[:committed] are full, keyed blocks
    parent: int = ROOT_HASH  # key of table[committed - 1]


class BlockManager:
    """Blocks of one engine's KV pool. `prefix_caching=False` keys nothing: every
    released block is free at once and nothing is ever shared."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, int] = {}  # block -> chain key (committed blocks)
        self._block_of: dict[int, int] = {}  # chain key -> block
        self._cached: OrderedDict[int, None] = OrderedDict()  # refs 0 and keyed, oldest first
        self._held: dict[int, _Held] = {}
        self.hits = 0  # tokens found cached at allocation, over the manager's life
        self.lookups = 0  # tokens looked up at allocation

    # --- questions ---

    @property
    def available(self) -> int:
        """Blocks a new allocation can take: free, plus cached ones it may evict."""
        return len(self._free) + len(self._cached)

    def cached_prefix(self, tokens: Sequence[int]) -> int:
        """Tokens of `tokens` a sequence allocated now would find in the cache: whole
        blocks along the chain, and never all of them (the last token must be
        computed to give the next token's logits)."""
        return len(self._shared_blocks(tokens)) * self.block_size

    def needed(self, tokens: Sequence[int], positions: int) -> int:
        """Fresh blocks an allocation of `positions` positions for `tokens` would take
        (those it finds cached and unreferenced count too: they leave the cache)."""
        shared = self._shared_blocks(tokens)
        idle = sum(1 for block in shared if self._refs[block] == 0)
        return blocks_for(positions, self.block_size) - len(shared) + idle

    def table(self, key: int) -> list[int]:
        return self._holder(key).table

    def holders(self) -> int:
        return len(self._held)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def key_of(self, block: int) -> int | None:
        return self._key_of.get(block)

    def is_cached(self, block: int) -> bool:
        return block in self._cached

    def free_blocks(self) -> int:
        return len(self._free)

    def cached_blocks(self) -> int:
        return len(self._cached)

    def summary(self, limit: int) -> tuple[int, ...]:
        """Up to `limit` chain keys this pool can serve from now, most useful first:
        keys held by running sequences, then cached keys, most recently released
        first. A router that finds a request's chain keys here can expect them to
        be reused (the summary may be stale by the time it is read)."""
        keys: list[int] = []
        seen: set[int] = set()
        for held in self._held.values():
            for block in held.table[: held.committed]:
                key = self._key_of.get(block)
                if key is not None and key not in seen:
                    seen.add(key)
                    keys.append(key)
        for block in reversed(self._cached):
            key = self._key_of[block]
            if key not in seen:
                seen.add(key)
                keys.append(key)
        return tuple(keys[:limit])

    # --- changes ---

    def allocate(self, key: int, tokens: Sequence[int], positions: int) -> int:
        """Give sequence `key` blocks for its first `positions` positions, sharing the
        longest cached chain of `tokens` (its known context). Returns how many
        tokens were found cached (their keys and values are in the table's first
        blocks already). Raises BlockError when the pool cannot supply them; ask
        `needed` against `available` first."""
        if key in self._held:
            raise BlockError(f"sequence {key} already holds blocks")
        if positions < len(tokens):
            raise BlockError("positions must cover the tokens")
        shared = self._shared_blocks(tokens)
        if self.needed(tokens, positions) > self.available:
            raise BlockError("not enough blocks")
        held = _Held()
        for block in shared:
            self._take_shared(block)
            held.table.append(block)
        held.committed = len(shared)
        held.parent = self._key_of[shared[-1]] if shared else ROOT_HASH
        self._held[key] = held
        self.extend(key, positions)
        cached = len(shared) * self.block_size
        self.hits += cached
        self.lookups += len(tokens)
        return cached

    def extend(self, key: int, positions: int) -> bool:
        """Make sequence `key`'s table cover `positions` positions. False (and no
        change) when the pool has too few blocks left."""
        held = self._holder(key)
        missing = blocks_for(positions, self.block_size) - len(held.table)
        if missing <= 0:
            return True
        if missing > self.available:
            return False
        for _ in range(missing):
            held.table.append(self._fresh())
        return True

    def trim(self, key: int, positions: int) -> None:
        """Give back sequence `key`'s blocks past its first `positions` positions: the
        ones a verification wrote ahead of what it accepted. Only blocks never
        committed go (they hold no other sequence's tokens, so they are free again)."""
        held = self._holder(key)
        keep = max(blocks_for(positions, self.block_size), held.committed)
        while len(held.table) > keep:
            block = held.table.pop()
            self._refs[block] -= 1
            if self._refs[block] != 0 or block in self._key_of:
                raise BlockError(f"block {block} trimmed while shared or cached")
            self._free.append(block)

    def commit(self, key: int, tokens: Sequence[int]) -> None:
        """Sequence `key` has written its first len(tokens) positions (these token
        ids): key its newly full blocks so later sequences can share them."""
        held = self._holder(key)
        full = min(len(tokens) // self.block_size, len(held.table))
        while held.committed < full:
            index = held.committed
            block = held.table[index]
            start = index * self.block_size
            chain = block_hash(held.parent, tokens[start : start + self.block_size])
            if self.prefix_caching and chain not in self._block_of and block not in self._key_of:
                self._key_of[block] = chain
                self._block_of[chain] = block
            held.parent = chain
            held.committed += 1

    def release(self, key: int) -> None:
        """Sequence `key` is done with its blocks (finished, stopped or preempted)."""
        held = self._held.pop(key, None)
        if held is None:
            return
        for block in reversed(held.table):  # a chain's tail is evicted before its head
            self._refs[block] -= 1
            if self._refs[block] < 0:
                raise BlockError(f"block {block} released more often than taken")
            if self._refs[block] == 0:
                if block in self._key_of:
                    self._cached[block] = None
                    self._cached.move_to_end(block)
                else:
                    self._free.append(block)

    # --- internals ---

    def _holder(self, key: int) -> _Held:
        held = self._held.get(key)
        if held is None:
            raise BlockError(f"sequence {key} holds no blocks")
        return held

    def _shared_blocks(self, tokens: Sequence[int]) -> list[int]:
        if not self.prefix_caching:
            return []
        usable = (len(tokens) - 1) // self.block_size  # keep at least one token to compute
        blocks: list[int] = []
        parent = ROOT_HASH
        for index in range(usable):
            parent = block_hash(
                parent, tokens[index * self.block_size : (index + 1) * self.block_size]
            )
            block = self._block_of.get(parent)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _take_shared(self, block: int) -> None:
        if self._refs[block] == 0:
            del self._cached[block]
        self._refs[block] += 1

    def _fresh(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._cached:
            block, _ = self._cached.popitem(last=False)  # least recently released
            del self._block_of[self._key_of.pop(block)]
        else:
            raise BlockError("no block left")
        self._refs[block] = 1
        return block
