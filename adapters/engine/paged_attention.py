"""Decode attention at fixed shapes, for the static decode step (static_decode.py).

A captured CUDA graph replays the same kernels on the same buffers every
step, so attention there takes every row's block table padded to the widest
a sequence can have (max_context) and each row's length as a tensor. Three
ways to spend that, chosen at start by timing them on the device
(`choose_attention`, logged):

- "gather" (torch alone): every row's whole table gathered into one tensor,
  positions past the row's length masked to -inf, then batched products and
  a softmax. Simple and exact, but every step reads max_context positions
  per row whatever the rows' real lengths are.
- "sdpa": the same gather, then torch's scaled_dot_product_attention (a
  candidate on CUDA only: on CPU its kernel's fixed costs lose, layers/attention.py).
- "triton": a kernel that reads each row's blocks where they lie in the
  pool, up to that row's own length, so a step costs what the rows really
  hold. A row's positions are cut into spans of SPAN (256) positions, or, for
  a row longer than MAX_SPANS (16) such spans, into 16 spans of the multiple
  of 256 that covers it; one program per (row, key head, span) runs an online
  softmax over its span for the query heads sharing that key head, and a
  second kernel joins the spans' partial results in span order. So up to 16
  programs share a long row's work whatever max_context is, and the spans
  depend on a row's length alone, so a row's result is the same in any batch
  (no split chosen by how busy the step is). A program whose span lies past its row's length reads
  and stores nothing, and the join reads only the spans a row uses.

All take q [rows, heads, dim] (already scaled; rows may be strided, as the
query part of the rotated q and k is), one layer's cache [kv_heads, slots,
dim] and that layer's attention settings (spec.Attention), and give [rows,
heads * dim]. `bind(tables, lengths)` does the per-step work once (the masks,
the span grid) and returns the per-layer function. Not every kind runs every
layer: the gathers and the kernel mask a layer's window and cap its scores;
SDPA takes a window but no cap. `problem(spec)` says what a kind cannot run
for a model, and the choice leaves it out with that reason. A windowed row's
spans are still cut by its length alone: those wholly before the window read
nothing and add nothing to the join.

The kernels (triton_kernels.py) are imported at first use, so CPU serving
never imports triton; with TRITON_INTERPRET=1 set before that first use they
run on CPU tensors, which is how the tests check them against "gather".
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from adapters.engine.fused import kernel_device_problem, next_pow2
from adapters.engine.layers.attention import Attend, attend_gathered
from adapters.engine.spec import Attention, ModelSpec

ATTENTIONS = ("gather", "sdpa", "triton")
SPAN = 256  # positions per program of the triton kernel, for rows up to MAX_SPANS * SPAN
MAX_SPANS = 16  # programs per row and key head at most; a longer row's spans are longer
CHUNK = 16  # positions a program reads per iteration


class GatherAttention:
    """Every row's whole table gathered, the positions past its length masked; the
    products and softmax written out as batched products (key head major)."""

    name = "gather"

    def __init__(self, heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.block_size = block_size

    @staticmethod
    def problem(spec: ModelSpec) -> str | None:
        del spec
        return None  # windows and caps alike

    def bind(self, tables: torch.Tensor, lengths: torch.Tensor) -> Attend:
        rows, width = tables.shape
        span = width * self.block_size
        positions = torch.arange(span, device=tables.device)
        past = positions[None, :] >= lengths[:, None]  # [rows, span]
        blocks = tables.flatten().to(torch.int64)
        masks: dict[tuple[torch.dtype, int | None], torch.Tensor] = {}  # built once per step

        def mask_for(dtype: torch.dtype, window: int | None) -> torch.Tensor:
            if (dtype, window) not in masks:
                hidden = (
                    past
                    if window is None
                    else past | (positions[None, :] < lengths[:, None] - window)
                )
                zeros = torch.zeros(past.shape, dtype=dtype, device=past.device)
                masks[dtype, window] = zeros.masked_fill(hidden, float("-inf"))
            return masks[dtype, window]

        def attend(
            q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention
        ) -> torch.Tensor:
            by_block = (self.kv_heads, -1, self.block_size, self.head_dim)
            keys = torch.index_select(k_cache.view(by_block), 1, blocks)
            values = torch.index_select(v_cache.view(by_block), 1, blocks)
            shape = (self.kv_heads, rows, span, self.head_dim)
            mask = mask_for(q.dtype, layer.window)
            return self._attend(q, keys.view(shape), values.view(shape), mask, layer)

        return attend

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        layer: Attention,
    ) -> torch.Tensor:
        """q [rows, heads, dim] over keys and values [kv_heads, rows, span, dim], the
        additive mask [rows, span] -> [rows, heads * dim]: the eager step's products."""
        rows, span = mask.shape
        return attend_gathered(q, keys, values, mask.view(1, rows, 1, span), layer.softcap)


class SdpaAttention(GatherAttention):
    """The same gather, then torch's scaled_dot_product_attention (whichever of its
    kernels takes a mask and grouped heads on the device)."""

    name = "sdpa"

    @staticmethod
    def problem(spec: ModelSpec) -> str | None:
        if "softcap" in spec.features():
            return "it cannot soft-cap attention scores"
        return None

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        mask: torch.Tensor,
        layer: Attention,
    ) -> torch.Tensor:
        rows, span, dim = keys.shape[1:]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [rows, heads, 1, dim]: one query per row
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask.view(rows, 1, 1, span),
            enable_gqa=True,
            scale=1.0,  # the query weights carry 1/sqrt(dim)
        )
        return out.reshape(rows, self.heads * dim)


class TritonAttention:
    """Each row's blocks read in place up to its own length (the module's docstring)."""

    name = "triton"

    def __init__(
        self, heads: int, kv_heads: int, head_dim: int, block_size: int, max_context: int
    ) -> None:
        problem = triton_problem(heads, kv_heads, head_dim)
        if problem:
            raise ValueError(problem)
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.block_size = block_size
        self.group = heads // kv_heads
        self.group_p2 = max(2, next_pow2(self.group))
        self.spans = min(MAX_SPANS, -(-max_context // SPAN))  # the most a row can use

    @staticmethod
    def problem(spec: ModelSpec) -> str | None:
        del spec
        return None  # windows and caps alike, per layer

    def bind(
        self, tables: torch.Tensor, lengths: torch.Tensor, longest: int | None = None
    ) -> Attend:
        """`longest`, when the caller knows it (an eager prefill, not a graph), bounds the
        rows' lengths: only the spans it needs get programs and partial buffers."""
        partial, join = _kernels()
        rows, width = tables.shape
        device = tables.device
        spans = self.spans if longest is None else min(self.spans, -(-longest // SPAN))
        shape = (rows, self.kv_heads, spans, self.group_p2)
        top = torch.empty(shape, dtype=torch.float32, device=device)
        total = torch.empty(shape, dtype=torch.float32, device=device)
        acc = torch.empty((*shape, self.head_dim), dtype=torch.float32, device=device)
        tables = tables.to(torch.int32).contiguous()
        lengths = lengths.to(torch.int32).contiguous()

        def attend(
            q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layer: Attention
        ) -> torch.Tensor:
            assert q.stride(2) == 1 and q.stride(1) == self.head_dim, "heads, dims contiguous"
            out = torch.empty((rows, self.heads * self.head_dim), dtype=q.dtype, device=device)
            slots = k_cache.shape[1]
            window, softcap = layer.window, layer.softcap
            partial[(rows, self.kv_heads, spans)](
                q, k_cache, v_cache, tables, lengths, top, total, acc,
                q.stride(0), slots, width, spans, window or 0, softcap or 1.0,
                HEAD_DIM=self.head_dim, GROUP=self.group, GROUP_P2=self.group_p2,
                BLOCK=self.block_size, SPAN=SPAN, PARTS=MAX_SPANS, CHUNK=CHUNK,
                WINDOWED=window is not None, CAPPED=softcap is not None,
            )  # fmt: skip
            join[(rows, self.kv_heads)](
                top, total, acc, out, lengths, spans,
                HEAD_DIM=self.head_dim, GROUP=self.group, GROUP_P2=self.group_p2,
                SPAN=SPAN, PARTS=MAX_SPANS,
            )  # fmt: skip
            return out

        return attend


def triton_problem(heads: int, kv_heads: int, head_dim: int) -> str | None:
    """Why the triton kernel cannot take this shape, or None."""
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"head size {head_dim} is not a power of two from 16 to 256"
    if heads % kv_heads:
        return f"{heads} query heads do not group over {kv_heads} key heads"
    return None


def make_attention(
    name: str, heads: int, kv_heads: int, head_dim: int, block_size: int, max_context: int
) -> GatherAttention | TritonAttention:
    if name == "gather":
        return GatherAttention(heads, kv_heads, head_dim, block_size)
    if name == "sdpa":
        return SdpaAttention(heads, kv_heads, head_dim, block_size)
    if name == "triton":
        return TritonAttention(heads, kv_heads, head_dim, block_size, max_context)
    raise ValueError(f"unknown decode attention {name!r}; one of {', '.join(ATTENTIONS)}")


def choose_attention(
    runner: Any,
    rows: int,
    say: Callable[[str], None],
    candidates: list[GatherAttention | TritonAttention] | None = None,
) -> GatherAttention | TritonAttention:
    """The fastest of the candidates for this runner's shape on its device, timed on one
    layer's worth of random keys and values: `rows` rows at lengths spread up to
    max_context (the gathers read max_context whatever the lengths; the kernel reads
    what they hold). A candidate that cannot run here, or whose output disagrees
    with the gather's in fp32 on the same inputs, is left out, and the log says why."""
    if candidates is None:
        candidates = _candidates(runner, say)
    if len(candidates) == 1:
        return candidates[0]
    trial = _Trial(runner, rows)
    # The reference: the gather in fp32, whatever the cache's dtype.
    reference = candidates[0].bind(trial.tables, trial.lengths)
    want = reference(trial.q.float(), trial.k.float(), trial.v.float(), trial.layer)
    tolerance = 1e-4 if trial.q.dtype == torch.float32 else 3e-2
    # The GPU path on a CPU: triton's interpreter is no measure of a GPU, so the kinds
    # are checked but not timed, and the last that passes (the kernel) is taken.
    untimed = runner.gpu_path and runner.device.type == "cpu"
    timings = []
    for candidate in candidates:
        try:
            seconds, got = trial.time(candidate, repeats=0 if untimed else 7)
        except Exception as error:  # a kernel that fails to build is no candidate
            say(f"decode attention: {candidate.name} failed to run ({type(error).__name__}: "
                f"{error})")  # fmt: skip
            continue
        if not torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance):
            gap = (got.float() - want.float()).abs().max()
            say(f"decode attention: {candidate.name} disagrees with an fp32 gather by "
                f"{gap:.3g}; not used")  # fmt: skip
            continue
        timings.append((seconds, candidate))
    if untimed:
        chosen = timings[-1][1]
        names = ", ".join(c.name for _, c in timings)
        say(f"decode attention: {chosen.name}, the last of {names} that agree with an fp32 "
            "gather (the GPU path on a CPU: untimed, triton runs interpreted)")  # fmt: skip
        return chosen
    timings.sort(key=lambda pair: pair[0])
    figures = ", ".join(f"{c.name} {t * 1e3:.3f} ms" for t, c in timings)
    say(
        f"decode attention: {timings[0][1].name}, measured for {rows} rows at lengths "
        f"up to {runner.max_context}, one layer ({figures})"
    )
    return timings[0][1]


def _candidates(runner: Any, say: Callable[[str], None]) -> list[GatherAttention | TritonAttention]:
    """The kinds that can run for this runner's shape on its device, gather first."""
    shape = (runner.heads, runner.kv_heads, runner.head_dim, runner.block_size)
    candidates: list[GatherAttention | TritonAttention] = [GatherAttention(*shape)]
    if runner.gpu_path:  # on the CPU path the flash kernel's fixed costs lose (layers/)
        if (unfit := SdpaAttention.problem(runner.spec)) is None:
            candidates.append(SdpaAttention(*shape))
        else:
            say(f"decode attention: no sdpa candidate for this model ({unfit})")
    problem = triton_problem(*shape[:3]) or TritonAttention.problem(runner.spec)
    if not runner.gpu_path:
        problem = problem or "the CPU path keeps torch's ops"
    problem = kernel_device_problem(runner.device) or problem
    if problem is None:
        candidates.append(TritonAttention(*shape, runner.max_context))
    else:
        say(f"decode attention: no triton candidate ({problem})")
    return candidates


class _Trial:
    """One layer's worth of random keys and values shaped as the runner's cache, and
    `rows` rows of random tables at lengths spread from 1 to max_context: what the
    candidates are checked against each other and timed on."""

    def __init__(self, runner: Any, rows: int) -> None:
        device, dtype = runner.device, runner.k_cache.dtype
        generator = torch.Generator().manual_seed(0)
        width = -(-runner.max_context // runner.block_size)
        tables = torch.randint(0, runner.num_blocks, (rows, width), generator=generator)
        self.tables = tables.to(device)
        lengths = torch.linspace(1, runner.max_context, rows).round().to(torch.int32)
        self.lengths = lengths.to(device)
        q = torch.randn(rows, runner.heads, runner.head_dim, generator=generator)
        self.q = (q * runner.head_dim**-0.5).to(device=device, dtype=dtype)  # scaled, as served
        self.k = torch.randn(runner.k_cache.shape[1:], device=device, dtype=dtype)
        self.v = torch.randn(runner.v_cache.shape[1:], device=device, dtype=dtype)
        self.layer = runner.spec.layers[0].attention  # its window and cap, if any

    def time(
        self, attention: GatherAttention | TritonAttention, repeats: int = 7
    ) -> tuple[float, torch.Tensor]:
        """Seconds per call (the median of `repeats` timings of 5 calls; 0: not timed)
        and the output."""
        attend = attention.bind(self.tables, self.lengths)
        out = attend(self.q, self.k, self.v, self.layer)
        if not repeats:
            return 0.0, out
        samples = []
        for _ in range(repeats):
            _sync(self.q.device)
            began = time.perf_counter()
            for _ in range(5):
                attend(self.q, self.k, self.v, self.layer)
            _sync(self.q.device)
            samples.append((time.perf_counter() - began) / 5)
        samples.sort()
        return samples[len(samples) // 2], out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _kernels() -> tuple[Any, Any]:
    """The two triton kernels, imported at first use (see the module's docstring)."""
    from adapters.engine import triton_kernels as kernels

    return kernels.partial, kernels.join
