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

from adapters.engine.weights import (
    FORMATS,
    Projection,
    activation_dtype,
    output_format,
    projection,
)


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
    """The model's weights in one format (adapters/engine/weights.py), per-slot KV caches,
    and the forward passes.

    Two dtypes: products take and give the format's activation dtype (fp32 for
    fp32 weights, bf16 otherwise); everything between them (the residual stream,
    norms, rotary, attention, the KV cache) is the state dtype, fp32 on CPU.
    A bf16 residual stream lost precision over 30 layers for nothing: the
    elementwise work is small, and bf16 attention over strided cache slices
    copied them first (4x slower at one row here). On CUDA both are the model's
    dtype.
    """

    def __init__(self, model: Any, max_seqs: int, max_context: int, weights: str = "fp32") -> None:
        _check_supported(model)
        if weights not in FORMATS:
            raise ValueError(f"unknown weight format {weights!r}; one of {', '.join(FORMATS)}")
        config = model.config
        self.format = weights
        self.device = next(model.parameters()).device
        self.dtype = activation_dtype(weights)
        self.state_dtype = torch.float32 if self.device.type == "cpu" else self.dtype
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
        shape = (len(self.layers), max_seqs, self.kv_heads, max_context, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.state_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.state_dtype, device=self.device)
        self._slot_ids = torch.arange(max_seqs, device=self.device)
        self._q_size = self.heads * self.head_dim
        self._kv_size = self.kv_heads * self.head_dim

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step must read (each matrix once)."""
        total: int = self.lm_head.nbytes + _nbytes(self.final_norm)
        for layer in self.layers:
            total += _nbytes(layer.input_norm) + _nbytes(layer.post_norm)
            total += layer.qkv.nbytes + layer.o.nbytes + layer.gate_up.nbytes + layer.down.nbytes
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
        # Added to the scores: 0 up to a row's own position, -inf past it.
        past = (span[None, :] > positions[:, None]).view(rows, 1, 1, length)
        mask = torch.zeros(past.shape, dtype=self.state_dtype, device=self.device)
        mask = mask.masked_fill(past, float("-inf"))
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            k_cache[slots, :, positions] = k
            v_cache[slots, :, positions] = v
            if packed:  # rows are slots 0..rows-1 in order: a view, no copy
                keys, values = k_cache[:rows, :, :length], v_cache[:rows, :, :length]
            else:
                keys, values = k_cache[slots, :, :length], v_cache[slots, :, :length]
            attn = self._attend_one(q, keys, values, mask)
            x = x + layer.o(attn.view(rows, self._q_size).to(self.dtype))
            x = x + self._mlp(x, layer)
        return self._logits(x)

    @torch.inference_mode()
    def prefill(
        self, slot: int, start: int, tokens: torch.Tensor, every_position: bool = False
    ) -> torch.Tensor:
        """Put a chunk of one sequence's prompt in its cache -> logits of its last token
        (or [count, vocab], every position's, to score a text)."""
        count = tokens.shape[0]
        end = start + count
        x = self.embed[tokens]
        cos, sin = self.cos[start:end][:, None, :], self.sin[start:end][:, None, :]
        span = torch.arange(end, device=self.device)
        positions = torch.arange(start, end, device=self.device)
        mask = (span[None, :] <= positions[:, None])[None, None, :, :]
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(x, layer, cos, sin)
            k_cache, v_cache = self.k_cache[index], self.v_cache[index]
            k_cache[slot, :, start:end] = k.transpose(0, 1)
            v_cache[slot, :, start:end] = v.transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None],
                k_cache[slot : slot + 1, :, :end],
                v_cache[slot : slot + 1, :, :end],
                attn_mask=mask,
                enable_gqa=True,
                scale=1.0,  # the query weights carry 1/sqrt(head_dim)
            )
            attn = attn[0].transpose(0, 1).reshape(count, self._q_size).to(self.dtype)
            x = x + layer.o(attn)
            x = x + self._mlp(x, layer)
        return self._logits(x) if every_position else self._logits(x[-1:])[0]

    def _attend_one(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention for one new token per row: q [rows, heads, dim] (already scaled) over
        keys and values [rows, kv_heads, length, dim] -> [rows, heads, dim].

        Written out rather than through scaled_dot_product_attention: for a single
        query, torch's CPU flash kernel spent ~0.5 ms per call on fixed costs, 14 of
        a 23 ms step at 30 layers. Query heads that share a key head are stacked
        as rows of one product (grouped-query attention without copying keys);
        bmm reads the cache's strided slices in place.
        """
        rows, group, length = q.shape[0], self.heads // self.kv_heads, keys.shape[2]
        batch = rows * self.kv_heads
        queries = q.reshape(batch, group, self.head_dim)
        scores = torch.bmm(queries, keys.reshape(batch, length, self.head_dim).transpose(1, 2))
        scores = scores.view(rows, self.kv_heads, group, length) + mask
        weights = torch.softmax(scores, dim=-1).view(batch, group, length)
        out = torch.bmm(weights, values.reshape(batch, length, self.head_dim))
        return out.view(rows, self.heads, self.head_dim)

    def _qkv(
        self, x: torch.Tensor, layer: LayerWeights, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (rotated together, one pass) and v, [rows, heads or kv_heads, dim]."""
        rows = x.shape[0]
        fused = layer.qkv(_rms_norm(x, layer.input_norm, self.eps, self.dtype))
        fused = fused.to(self.state_dtype)
        qk = _rotate(
            fused[:, : self._q_size + self._kv_size].view(rows, -1, self.head_dim), cos, sin
        )
        v = fused[:, self._q_size + self._kv_size :].view(rows, self.kv_heads, self.head_dim)
        return qk[:, : self.heads], qk[:, self.heads :], v

    def _mlp(self, x: torch.Tensor, layer: LayerWeights) -> torch.Tensor:
        normed = _rms_norm(x, layer.post_norm, self.eps, self.dtype)
        gate, up = layer.gate_up(normed).chunk(2, dim=-1)
        return layer.down(F.silu(gate) * up)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(_rms_norm(x, self.final_norm, self.eps, self.dtype)).float()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype) -> torch.Tensor:
    """RMSNorm of the (fp32) residual stream, handed on in the products' dtype `out`."""
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight
    return normed.to(out)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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
