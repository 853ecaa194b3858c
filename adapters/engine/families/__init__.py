"""The model families the engine serves, registered by the architecture names they serve.

A family is one small module: a `FAMILY` that names the Hugging Face
architectures (config.architectures) and model types it covers, reads a
config into a ModelSpec (adapters/engine/spec.py: what each layer computes) and
says where each tensor sits in a checkpoint (TensorNames). What the families
share (reading rope parameters, layer types, the usual tensor names) is in
base.py. Adding a family is a module here and a line in FAMILIES; the tests
parametrised over the registry then check it like every other.

A config no family serves is refused from config.json alone, before a weight
is read, naming the field and what is supported.
"""

from __future__ import annotations

from typing import Any

from adapters.engine.families import gemma, granite, llama, moe, olmo2, phi3, qwen
from adapters.engine.families.base import Family, UnsupportedModel

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    llama.MISTRAL,
    qwen.QWEN2,
    qwen.QWEN3,
    gemma.GEMMA2,
    gemma.GEMMA3,
    phi3.FAMILY,
    granite.FAMILY,
    olmo2.FAMILY,
    moe.QWEN3_MOE,
    moe.QWEN2_MOE,
    moe.MIXTRAL,
)

__all__ = ["FAMILIES", "Family", "UnsupportedModel", "family_for", "supported_model_types"]


def supported_model_types() -> list[str]:
    return sorted({t for family in FAMILIES for t in family.model_types})


def family_for(config: Any) -> Family:
    """The family serving this config: by its architecture names, else its model type.
    Raises UnsupportedModel naming the field and what is supported."""
    architectures = list(getattr(config, "architectures", None) or [])
    for name in architectures:
        for family in FAMILIES:
            if name in family.architectures:
                return family
    model_type = getattr(config, "model_type", None)
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    supported = ", ".join(supported_model_types())
    if architectures and model_type is None:
        raise UnsupportedModel(
            f"architecture {architectures[0]!r} is not supported (supported model types: "
            f"{supported})"
        )
    raise UnsupportedModel(f"model_type {model_type!r} is not supported (supported: {supported})")
