"""Gemma 2 and Gemma 3 (text; also the text half of a Gemma 3 image-text checkpoint).

Both: RMSNorm weights of 1 + w, norms before and after each sublayer, the
embedding scaled by sqrt(hidden), a tanh-approximated GELU gate, attention
scaled by query_pre_attn_scalar**-0.5, tied embeddings, and windowed layers
where layer_types says (Gemma 2 every other one, Gemma 3 five in six). Gemma 2
soft-caps attention scores and the final logits; Gemma 3 normalises each head
of q and k (1 + w as well) instead of capping scores, and gives its windowed
layers their own rotary base (rope_parameters per layer type).
"""

from __future__ import annotations

import math
from typing import Any

from adapters.engine.families.base import Family, activation, dense_spec, llama_names
from adapters.engine.spec import ModelSpec, TensorNames


def _text(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _common(config: Any) -> dict[str, Any]:
    return {
        "scale": float(config.query_pre_attn_scalar) ** -0.5,
        "act": activation(config, "hidden_activation"),
        "pre_norms": True,
        "post_norms": True,
        "norm_offset": 1.0,
        "embed_scale": math.sqrt(int(config.hidden_size)),
        "final_softcap": getattr(config, "final_logit_softcapping", None),
    }


def gemma2_spec(config: Any, max_context: int) -> ModelSpec:
    softcap = getattr(config, "attn_logit_softcapping", None)
    return dense_spec(config, max_context, family="gemma2", softcap=softcap, **_common(config))


def gemma3_spec(config: Any, max_context: int) -> ModelSpec:
    text = _text(config)
    spec = dense_spec(
        text, max_context, family="gemma3", qk_norm="head", rotaries_by_type=True, **_common(text)
    )
    architectures = getattr(config, "architectures", None)
    if architectures:  # an image-text checkpoint's config names the whole model
        from dataclasses import replace

        spec = replace(spec, architecture=architectures[0])
    return spec


def gemma2_tensors(config: Any) -> TensorNames:
    return llama_names(config, gemma_norms=True)


def gemma3_tensors(config: Any) -> TensorNames:
    text = _text(config)
    if text is config:
        return llama_names(config, gemma_norms=True, qk_norm=True)
    # Gemma3ForConditionalGeneration: the language model under model.language_model.
    names = llama_names(text, "model.language_model.", gemma_norms=True, qk_norm=True)
    tied = bool(getattr(config, "tie_word_embeddings", True))
    from dataclasses import replace

    return replace(names, lm_head=None if tied else "lm_head.weight")


GEMMA2 = Family(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    spec=gemma2_spec,
    tensors=gemma2_tensors,
)

GEMMA3 = Family(
    name="gemma3",
    architectures=("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
    model_types=("gemma3_text", "gemma3"),
    spec=gemma3_spec,
    tensors=gemma3_tensors,
)
