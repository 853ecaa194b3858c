"""OLMo 2: norms on the sublayers' outputs only, and q and k normalised whole.

Each layer adds post_attention_layernorm(attention(x)) and then
post_feedforward_layernorm(mlp(x)) to the residual stream, with no norm before
either; q and k are RMSNorm-ed over their whole projection (all heads at once)
before rotary. attention_bias covers q, k, v and o.
"""

from __future__ import annotations

from typing import Any

from adapters.engine.families.base import Family, dense_spec, llama_names
from adapters.engine.spec import ModelSpec, TensorNames


def spec(config: Any, max_context: int) -> ModelSpec:
    bias = bool(getattr(config, "attention_bias", False))
    return dense_spec(
        config,
        max_context,
        family="olmo2",
        qk_norm="width",
        qkv_bias=bias,
        o_bias=bias,
        pre_norms=False,
        post_norms=True,
    )


def tensors(config: Any) -> TensorNames:
    bias = bool(getattr(config, "attention_bias", False))
    return llama_names(
        config, qk_norm=True, qkv_bias=bias, o_bias=bias, pre_norms=False, post_norms=True
    )


FAMILY = Family(
    name="olmo2",
    architectures=("Olmo2ForCausalLM",),
    model_types=("olmo2",),
    spec=spec,
    tensors=tensors,
)
