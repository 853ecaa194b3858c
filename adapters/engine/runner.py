"""The model's weights, its KV pool, and the forward passes that run every family.

The model is a ModelSpec (spec.py: what each layer computes, from its family in
families/) whose weights loader.py reads from its checkpoint in the chosen
format (weights.py). A Runner holds those weights, the KV pool (a pool of
`num_blocks` blocks of `block_size` positions, and one scratch block past them
for the padding rows of static_decode.py: layers/attention.py has the layout)
and the rotary tables, and runs the layers over it. One call decodes a batch of
sequences that sit at different positions, or prefills chunks of several
sequences at once; nothing is copied when sequences join or leave, and blocks
holding a shared prefix are read by every sequence that shares it.

A layer, as spec.Layer describes it, from the pieces in layers/: an optional
RMSNorm, the q/k/v product (with biases), optional RMSNorms of q and k (per
head, or over the whole projection), rotary on the rotated part of each head
(the layer's table, or none) as k and v go to the cache, attention (scaled,
windowed, soft-capped as the layer says), the output product, an optional norm
of the result, the residual add; then the same pattern for the gated MLP (SiLU
or tanh-GELU), a mixture of experts, or both. Constant multipliers were folded
into the weights as they were loaded (loader.py), so none of them costs a step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from adapters.engine.fused import fused_problem, kernel_device_problem, kernel_problem
from adapters.engine.index_check import IndexCheckError, check_rows, checking
from adapters.engine.layers.attention import (
    CPU_GATHER_BYTES,
    Attend,
    ChunkPages,
    Pages,
    chunk_attend,
    padded_table,
    paged_attend,
    row_groups,
    slots,
)
from adapters.engine.layers.attention import pages as pages_of
from adapters.engine.layers.embed_head import embedded, logits
from adapters.engine.layers.experts import mixture
from adapters.engine.layers.mlp import gated
from adapters.engine.layers.norm import qk_norm, rms_norm
from adapters.engine.layers.rotary import Table, at_positions, rotate_store
from adapters.engine.loader import LayerWeights, load_weights, return_freed_heap, tensor_bytes
from adapters.engine.spec import Layer
from adapters.engine.weights import DENSE, FORMATS, NATIVE, activation_dtype

if TYPE_CHECKING:
    from adapters.engine.model import LoadedModel
    from adapters.engine.native import NativeModel

# A prefill attends row by row (row_attention) when its rows read at most this many
# positions together: each row reads its whole prefix, so the work grows with the
# square of a chunk's length, where the per-chunk SDPA's does not (a bound by arithmetic:
# 2^17 positions of the 8B shape are 0.5 GB of keys and values a layer, mostly cached).
ROW_ATTENTION_POSITIONS = 1 << 17
DEFAULT_BLOCK_SIZE = 16  # positions per KV block, chosen by measurement (engine.md)


class AttentionDtypeError(TypeError):
    """Attention's inputs in two dtypes: a bug of the forward pass, named where it is."""


class Chunk(NamedTuple):
    """Part of one sequence's context to prefill: `tokens` at positions start.. of the
    sequence whose blocks are `table` (the table must cover them)."""

    table: list[int]
    start: int
    tokens: torch.Tensor  # [count] token ids


def state_dtype(gpu_path: bool, dtype: torch.dtype) -> torch.dtype:
    """What the runner keeps its activations, rotary tables and (but for w4a16) caches
    in: fp32 on the CPU path, since a CPU's elementwise work is no faster in 16 bits,
    and the weights' activation dtype on the GPU path."""
    return dtype if gpu_path else torch.float32


def gpu_path_problem(device: torch.device, weights: str) -> str | None:
    """Why the GPU's code cannot run on this device with these weights, or None."""
    if weights not in DENSE:
        return f"{weights} is a CPU format; the GPU path runs {', '.join(DENSE)}"
    if device.type == "cpu" and (problem := kernel_device_problem(device)):
        return (
            f"on a CPU the GPU path runs triton's kernels through its interpreter ({problem}): "
            "set TRITON_INTERPRET=1 before triton is first imported"
        )
    return None


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

    `gpu_path`: run the GPU's code (None: on CUDA). It differs from the CPU's in
    the state dtype (the weights' activation dtype: bf16 or fp16), the fused
    triton kernels (fused.py), no gather budget for decode attention, and, in the
    engine, the fixed-shape decode step with the triton decode attention. On a
    CPU it runs the kernels through triton's interpreter: how the tests run, on
    a machine without a GPU, the code a GPU runs (docs/design/engine.md).
    """

    def __init__(
        self,
        loaded: LoadedModel,
        num_blocks: int | None,
        block_size: int,
        max_context: int,
        weights: str = "fp32",
        layers: int | None = None,
        gpu_path: bool | None = None,
    ) -> None:
        if weights not in FORMATS:
            raise ValueError(f"unknown weight format {weights!r}; one of {', '.join(FORMATS)}")
        self.gpu_path = loaded.device.type == "cuda" if gpu_path is None else gpu_path
        if self.gpu_path and (problem := gpu_path_problem(loaded.device, weights)):
            raise ValueError(problem)
        spec = loaded.spec
        if layers is not None:
            from dataclasses import replace

            spec = replace(spec, layers=spec.layers[:layers])
        self.spec = spec
        self.format = weights
        self.device = loaded.device
        self.dtype = activation_dtype(weights)
        self.state_dtype = state_dtype(self.gpu_path, self.dtype)
        self.heads, self.kv_heads, self.head_dim = spec.heads, spec.kv_heads, spec.head_dim
        self.eps = spec.eps
        self.vocab_size = spec.vocab
        self.max_context = max_context
        self.embed, self.final_norm, self.lm_head, self.layers, sources = load_weights(
            loaded, spec, weights, self.state_dtype
        )
        # How many matrices came in each form (w4a16 on a GGUF: its block types as
        # shipped, and any requantised): for the start log.
        self.weight_sources: Counter[str] = sources
        loaded.checkpoint.release()
        return_freed_heap()
        # Norms, rotary and the SiLU gate as one triton kernel each (fused.py): on the GPU
        # path, once triton has built them and they agree with torch's ops here. Rotary and
        # the gate only where every layer is the plain kind the kernels compute.
        hidden = spec.hidden
        self.fused_problem = fused_problem(
            self.device, hidden, self.head_dim, self.gpu_path
        ) or kernel_problem(self.device, self.state_dtype, hidden, self.head_dim)
        self.fused = self.fused_problem is None
        features = spec.features()
        self.fused_rotate = self.fused and not features & {"partial_rotary", "no_rotary"}
        self.fused_gate = self.fused and "gelu_tanh" not in features
        # Set by the engine when its decode attention is paged_attention.py's kernel:
        # prefills that read few enough positions then attend row by row through it.
        self.row_attention: Any = None
        self.block_size = block_size
        self._kv_size = self.kv_heads * self.head_dim
        # Bytes of keys and values a decode step gathers at once (None: no bound).
        self._gather_bytes = None if self.gpu_path else CPU_GATHER_BYTES
        self._native: NativeModel | None = None
        self._fixed_shapes = False  # inside forward_static: no shape read from the device
        # FENCEPOST_CHECK_INDICES=1: every step's indices checked before its kernels run.
        self.check_indices = checking()
        # The native format keeps keys and values in fp16 (half the bytes attention
        # reads, and half the memory); only native.c reads or writes them then.
        self.cache_dtype = torch.float16 if weights in NATIVE else self.state_dtype
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
        # The gather buffers of keys and values (layers/attention.py `read`), reused.
        self._gathered = [torch.empty(0, device=self.device) for _ in range(2)]  # k, v
        if self.format in NATIVE:  # a whole decode step in one call (adapters/engine/native.py)
            from adapters.engine.native import NativeModel

            self._native = NativeModel(self)

    def embed_bytes(self) -> int:
        """Bytes the embedding table takes (packed, or fp32 rows); 0 where it is the
        output projection's own tiles."""
        if isinstance(self.embed, torch.Tensor):
            return tensor_bytes(self.embed)
        head_parts = getattr(self.lm_head, "parts", [])
        if head_parts and self.embed.parts[0].packed is head_parts[0].packed:
            return 0
        return self.embed.nbytes

    def weight_bytes(self, rows: int | None = None) -> int:
        """Bytes of the weights (each matrix once); with `rows`, those a decode step of
        that many rows reads: of a mixture, the router and the experts the rows pick,
        as many as evenly spread choices touch on average (experts x (1 - (1 - top_k /
        experts) ^ rows): top_k of them at one row)."""
        total: int = self.lm_head.nbytes + tensor_bytes(self.final_norm)
        for layer, weights in zip(self.spec.layers, self.layers, strict=True):
            total += weights.qkv.nbytes + weights.o.nbytes
            total += sum(p.nbytes for p in (weights.gate_up, weights.down) if p is not None)
            total += sum(tensor_bytes(t) for t in weights[4:] if isinstance(t, torch.Tensor))
            if weights.moe is None or layer.experts is None:
                continue
            total += weights.moe.nbytes
            if rows is not None:
                count, k = layer.experts.count, layer.experts.top_k
                touched = count * (1 - (1 - k / count) ** rows)
                total -= round((count - touched) * weights.moe.expert_bytes())
        return total

    def check_step(
        self,
        kind: str,
        tokens: torch.Tensor | list[int],
        positions: torch.Tensor | list[int],
        tables: torch.Tensor | list[list[int]],
        live: int | None = None,
    ) -> None:
        """With FENCEPOST_CHECK_INDICES=1, IndexCheckError unless these rows are within
        the pool, the context and the vocabulary (index_check.py); otherwise nothing."""
        if self.check_indices:
            check_rows(kind, tokens, positions, tables, vocab=self.vocab_size,
                       max_context=self.max_context, block_size=self.block_size,
                       num_blocks=self.num_blocks, live=live)  # fmt: skip

    def pages(self, tables: list[list[int]], length: int) -> Pages:
        """The Pages of rows with these block tables, each read up to `length` positions."""
        return pages_of(tables, length, self.block_size, self.device)

    @property
    def native(self) -> bool:
        """The fused native pass computes this runner's steps (its own threads)."""
        return self._native is not None

    @torch.inference_mode()
    def decode(self, pages: Pages, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """One token for each row (its table in `pages`, position, token) -> logits
        [rows, vocab]. Each row's table must cover its position."""
        self.check_step("decode", tokens, positions, pages.tables)
        if self._native is not None:
            return self._native.forward(tokens, positions, pages.tables)
        groups = row_groups(pages, positions.shape[0], self._gather_bytes, self.k_cache[0])
        attend = paged_attend(pages, positions, groups, self.block_size, self._gathered,
                              self.state_dtype, self.device)  # fmt: skip
        x = embedded(self.embed, tokens, self.device)
        return self._forward_rows(x, positions, pages.tables, attend, None)

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
        A mixture's experts run as fixed-shape batched products then (layers/experts.py)."""
        self._fixed_shapes = True
        try:
            x = embedded(self.embed, tokens, self.device)
            return self._forward_rows(x, positions, tables, attend, None)
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
        writes = slots(tables, positions[:, None], self.block_size)[:, 0]
        return self._layers(x, positions, writes, attend, rows)

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        writes: torch.Tensor,
        attend: Attend,
        rows: Sequence[int] | None,
    ) -> torch.Tensor:
        """Every layer over rows x at `positions`, their keys and values written to the
        cache slots `writes`, attention by `attend` -> logits of `rows` (None: all)."""
        rotary = at_positions(self.rotary_tables, positions)
        for index, (layer, weights) in enumerate(zip(self.spec.layers, self.layers, strict=True)):
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            q = self._attention_inputs(x, layer, weights, rotary, k_cache, v_cache, writes)
            if q.dtype != self.state_dtype:  # a norm, rotary or scale that changed a dtype
                raise AttentionDtypeError(
                    f"layer {index}: q is {q.dtype} after its norms and rotary, but the "
                    f"activations are {self.state_dtype} (KV cache {k_cache.dtype}; "
                    f"{self.spec.family}, {self.format} weights)"
                )
            out = attend(q, k_cache, v_cache, layer.attention)
            x = self._attention_output(x, out, weights)
            x = self._mlp(x, layer, weights)
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
        (layers/attention.py `chunk_attend`), or row by row through `row_attention`
        when the rows read few enough positions together.
        """
        total = sum(chunk.tokens.shape[0] for chunk in chunks)
        if total == 0:
            raise ValueError("prefill_packed needs at least one token")
        if self.check_indices:
            for chunk in chunks:
                count = chunk.tokens.shape[0]
                where = list(range(chunk.start, chunk.start + count))
                self.check_step("prefill", chunk.tokens, where, [chunk.table] * count)
            if any(not 0 <= row < total for row in rows):
                raise IndexCheckError(f"prefill: rows {list(rows)} of {total} packed tokens")
        if self._native is not None:
            return self._native_prefill(chunks, rows)
        if self.row_attention is not None and _reads(chunks) <= ROW_ATTENTION_POSITIONS:
            return self._prefill_by_rows(chunks, rows, self.row_attention)
        x = embedded(self.embed, torch.cat([chunk.tokens for chunk in chunks]), self.device)
        spans, writes = [], []
        for chunk in chunks:
            count = chunk.tokens.shape[0]
            end = chunk.start + count
            pages = self.pages([chunk.table], end)
            positions = torch.arange(chunk.start, end, device=self.device)
            writes.append(slots(pages.tables, positions[None, :], self.block_size)[0])
            span = torch.arange(pages.length, device=self.device)
            spans.append(ChunkPages(count, pages, positions, span))
        positions = torch.cat(
            [torch.arange(c.start, c.start + c.tokens.shape[0]) for c in chunks]
        ).to(self.device)
        attend = chunk_attend(spans, self.block_size, self._gathered)
        return self._layers(x, positions, torch.cat(writes), attend, rows)

    def _prefill_by_rows(
        self, chunks: list[Chunk], rows: Sequence[int], attention: Any
    ) -> torch.Tensor:
        """prefill_packed with attention row by row: every token of every chunk is a row
        with its own position and its sequence's table, attended in one call per layer
        (`attention`, paged_attention.py's kernel, as decode steps run it) instead of
        one call per chunk."""
        tokens, positions, tables, longest = self._rows_of(chunks)
        attend = attention.bind(tables, positions + 1, longest)
        x = embedded(self.embed, tokens, self.device)
        return self._forward_rows(x, positions, tables, attend, rows)

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

    def _attention_inputs(
        self,
        x: torch.Tensor,
        layer: Layer,
        weights: LayerWeights,
        rotary: list[Table],
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
            assert weights.q_norm is not None and weights.k_norm is not None
            qkv = qk_norm(qkv, attention.qk_norm, weights.q_norm, weights.k_norm, self.heads,
                          self.kv_heads, self.head_dim, self.eps)  # fmt: skip
        table = None if attention.rotary is None else rotary[attention.rotary]
        return rotate_store(qkv, table, self.heads, k_cache, v_cache, writes, self.fused_rotate)

    def _attention_output(
        self, x: torch.Tensor, attn: torch.Tensor, weights: LayerWeights
    ) -> torch.Tensor:
        out = weights.o(attn.to(self.dtype)).to(self.state_dtype)
        if weights.o_bias is not None:
            out = out + weights.o_bias
        if weights.post_attention is not None:
            out = self._norm(out, weights.post_attention).to(self.state_dtype)
        return x + out

    def _mlp(self, x: torch.Tensor, layer: Layer, weights: LayerWeights) -> torch.Tensor:
        """The layer's feed-forward half: a gated MLP (or shared expert, gated by its
        sigmoid), a mixture of experts, or both summed; its bias and norm; the residual."""
        h = self._norm(x, weights.pre_mlp) if weights.pre_mlp is not None else x.to(self.dtype)
        out: torch.Tensor | None = None
        if weights.gate_up is not None and weights.down is not None:  # an MLP, or shared expert
            assert layer.mlp is not None
            out = gated(h, weights.gate_up, weights.down, layer.mlp.activation, self.state_dtype,
                        self.fused_gate, weights.gate_up_bias)  # fmt: skip
            moe = weights.moe
            if moe is not None and moe.shared_gate is not None:
                out = out * torch.sigmoid(h.to(self.state_dtype) @ moe.shared_gate)[:, None]
        if layer.experts is not None:
            assert weights.moe is not None
            mixed = mixture(h, layer.experts, weights.moe, self.state_dtype, self._fixed_shapes,
                            self.fused_gate)  # fmt: skip
            out = mixed if out is None else mixed + out
        assert out is not None
        if weights.down_bias is not None:
            out = out + weights.down_bias
        if weights.post_mlp is not None:
            out = self._norm(out, weights.post_mlp).to(self.state_dtype)
        return x + out

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps, self.dtype, self.fused)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return logits(x, self.final_norm, self.lm_head, self.eps, self.dtype, self.fused,
                      self.spec.final_softcap)  # fmt: skip


def _reads(chunks: list[Chunk]) -> int:
    """Positions the chunks' tokens read together, each its whole prefix."""
    return sum(c.tokens.shape[0] * (2 * c.start + c.tokens.shape[0] + 1) // 2 for c in chunks)
