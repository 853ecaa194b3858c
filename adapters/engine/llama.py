"""A batched Llama forward pass over per-slot KV caches, using a transformers model's weights.

transformers loads the model (from GGUF or an HF directory) and we read its
weights; the forward pass is our own so that one call can decode a batch of
sequences that sit at different positions, each with its own cache slot. The
cache is one preallocated tensor per layer, [slots, kv_heads, max_context,
head_dim]: a sequence owns one slot from admission to its end, writes its keys
and values at its own positions, and attends over its own prefix only (a mask
from per-row lengths). Nothing is copied when sequences join or leave.

Supported: the Llama family as transformers implements it (LlamaForCausalLM:
RMSNorm, rotary embeddings without scaling, grouped-query attention, SiLU-gated
MLP, no biases), which covers SmolLM2. Anything else is refused with a clear
error at start.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F


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


class LlamaRunner:
    def __init__(self, model: Any, max_seqs: int, max_context: int, weights: str = "float") -> None:
        _check_supported(model)
        if weights not in ("float", "int8"):
            raise ValueError("weights must be 'float' or 'int8'")
        if weights == "int8" and next(model.parameters()).device.type != "cpu":
            raise ValueError("int8 weights are a CPU option (fbgemm/x86 kernels)")
        int8 = weights == "int8"
        config = model.config
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(
            getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        )
        self.eps = float(config.rms_norm_eps)
        self.vocab_size = int(config.vocab_size)
        self.max_context = max_context
        with torch.no_grad():
            self.embed = model.model.embed_tokens.weight.detach()
            self.final_norm = model.model.norm.weight.detach()
            self.lm_head = Projection(model.lm_head.weight.detach(), int8)
            self.layers: list[LayerWeights] = []
            for layer in model.model.layers:
                attn, mlp = layer.self_attn, layer.mlp
                qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
                gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
                self.layers.append(
                    LayerWeights(
                        input_norm=layer.input_layernorm.weight.detach(),
                        qkv=Projection(qkv.detach().contiguous(), int8),
                        o=Projection(attn.o_proj.weight.detach(), int8),
                        post_norm=layer.post_attention_layernorm.weight.detach(),
                        gate_up=Projection(gate_up.detach().contiguous(), int8),
                        down=Projection(mlp.down_proj.weight.detach(), int8),
                    )
                )
        half = self.head_dim // 2
        inv_freq = 1.0 / (
            _rope_theta(config)
            ** (torch.arange(0, half, dtype=torch.float32, device=self.device) / half)
        )
        angles = torch.outer(
            torch.arange(max_context, dtype=torch.float32, device=self.device), inv_freq
        )
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(self.dtype)
        self.sin = angles.sin().to(self.dtype)
        shape = (len(self.layers), max_seqs, self.kv_heads, max_context, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self._slot_ids = torch.arange(max_seqs, device=self.device)
        self._q_size = self.heads * self.head_dim
        self._kv_size = self.kv_heads * self.head_dim

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step must read (each matrix once)."""
        total: int = self.lm_head.nbytes + self.final_norm.numel() * self.final_norm.element_size()
        for layer in self.layers:
            for part in layer:
                total += part.nbytes if isinstance(part, Projection) else part.numel() * 4
        return total

    @torch.inference_mode()
    def decode(
        self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """One token for each row (slot, position, token) -> logits [rows, vocab]."""
        rows = tokens.shape[0]
        packed = bool(torch.equal(slots, self._slot_ids[:rows]))
        x = self.embed[tokens]
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        length = int(positions.max()) + 1
        span = torch.arange(length, device=self.device)
        mask = (span[None, :] <= positions[:, None])[:, None, None, :]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer)
            q = q.view(rows, self.heads, self.head_dim)
            k = k.view(rows, self.kv_heads, self.head_dim)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            k_cache[slots, :, positions] = k
            v_cache[slots, :, positions] = v.view(rows, self.kv_heads, self.head_dim)
            if packed:  # rows are slots 0..rows-1 in order: a view, no copy
                keys, values = k_cache[:rows, :, :length], v_cache[:rows, :, :length]
            else:
                keys, values = k_cache[slots, :, :length], v_cache[slots, :, :length]
            attn = F.scaled_dot_product_attention(
                q[:, :, None, :], keys, values, attn_mask=mask, enable_gqa=True
            )
            x = x + layer.o(attn.reshape(rows, self._q_size))
            x = x + self._mlp(x, layer)
        return self._logits(x)

    @torch.inference_mode()
    def prefill(self, slot: int, start: int, tokens: torch.Tensor) -> torch.Tensor:
        """Put a chunk of one sequence's prompt in its cache -> logits of its last token."""
        count = tokens.shape[0]
        end = start + count
        x = self.embed[tokens]
        cos, sin = self.cos[start:end][:, None, :], self.sin[start:end][:, None, :]
        span = torch.arange(end, device=self.device)
        positions = torch.arange(start, end, device=self.device)
        mask = (span[None, :] <= positions[:, None])[None, None, :, :]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer)
            q = _rotate(q.view(count, self.heads, self.head_dim), cos, sin)
            k = _rotate(k.view(count, self.kv_heads, self.head_dim), cos, sin)
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            k_cache[slot, :, start:end] = k.transpose(0, 1)
            v_cache[slot, :, start:end] = v.view(count, self.kv_heads, self.head_dim).transpose(
                0, 1
            )
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k_cache[slot : slot + 1, :, :end],
                v_cache[slot : slot + 1, :, :end],
                attn_mask=mask,
                enable_gqa=True,
            )
            x = x + layer.o(attn[0].transpose(0, 1).reshape(count, self._q_size))
            x = x + self._mlp(x, layer)
        return self._logits(x[-1:])[0]

    def _qkv(
        self, x: torch.Tensor, layer: LayerWeights
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fused = layer.qkv(_rms_norm(x, layer.input_norm, self.eps))
        q = fused[..., : self._q_size]
        k = fused[..., self._q_size : self._q_size + self._kv_size]
        return q, k, fused[..., self._q_size + self._kv_size :]

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        gate, up = layer.gate_up(_rms_norm(x, layer.post_norm, self.eps)).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(_rms_norm(x, self.final_norm, self.eps)).float()


class Projection:
    """y = x @ W.T, with W kept as given or as int8 per output channel.

    int8 uses dynamic quantization (activations quantized per call) with
    fbgemm's x86 kernels: a quarter of the weight bytes and 2-3.5x faster
    matrix products on this CPU, at some cost in accuracy (see engine.md).
    """

    def __init__(self, weight: torch.Tensor, int8: bool) -> None:
        self.weight: torch.Tensor | None = None
        self.packed: Any = None
        if int8:
            scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-8).float()
            zeros = torch.zeros(weight.shape[0], dtype=torch.long)
            quantized = torch.quantize_per_channel(weight.float(), scales, zeros, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)
            self.nbytes: int = weight.numel() + weight.shape[0] * 4
        else:
            self.weight = weight
            self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            result: torch.Tensor = x @ self.weight.T
            return result
        # reduce_range: 7-bit activations, or the x86 kernels' 16-bit sums saturate.
        out: torch.Tensor = torch.ops.quantized.linear_dynamic(x, self.packed, True)
        return out


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    as_float = x.float()
    normed = as_float * torch.rsqrt(as_float.pow(2).mean(-1, keepdim=True) + eps)
    result: torch.Tensor = weight * normed.to(x.dtype)
    return result


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
