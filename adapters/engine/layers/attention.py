"""Attention over the paged KV cache: where rows write, how their pages are read, and
the eager decode and prefill attention over them.

The KV pool (the runner's) is one key and one value tensor per layer laid out
[kv_heads, (num_blocks + 1) * block_size, head_dim]: cache slot block *
block_size + offset. A sequence's block table (core/blocks.py decides it) says
which blocks hold its positions in order; each row writes its new key and value
at its position's slot (`slots`) and attends over its own prefix only (and
within its layer's window), read through its table (`Pages`): as a view when
the table is one contiguous run, else whole blocks gathered into a reused buffer.

Two front-ends, each an `Attend` for the runner's layer loop:
- `paged_attend`, a decode step: one query per row over its gathered prefix
  (`attend_gathered`), rows gathered in groups that fit the CPU's cache;
- `chunk_attend`, a prefill: each chunk's queries over its own sequence with
  SDPA (`attend_chunk`), causal within the chunk.
The fixed-shape step's kinds (for CUDA graphs) are paged_attention.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from adapters.engine.spec import Attention

# One layer's attention: (q, that layer's key cache, its value cache, the layer's
# attention settings: window and soft-cap) -> [rows, heads * dim].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Attention], torch.Tensor]
# On CPU, decode attention gathers at most this many bytes of keys and values at
# once; more rows are attended in groups, so that what a gather writes is still in
# cache when the products read it (16 rows x 1000 positions: 15% faster a step).
CPU_GATHER_BYTES = 8 << 20


class Pages(NamedTuple):
    """Where the rows of one forward pass keep their keys and values in the pool.

    `run` is set when there is one row and its table is one contiguous run of
    blocks: its cache is then read as a view, with no gather (the usual case
    for a lone sequence, since fresh blocks are handed out lowest first).
    """

    tables: torch.Tensor  # [rows, width] block ids; a short row is padded with any block
    length: int  # positions read: width * block_size (a gather) or the row's length (a run)
    run: int | None  # first cache slot of a one-row contiguous table


class ChunkPages(NamedTuple):
    """What a prefill chunk's attention reads: its rows (one query a token), its Pages,
    its positions and the positions its pages span (arange(pages.length))."""

    rows: int
    pages: Pages
    positions: torch.Tensor
    span: torch.Tensor


def pages(tables: list[list[int]], length: int, block_size: int, device: torch.device) -> Pages:
    """The Pages of rows with these block tables, each read up to `length` positions."""
    width = -(-length // block_size)
    ids = torch.tensor([padded_table(table, width) for table in tables], device=device)
    if len(tables) == 1 and len(tables[0]) >= width and _contiguous(tables[0][:width]):
        return Pages(ids, length, tables[0][0] * block_size)
    return Pages(ids, width * block_size, None)


def padded_table(table: list[int], width: int, fill: int = 0) -> list[int]:
    """A block table cut or padded with `fill` to `width` entries."""
    return table[:width] + [fill] * (width - len(table[:width]))


def _contiguous(table: list[int]) -> bool:
    return all(block == table[0] + i for i, block in enumerate(table))


def slots(tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` ([rows, n]) through each row's table ([rows, width])."""
    blocks = tables.gather(1, positions // block_size)
    return blocks * block_size + positions % block_size


def read(
    cache: torch.Tensor, pages: Pages, block_size: int, buffers: list[torch.Tensor], which: int
) -> torch.Tensor:
    """One layer's keys (which 0) or values (1), cache [kv_heads, slots, dim], of the rows
    in `pages`: [kv_heads, length, dim] as a view of a one-row run, else whole blocks
    gathered into buffers[which] (grown here when too small), [kv_heads, rows, length,
    dim]. Each block is block_size * dim contiguous values, so the gather copies runs
    of kilobytes; the buffer is kept because a fresh tensor of megabytes a layer cost
    more in page faults on CPU than the copy itself."""
    if pages.run is not None:
        return cache[:, pages.run : pages.run + pages.length]
    kv_heads, head_dim = cache.shape[0], cache.shape[-1]
    rows, width = pages.tables.shape
    shape = (kv_heads, rows * width, block_size, head_dim)
    size = shape[0] * shape[1] * shape[2] * shape[3]
    if buffers[which].numel() < size:
        buffers[which] = torch.empty(size, dtype=cache.dtype, device=cache.device)
    out = buffers[which][:size].view(shape)
    by_block = cache.view(kv_heads, -1, block_size, head_dim)
    torch.index_select(by_block, 1, pages.tables.flatten(), out=out)
    return out.view(kv_heads, rows, width * block_size, head_dim)


def row_groups(
    pages: Pages, rows: int, budget_bytes: int | None, cache: torch.Tensor
) -> list[tuple[int, Pages]]:
    """(first row, its Pages) of each group of rows attended together: all rows at once
    unless their gathered keys and values (of one layer's cache [kv_heads, slots,
    dim]) would exceed `budget_bytes` (None: no budget)."""
    if pages.run is not None or budget_bytes is None:
        return [(0, pages)]
    kv_heads, head_dim = cache.shape[0], cache.shape[-1]
    row_bytes = 2 * kv_heads * pages.length * head_dim * cache.element_size()
    size = max(1, budget_bytes // row_bytes)
    if size >= rows:
        return [(0, pages)]
    return [
        (first, pages._replace(tables=pages.tables[first : first + size]))
        for first in range(0, rows, size)
    ]


def paged_attend(
    pages: Pages,
    positions: torch.Tensor,
    groups: list[tuple[int, Pages]],
    block_size: int,
    buffers: list[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
) -> Attend:
    """The eager decode step's attention: each row over its own prefix through `pages`
    (a view of a one-row run, else whole blocks gathered, in `groups` of rows:
    row_groups), masked past the row's position and before its layer's window. The
    masks are in `dtype` (the runner's state dtype) on `device`."""
    rows, length = positions.shape[0], pages.length
    span = torch.arange(length, device=device)
    masks: dict[int | None, torch.Tensor] = {}  # by window, built at first use

    def mask_for(window: int | None) -> torch.Tensor:
        if window not in masks:
            hidden = span[None, :] > positions[:, None]
            if window is not None:
                hidden |= span[None, :] <= positions[:, None] - window
            shape = (1, rows, 1, length)
            zeros = torch.zeros(shape, dtype=dtype, device=device)
            masks[window] = zeros.masked_fill(hidden.view(shape), float("-inf"))
        return masks[window]

    def attend(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention
    ) -> torch.Tensor:
        mask, parts = mask_for(layer.window), []
        for first, group in groups:
            keys = read(k_cache, group, block_size, buffers, 0)
            values = read(v_cache, group, block_size, buffers, 1)
            end = first + group.tables.shape[0]
            chosen = mask[:, first:end]
            parts.append(attend_gathered(q[first:end], keys, values, chosen, layer.softcap))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return attend


def attend_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention for one new token per row: q [rows, heads, dim] (already scaled) over
    keys and values [kv_heads, rows, length, dim] (or [kv_heads, length, dim] for one
    row), plus `mask` (broadcast to [kv_heads, rows, 1, length]) -> [rows, heads * dim];
    with `softcap`, scores become tanh(s / softcap) * softcap before the mask.

    Written out rather than through scaled_dot_product_attention: for a single
    query, torch's CPU flash kernel spent ~0.5 ms per call on fixed costs, 14 of
    a 23 ms step at 30 layers. Query heads that share a key head are stacked
    as rows of one product (grouped-query attention without copying keys);
    the batch runs key head major, the cache's own order.
    """
    rows, heads, dim = q.shape
    kv_heads, length = keys.shape[0], keys.shape[-2]
    group, batch = heads // kv_heads, rows * kv_heads
    queries = q.reshape(rows, kv_heads, group, dim).transpose(0, 1).reshape(batch, group, dim)
    scores = torch.bmm(queries, keys.reshape(batch, length, dim).transpose(1, 2))
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(kv_heads, rows, group, length) + mask
    weights = torch.softmax(scores, dim=-1).view(batch, group, length)
    out = torch.bmm(weights, values.reshape(batch, length, dim))
    return out.view(kv_heads, rows, group * dim).transpose(0, 1).reshape(rows, heads * dim)


def chunk_attend(chunks: list[ChunkPages], block_size: int, buffers: list[torch.Tensor]) -> Attend:
    """A packed prefill's attention: the rows are the chunks' queries, chunk after chunk,
    each chunk's over its own sequence's cached prefix and itself (causal, within the
    layer's window), read through its own pages (attend_chunk). A loop rather than one
    masked product over every chunk's keys: that product grows as (tokens x all
    chunks' keys), and for short chunks the loop's fixed costs are small beside the
    products (engine.md)."""
    masks: dict[tuple[int, int | None], torch.Tensor] = {}  # (chunk, window)

    def attend(
        q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention
    ) -> torch.Tensor:
        parts, first = [], 0
        for number, (count, chunk_pages, positions, span) in enumerate(chunks):
            window = layer.window
            if (number, window) not in masks:
                seen = span[None, :] <= positions[:, None]
                if window is not None:
                    seen &= span[None, :] > positions[:, None] - window
                masks[number, window] = seen[None, None, :, :]
            queries = q[first : first + count]
            seen = masks[number, window]
            args = (chunk_pages, seen, layer.softcap, block_size, buffers)
            parts.append(attend_chunk(queries, k_cache, v_cache, *args))
            first += count
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    return attend


def attend_chunk(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: Pages,
    seen: torch.Tensor,
    softcap: float | None,
    block_size: int,
    buffers: list[torch.Tensor],
) -> torch.Tensor:
    """Attention of one chunk's queries q [count, heads, dim] (already scaled) over its
    sequence's keys and values where `seen` [1, 1, count, read] allows -> [count,
    heads * dim]. SDPA, but for soft-capped scores, which it cannot take."""
    count, heads, head_dim = q.shape
    kv_heads, length = k_cache.shape[0], pages.length
    keys = read(k_cache, pages, block_size, buffers, 0)
    values = read(v_cache, pages, block_size, buffers, 1)
    keys = keys.reshape(1, kv_heads, length, head_dim)
    values = values.reshape(1, kv_heads, length, head_dim)
    queries = q.transpose(0, 1)[None]
    if softcap is None:
        attn = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=seen, enable_gqa=True,
            scale=1.0,  # the query weights carry the attention scale
        )  # fmt: skip
    else:
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.tanh(queries @ keys.transpose(-1, -2) / softcap) * softcap
        scores = scores.masked_fill(~seen, float("-inf"))
        attn = torch.softmax(scores, dim=-1) @ values
    return attn[0].transpose(0, 1).reshape(count, heads * head_dim)
