"""Rotary position embeddings: every variant the supported checkpoints ask for, once.

A config names its rotary kind in `rope_parameters` (transformers 5 gathers the
older `rope_scaling`, `rope_theta` and `partial_rotary_factor` there; Gemma 3 has
one entry per layer type). What differs between the kinds is only the inverse
frequency of each rotated pair of dimensions and a factor multiplied into cos and
sin; the rotation itself is the same everywhere (the two halves of the rotated
part of a head, as transformers' rotate_half does), and a partial factor leaves
the rest of the head as it is. So each kind is one function from its parameters
to a `Rotary`, computed in fp32 the way transformers computes it (the tests
compare every kind with transformers' own functions). `Rotary.tables` turns one into
cos and sin tables by position (the runner keeps them for its context), and
`rotate_store` applies a layer's table to q and k as their keys go into the KV
cache: one kernel on CUDA (fused.py), torch's ops elsewhere, and the head's
unrotated rest passed through where only part of it turns.

Kinds: default, linear (positions divided by a factor), llama3 (low frequencies
divided by the factor, high ones kept, a smooth band between), yarn (the same
idea with a ramp and an attention factor), longrope (a factor per frequency,
short or long), and dynamic, which is default up to the trained length (the
only stretch served: beyond it the frequencies would follow each sequence's
length, which no batch of mixed lengths can do exactly).

Longrope switches from its short factors to its long ones when a sequence
outgrows the original training length; transformers then recomputes the whole
sequence with the long ones. A batch-invariant engine cannot redo a sequence's
cache mid-stream, so the choice is made once for the engine: short factors when
every sequence it serves fits the original length (exactly what transformers
computes for those), long ones otherwise (exactly what it computes for the long
sequences), and the start log says which.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from adapters.engine import fused

# cos and sin of one rotary kind, [positions (or rows), rotated dims]
Table = tuple[torch.Tensor, torch.Tensor]
KINDS = ("default", "linear", "llama3", "yarn", "longrope", "dynamic")


class RopeError(ValueError):
    """A rotary configuration this engine cannot compute."""


@dataclass(frozen=True, eq=False)
class Rotary:
    """One rotary kind: the inverse frequencies of the rotated pairs (fp32, [dim / 2]),
    the rotated dimensions of each head (the first `dim`), and the factor multiplied
    into cos and sin."""

    inv_freq: torch.Tensor
    dim: int
    scale: float = 1.0
    note: str = ""  # for the start log, when a choice was made (longrope, dynamic)

    def tables(
        self, positions: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [positions, dim], each half repeated as rotate_half pairs them."""
        inv = self.inv_freq.to(device=device, dtype=torch.float32)
        angles = torch.outer(torch.arange(positions, dtype=torch.float32, device=device), inv)
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)


def rotary(params: Mapping[str, Any], head_dim: int, max_context: int, trained: int) -> Rotary:
    """The Rotary of one `rope_parameters` entry, for heads of `head_dim`, an engine
    serving up to `max_context` positions, and a model trained to `trained` positions
    (its max_position_embeddings)."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in KINDS:
        raise RopeError(f"rope type {kind!r} is not supported (supported: {', '.join(KINDS)})")
    base = float(params.get("rope_theta", 10000.0))
    dim = int(head_dim * float(params.get("partial_rotary_factor", 1.0) or 1.0))
    if dim % 2 or dim <= 0:
        raise RopeError(
            f"rotary dimensions {dim} of head size {head_dim}: not a positive even number"
        )
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv = 1.0 / (base**exponents)
    original = int(params.get("original_max_position_embeddings") or trained)
    factor = params.get("factor")
    if kind == "default":
        return Rotary(inv, dim)
    if kind == "dynamic":
        return Rotary(inv, dim, note=f"dynamic rope: as default, within {trained} positions")
    if kind == "linear":
        return Rotary(inv / float(_required(params, "factor")), dim)
    if kind == "llama3":
        return Rotary(_llama3(inv, params, original), dim)
    if kind == "yarn":
        return _yarn(params, base, dim, exponents, trained, original)
    # longrope
    scale = float(factor) if factor else trained / original
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    long = max_context > original
    ext = torch.tensor(
        _required(params, "long_factor" if long else "short_factor"), dtype=torch.float32
    )
    if ext.shape[0] != dim // 2:
        raise RopeError(f"longrope factors: {ext.shape[0]} for {dim // 2} rotated pairs")
    which = "long" if long else "short"
    note = f"longrope: {which} factors (contexts {'beyond' if long else 'within'} {original})"
    return Rotary(1.0 / (ext * base**exponents), dim, float(attention), note)


def _required(params: Mapping[str, Any], key: str) -> Any:
    value = params.get(key)
    if value is None:
        raise RopeError(f"rope type {params.get('rope_type')!r} needs {key!r}")
    return value


def _llama3(inv: torch.Tensor, params: Mapping[str, Any], original: int) -> torch.Tensor:
    """Llama 3.1's scaling: wavelengths beyond original / low_freq_factor are divided by
    the factor, those below original / high_freq_factor kept, a smooth blend between."""
    factor = float(_required(params, "factor"))
    low, high = (
        float(params.get("low_freq_factor", 1.0)),
        float(params.get("high_freq_factor", 4.0)),
    )
    wavelength = 2 * math.pi / inv
    scaled = torch.where(wavelength > original / low, inv / factor, inv)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    band = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(band, blended, scaled)


def _yarn(
    params: Mapping[str, Any],
    base: float,
    dim: int,
    exponents: torch.Tensor,
    trained: int,
    original: int,
) -> Rotary:
    """YaRN: interpolated frequencies below a ramp, extrapolated above, and cos and sin
    scaled by the attention factor."""
    factor = float(params.get("factor") or trained / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction(fast), correction(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    frequencies = base**exponents
    inv = (1.0 / (factor * frequencies)) * (1 - extrapolated) + (1.0 / frequencies) * extrapolated
    return Rotary(inv, dim, float(attention))


def at_positions(tables: list[Table], positions: torch.Tensor) -> list[Table]:
    """Each rotary table's cos and sin at the rows' positions ([rows, its dims])."""
    return [(cos[positions], sin[positions]) for cos, sin in tables]


def rotate_store(
    qkv: torch.Tensor,
    table: Table | None,
    heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    writes: torch.Tensor,
    kernel: bool,
) -> torch.Tensor:
    """One layer's attention inputs from qkv [rows, (heads + 2 kv_heads) * dim]: q and k
    rotated by `table` (the rows' cos and sin; None: no rotary), k and v written to
    the layer's caches [kv_heads, slots, dim] at the rows' slots `writes` -> q [rows,
    heads, dim]. `kernel`: the triton kernel (fused.rotate_store), for a rotary over
    whole heads."""
    if table is not None and kernel:
        return fused.rotate_store(qkv, *table, heads, k_cache, v_cache, writes)
    if table is not None and table[0].shape[-1] == k_cache.shape[-1]:
        return fused.torch_rotate_store(qkv, *table, heads, k_cache, v_cache, writes)
    return _partial_rotate_store(qkv, table, heads, k_cache, v_cache, writes)


def _partial_rotate_store(
    qkv: torch.Tensor,
    table: Table | None,
    heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    writes: torch.Tensor,
) -> torch.Tensor:
    """rotate_store for a rotary over the first part of each head only (or none):
    the rest of q and k passes as it is."""
    rows, kv_heads, dim = qkv.shape[0], k_cache.shape[0], k_cache.shape[-1]
    qk = qkv[:, : (heads + kv_heads) * dim].reshape(rows, heads + kv_heads, dim)
    if table is not None:
        cos, sin = table
        turned = cos.shape[-1]
        rotated = fused.torch_rotate(qk[..., :turned], cos[:, None, :], sin[:, None, :])
        qk = torch.cat([rotated, qk[..., turned:]], dim=-1)
    k_cache[:, writes] = qk[:, heads:].transpose(0, 1)
    values = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    v_cache[:, writes] = values.transpose(0, 1)
    return qk[:, :heads]
