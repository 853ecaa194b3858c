"""Phi-3, 3.5 and 4 (mini): q, k and v in one matrix, gate and up in one, partial rotary.

qkv_proj holds q's rows, then k's, then v's; gate_up_proj the gate's half first.
rope_parameters may rotate only part of each head (partial_rotary_factor, as in
Phi-4-mini) and use longrope (layers/rotary.py says how its short and long factors are
chosen; Phi3Config puts its top-level original_max_position_embeddings there).
A sliding_window, when set, windows every layer.
"""

from __future__ import annotations

from typing import Any

from adapters.engine.families.base import Family, dense_spec, llama_names
from adapters.engine.spec import ModelSpec, TensorNames


def spec(config: Any, max_context: int) -> ModelSpec:
    windowed = getattr(config, "sliding_window", None) is not None
    types = ["sliding_attention" if windowed else "full_attention"] * int(config.num_hidden_layers)
    return dense_spec(config, max_context, family="phi3", types=types)


def tensors(config: Any) -> TensorNames:
    return llama_names(config, fused=True)


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    spec=spec,
    tensors=tensors,
)
