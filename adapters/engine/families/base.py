"""What the families share: the Family record, and reading the common config fields.

Most families are a Llama layer with a few switches (biases, q/k norms, norms
after the sublayers, windows, caps), and the usual tensor names; `dense_spec`
and `llama_names` build those from a config and the switches a family sets, so
a family's module says only what is its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapters.engine.errors import ModelError
from adapters.engine.layers.rotary import RopeError, Rotary, rotary
from adapters.engine.spec import (
    Activation,
    Attention,
    Layer,
    LayerTensors,
    Mlp,
    ModelSpec,
    QkNorm,
    TensorNames,
)


class UnsupportedModel(ModelError):
    """A model this engine cannot serve; the message names the field and what is supported."""


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # config.architectures values it serves
    model_types: tuple[str, ...]  # config.model_type values it serves
    spec: Callable[[Any, int], ModelSpec]  # (config, the context it will serve)
    tensors: Callable[[Any], TensorNames]


ACTIVATIONS: dict[str, Activation] = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_tanh": "gelu_tanh",
}


def head_dim(config: Any) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def kv_heads(config: Any) -> int:
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def activation(config: Any, field: str = "hidden_act") -> Activation:
    name = getattr(config, field, None) or "silu"
    if name not in ACTIVATIONS:
        raise UnsupportedModel(
            f"{field} {name!r} is not supported (supported: {', '.join(sorted(ACTIVATIONS))})"
        )
    return ACTIVATIONS[name]


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """One rope_parameters entry (the layer type's, where the config has one per type),
    with the older top-level fields as fallbacks."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    elif params and all(isinstance(v, dict) for v in params.values()):
        params = next(iter(params.values()))
    found = dict(params)
    scaling = getattr(config, "rope_scaling", None)
    if not found and isinstance(scaling, dict):
        found = dict(scaling)
    found.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    if "partial_rotary_factor" not in found and getattr(config, "partial_rotary_factor", None):
        found["partial_rotary_factor"] = config.partial_rotary_factor
    return found


def layer_types(config: Any) -> list[str]:
    layers = int(config.num_hidden_layers)
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    if len(types) != layers:
        raise UnsupportedModel(f"layer_types has {len(types)} entries for {layers} layers")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise UnsupportedModel(
            f"layer_types {unknown[0]!r} is not supported (supported: full_attention, "
            "sliding_attention)"
        )
    return types


def window(config: Any, layer_type: str, max_context: int) -> int | None:
    """The layer's attention window, or None when it has none or none that binds."""
    size = getattr(config, "sliding_window", None)
    if layer_type != "sliding_attention" or size is None or int(size) >= max_context:
        return None
    return int(size)


def rotary_of(config: Any, params: dict[str, Any], dim: int, max_context: int) -> Rotary:
    trained = int(getattr(config, "max_position_embeddings", max_context))
    try:
        return rotary(params, dim, max_context, trained)
    except RopeError as error:
        raise UnsupportedModel(str(error)) from error


def dense_spec(
    config: Any,
    max_context: int,
    *,
    family: str,
    types: list[str] | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    qk_norm: QkNorm | None = None,
    qkv_bias: bool = False,
    o_bias: bool = False,
    mlp_bias: bool = False,
    act: Activation | None = None,
    pre_norms: bool = True,
    post_norms: bool = False,
    rotaries_by_type: bool = False,
    rotary_layers: list[bool] | None = None,
    **model: Any,
) -> ModelSpec:
    """A ModelSpec for a Llama-shaped config with the given switches: every layer the
    same but for its type (full or sliding attention, and with `rotaries_by_type` the
    rotary table of its type) and, where `rotary_layers` says False, no rotary."""
    types = types if types is not None else layer_types(config)
    dim = head_dim(config)
    kinds: list[str | None] = [*sorted(set(types))] if rotaries_by_type else [None]
    rotaries = tuple(
        rotary_of(config, rope_parameters(config, kind), dim, max_context) for kind in kinds
    )
    mlp = Mlp(int(config.intermediate_size), act or activation(config), mlp_bias)
    layers = []
    for index, kind in enumerate(types):
        uses_rotary = rotary_layers is None or rotary_layers[index]
        table = kinds.index(kind) if rotaries_by_type else 0
        attention = Attention(
            heads=int(config.num_attention_heads),
            kv_heads=kv_heads(config),
            head_dim=dim,
            scale=dim**-0.5 if scale is None else scale,
            rotary=table if uses_rotary else None,
            window=window(config, kind, max_context),
            softcap=softcap,
            qk_norm=qk_norm,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
        )
        layers.append(Layer(attention, mlp, pre_norms, post_norms, pre_norms, post_norms))
    architecture = (getattr(config, "architectures", None) or [family])[0]
    notes = tuple(r.note for r in rotaries if r.note)
    return ModelSpec(
        family=family,
        architecture=architecture,
        hidden=int(config.hidden_size),
        vocab=int(config.vocab_size),
        eps=float(getattr(config, "rms_norm_eps", None) or 1e-6),
        layers=tuple(layers),
        rotaries=rotaries,
        trained_context=int(getattr(config, "max_position_embeddings", max_context)),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        notes=notes,
        **model,
    )


def llama_names(
    config: Any,
    prefix: str = "model.",
    *,
    qkv_bias: bool = False,
    o_bias: bool = False,
    mlp_bias: bool = False,
    qk_norm: bool = False,
    fused: bool = False,
    pre_norms: bool = True,
    post_norms: bool = False,
    gemma_norms: bool = False,
) -> TensorNames:
    """The usual Hugging Face tensor names: `{prefix}layers.{i}.self_attn.q_proj.weight`
    and so on; `fused` for Phi-3's qkv_proj and gate_up_proj; `gemma_norms` for the
    four norms of Gemma 2/3 (their pre-MLP norm is pre_feedforward_layernorm)."""
    layers = []
    for i in range(int(config.num_hidden_layers)):
        at = f"{prefix}layers.{i}."
        attn, mlp = f"{at}self_attn.", f"{at}mlp."
        parts = ("q_proj", "k_proj", "v_proj")
        qkv = (f"{attn}qkv_proj.weight",) if fused else tuple(f"{attn}{p}.weight" for p in parts)
        gate_up = (
            (f"{mlp}gate_up_proj.weight",)
            if fused
            else (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight")
        )
        norms: dict[str, Any]
        if gemma_norms:
            norms = dict(
                pre_attention=f"{at}input_layernorm.weight",
                post_attention=f"{at}post_attention_layernorm.weight",
                pre_mlp=f"{at}pre_feedforward_layernorm.weight",
                post_mlp=f"{at}post_feedforward_layernorm.weight",
            )
        elif post_norms and not pre_norms:  # OLMo 2
            norms = dict(
                post_attention=f"{at}post_attention_layernorm.weight",
                post_mlp=f"{at}post_feedforward_layernorm.weight",
            )
        else:
            norms = dict(
                pre_attention=f"{at}input_layernorm.weight",
                pre_mlp=f"{at}post_attention_layernorm.weight",
            )
        layers.append(
            LayerTensors(
                qkv=qkv,
                o=f"{attn}o_proj.weight",
                gate_up=gate_up,
                down=f"{mlp}down_proj.weight",
                qkv_bias=tuple(f"{attn}{p}.bias" for p in parts) if qkv_bias else None,
                o_bias=f"{attn}o_proj.bias" if o_bias else None,
                gate_up_bias=(f"{mlp}gate_proj.bias", f"{mlp}up_proj.bias") if mlp_bias else None,
                down_bias=f"{mlp}down_proj.bias" if mlp_bias else None,
                q_norm=f"{attn}q_norm.weight" if qk_norm else None,
                k_norm=f"{attn}k_norm.weight" if qk_norm else None,
                **norms,
            )
        )
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return TensorNames(
        embed=f"{prefix}embed_tokens.weight",
        final_norm=f"{prefix}norm.weight",
        lm_head=None if tied else "lm_head.weight",
        layers=tuple(layers),
    )
