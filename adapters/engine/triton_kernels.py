"""The engine's triton kernels (what they compute: paged_attention.py and fused.py).

A module of their own for two reasons. Triton is imported only when a GPU
path asks for a kernel: paged_attention.py and fused.py import this module
at first use, so CPU serving never loads triton. And `tl` must be a global
of the kernels' module: triton 3.1 (what torch 2.5's CUDA builds bring, as
in deploy/docker/Dockerfile.cuda) resolves a kernel's names in its module's
globals only, and the kernels, when they were defined inside a function
that imported triton, failed to compile there with "tl is not defined"
(found by bench/kernel_build.py --triton-from; 3.6 and 3.9 took them).

No `from __future__ import annotations`: triton reads the `tl.constexpr`
annotations of the kernels' parameters as objects.
"""

import triton
import triton.language as tl

# The paged decode attention: each (row, key head, span) program reads its row's
# blocks up to the row's length (from the window's first position, where the layer
# has a window) with an online softmax; `join` combines the spans.


@triton.jit  # type: ignore[untyped-decorator]
def row_span(length, SPAN: tl.constexpr, PARTS: tl.constexpr):  # type: ignore[no-untyped-def]
    # A row's span: SPAN positions, or the multiple of SPAN that cuts the row into at
    # most PARTS spans, so that a long row's work is shared by PARTS programs a key head.
    # (partial cuts the row and join counts its spans: both call this.)
    return SPAN * tl.cdiv(tl.cdiv(length, SPAN), PARTS)


@triton.jit  # type: ignore[untyped-decorator]
def partial(  # type: ignore[no-untyped-def]
    q_ptr, k_ptr, v_ptr, tables_ptr, lengths_ptr, top_ptr, total_ptr, acc_ptr,
    q_stride, slots, width, spans, window, softcap,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    BLOCK: tl.constexpr, SPAN: tl.constexpr, PARTS: tl.constexpr, CHUNK: tl.constexpr,
    WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
):  # fmt: skip
    # window: a row sees its last `window` positions (WINDOWED); softcap: scores become
    # tanh(s / softcap) * softcap (CAPPED). The spans are cut by the row's length alone,
    # windowed or not, so the join adds the same spans in the same order in any batch.
    row = tl.program_id(0)
    kv = tl.program_id(1)
    part = tl.program_id(2)
    kv_heads = tl.num_programs(1)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM)
    live = g < GROUP
    head = kv * GROUP + g
    q_at = row * q_stride + head[:, None] * HEAD_DIM + d[None, :]
    q = tl.load(q_ptr + q_at, mask=live[:, None], other=0.0).to(tl.float32)
    length = tl.load(lengths_ptr + row)
    span = row_span(length, SPAN, PARTS)
    start = part * span
    end = tl.minimum(length, start + span)
    first_seen = start
    if WINDOWED:  # a span wholly before the window reads nothing and stores an empty part
        first_seen = tl.maximum(start, length - window)
    top = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    base = kv.to(tl.int64) * slots * HEAD_DIM
    for first in range(first_seen, end, CHUNK):
        position = first + tl.arange(0, CHUNK)
        valid = position < end
        block = tl.load(tables_ptr + row * width + position // BLOCK, mask=valid, other=0)
        slot = block.to(tl.int64) * BLOCK + position % BLOCK
        at = base + slot[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
        v = tl.load(v_ptr + at, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        if CAPPED:  # tanh through exp (on every backend): 1 - 2 / (e^2x + 1)
            scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0))
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, axis=1))
        scale = tl.exp(top - new_top)  # new_top is finite: `first` itself is valid
        p = tl.exp(scores - new_top[:, None])
        total = total * scale + tl.sum(p, axis=1)
        acc = acc * scale[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        top = new_top
    # A span past the row's length stores nothing: join reads only the spans in use.
    used = g < tl.where(start < length, GROUP_P2, 0)
    out = ((row * kv_heads + kv) * spans + part) * GROUP_P2 + g
    tl.store(top_ptr + out, top, mask=used)
    tl.store(total_ptr + out, total, mask=used)
    tl.store(acc_ptr + out[:, None] * HEAD_DIM + d[None, :], acc, mask=used[:, None])


@triton.jit  # type: ignore[untyped-decorator]
def join(  # type: ignore[no-untyped-def]
    top_ptr, total_ptr, acc_ptr, out_ptr, lengths_ptr, spans,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    SPAN: tl.constexpr, PARTS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv = tl.program_id(1)
    kv_heads = tl.num_programs(1)
    g = tl.arange(0, GROUP_P2)
    d = tl.arange(0, HEAD_DIM)
    first = (row * kv_heads + kv) * spans
    length = tl.load(lengths_ptr + row)
    used = tl.cdiv(length, row_span(length, SPAN, PARTS))  # the spans partial filled
    best = tl.full([GROUP_P2], float("-inf"), tl.float32)
    for s in range(0, used):
        best = tl.maximum(best, tl.load(top_ptr + (first + s) * GROUP_P2 + g))
    weight_sum = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, HEAD_DIM], tl.float32)
    for s in range(0, used):  # in span order: the same sum whatever the batch
        at = (first + s) * GROUP_P2 + g
        scale = tl.exp(tl.load(top_ptr + at) - best)
        weight_sum += tl.load(total_ptr + at) * scale
        acc += tl.load(acc_ptr + at[:, None] * HEAD_DIM + d[None, :]) * scale[:, None]
    result = acc / weight_sum[:, None]
    head = kv * GROUP + g
    out_at = (row * kv_heads * GROUP + head)[:, None] * HEAD_DIM + d[None, :]
    live = g < GROUP
    tl.store(out_ptr + out_at, result.to(out_ptr.dtype.element_ty), mask=live[:, None])


# The elementwise kernels of fused.py: each reads its input once, computes in fp32
# and rounds once to the output's dtype.


@triton.jit  # type: ignore[untyped-decorator]
def rms_norm(x_ptr, w_ptr, out_ptr, width, eps, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=inside, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    y = x * scale * w
    tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit  # type: ignore[untyped-decorator]
def rotate_store(  # type: ignore[no-untyped-def]
    x_ptr, cos_ptr, sin_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    row_stride, cache_slots,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    # One program per (row, head) of q and k in a row of x = [q | k | v] heads: q's
    # heads rotated into q_ptr; k's rotated, and v's copied, to the row's cache slot.
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    i = tl.arange(0, HALF)
    at = x_ptr + row * row_stride + head * (2 * HALF)
    x1 = tl.load(at + i).to(tl.float32)
    x2 = tl.load(at + HALF + i).to(tl.float32)
    c = tl.load(cos_ptr + row * (2 * HALF) + i).to(tl.float32)
    s = tl.load(sin_ptr + row * (2 * HALF) + i).to(tl.float32)
    first = x1 * c - x2 * s
    second = x2 * c + x1 * s
    # (No name is bound in both branches: triton would have to join them, and cannot
    # join the branches' different element types.)
    if head < HEADS:
        q_at = q_ptr + (row * HEADS + head) * (2 * HALF)
        tl.store(q_at + i, first.to(q_ptr.dtype.element_ty))
        tl.store(q_at + HALF + i, second.to(q_ptr.dtype.element_ty))
    else:
        kv = head - HEADS
        slot = tl.load(slots_ptr + row).to(tl.int64)
        k_at = k_cache_ptr + (kv * cache_slots + slot) * (2 * HALF)
        tl.store(k_at + i, first.to(k_cache_ptr.dtype.element_ty))
        tl.store(k_at + HALF + i, second.to(k_cache_ptr.dtype.element_ty))
        value = x_ptr + row * row_stride + (KV_HEADS + head) * (2 * HALF)  # v's head kv
        v_at = v_cache_ptr + (kv * cache_slots + slot) * (2 * HALF)
        tl.store(v_at + i, tl.load(value + i).to(v_cache_ptr.dtype.element_ty))
        tl.store(v_at + HALF + i, tl.load(value + HALF + i).to(v_cache_ptr.dtype.element_ty))


@triton.jit  # type: ignore[untyped-decorator]
def silu_gate(x_ptr, out_ptr, width, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    gate = tl.load(x_ptr + row * 2 * width + cols, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * width + width + cols, mask=inside, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * width + cols, y.to(out_ptr.dtype.element_ty), mask=inside)
