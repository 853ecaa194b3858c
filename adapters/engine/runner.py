"""One batched forward pass for every family, over a paged KV cache.

The model is a ModelSpec (spec.py: what each layer computes, from its family in
families/) and a checkpoint read tensor by tensor (checkpoint.py); this file
keeps the weights in the chosen format (weights.py), the KV pool, the rotary
tables, and runs the layers. One call decodes a batch of sequences that sit at
different positions. The KV cache is a pool of `num_blocks` blocks of
`block_size` positions (and one scratch block past them, for the padding rows
of static_decode.py), one key and one value tensor per layer laid out
[kv_heads, (num_blocks + 1) * block_size, head_dim]: cache slot block *
block_size + offset. A sequence's block table (core/blocks.py decides it) says
which blocks hold its positions in order; it writes each new key and value at
its position's slot and attends over its own prefix only (and within its
layer's window), gathered through its table (or read as a view when the table
is one contiguous run). Nothing is copied when sequences join or leave, and
blocks holding a shared prefix are read by every sequence that shares it.

A layer, as spec.Layer describes it: an optional RMSNorm, the q/k/v product
(with biases), optional RMSNorms of q and k (per head, or over the whole
projection), rotary on the rotated part of each head (the layer's table, or
none), attention (scaled, windowed, soft-capped as the layer says), the output
product, an optional norm of the result, the residual add; then the same
pattern for the gated MLP (SiLU or tanh-GELU). Constant multipliers are folded
into the weights as they are loaded (`_load`), so none of them costs a step.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn.functional as F

from adapters.engine.checkpoint import CheckpointError, expert_matrix
from adapters.engine.checkpoint import first as first_present
from adapters.engine.fused import (
    fused_problem,
    kernel_problem,
    rms_norm,
    rotate_store,
    silu_gate,
    torch_rms_norm,
    torch_rotate,
    torch_rotate_store,
    torch_silu_gate,
)
from adapters.engine.spec import Attention, Experts, ExpertTensors, Layer, ModelSpec
from adapters.engine.weights import (
    FORMATS,
    Projection,
    activation_dtype,
    output_format,
    projection,
)

if TYPE_CHECKING:
    from adapters.engine.model import LoadedModel
    from adapters.engine.native import NativeModel, NativeProduct, Part

# A prefill attends row by row (row_attention) when its rows read at most this many
# positions together: each row reads its whole prefix, so the work grows with the
# square of a chunk's length, where the per-chunk SDPA's does not (a bound by arithmetic:
# 2^17 positions of the 8B shape are 0.5 GB of keys and values a layer, mostly cached).
ROW_ATTENTION_POSITIONS = 1 << 17
# One layer's attention: (q, that layer's key cache, its value cache, the layer's
# attention settings: window and soft-cap) -> [rows, heads * dim].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Attention], torch.Tensor]
DEFAULT_BLOCK_SIZE = 16  # positions per KV block, chosen by measurement (engine.md)
# On CPU, decode attention gathers at most this many bytes of keys and values at
# once; more rows are attended in groups, so that what a gather writes is still in
# cache when the products read it (16 rows x 1000 positions: 15% faster a step).
CPU_GATHER_BYTES = 8 << 20


class MoeWeights(NamedTuple):
    """A mixture's weights (spec.Experts): the router, each expert's gate|up and down
    products, and (dense formats) the same experts stacked, [experts, 2 * width,
    hidden] and [experts, hidden, width], for the fixed-shape step's batched products
    (the per-expert products are views of them then, no second copy)."""

    router: torch.Tensor  # [experts, hidden], state dtype
    gate_up: list[Projection]
    down: list[Projection]
    stacked: tuple[torch.Tensor, torch.Tensor] | None = None
    shared_gate: torch.Tensor | None = None  # [hidden]: the shared expert's sigmoid gate

    @property
    def nbytes(self) -> int:
        total = _nbytes(self.router) + sum(p.nbytes for p in [*self.gate_up, *self.down])
        return total + (_nbytes(self.shared_gate) if self.shared_gate is not None else 0)

    def expert_bytes(self) -> int:
        """Bytes one expert's products read."""
        return self.gate_up[0].nbytes + self.down[0].nbytes


class LayerWeights(NamedTuple):
    """One decoder layer's weights, q/k/v and gate/up fused into one matrix each; the
    norms, biases and q/k norms a layer does not have are None. A mixture's layer has
    `moe`, and gate_up and down only for a shared expert."""

    qkv: Projection
    o: Projection
    gate_up: Projection | None
    down: Projection | None
    pre_attention: torch.Tensor | None = None
    post_attention: torch.Tensor | None = None
    pre_mlp: torch.Tensor | None = None
    post_mlp: torch.Tensor | None = None
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    moe: MoeWeights | None = None


class Pages(NamedTuple):
    """Where the rows of one forward pass keep their keys and values in the pool.

    `run` is set when there is one row and its table is one contiguous run of
    blocks: its cache is then read as a view, with no gather (the usual case
    for a lone sequence, since fresh blocks are handed out lowest first).
    """

    tables: torch.Tensor  # [rows, width] block ids; a short row is padded with any block
    length: int  # positions read: width * block_size (a gather) or the row's length (a run)
    run: int | None  # first cache slot of a one-row contiguous table


class Chunk(NamedTuple):
    """Part of one sequence's context to prefill: `tokens` at positions start.. of the
    sequence whose blocks are `table` (the table must cover them)."""

    table: list[int]
    start: int
    tokens: torch.Tensor  # [count] token ids


def state_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """What the runner keeps its activations, rotary tables and (but for w4a16) caches
    in: fp32 on a CPU, whose elementwise work is no faster in 16 bits, and the weights'
    activation dtype on a GPU."""
    return torch.float32 if device.type == "cpu" else dtype


class Runner:
    """The model's weights in one format (adapters/engine/weights.py), the paged KV
    pool, and the forward passes.

    Two dtypes: products take and give the format's activation dtype (fp32 for
    fp32 weights, bf16 otherwise); everything between them (the residual stream,
    norms, rotary, attention, the KV cache) is the state dtype, fp32 on CPU.
    A bf16 residual stream lost precision over 30 layers for nothing: the
    elementwise work is small, and bf16 attention over strided cache slices
    copied them first (4x slower at one row here). On CUDA both are the model's
    dtype.

    `layers`, when given, builds only the first that many layers (start-up speed
    trials measure a few layers and scale by their count). `num_blocks` None: the
    KV pool and rotary tables wait for `allocate`.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int | None,
        block_size: int,
        max_context: int,
        weights: str = "fp32",
        layers: int | None = None,
    ) -> None:
        if weights not in FORMATS:
            raise ValueError(f"unknown weight format {weights!r}; one of {', '.join(FORMATS)}")
        spec = loaded.spec
        if layers is not None:
            from dataclasses import replace

            spec = replace(spec, layers=spec.layers[:layers])
        self.spec = spec
        self.format = weights
        self.device = loaded.device
        self.dtype = activation_dtype(weights)
        self.state_dtype = state_dtype(self.device, self.dtype)
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.eps = spec.eps
        self.vocab_size = spec.vocab
        self.max_context = max_context
        self.embed, self.final_norm, self.lm_head, self.layers, sources = _load(
            loaded, spec, weights, self.state_dtype
        )
        # How many matrices came in each form (w4a16 on a GGUF: its block types as
        # shipped, and any requantised): for the start log.
        self.weight_sources: Counter[str] = sources
        loaded.checkpoint.release()
        return_freed_heap()
        # Norms, rotary and the SiLU gate as one triton kernel each (fused.py): on CUDA,
        # once triton has built them and they agree with torch's ops here. Rotary and the
        # gate only where every layer is the plain kind the kernels compute.
        hidden = spec.hidden
        self.fused_problem = fused_problem(self.device, hidden, self.head_dim) or kernel_problem(
            self.device, self.state_dtype, hidden, self.head_dim
        )
        self.fused = self.fused_problem is None
        features = spec.features()
        self.fused_rotate = self.fused and not features & {"partial_rotary", "no_rotary"}
        self.fused_gate = self.fused and "gelu_tanh" not in features
        # Set by the engine when its decode attention is paged_attention.py's kernel:
        # prefills that read few enough positions then attend row by row through it.
        self.row_attention: Any = None
        self.block_size = block_size
        self._q_size = self.heads * self.head_dim
        self._kv_size = self.kv_heads * self.head_dim
        self._gather_bytes = CPU_GATHER_BYTES if self.device.type == "cpu" else None
        self._native: NativeModel | None = None
        self._fixed_shapes = False  # inside forward_static: no shape read from the device
        # The native format keeps keys and values in fp16 (half the bytes attention
        # reads, and half the memory); only native.c reads or writes them then.
        self.cache_dtype = torch.float16 if weights == "w4a16" else self.state_dtype
        if num_blocks is not None:
            self.allocate(num_blocks, max_context)

    def token_bytes(self) -> int:
        """Bytes of KV cache one position takes, every layer's keys and values."""
        size = torch.empty(0, dtype=self.cache_dtype).element_size()
        return len(self.layers) * 2 * self._kv_size * size

    def allocate(self, num_blocks: int, max_context: int) -> None:
        """The KV pool of `num_blocks` blocks and the rotary tables for `max_context`
        positions (given to the constructor, or once the weights have told how much
        memory is left: engine.py sizes the pool then)."""
        self.max_context = max_context
        self.rotary_tables = [
            rotary.tables(max_context, self.state_dtype, self.device)
            for rotary in self.spec.rotaries
        ]
        self.num_blocks = num_blocks
        # [kv_heads, slot, dim] per layer: gathering whole blocks of each row's
        # table gives [kv_heads, rows, length, dim], ready for the batched products
        # without a second copy (engine.md compares this with a block-major layout).
        # One block more than the pool: the scratch block, given to no sequence, where the
        # padding rows of a fixed-shape decode step write and read (static_decode.py).
        self.scratch_block = num_blocks
        slots = (num_blocks + 1) * self.block_size
        shape = (len(self.layers), self.kv_heads, slots, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.cache_dtype, device=self.device)
        self._gathered = [torch.empty(0, device=self.device) for _ in range(2)]  # k, v
        if self.format == "w4a16":  # a whole decode step in one call (adapters/engine/native.py)
            from adapters.engine.native import NativeModel

            self._native = NativeModel(self)

    def _embedded(self, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of the embedding table the torch passes start from (a packed table:
        unpacked by native.c, as its fused pass does)."""
        if isinstance(self.embed, torch.Tensor):
            return self.embed[tokens]
        return self.embed.rows(tokens.cpu()).to(self.device)

    def embed_bytes(self) -> int:
        """Bytes the embedding table takes (packed, or fp32 rows); 0 where it is the
        output projection's own tiles."""
        if isinstance(self.embed, torch.Tensor):
            return _nbytes(self.embed)
        head_parts = getattr(self.lm_head, "parts", [])
        if head_parts and self.embed.parts[0].packed is head_parts[0].packed:
            return 0
        return self.embed.nbytes

    def weight_bytes(self, rows: int | None = None) -> int:
        """Bytes of the weights (each matrix once); with `rows`, those a decode step of
        that many rows reads: of a mixture, the router and the experts the rows pick,
        as many as evenly spread choices touch on average (experts x (1 - (1 - top_k /
        experts) ^ rows): top_k of them at one row)."""
        total: int = self.lm_head.nbytes + _nbytes(self.final_norm)
        for layer, weights in zip(self.spec.layers, self.layers, strict=True):
            total += weights.qkv.nbytes + weights.o.nbytes
            total += sum(p.nbytes for p in (weights.gate_up, weights.down) if p is not None)
            total += sum(_nbytes(t) for t in weights[4:] if isinstance(t, torch.Tensor))
            if weights.moe is None or layer.experts is None:
                continue
            total += weights.moe.nbytes
            if rows is not None:
                count, k = layer.experts.count, layer.experts.top_k
                touched = count * (1 - (1 - k / count) ** rows)
                total -= round((count - touched) * weights.moe.expert_bytes())
        return total

    def pages(self, tables: list[list[int]], length: int) -> Pages:
        """The Pages of rows with these block tables, each read up to `length` positions."""
        width = -(-length // self.block_size)
        ids = torch.tensor([padded_table(table, width) for table in tables], device=self.device)
        if len(tables) == 1 and len(tables[0]) >= width and _contiguous(tables[0][:width]):
            return Pages(ids, length, tables[0][0] * self.block_size)
        return Pages(ids, width * self.block_size, None)

    @torch.inference_mode()
    def decode(self, pages: Pages, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One token for each row (its table in `pages`, position, token) -> logits
        [rows, vocab]. Each row's table must cover its position."""
        if self._native is not None:
            return self._native.forward(tokens, positions, pages.tables)
        attend = self._paged_attend(pages, positions)
        return self._forward_rows(self._embedded(tokens), positions, pages.tables, attend, None)

    def _paged_attend(self, pages: Pages, positions: torch.Tensor) -> Attend:
        """The eager decode step's attention: each row over its own prefix through
        `pages` (a view of a one-row run, else whole blocks gathered, in groups of rows
        that fit the CPU budget), masked past the row's position and before its
        layer's window."""
        rows, length = positions.shape[0], pages.length
        span = torch.arange(length, device=self.device)
        groups = self._row_groups(pages, rows)
        masks: dict[int | None, torch.Tensor] = {}  # by window, built at first use

        def mask_for(window: int | None) -> torch.Tensor:
            if window not in masks:
                hidden = span[None, :] > positions[:, None]
                if window is not None:
                    hidden |= span[None, :] <= positions[:, None] - window
                shape = (1, rows, 1, length)
                zeros = torch.zeros(shape, dtype=self.state_dtype, device=self.device)
                masks[window] = zeros.masked_fill(hidden.view(shape), float("-inf"))
            return masks[window]

        def attend(
            q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention
        ) -> torch.Tensor:
            mask, parts = mask_for(layer.window), []
            for first, group in groups:
                keys, values = self._read(k_cache, group, 0), self._read(v_cache, group, 1)
                end = first + group.tables.shape[0]
                chosen = mask[:, first:end]
                parts.append(attend_gathered(q[first:end], keys, values, chosen, layer.softcap))
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return attend

    def forward_static(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        attend: Attend,
    ) -> torch.Tensor:
        """decode() at fixed shapes, for static_decode.py: every input a tensor of a
        size fixed per batch size (tables [rows, widest]), no Python value read from
        the device, attention by `attend` (paged_attention.py). -> logits [rows, vocab].
        A mixture's experts run as fixed-shape batched products then (_mixture)."""
        self._fixed_shapes = True
        try:
            return self._forward_rows(self._embedded(tokens), positions, tables, attend, None)
        finally:
            self._fixed_shapes = False

    def _forward_rows(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        tables: torch.Tensor,
        attend: Attend,
        rows: Sequence[int] | None,
    ) -> torch.Tensor:
        """The layers over rows x (embedded tokens), each at its position through its table:
        every row's key and value written, then attention by `attend` -> logits of `rows`
        (None: all)."""
        rotary = self._rotary(positions)
        writes = self._slots(tables, positions[:, None])[:, 0]
        for index, (layer, weights) in enumerate(zip(self.spec.layers, self.layers, strict=True)):
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            q = self._attention_inputs(x, layer, weights, rotary, k_cache, v_cache, writes)
            out = attend(q, k_cache, v_cache, layer.attention)
            x = self._attention_output(x, out, layer, weights)
            x = self._mlp(x, layer, weights)
        if rows is None:
            return self._logits(x)
        if not rows:
            return torch.empty(0, self.vocab_size, device=self.device)
        return self._logits(x[torch.tensor(list(rows), device=self.device)])

    def _rotary(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each rotary table's cos and sin at the rows' positions ([rows, its dims])."""
        return [(cos[positions], sin[positions]) for cos, sin in self.rotary_tables]

    @torch.inference_mode()
    def prefill(
        self, table: list[int], start: int, tokens: torch.Tensor, every_position: bool = False
    ) -> torch.Tensor:
        """Put a chunk of one sequence's context (positions start.. of the sequence whose
        blocks are `table`) in the cache -> logits of its last token (or [count, vocab],
        every position's, to score a text). The one-chunk case of prefill_packed."""
        count = tokens.shape[0]
        rows = range(count) if every_position else [count - 1]
        logits = self.prefill_packed([Chunk(table, start, tokens)], rows)
        return logits if every_position else logits[0]

    @torch.inference_mode()
    def prefill_packed(self, chunks: list[Chunk], rows: Sequence[int]) -> torch.Tensor:
        """Put every chunk in the cache in one forward pass -> logits [len(rows), vocab] of
        the given rows of the packed tokens (chunk after chunk, in order; no rows, no
        lm_head: a chunk that does not end its prompt samples nothing).

        The products (qkv, o, the MLP) run once over all the chunks' tokens; attention
        runs per chunk, its queries over its own sequence's cached prefix and itself
        (causal, within the layer's window), read through its own table. A loop rather
        than one masked product over every chunk's keys: that product grows as (tokens x
        all chunks' keys), and for short chunks the loop's fixed costs are small beside
        the products (engine.md).
        """
        total = sum(chunk.tokens.shape[0] for chunk in chunks)
        if total == 0:
            raise ValueError("prefill_packed needs at least one token")
        if self._native is not None:
            return self._native_prefill(chunks, rows)
        if self.row_attention is not None and _reads(chunks) <= ROW_ATTENTION_POSITIONS:
            return self._prefill_by_rows(chunks, rows, self.row_attention)
        x = self._embedded(torch.cat([chunk.tokens for chunk in chunks]))
        spans = []
        for chunk in chunks:
            count = chunk.tokens.shape[0]
            end = chunk.start + count
            pages = self.pages([chunk.table], end)
            positions = torch.arange(chunk.start, end, device=self.device)
            writes = self._slots(pages.tables, positions[None, :])[0]
            span = torch.arange(pages.length, device=self.device)
            spans.append((count, pages, writes, positions, span))
        positions = torch.cat(
            [torch.arange(c.start, c.start + c.tokens.shape[0]) for c in chunks]
        ).to(self.device)
        rotary = self._rotary(positions)
        writes = torch.cat([span[2] for span in spans])
        masks: dict[tuple[int, int | None], torch.Tensor] = {}  # (chunk, window)
        for index, (layer, weights) in enumerate(zip(self.spec.layers, self.layers, strict=True)):
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            q = self._attention_inputs(x, layer, weights, rotary, k_cache, v_cache, writes)
            parts, first = [], 0
            for number, (count, pages, _, chunk_positions, span) in enumerate(spans):
                window = layer.attention.window
                if (number, window) not in masks:
                    seen = span[None, :] <= chunk_positions[:, None]
                    if window is not None:
                        seen &= span[None, :] > chunk_positions[:, None] - window
                    masks[number, window] = seen[None, None, :, :]
                queries = q[first : first + count]
                mask = masks[number, window]
                parts.append(self._attend_chunk(queries, k_cache, v_cache, pages, mask, layer))
                first += count
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = self._attention_output(x, out, layer, weights)
            x = self._mlp(x, layer, weights)
        if not rows:
            return torch.empty(0, self.vocab_size, device=self.device)
        picked = torch.tensor(list(rows), device=self.device)
        return self._logits(x[picked])

    def _prefill_by_rows(
        self, chunks: list[Chunk], rows: Sequence[int], attention: Any
    ) -> torch.Tensor:
        """prefill_packed with attention row by row: every token of every chunk is a row
        with its own position and its sequence's table, attended in one call per layer
        (`attention`, paged_attention.py's kernel, as decode steps run it) instead of
        one call per chunk."""
        tokens, positions, tables, longest = self._rows_of(chunks)
        attend = attention.bind(tables, positions + 1, longest)
        return self._forward_rows(self._embedded(tokens), positions, tables, attend, rows)

    def _native_prefill(self, chunks: list[Chunk], rows: Sequence[int]) -> torch.Tensor:
        """prefill_packed through the fused native pass: one row per chunk token, at its
        position, through its chunk's table; the same computation, row by row, as a
        decode step (native.c), so a prefilled position equals a decoded one exactly."""
        assert self._native is not None
        tokens, positions, tables, _ = self._rows_of(chunks)
        picked = torch.tensor(list(rows), dtype=torch.int32)
        return self._native.forward(tokens, positions, tables.to(torch.int32), picked)

    def _rows_of(self, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """The chunks' tokens as rows on the runner's device: token ids, positions, each
        row's table (its chunk's, padded to the widest; the tables go to the device once
        per chunk and are spread to the rows there) and the longest context they reach."""
        device = self.device
        counts = [chunk.tokens.shape[0] for chunk in chunks]
        longest = max(chunk.start + count for chunk, count in zip(chunks, counts, strict=True))
        width = -(-longest // self.block_size)
        per_chunk = torch.tensor([padded_table(c.table, width) for c in chunks], device=device)
        tables = per_chunk.repeat_interleave(
            torch.tensor(counts, device=device), dim=0, output_size=sum(counts)
        )
        positions = torch.cat(
            [torch.arange(c.start, c.start + n) for c, n in zip(chunks, counts, strict=True)]
        )
        tokens = torch.cat([chunk.tokens for chunk in chunks])
        return tokens, positions.to(device), tables, longest

    def _attend_chunk(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        pages: Pages,
        seen: torch.Tensor,
        layer: Layer,
    ) -> torch.Tensor:
        """Attention of one chunk's queries q [count, heads, dim] (already scaled) over its
        sequence's keys and values where `seen` [1, 1, count, read] allows -> [count,
        heads * dim]. SDPA, but for soft-capped scores, which it cannot take."""
        count, read = q.shape[0], pages.length
        keys, values = self._read(k_cache, pages, 0), self._read(v_cache, pages, 1)
        keys = keys.reshape(1, self.kv_heads, read, self.head_dim)
        values = values.reshape(1, self.kv_heads, read, self.head_dim)
        queries = q.transpose(0, 1)[None]
        softcap = layer.attention.softcap
        if softcap is None:
            attn = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=seen, enable_gqa=True,
                scale=1.0,  # the query weights carry the attention scale
            )  # fmt: skip
        else:
            group = self.heads // self.kv_heads
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            scores = torch.tanh(queries @ keys.transpose(-1, -2) / softcap) * softcap
            scores = scores.masked_fill(~seen, float("-inf"))
            attn = torch.softmax(scores, dim=-1) @ values
        return attn[0].transpose(0, 1).reshape(count, self._q_size)

    def _row_groups(self, pages: Pages, rows: int) -> list[tuple[int, Pages]]:
        """(first row, its Pages) of each group of rows attended together: all rows at
        once unless their gathered keys and values would exceed the CPU budget."""
        if pages.run is not None or self._gather_bytes is None:
            return [(0, pages)]
        row_bytes = 2 * self.kv_heads * pages.length * self.head_dim * self.k_cache.element_size()
        size = max(1, self._gather_bytes // row_bytes)
        if size >= rows:
            return [(0, pages)]
        return [
            (first, pages._replace(tables=pages.tables[first : first + size]))
            for first in range(0, rows, size)
        ]

    def _read(self, cache: torch.Tensor, pages: Pages, which: int) -> torch.Tensor:
        """One layer's keys (which 0) or values (1) of the rows in `pages`: [kv_heads,
        length, dim] as a view of a one-row run, else whole blocks gathered into a
        reused buffer, [kv_heads, rows, length, dim]. Each block is block_size * dim
        contiguous values, so the gather copies runs of kilobytes; the buffer is kept
        because a fresh tensor of megabytes a layer cost more in page faults on CPU
        than the copy itself."""
        if pages.run is not None:
            return cache[:, pages.run : pages.run + pages.length]
        rows, width = pages.tables.shape
        shape = (self.kv_heads, rows * width, self.block_size, self.head_dim)
        size = shape[0] * shape[1] * shape[2] * shape[3]
        if self._gathered[which].numel() < size:
            self._gathered[which] = torch.empty(size, dtype=cache.dtype, device=cache.device)
        out = self._gathered[which][:size].view(shape)
        by_block = cache.view(self.kv_heads, -1, self.block_size, self.head_dim)
        torch.index_select(by_block, 1, pages.tables.flatten(), out=out)
        return out.view(self.kv_heads, rows, width * self.block_size, self.head_dim)

    def _slots(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots of `positions` ([rows, n]) through each row's table ([rows, width])."""
        blocks = tables.gather(1, positions // self.block_size)
        return blocks * self.block_size + positions % self.block_size

    def _attention_inputs(
        self,
        x: torch.Tensor,
        layer: Layer,
        weights: LayerWeights,
        rotary: list[tuple[torch.Tensor, torch.Tensor]],
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        writes: torch.Tensor,
    ) -> torch.Tensor:
        """The layer's q [rows, heads, dim], normalised and rotated as the layer says;
        k (the same) and v written to its caches at the rows' slots `writes`."""
        h = self._norm(x, weights.pre_attention) if weights.pre_attention is not None else x
        qkv = weights.qkv(h.to(self.dtype)).to(self.state_dtype)
        if weights.qkv_bias is not None:
            qkv = qkv + weights.qkv_bias
        attention = layer.attention
        if attention.qk_norm is not None:
            qkv = self._qk_norm(qkv, attention, weights)
        table = None if attention.rotary is None else rotary[attention.rotary]
        if table is not None and self.fused_rotate:
            return rotate_store(qkv, *table, self.heads, k_cache, v_cache, writes)
        if table is not None and table[0].shape[-1] == self.head_dim:
            return torch_rotate_store(qkv, *table, self.heads, k_cache, v_cache, writes)
        return self._partial_rotate_store(qkv, table, k_cache, v_cache, writes)

    def _partial_rotate_store(
        self,
        qkv: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor] | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        writes: torch.Tensor,
    ) -> torch.Tensor:
        """rotate_store for a rotary over the first part of each head only (or none):
        the rest of q and k passes as it is."""
        rows, heads, kv_heads, dim = qkv.shape[0], self.heads, self.kv_heads, self.head_dim
        qk = qkv[:, : (heads + kv_heads) * dim].reshape(rows, heads + kv_heads, dim)
        if table is not None:
            cos, sin = table
            turned = cos.shape[-1]
            rotated = torch_rotate(qk[..., :turned], cos[:, None, :], sin[:, None, :])
            qk = torch.cat([rotated, qk[..., turned:]], dim=-1)
        k_cache[:, writes] = qk[:, heads:].transpose(0, 1)
        values = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
        v_cache[:, writes] = values.transpose(0, 1)
        return qk[:, :heads]

    def _qk_norm(
        self, qkv: torch.Tensor, attention: Attention, weights: LayerWeights
    ) -> torch.Tensor:
        """q and k RMSNorm-ed: each head over head_dim, or each whole projection."""
        assert weights.q_norm is not None and weights.k_norm is not None
        rows, q_size, kv_size = qkv.shape[0], self._q_size, self._kv_size
        q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
        if attention.qk_norm == "head":
            q = torch_rms_norm(q.reshape(rows, self.heads, -1), weights.q_norm, self.eps)
            k = torch_rms_norm(k.reshape(rows, self.kv_heads, -1), weights.k_norm, self.eps)
        else:
            q = torch_rms_norm(q, weights.q_norm, self.eps)
            k = torch_rms_norm(k, weights.k_norm, self.eps)
        return torch.cat([q.reshape(rows, q_size), k.reshape(rows, kv_size), v], dim=-1)

    def _attention_output(
        self, x: torch.Tensor, attn: torch.Tensor, layer: Layer, weights: LayerWeights
    ) -> torch.Tensor:
        out = weights.o(attn.to(self.dtype)).to(self.state_dtype)
        if weights.o_bias is not None:
            out = out + weights.o_bias
        if weights.post_attention is not None:
            out = self._norm(out, weights.post_attention).to(self.state_dtype)
        return x + out

    def _mlp(self, x: torch.Tensor, layer: Layer, weights: LayerWeights) -> torch.Tensor:
        h = self._norm(x, weights.pre_mlp) if weights.pre_mlp is not None else x.to(self.dtype)
        out: torch.Tensor | None = None
        if weights.gate_up is not None and weights.down is not None:  # an MLP, or shared expert
            assert layer.mlp is not None
            out = self._gated(
                h, weights.gate_up, weights.down, layer.mlp.activation, weights.gate_up_bias
            )
            moe = weights.moe
            if moe is not None and moe.shared_gate is not None:
                out = out * torch.sigmoid(h.to(self.state_dtype) @ moe.shared_gate)[:, None]
        if layer.experts is not None:
            assert weights.moe is not None
            mixed = self._mixture(h, layer.experts, weights.moe)
            out = mixed if out is None else mixed + out
        assert out is not None
        if weights.down_bias is not None:
            out = out + weights.down_bias
        if weights.post_mlp is not None:
            out = self._norm(out, weights.post_mlp).to(self.state_dtype)
        return x + out

    def _gated(
        self,
        h: torch.Tensor,
        gate_up: Projection,
        down: Projection,
        activation: str,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """down(act(gate) * up) of rows h -> [rows, hidden] in the state dtype."""
        both = gate_up(h)
        if bias is not None:
            both = both + bias.to(both.dtype)
        return down(self._activate(both, activation)).to(self.state_dtype)

    def _activate(self, both: torch.Tensor, activation: str) -> torch.Tensor:
        """act(gate) * up of [..., gate | up] -> [..., width]."""
        if activation == "gelu_tanh":
            gate, up = both.chunk(2, dim=-1)
            return F.gelu(gate, approximate="tanh") * up
        if not self.fused_gate:
            return torch_silu_gate(both)
        return silu_gate(both.reshape(-1, both.shape[-1])).view(*both.shape[:-1], -1)

    def _mixture(self, h: torch.Tensor, experts: Experts, moe: MoeWeights) -> torch.Tensor:
        """A mixture of experts over rows h [rows, hidden] -> [rows, hidden] (state dtype).

        The router's softmax in fp32, each row's top_k (renormalised where the family
        says); then the rows grouped by expert: the (row, rank) pairs sorted by expert,
        one product per expert over the rows that chose it, each result put back at its
        pair, and each row's k results weighed and summed in rank order, so that a
        row's sum is formed the same way whatever rows share its experts. In the
        fixed-shape step (CUDA graphs: no count read from the device) every expert
        takes `rows` rows, the pairs it got and padding, in two batched products."""
        rows, k = h.shape[0], experts.top_k
        logits = h.to(self.state_dtype) @ moe.router.T
        probs = torch.softmax(logits.float(), dim=-1)
        top, chosen = torch.topk(probs, k, dim=-1)
        if experts.renormalise:
            top = top / top.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs, expert by expert
        pairs = h[order // k]
        if self._fixed_shapes and moe.stacked is not None:
            done = self._experts_padded(pairs, flat, order, experts, moe.stacked)
        else:
            done = torch.empty(rows * k, h.shape[1], dtype=self.state_dtype, device=h.device)
            start = 0
            for expert, count in enumerate(torch.bincount(flat, minlength=experts.count).tolist()):
                if count:
                    span = slice(start, start + count)
                    up, down = moe.gate_up[expert], moe.down[expert]
                    done[order[span]] = self._gated(pairs[span], up, down, experts.activation)
                    start += count
        weighed = done.view(rows, k, -1) * top.to(self.state_dtype)[:, :, None]
        return weighed.sum(dim=1)

    def _experts_padded(
        self,
        pairs: torch.Tensor,
        flat: torch.Tensor,
        order: torch.Tensor,
        experts: Experts,
        stacked: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """The experts of the sorted `pairs` in two batched products of fixed shapes: each
        expert takes `rows` slots (a row picks an expert at most once), its own pairs
        first, zero rows after -> results [pairs, hidden] in the pairs' first order."""
        count, total = experts.count, flat.shape[0]
        device = pairs.device
        per_expert = torch.zeros(count, dtype=flat.dtype, device=device)
        per_expert.scatter_add_(0, flat, torch.ones_like(flat))
        starts = torch.cumsum(per_expert, 0) - per_expert
        by_expert = flat[order]
        within = torch.arange(total, device=device) - starts[by_expert]
        # slot [expert, i]: the sorted pair there, or `total` (a zero row: padding)
        where = torch.full((count, total // experts.top_k), total, dtype=flat.dtype, device=device)
        where[by_expert, within] = torch.arange(total, device=device)
        gate_up, down = stacked
        inputs = torch.cat([pairs, pairs.new_zeros(1, pairs.shape[1])])[where]
        hidden = self._activate(torch.bmm(inputs, gate_up.transpose(1, 2)), experts.activation)
        out = torch.bmm(hidden, down.transpose(1, 2)).to(self.state_dtype)
        done = out.new_zeros(total + 1, out.shape[-1])  # the last row takes the padding's
        targets = torch.cat([order, order.new_full((1,), total)])[where]
        done[targets.flatten()] = out.flatten(0, 1)
        return done[:total]

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, weight, self.eps, self.dtype)
        return torch_rms_norm(x, weight, self.eps, self.dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self._norm(x, self.final_norm)).float()
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap


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


def padded_table(table: list[int], width: int, fill: int = 0) -> list[int]:
    """A block table cut or padded with `fill` to `width` entries."""
    return table[:width] + [fill] * (width - len(table[:width]))


def _reads(chunks: list[Chunk]) -> int:
    """Positions the chunks' tokens read together, each its whole prefix."""
    return sum(c.tokens.shape[0] * (2 * c.start + c.tokens.shape[0] + 1) // 2 for c in chunks)


def _contiguous(table: list[int]) -> bool:
    return all(block == table[0] + i for i, block in enumerate(table))


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def return_freed_heap() -> None:
    """Hand glibc's freed heap pages back to the system: loading frees about as much
    as it keeps (each tensor's fp32 reading and candidates), in pieces the allocator
    would otherwise hold (~190 MB at a 1.1B shape). No-op off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


class _Shipped:
    """The native format's products from a GGUF's blocks as shipped (adapters/engine/
    ggml_blocks.py): each tensor packed straight from the file's bytes, never as fp32, unless
    its type is one the kernels lack, which is dequantised and requantised (4-bit
    groups, or 8-bit for the 5-bit types) and counted as such in `sources`."""

    WIDER = ("Q5_0", "Q5_1", "Q8_1")  # more than 4 bits: requantised to 8

    def __init__(self, checkpoint: Any) -> None:
        from adapters.engine.native_build import load

        self.checkpoint = checkpoint
        self.library = load()
        self.sources: Counter[str] = Counter()
        self._parts: dict[tuple[str, int, int | None], Part] = {}

    def part(self, name: str, bits: int, expert: int | None = None) -> Part:
        """`name`'s matrix (or expert `expert`'s of a stacked tensor), packed once however
        many products use it."""
        from adapters.engine.ggml_blocks import FALLBACK, pack_blocks, shippable
        from adapters.engine.native import Part, quantized_part

        key = (name, bits, expert)
        if key in self._parts:
            return self._parts[key]
        checkpoint = self.checkpoint
        if expert is None:
            type_name, raw, (rows, cols) = checkpoint.blocks(name)
        else:
            type_name, raw, (rows, cols) = checkpoint.expert_blocks(name, expert)
        if shippable(type_name, cols):
            packed, kind = pack_blocks(type_name, raw, rows, cols, self.library.tile)
            part = Part(packed, kind, rows, cols, f"{type_name} as shipped")
            if expert is None:
                checkpoint.done_with(name)
        else:
            wide = 8 if type_name in self.WIDER else bits
            weight = checkpoint.tensor(name) if expert is None else checkpoint.expert(name, expert)
            part = quantized_part(weight.float(), wide, self.library.tile)
            part = replace(part, source=f"{type_name} -> {FALLBACK.replace('8', str(wide))}")
        self.sources[part.source] += 1
        self._parts[key] = part
        return part

    def expert_product(
        self, names: ExpertTensors, expert: int, which: Sequence[int], scale: float
    ) -> NativeProduct:
        """One expert's gate|up (which (0, 1)) or down ((2,)) from a GGUF's tensors stacked
        over the experts: each expert's slice of blocks packed as a matrix is."""
        from adapters.engine.native import NativeProduct

        parts = []
        for kind in which:
            name = names.stacked[kind]
            if not self.checkpoint.has(name):
                raise CheckpointError(
                    f"{self.checkpoint.source}: no {name!r} (experts stacked, as llama.cpp "
                    "writes them; a file with one tensor per expert is not read)"
                )
            parts.append(replace(self.part(name, 4, expert), scale=scale))
        return NativeProduct(library=self.library, parts=parts)

    def product(
        self, names: Sequence[str], scales: Sequence[float], bits: int = 4
    ) -> NativeProduct:
        """The product over these tensors' rows, one after another, each's outputs times
        its scale. `bits`: what a type the kernels lack is requantised to."""
        from adapters.engine.native import NativeProduct

        parts = [
            replace(self.part(name, bits), scale=scale)
            for name, scale in zip(names, scales, strict=True)
        ]
        return NativeProduct(library=self.library, parts=parts)

    def fused_qkv(self, name: str, q_size: int, q_scale: float) -> NativeProduct:
        """A q|k|v matrix shipped as one tensor (Phi-3's), with the attention scale on q's
        rows only: two parts over the same tiles (as shipped or requantised alike), split
        where q's rows end. That is a whole tile: the fused pass takes only head sizes
        that are multiples of 16 (native.model_problem)."""
        from adapters.engine.native import NativeProduct

        part, tile = self.part(name, 4), self.library.tile
        if q_size % tile:
            raise ValueError(f"q's {q_size} rows are not whole {tile}-row tiles")
        q_tiles = q_size // tile
        q = replace(part, packed=part.packed[:q_tiles], out_features=q_size, scale=q_scale)
        kv = replace(part, packed=part.packed[q_tiles:], out_features=part.out_features - q_size)
        return NativeProduct(library=self.library, parts=[q, kv])

    def embedding(self, name: str, scale: float, head_name: str) -> torch.Tensor | NativeProduct:
        """The embedding table: packed as shipped (shared with a tied head) where its
        type runs so, else fp32 rows as the other formats keep it."""
        from adapters.engine.ggml_blocks import shippable
        from adapters.engine.native import NativeProduct

        type_name, _, shape = self.checkpoint.quantized(name)
        if len(shape) != 2 or not shippable(type_name, shape[1]):
            table: torch.Tensor = self.checkpoint.tensor(name).float()
            return table * scale if scale != 1.0 else table
        part = self.part(name, 8 if name == head_name else 4)  # a tied head's own tiles
        return NativeProduct(library=self.library, parts=[replace(part, scale=scale)])


def _load(
    loaded: LoadedModel, spec: ModelSpec, fmt: str, state: torch.dtype
) -> tuple[
    torch.Tensor | NativeProduct, torch.Tensor, Projection, list[LayerWeights], Counter[str]
]:
    """(embedding table, final norm, lm_head, layers) from the checkpoint, tensor by
    tensor: products in `fmt`, the rest in `state`, each source let go once converted.

    Folded in as they are read: the attention scale into the query rows and bias (or,
    where q is normalised, into the q norm's weight, since a norm would undo it: exact
    for power-of-two scales, else one rounding), the residual multiplier into the
    output and down products, the embedding scale into the embedding table, the
    logit multiplier into lm_head, and the norm offset (Gemma's 1 + w) into every
    norm weight. A tied lm_head is the embedding table itself unless one of those
    scales differs between them.

    w4a16 on a GGUF keeps the file's blocks (_Shipped): the attention scale, the
    residual and logit multipliers then scale the products' outputs instead of the
    weights, and the embedding table is a packed matrix (the tied head's own tiles)
    whose rows native.c unpacks.
    """
    checkpoint, names, device = loaded.checkpoint, loaded.tensors, loaded.device
    packer = _Shipped(checkpoint) if fmt == "w4a16" and hasattr(checkpoint, "blocks") else None

    def read(name: str) -> torch.Tensor:
        return checkpoint.tensor(name).to(device=device, dtype=torch.float32)

    def rows(parts: Sequence[str]) -> torch.Tensor:
        return torch.cat([read(name) for name in parts]) if len(parts) > 1 else read(parts[0])

    def norm(name: str | None) -> torch.Tensor | None:
        if name is None:
            return None
        return (read(name) + spec.norm_offset).to(state)

    with torch.no_grad():
        head_scale = spec.logit_scale
        head_name = names.embed
        if names.lm_head is not None and checkpoint.has(names.lm_head):
            head_name = names.lm_head
        elif names.lm_head is not None and not spec.tie_embeddings:
            raise CheckpointError(f"{checkpoint.source}: no {names.lm_head}, and it is not tied")
        table: torch.Tensor | NativeProduct
        lm_head: Projection
        if packer is not None:
            lm_head = packer.product([head_name], [head_scale], bits=8)
            table = packer.embedding(names.embed, spec.embed_scale, head_name)
        else:
            embed = read(names.embed)
            head = embed if head_name == names.embed else read(head_name)
            head = head * head_scale if head_scale != 1.0 else head
            lm_head = projection(head, output_format(fmt))
            del head
            table = (embed * spec.embed_scale if spec.embed_scale != 1.0 else embed).to(state)
            del embed
        final = norm(names.final_norm)
        assert final is not None
        return_freed_heap()
        layers = []
        for layer, where in zip(spec.layers, names.layers, strict=False):
            attention, residual = layer.attention, spec.residual_scale
            q_size = attention.heads * attention.head_dim
            q_norm, k_norm = norm(where.q_norm), norm(where.k_norm)
            bias = rows(where.qkv_bias).to(state) if where.qkv_bias else None
            q_scale = 1.0 if q_norm is not None else attention.scale
            if q_norm is not None:
                q_norm = q_norm * attention.scale
            elif bias is not None:  # out of place: a tensor read may be the checkpoint's own
                bias = torch.cat([bias[:q_size] * attention.scale, bias[q_size:]])
            o_bias = read(where.o_bias).to(state) if where.o_bias else None
            down_bias = read(where.down_bias).to(state) if where.down_bias else None
            if residual != 1.0:
                o_bias = o_bias * residual if o_bias is not None else None
                down_bias = down_bias * residual if down_bias is not None else None
            gate_up_bias = rows(where.gate_up_bias).to(state) if where.gate_up_bias else None
            products: tuple[Projection, Projection, Projection | None, Projection | None]
            has_mlp = layer.mlp is not None  # else only experts
            if packer is not None:  # each tensor as shipped, scales on the outputs
                if len(where.qkv) == 1 and q_scale != 1.0:
                    qkv_product = packer.fused_qkv(where.qkv[0], q_size, q_scale)
                else:
                    scales = [q_scale] + [1.0] * (len(where.qkv) - 1)
                    qkv_product = packer.product(where.qkv, scales)
                products = (
                    qkv_product,
                    packer.product([where.o], [residual]),
                    packer.product(where.gate_up, [1.0] * len(where.gate_up)) if has_mlp else None,
                    packer.product([where.down], [residual]) if has_mlp else None,
                )
            else:
                qkv = rows(where.qkv)
                if q_scale != 1.0:  # out of place, as the bias
                    qkv = torch.cat([qkv[:q_size] * q_scale, qkv[q_size:]])
                o, down = read(where.o), read(where.down) if has_mlp else None
                if residual != 1.0:
                    o, down = o * residual, down * residual if down is not None else None
                products = (
                    projection(qkv, fmt),
                    projection(o, fmt),
                    projection(rows(where.gate_up), fmt) if has_mlp else None,
                    projection(down, fmt) if down is not None else None,
                )
                del qkv, o, down
            moe = None
            if layer.experts is not None:
                if where.experts is None:
                    raise CheckpointError(f"{checkpoint.source}: no expert tensors named")
                moe = _experts(checkpoint, where.experts, layer.experts, fmt, residual, state,
                               packer, device)  # fmt: skip
            layers.append(
                LayerWeights(
                    *products,
                    pre_attention=norm(where.pre_attention),
                    post_attention=norm(where.post_attention),
                    pre_mlp=norm(where.pre_mlp),
                    post_mlp=norm(where.post_mlp),
                    qkv_bias=bias,
                    o_bias=o_bias,
                    gate_up_bias=gate_up_bias,
                    down_bias=down_bias,
                    q_norm=q_norm,
                    k_norm=k_norm,
                    moe=moe,
                )
            )
            return_freed_heap()  # each layer's temporaries, before the next layer's
    sources = packer.sources if packer is not None else Counter()
    return table, final, lm_head, layers, sources


def _experts(
    checkpoint: Any,
    names: ExpertTensors,
    experts: Experts,
    fmt: str,
    residual: float,
    state: torch.dtype,
    packer: _Shipped | None,
    device: torch.device,
) -> MoeWeights:
    """A mixture's weights, expert by expert (each read, converted and let go before the
    next): the router and a shared expert's gate in the state dtype; each expert's
    gate|up and down in `fmt` (a GGUF's blocks as shipped under w4a16), the residual
    multiplier on down. Dense formats keep the experts stacked, and each expert's
    products are views of the stack."""
    router_name = first_present(checkpoint, names.router)
    if router_name is None:
        raise CheckpointError(f"{checkpoint.source}: no router ({names.router[0]!r})")
    router = checkpoint.tensor(router_name).to(device=device, dtype=state)
    if router.shape[0] != experts.count:
        raise CheckpointError(
            f"{checkpoint.source}: {router_name} routes to {router.shape[0]} experts, "
            f"the config says {experts.count}"
        )
    shared_gate = None
    gate_up: list[Projection]
    down: list[Projection]
    if names.shared_gate is not None:
        shared_gate = checkpoint.tensor(names.shared_gate).to(device=device, dtype=state)
        shared_gate = shared_gate.reshape(-1)
    if packer is not None:
        gate_up = [packer.expert_product(names, e, (0, 1), 1.0) for e in range(experts.count)]
        down = [packer.expert_product(names, e, (2,), residual) for e in range(experts.count)]
        for name in names.stacked:  # packed: their pages leave the resident set
            checkpoint.done_with(name)
        return MoeWeights(router, gate_up, down, None, shared_gate)

    def matrix(which: int, index: int) -> torch.Tensor:
        return expert_matrix(checkpoint, names, which, index).to(device, torch.float32)

    if fmt in ("fp32", "bf16"):
        dtype = activation_dtype(fmt)
        stacked = _stacked_as_held(checkpoint, names, dtype, device) if residual == 1.0 else None
        if stacked is not None:  # transformers' own layout already: no copy
            gate_up = [projection(stacked[0][e], fmt) for e in range(experts.count)]
            down = [projection(stacked[1][e], fmt) for e in range(experts.count)]
            return MoeWeights(router, gate_up, down, stacked, shared_gate)
        hidden, width = router.shape[1], experts.intermediate
        stacked_up = torch.empty(experts.count, 2 * width, hidden, dtype=dtype, device=device)
        stacked_down = torch.empty(experts.count, hidden, width, dtype=dtype, device=device)
        for e in range(experts.count):
            stacked_up[e, :width] = matrix(0, e)
            stacked_up[e, width:] = matrix(1, e)
            stacked_down[e] = matrix(2, e) * residual if residual != 1.0 else matrix(2, e)
        gate_up = [projection(stacked_up[e], fmt) for e in range(experts.count)]
        down = [projection(stacked_down[e], fmt) for e in range(experts.count)]
        return MoeWeights(router, gate_up, down, (stacked_up, stacked_down), shared_gate)
    gate_up, down = [], []
    for e in range(experts.count):
        gate_up.append(projection(torch.cat([matrix(0, e), matrix(1, e)]), fmt))
        down.append(projection(matrix(2, e) * residual, fmt))
    return MoeWeights(router, gate_up, down, None, shared_gate)


def _stacked_as_held(
    checkpoint: Any, names: ExpertTensors, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A model built in this process whose experts are already the stacked layout the
    fixed-shape step takes (transformers' gate|up [experts, 2 x width, hidden] and down),
    in `dtype` on `device`: those tensors themselves, else None."""
    gate_up, down = names.fused
    if not (checkpoint.has(gate_up) and checkpoint.has(down)):
        return None
    both, out = checkpoint.tensor(gate_up), checkpoint.tensor(down)
    fits = all(t.dtype == dtype and t.device == device and t.is_contiguous() for t in (both, out))
    return (both, out) if fits else None
