"""Granite 3: a Llama layer and four multipliers, each folded into the weights.

embedding_multiplier scales the embeddings, attention_multiplier replaces
1/sqrt(head_dim) as the attention scale, residual_multiplier scales each
sublayer's output before the residual add, and the logits are divided by
logits_scaling.
"""

from __future__ import annotations

from typing import Any

from adapters.engine.families.base import Family, dense_spec
from adapters.engine.families.llama import biases, tensors
from adapters.engine.spec import ModelSpec


def spec(config: Any, max_context: int) -> ModelSpec:
    attention, mlp = biases(config)
    return dense_spec(
        config,
        max_context,
        family="granite",
        scale=float(config.attention_multiplier),
        embed_scale=float(config.embedding_multiplier),
        residual_scale=float(config.residual_multiplier),
        logit_scale=1.0 / float(config.logits_scaling),
        qkv_bias=attention,
        o_bias=attention,
        mlp_bias=mlp,
    )


FAMILY = Family(
    name="granite",
    architectures=("GraniteForCausalLM",),
    model_types=("granite",),
    spec=spec,
    tensors=tensors,
)
