"""RMSNorm, the one norm the supported families use, of rows and of q and k.

Gemma's (1 + w) weights and the attention scale a normalised q carries are
folded into the weights as they are loaded (loader.py), so one function serves
every norm site: before and after attention and the MLP, the final norm, and
q and k per head (Qwen 3, Gemma 3) or over the whole projection (OLMo 2).
On CUDA it is one triton kernel (fused.rms_norm) when `kernel` says so;
torch's ops otherwise, which are also the kernel's reference.
"""

from __future__ import annotations

import torch

from adapters.engine import fused
from adapters.engine.spec import QkNorm


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype, kernel: bool
) -> torch.Tensor:
    """x [rows, hidden] RMSNorm-ed by `weight`, handed on in `out` (the products' dtype)."""
    if kernel:
        return fused.rms_norm(x, weight, eps, out)
    return fused.torch_rms_norm(x, weight, eps, out)


def qk_norm(
    qkv: torch.Tensor,
    kind: QkNorm,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
) -> torch.Tensor:
    """q and k of qkv [rows, (heads + 2 kv_heads) * head_dim] RMSNorm-ed: each head over
    head_dim ("head"), or each whole projection ("width"); v as it is. In qkv's dtype
    (the norm computes in the wider of it and the weights', then rounds once)."""
    rows, q_size, kv_size = qkv.shape[0], heads * head_dim, kv_heads * head_dim
    q, k, v = qkv[:, :q_size], qkv[:, q_size : q_size + kv_size], qkv[:, q_size + kv_size :]
    dtype = qkv.dtype  # kept: q and k meet v's dtype in the cache and in attention
    if kind == "head":
        q = fused.torch_rms_norm(q.reshape(rows, heads, -1), q_norm, eps, dtype)
        k = fused.torch_rms_norm(k.reshape(rows, kv_heads, -1), k_norm, eps, dtype)
    else:
        q = fused.torch_rms_norm(q, q_norm, eps, dtype)
        k = fused.torch_rms_norm(k, k_norm, eps, dtype)
    return torch.cat([q.reshape(rows, q_size), k.reshape(rows, kv_size), v], dim=-1)
