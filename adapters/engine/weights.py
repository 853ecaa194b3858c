"""Weight formats for the engine's matrix products: y = x @ W.T, with W kept four ways.

- fp32: as loaded (the GGUF's dequantized values); activations fp32.
- bf16: W and activations in bfloat16: half the bytes; fast where the CPU has
  bf16 dot products (AVX-512 BF16, AMX), slow where it emulates them. What a
  GPU serves.
- fp16: the same in float16, for GPUs without bf16 (before NVIDIA's Ampere);
  never a CPU's choice (choose.py measures the others there).
- int8: weight-only, per output channel (W = q * scale, q in [-128, 127]),
  activations bf16, torch's `_weight_int8pack_mm` kernel: a quarter of fp32's
  bytes, and nothing about the activations is quantized.
- int4: weight-only, group-wise asymmetric along the input dimension
  (W = (q - 8) * scale + zero per group of 32 inputs, q in [0, 15]), packed for
  torch's `_weight_int4pack_mm_for_cpu`: an eighth of fp32's bytes. A group of
  32 with a scale and an offset is what a Q4_1 GGUF block is, so the default
  model's 4-bit weights come back nearly as they were shipped. The output
  projection (lm_head, the largest matrix) stays int8 in this format: GGUF
  files keep it at 8 bits (the default model's is Q8_0), and at 4 bits it
  alone cost the default model 8% perplexity.
- w4a16: the same 4-bit groups (fp16 scale and minimum: exactly a Q4_1 block), but
  each product turns its fp32 activations into 16-bit integers per group of 32 (two
  bytes each) and multiplies integers (AVX-512 VNNI or AVX2), in our own C kernels
  (adapters/engine/native.c, compiled at first use); the output projection is 8-bit
  per group of 32 (a Q8_0 block, as the default model ships it). On a GGUF file
  the kernels take the file's own blocks instead (Q4_K, Q6_K, Q5_K, Q8_0, Q4_0,
  Q4_1, F16, BF16: adapters/engine/ggml_blocks.py), each tensor as shipped, with no
  fp32 copy and no requantisation; other types are requantised, and the start log
  says which. A decode step in this format is one call into C (the fused pass,
  with an fp16 KV cache): no per-operation dispatch from Python.
- w4a8: w4a16's weights, kernels and fused pass, with every product's activations
  quantized to one signed byte per input (per row, per group of 32, at a step of
  the group's largest magnitude / 127), so each weight costs one integer product
  instead of two: about half the work where the product is compute-bound (many
  rows, prompts; AVX2 without VNNI most of all). A row's bytes are the same alone
  or in any batch, so batch invariance and prefill = decode hold as for w4a16; only
  the rounding of the activations differs, which the quality gate judges.

Which format a CPU should use is measured, not assumed (adapters/engine/choose.py):
what its kernels run at and whether the format passes the quality gate
(adapters/engine/quality.py). On CUDA the engine runs bf16 (int8 and int4
here are CPU kernels).
"""

from __future__ import annotations

from typing import Protocol

import torch

FORMATS = ("fp32", "bf16", "fp16", "int8", "int4", "w4a16", "w4a8")
DENSE = ("fp32", "bf16", "fp16")  # W kept as it is, in the activations' dtype
QUANTIZED = ("int8", "int4", "w4a16", "w4a8")
NATIVE = ("w4a16", "w4a8")  # native.c's kernels and fused step
INT4_GROUP = 32


class Projection(Protocol):
    nbytes: int  # bytes a product reads of the weight (scales included)

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


def activation_dtype(fmt: str) -> torch.dtype:
    """The dtype of everything between products: fp32 for fp32 weights and for w4a16 (whose
    products quantize fp32 activations themselves), fp16 for fp16, bf16 otherwise."""
    if fmt == "fp16":
        return torch.float16
    return torch.float32 if fmt in ("fp32", *NATIVE) else torch.bfloat16


def act_bytes(fmt: str) -> int:
    """The bytes of each activation a native format's products multiply: 2 or 1."""
    return 1 if fmt in ("w4a8", "w8a8") else 2


def output_format(fmt: str) -> str:
    """The format of the output projection (lm_head) when the layers are in `fmt`."""
    return {"int4": "int8", "w4a16": "w8a16", "w4a8": "w8a8"}.get(fmt, fmt)


def projection(weight: torch.Tensor, fmt: str) -> Projection:
    """The weight [out, in] in format `fmt`."""
    if fmt in DENSE:
        return Dense(weight.to(activation_dtype(fmt)).contiguous())
    if weight.device.type != "cpu":
        raise ValueError(
            f"{fmt} weights are a CPU format; use bf16 or fp16 on {weight.device.type}"
        )
    if fmt == "int8":
        return Int8(weight)
    if fmt == "int4":
        return Int4(weight)
    if fmt in (*NATIVE, "w8a16", "w8a8"):  # w8a*: only as a native format's output projection
        from adapters.engine.native import NativeProduct

        return NativeProduct(weight, 4 if fmt in NATIVE else 8, act_bytes=act_bytes(fmt))
    raise ValueError(f"unknown weight format {fmt!r}; one of {', '.join(FORMATS)}")


class Dense:
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T


class Int8:
    """Per output channel: the largest magnitude in a row maps to 127."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        self.weight = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
        self.scales = scales.to(torch.bfloat16)
        self.nbytes = self.weight.numel() + self.scales.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int8pack_mm(x, self.weight, self.scales)
        return out


class Int4:
    """Group-wise asymmetric 4-bit along the input dimension, groups of INT4_GROUP."""

    def __init__(self, weight: torch.Tensor, group: int = INT4_GROUP) -> None:
        out_features, in_features = weight.shape
        if in_features % group:
            raise ValueError(f"int4 needs the input size ({in_features}) divisible by {group}")
        groups = weight.float().reshape(out_features, in_features // group, group)
        low = groups.amin(dim=-1, keepdim=True)
        high = groups.amax(dim=-1, keepdim=True)
        scale = ((high - low) / 15.0).clamp(min=1e-12)
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32)
        zero = low + 8.0 * scale  # the kernel computes (q - 8) * scale + zero
        # [groups, out, 2]: the layout the kernel reads.
        pairs = torch.cat([scale, zero], dim=-1).transpose(0, 1).contiguous()
        self.scales_and_zeros = pairs.to(torch.bfloat16)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.reshape(out_features, in_features), 2
        )
        self.group = group
        self.nbytes = out_features * in_features // 2 + self.scales_and_zeros.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group, self.scales_and_zeros
        )
        return out
