"""One kernel each for the forward pass's elementwise work on a GPU (triton).

On a GPU every torch op is a kernel of its own. RMSNorm written as torch ops
is six (square, mean, add, rsqrt, two products), rotary embeddings five
(negate, concatenate, two products, add) and the SiLU gate two, so of about
32 kernels a layer runs per decode step, 19 are these, and writing k and v
to the cache two more; inside a CUDA graph each still costs its launch and a
pass over memory. Here RMSNorm and the SiLU gate are one kernel each, and
rotary one kernel that also writes k and v to their cache slots
(`rotate_store`); each reads its inputs once, computes in fp32 and rounds
once.

Used on the GPU path (on CUDA, and on a CPU that runs the GPU's code through
triton's interpreter: runner.py) whenever triton is there and the shape fits
(`fused_problem`), by prefill and decode alike, so that a position prefilled
and one decoded go through the same arithmetic; FENCEPOST_FUSED=off leaves
them out (the start log says which). The CPU path keeps torch's ops, which
live here too (torch_*): the CPU's arithmetic, and the kernels' reference.
The kernels (triton_kernels.py) are imported at first use; the tests run them
through triton's interpreter against the torch ops.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

SILU_BLOCK = 1024  # gate columns per program


def fused_problem(
    device: torch.device, hidden: int, head_dim: int, gpu_path: bool = True
) -> str | None:
    """Why the fused kernels are not used for this model on this device, or None.
    `gpu_path`: whether the runner runs the GPU's code (runner.py); the CPU's keeps
    torch's ops."""
    if os.environ.get("FENCEPOST_FUSED", "").lower() == "off":
        return "FENCEPOST_FUSED=off"
    if not gpu_path:
        return "the CPU path keeps torch's ops"
    if problem := kernel_device_problem(device):
        return problem
    return fused_shape_problem(hidden, head_dim)


def kernel_device_problem(device: torch.device) -> str | None:
    """Why triton's kernels cannot run on this device, or None: CUDA compiles them, and
    a CPU runs them through triton's interpreter when TRITON_INTERPRET=1 was set
    before triton was first imported (the GPU path on a CPU: runner.py)."""
    if problem := triton_missing():
        return problem
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return None
    return f"the kernels are compiled for CUDA, not {device.type} (TRITON_INTERPRET is not 1)"


def interpreting() -> bool:
    """Whether triton runs its kernels through its interpreter (on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def kernel_problem(
    device: torch.device, dtype: torch.dtype, hidden: int, head_dim: int
) -> str | None:
    """Run each kernel once at this model's widths against the torch ops it replaces:
    the reason it cannot be used (it failed to build or run, or disagrees), or None."""
    generator = torch.Generator().manual_seed(0)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    x, weight = draw(3, hidden), draw(hidden)
    heads, kv_heads = 4, 2  # 3 rows of q, k and v heads, into caches of 8 slots
    qkv = draw(3, (heads + 2 * kv_heads) * head_dim)
    angles = torch.randn(3, head_dim // 2, generator=generator).repeat(1, 2).to(device)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([5, 0, 2], device=device)
    caches = draw(kv_heads, 8, head_dim), draw(kv_heads, 8, head_dim)
    wanted = caches[0].float(), caches[1].float()
    gate_up = x[:, : hidden // 2 * 2].contiguous()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    try:
        pairs = [  # each kernel, and the torch ops it replaces in fp32
            (rms_norm(x, weight, 1e-5, dtype), torch_rms_norm(x.float(), weight.float(), 1e-5)),
            (
                rotate_store(qkv, cos, sin, heads, *caches, slots),
                torch_rotate_store(qkv.float(), cos.float(), sin.float(), heads, *wanted, slots),
            ),
            *zip(caches, wanted, strict=True),
            (silu_gate(gate_up), torch_silu_gate(gate_up.float())),
        ]
        for got, want in pairs:
            if not torch.allclose(got.float(), want, rtol=tolerance, atol=tolerance):
                return f"a kernel disagrees with torch by {(got.float() - want).abs().max():.3g}"
    except Exception as error:  # a kernel that does not build here is not used
        return f"the kernels failed here ({type(error).__name__}: {error})"
    return None


def triton_missing() -> str | None:
    """Why triton cannot be used here, or None."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed"
    return None


def fused_shape_problem(hidden: int, head_dim: int) -> str | None:
    if problem := triton_missing():
        return problem
    if head_dim < 4 or head_dim & (head_dim - 1):
        return f"head size {head_dim} is not a power of two"
    if hidden > 32768:
        return f"hidden size {hidden} is wider than one program's row"
    return None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim of x [rows, hidden], in `out`."""
    kernels = _kernels()
    x = x.contiguous()
    rows, width = x.shape
    result = torch.empty((rows, width), dtype=out, device=x.device)
    block = next_pow2(width)
    kernels.rms_norm[(rows,)](x, weight, result, width, eps, BLOCK=block, num_warps=_warps(block))
    return result


def rotate_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One layer's attention inputs from qkv [rows, (heads + 2 kv_heads) * dim] (q's,
    k's and v's heads side by side; rows may be strided): q and k rotated by each
    row's cos and sin [rows, dim] (both halves equal, as the runner builds them), k
    and v written to the caches [kv_heads, cache slots, dim] at each row's slot
    (`slots` [rows]) -> q, a new contiguous [rows, heads, dim]. One kernel for what
    torch does as rotary's five ops and the two cache writes (`torch_rotate_store`)."""
    kernels = _kernels()
    kv_heads, cache_slots, dim = k_cache.shape
    rows = qkv.shape[0]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (heads + 2 * kv_heads) * dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    q = torch.empty((rows, heads, dim), dtype=qkv.dtype, device=qkv.device)
    kernels.rotate_store[(rows, heads + kv_heads)](
        qkv, cos.contiguous(), sin.contiguous(), q, k_cache, v_cache, slots.contiguous(),
        qkv.stride(0), cache_slots,
        HEADS=heads, KV_HEADS=kv_heads, HALF=dim // 2,
    )  # fmt: skip
    return q


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2 * width] = [gate | up] -> [rows, width]."""
    kernels = _kernels()
    gate_up = gate_up.contiguous()
    rows, both = gate_up.shape
    width = both // 2
    out = torch.empty((rows, width), dtype=gate_up.dtype, device=gate_up.device)
    grid = (rows, -(-width // SILU_BLOCK))
    kernels.silu_gate[grid](gate_up, out, width, BLOCK=SILU_BLOCK)
    return out


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype = torch.float32
) -> torch.Tensor:
    """RMSNorm as torch ops (the CPU path's, and rms_norm's reference), computed in
    fp32 as the kernel computes it (a no-op on the CPU path's fp32 rows) and handed
    on in the products' dtype `out`."""
    x = x.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return normed.to(out)


def torch_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as torch ops: x [..., dim] by cos and sin broadcast to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def torch_rotate_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """rotate_store as torch ops (the CPU path, and the kernel's reference): q and k
    rotated in one pass, k and v written to the caches, q handed back (a view)."""
    kv_heads, _, dim = k_cache.shape
    rows = qkv.shape[0]
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim)
    qk = torch_rotate(qk, cos[:, None, :], sin[:, None, :])
    k_cache[:, slots] = qk[:, heads:].transpose(0, 1)
    v_cache[:, slots] = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim).transpose(0, 1)
    return qk[:, :heads]


def torch_silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up as torch ops, gate_up = [gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def next_pow2(value: int) -> int:
    """The smallest power of two at least `value` (a triton block's size)."""
    return 1 << max(0, (value - 1).bit_length())


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


class _Kernels:
    def __init__(self, rms: Any, rot: Any, silu: Any) -> None:
        self.rms_norm, self.rotate_store, self.silu_gate = rms, rot, silu


@functools.cache
def _kernels() -> _Kernels:
    from adapters.engine import triton_kernels as kernels

    return _Kernels(kernels.rms_norm, kernels.rotate_store, kernels.silu_gate)
