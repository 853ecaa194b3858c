"""A batched Llama forward pass over a paged KV cache, using a transformers model's weights.

transformers loads the model (from GGUF or an HF directory) and we read its
weights; the forward pass is our own so that one call can decode a batch of
sequences that sit at different positions. The KV cache is a pool of
`num_blocks` blocks of `block_size` positions (and one scratch block past
them, for the padding rows of static_decode.py), one key and one value tensor
per layer laid out [kv_heads, (num_blocks + 1) * block_size, head_dim]: cache
slot block * block_size + offset. A sequence's block table (core/blocks.py decides
it) says which blocks hold its positions in order; it writes each new key and
value at its position's slot and attends over its own prefix only, gathered
through its table (or read as a view when the table is one contiguous run).
Nothing is copied when sequences join or leave, and blocks holding a shared
prefix are read by every sequence that shares it.

Supported: the Llama family as transformers implements it (LlamaForCausalLM:
RMSNorm, rotary embeddings without scaling, grouped-query attention, SiLU-gated
MLP, no biases), which covers SmolLM2. Anything else is refused with a clear
error at start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from adapters.engine.fused import (
    fused_problem,
    kernel_problem,
    rms_norm,
    rotate_store,
    silu_gate,
    torch_rms_norm,
    torch_rotate_store,
    torch_silu_gate,
)
from adapters.engine.weights import (
    FORMATS,
    Projection,
    activation_dtype,
    output_format,
    projection,
)

# A prefill attends row by row (row_attention) when its rows read at most this many
# positions together: each row reads its whole prefix, so the work grows with the
# square of a chunk's length, where the per-chunk SDPA's does not (a bound by arithmetic:
# 2^17 positions of the 8B shape are 0.5 GB of keys and values a layer, mostly cached).
ROW_ATTENTION_POSITIONS = 1 << 17
# One layer's attention: (q, that layer's key cache, its value cache) -> [rows, heads * dim].
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
DEFAULT_BLOCK_SIZE = 16  # positions per KV block, chosen by measurement (engine.md)
# On CPU, decode attention gathers at most this many bytes of keys and values at
# once; more rows are attended in groups, so that what a gather writes is still in
# cache when the products read it (16 rows x 1000 positions: 15% faster a step).
CPU_GATHER_BYTES = 8 << 20


class UnsupportedModel(Exception):
    """The loaded architecture is not one this engine can run."""


def _check_supported(model: Any) -> None:
    config = model.config
    if getattr(config, "model_type", None) != "llama":
        raise UnsupportedModel(f"model_type {config.model_type!r}: only llama-family models run")
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModel(f"rope type {rope.get('rope_type')!r} is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"activation {config.hidden_act!r} is not supported")
    attention = model.model.layers[0].self_attn
    if attention.q_proj.bias is not None or model.model.layers[0].mlp.gate_proj.bias is not None:
        raise UnsupportedModel("attention or MLP biases are not supported")


def _rope_theta(config: Any) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class LayerWeights(NamedTuple):
    """One decoder layer's weights, q/k/v and gate/up fused into one matrix each."""

    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection


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


class LlamaRunner:
    """The model's weights in one format (adapters/engine/weights.py), the paged KV
    pool, and the forward passes.

    Two dtypes: products take and give the format's activation dtype (fp32 for
    fp32 weights, bf16 otherwise); everything between them (the residual stream,
    norms, rotary, attention, the KV cache) is the state dtype, fp32 on CPU.
    A bf16 residual stream lost precision over 30 layers for nothing: the
    elementwise work is small, and bf16 attention over strided cache slices
    copied them first (4x slower at one row here). On CUDA both are the model's
    dtype.
    """

    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int,
        max_context: int,
        weights: str = "fp32",
    ) -> None:
        _check_supported(model)
        if weights not in FORMATS:
            raise ValueError(f"unknown weight format {weights!r}; one of {', '.join(FORMATS)}")
        config = model.config
        self.format = weights
        self.device = next(model.parameters()).device
        self.dtype = activation_dtype(weights)
        self.state_dtype = state_dtype(self.device, self.dtype)
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.eps = float(config.rms_norm_eps)
        self.vocab_size = int(config.vocab_size)
        self.max_context = max_context
        self.embed, self.final_norm, self.lm_head, self.layers = _load_weights(
            model, weights, self.state_dtype, self.head_dim**-0.5
        )
        # Norms, rotary and the SiLU gate as one triton kernel each (fused.py): on CUDA,
        # once triton has built them and they agree with torch's ops here.
        hidden = int(config.hidden_size)
        self.fused_problem = fused_problem(self.device, hidden, self.head_dim) or kernel_problem(
            self.device, self.state_dtype, hidden, self.head_dim
        )
        self.fused = self.fused_problem is None
        # Set by the engine when its decode attention is paged_attention.py's kernel:
        # prefills that read few enough positions then attend row by row through it.
        self.row_attention: Any = None
        half = self.head_dim // 2
        inv_freq = 1.0 / (
            _rope_theta(config)
            ** (torch.arange(0, half, dtype=torch.float32, device=self.device) / half)
        )
        angles = torch.outer(
            torch.arange(max_context, dtype=torch.float32, device=self.device), inv_freq
        )
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(self.state_dtype)
        self.sin = angles.sin().to(self.state_dtype)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # [kv_heads, slot, dim] per layer: gathering whole blocks of each row's
        # table gives [kv_heads, rows, length, dim], ready for the batched products
        # without a second copy (engine.md compares this with a block-major layout).
        # One block more than the pool: the scratch block, given to no sequence, where the
        # padding rows of a fixed-shape decode step write and read (static_decode.py).
        self.scratch_block = num_blocks
        shape = (len(self.layers), self.kv_heads, (num_blocks + 1) * block_size, self.head_dim)
        # The native format keeps keys and values in fp16 (half the bytes attention
        # reads, and half the memory); only native.c reads or writes them then.
        cache_dtype = torch.float16 if weights == "w4a16" else self.state_dtype
        self.k_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=cache_dtype, device=self.device)
        self._gathered = [torch.empty(0, device=self.device) for _ in range(2)]  # k, v
        self._gather_bytes = CPU_GATHER_BYTES if self.device.type == "cpu" else None
        self._q_size = self.heads * self.head_dim
        self._native = None
        if weights == "w4a16":  # a whole decode step in one call (adapters/engine/native.py)
            from adapters.engine.native import NativeModel

            self._native = NativeModel(self, config)

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step must read (each matrix once)."""
        total: int = self.lm_head.nbytes + _nbytes(self.final_norm)
        for layer in self.layers:
            total += _nbytes(layer.input_norm) + _nbytes(layer.post_norm)
            total += layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes + layer.down.nbytes
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
        return self._forward_rows(self.embed[tokens], positions, pages.tables, attend, None)

    def _paged_attend(self, pages: Pages, positions: torch.Tensor) -> Attend:
        """The eager decode step's attention: each row over its own prefix through
        `pages` (a view of a one-row run, else whole blocks gathered, in groups of rows
        that fit the CPU budget), masked past the row's position."""
        rows, length = positions.shape[0], pages.length
        span = torch.arange(length, device=self.device)
        # Added to the scores: 0 up to a row's own position, -inf past it.
        past = (span[None, :] > positions[:, None]).view(1, rows, 1, length)
        mask = torch.zeros(past.shape, dtype=self.state_dtype, device=self.device)
        mask = mask.masked_fill(past, float("-inf"))
        groups = self._row_groups(pages, rows)

        def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
            parts = []
            for first, group in groups:
                keys, values = self._read(k_cache, group, 0), self._read(v_cache, group, 1)
                end = first + group.tables.shape[0]
                parts.append(attend_gathered(q[first:end], keys, values, mask[:, first:end]))
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
        the device, attention by `attend` (paged_attention.py). -> logits [rows, vocab]."""
        return self._forward_rows(self.embed[tokens], positions, tables, attend, None)

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
        cos, sin = self.cos[positions], self.sin[positions]
        writes = self._slots(tables, positions[:, None])[:, 0]
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            q = self._attention_inputs(x, layer, cos, sin, k_cache, v_cache, writes)
            x = x + layer.o(attend(q, k_cache, v_cache).to(self.dtype))
            x = x + self._mlp(x, layer)
        if rows is None:
            return self._logits(x)
        if not rows:
            return torch.empty(0, self.vocab_size, device=self.device)
        return self._logits(x[torch.tensor(list(rows), device=self.device)])

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
        (causal), read through its own table. A loop rather than one masked product over
        every chunk's keys: that product grows as (tokens x all chunks' keys), and for
        short chunks the loop's fixed costs are small beside the products (engine.md).
        """
        total = sum(chunk.tokens.shape[0] for chunk in chunks)
        if total == 0:
            raise ValueError("prefill_packed needs at least one token")
        if self._native is not None:
            return self._native_prefill(chunks, rows)
        if self.row_attention is not None and _reads(chunks) <= ROW_ATTENTION_POSITIONS:
            return self._prefill_by_rows(chunks, rows, self.row_attention)
        x = self.embed[torch.cat([chunk.tokens for chunk in chunks])]
        spans = []
        for chunk in chunks:
            count = chunk.tokens.shape[0]
            end = chunk.start + count
            pages = self.pages([chunk.table], end)
            positions = torch.arange(chunk.start, end, device=self.device)
            writes = self._slots(pages.tables, positions[None, :])[0]
            span = torch.arange(pages.length, device=self.device)
            mask = (span[None, :] <= positions[:, None])[None, None, :, :]
            spans.append((count, pages, writes, mask))
        positions = torch.cat(
            [torch.arange(c.start, c.start + c.tokens.shape[0]) for c in chunks]
        ).to(self.device)
        cos, sin = self.cos[positions], self.sin[positions]
        writes = torch.cat([span[2] for span in spans])
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            q = self._attention_inputs(x, layer, cos, sin, k_cache, v_cache, writes)
            parts, first = [], 0
            for count, pages, _, mask in spans:
                queries = q[first : first + count]
                parts.append(self._attend_chunk(queries, k_cache, v_cache, pages, mask))
                first += count
            attn = parts[0] if len(parts) == 1 else torch.cat(parts)
            x = x + layer.o(attn.to(self.dtype))
            x = x + self._mlp(x, layer)
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
        return self._forward_rows(self.embed[tokens], positions, tables, attend, rows)

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
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of one chunk's queries q [count, heads, dim] (already scaled) over its
        sequence's keys and values up to each query's position -> [count, heads * dim]."""
        count, read = q.shape[0], pages.length
        keys, values = self._read(k_cache, pages, 0), self._read(v_cache, pages, 1)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.reshape(1, self.kv_heads, read, self.head_dim),
            values.reshape(1, self.kv_heads, read, self.head_dim),
            attn_mask=mask,
            enable_gqa=True,
            scale=1.0,  # the query weights carry 1/sqrt(head_dim)
        )
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
        layer: LayerWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        writes: torch.Tensor,
    ) -> torch.Tensor:
        """The layer's q [rows, heads, dim], rotated; k (rotated) and v written to its
        caches at the rows' slots `writes`. cos and sin: [rows, dim]."""
        qkv = layer.qkv(self._norm(x, layer.input_norm)).to(self.state_dtype)
        store = rotate_store if self.fused else torch_rotate_store
        return store(qkv, cos, sin, self.heads, k_cache, v_cache, writes)

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate_up = layer.gate_up(self._norm(x, layer.post_norm))
        return layer.down(silu_gate(gate_up) if self.fused else torch_silu_gate(gate_up))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, weight, self.eps, self.dtype)
        return torch_rms_norm(x, weight, self.eps, self.dtype)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self._norm(x, self.final_norm)).float()


def attend_gathered(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Attention for one new token per row: q [rows, heads, dim] (already scaled) over
    keys and values [kv_heads, rows, length, dim] (or [kv_heads, length, dim] for one
    row), plus `mask` (broadcast to [kv_heads, rows, 1, length]) -> [rows, heads * dim].

    Written out rather than through scaled_dot_product_attention: for a single
    query, torch's CPU flash kernel spent ~0.5 ms per call on fixed costs, 14 of
    a 23 ms step at 30 layers. Query heads that share a key head are stacked
    as rows of one product (grouped-query attention without copying keys);
    the batch runs key head major, the cache's own order.
    """
    rows, heads, dim = q.shape
    kv_heads, length = keys.shape[0], keys.shape[-2]
    group, batch = heads // kv_heads, rows * kv_heads
    queries = q.view(rows, kv_heads, group, dim).transpose(0, 1).reshape(batch, group, dim)
    scores = torch.bmm(queries, keys.reshape(batch, length, dim).transpose(1, 2))
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


def _load_weights(
    model: Any, fmt: str, state: torch.dtype, query_scale: float
) -> tuple[torch.Tensor, torch.Tensor, Projection, list[LayerWeights]]:
    """(embedding table, final norm, lm_head, layers) from a transformers Llama: products in
    `fmt`, the rest in `state`. The query rows carry attention's 1/sqrt(head_dim), so
    attention need not scale (exact for head_dim 64, a power of two)."""
    with torch.no_grad():
        inner = model.model
        embed = inner.embed_tokens.weight.detach().to(state)
        final_norm = inner.norm.weight.detach().to(state)
        lm_head = projection(model.lm_head.weight.detach(), output_format(fmt))
        layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            q = attn.q_proj.weight.float() * query_scale
            qkv = torch.cat([q, attn.k_proj.weight.float(), attn.v_proj.weight.float()])
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            layers.append(
                LayerWeights(
                    input_norm=layer.input_layernorm.weight.detach().to(state),
                    qkv=projection(qkv.detach(), fmt),
                    o=projection(attn.o_proj.weight.detach(), fmt),
                    post_norm=layer.post_attention_layernorm.weight.detach().to(state),
                    gate_up=projection(gate_up.detach(), fmt),
                    down=projection(mlp.down_proj.weight.detach(), fmt),
                )
            )
    return embed, final_norm, lm_head, layers
