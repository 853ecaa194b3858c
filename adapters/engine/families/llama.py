"""Llama 1/2/3/3.1/3.2/3.3 (any rope kind, tied or not), SmolLM3, Mistral and Ministral.

The Llama layer is the plain one of spec.py; `attention_bias` puts biases on
q, k, v and o, `mlp_bias` on the MLP. SmolLM3 leaves rotary out of every
fourth layer (`no_rope_layers`). Mistral's layers are Llama's, every one of
them windowed when the config has a sliding_window; Ministral says per layer
(`layer_types`).
"""

from __future__ import annotations

from typing import Any

from adapters.engine.families.base import Family, dense_spec, layer_types, llama_names
from adapters.engine.spec import ModelSpec, TensorNames


def biases(config: Any) -> tuple[bool, bool]:
    """(q, k, v and o have biases, the MLP has)."""
    return bool(getattr(config, "attention_bias", False)), bool(getattr(config, "mlp_bias", False))


def spec(config: Any, max_context: int) -> ModelSpec:
    attention, mlp = biases(config)
    rotary_layers = None
    if getattr(config, "model_type", None) == "smollm3":
        rotary_layers = [bool(flag) for flag in config.no_rope_layers]
    return dense_spec(
        config,
        max_context,
        family="llama",
        rotary_layers=rotary_layers,
        qkv_bias=attention,
        o_bias=attention,
        mlp_bias=mlp,
    )


def tensors(config: Any) -> TensorNames:
    attention, mlp = biases(config)
    return llama_names(config, qkv_bias=attention, o_bias=attention, mlp_bias=mlp)


def mistral_spec(config: Any, max_context: int) -> ModelSpec:
    if getattr(config, "layer_types", None):
        types = layer_types(config)
    else:  # Mistral: every layer windowed when there is a window
        windowed = getattr(config, "sliding_window", None) is not None
        types = ["sliding_attention" if windowed else "full_attention"] * int(
            config.num_hidden_layers
        )
    return dense_spec(config, max_context, family="mistral", types=types)


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM", "SmolLM3ForCausalLM"),
    model_types=("llama", "smollm3"),
    spec=spec,
    tensors=tensors,
)

MISTRAL = Family(
    name="mistral",
    architectures=("MistralForCausalLM", "MinistralForCausalLM"),
    model_types=("mistral", "ministral"),
    spec=mistral_spec,
    tensors=llama_names,
)
