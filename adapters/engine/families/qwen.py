"""Qwen2 / 2.5 (biases on q, k and v) and Qwen3 (per-head q and k norms).

Qwen2's q, k and v carry biases whatever the config says (o does not). Qwen3
normalises each head of q and k (an RMSNorm over head_dim) before rotary, and
its `attention_bias` covers o too. A window applies to the layers the config's
layer_types mark (from use_sliding_window and max_window_layers).
"""

from __future__ import annotations

from typing import Any

from adapters.engine.families.base import Family, dense_spec, llama_names
from adapters.engine.spec import ModelSpec, TensorNames


def qwen2_spec(config: Any, max_context: int) -> ModelSpec:
    return dense_spec(config, max_context, family="qwen2", qkv_bias=True)


def qwen2_tensors(config: Any) -> TensorNames:
    return llama_names(config, qkv_bias=True)


def qwen3_spec(config: Any, max_context: int) -> ModelSpec:
    bias = bool(getattr(config, "attention_bias", False))
    return dense_spec(
        config, max_context, family="qwen3", qk_norm="head", qkv_bias=bias, o_bias=bias
    )


def qwen3_tensors(config: Any) -> TensorNames:
    bias = bool(getattr(config, "attention_bias", False))
    return llama_names(config, qk_norm=True, qkv_bias=bias, o_bias=bias)


QWEN2 = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    spec=qwen2_spec,
    tensors=qwen2_tensors,
)

QWEN3 = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    spec=qwen3_spec,
    tensors=qwen3_tensors,
)
