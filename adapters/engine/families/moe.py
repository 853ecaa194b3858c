"""Mixtures of experts: Qwen3-MoE, Qwen2-MoE (with its shared expert) and Mixtral.

Each is its dense family's attention (Qwen3's per-head q/k norms, Qwen2's q/k/v
biases, Mistral's window) with the MLP of its sparse layers replaced by a
mixture (spec.Experts): softmax over the router's logits, the top k, and for
Mixtral and configs with norm_topk_prob those k divided by their sum.
Qwen2-MoE adds a shared expert every row runs, scaled by a sigmoid gate.

Which layers are sparse: every `decoder_sparse_step`-th one not listed in
`mlp_only_layers` (the Qwen configs; the others are dense MLPs of
intermediate_size); in Mixtral, all. The tensors are named as Hugging Face
saves them, one per expert (`mlp.experts.3.gate_proj.weight`; Mixtral's
`block_sparse_moe.experts.3.w1.weight`), and checkpoint.expert_matrix also finds
them stacked over the experts, as GGUF files keep them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from adapters.engine.families.base import Family, UnsupportedModel, dense_spec, llama_names
from adapters.engine.spec import Experts, ExpertTensors, Mlp, ModelSpec, TensorNames


def sparse_layers(config: Any) -> list[bool]:
    """Which layers are mixtures (the Qwen rule; a config without it: all)."""
    layers = int(config.num_hidden_layers)
    step = int(getattr(config, "decoder_sparse_step", None) or 1)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return [i not in dense and (i + 1) % step == 0 for i in range(layers)]


def _mixture(config: Any, base: ModelSpec, experts: Experts, shared: int | None) -> ModelSpec:
    """`base` (a dense spec of the config) with its sparse layers' MLPs a mixture; a
    shared expert `shared` wide beside it where given."""
    if experts.count < 1 or not 0 < experts.top_k <= experts.count:
        raise UnsupportedModel(
            f"{experts.top_k} experts a token of {experts.count}: not a mixture this engine runs"
        )
    layers = []
    for layer, sparse in zip(base.layers, sparse_layers(config), strict=True):
        if sparse:
            assert layer.mlp is not None
            mlp = None if shared is None else Mlp(shared, layer.mlp.activation)
            layer = replace(layer, mlp=mlp, experts=experts)
        layers.append(layer)
    return replace(base, layers=tuple(layers))


def _experts(config: Any, count: str, renormalise: bool, **more: Any) -> Experts:
    width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    return Experts(
        count=int(getattr(config, count)),
        top_k=int(config.num_experts_per_tok),
        intermediate=int(width),
        renormalise=renormalise,
        **more,
    )


def _names(config: Any, base: TensorNames, block: str, kinds: tuple[str, str, str],
           shared: bool) -> TensorNames:  # fmt: skip
    """`base` (llama_names of the config) with each sparse layer's experts; its MLP
    names become the shared expert's (or stay unused where there is none)."""
    layers = []
    for i, (where, sparse) in enumerate(zip(base.layers, sparse_layers(config), strict=True)):
        if sparse:
            at, mlp = f"model.layers.{i}.{block}.", f"model.layers.{i}.mlp."
            gate, up, down = (f"{at}experts.{{e}}.{kind}.weight" for kind in kinds)
            experts = ExpertTensors(
                router=(f"{at}gate.weight", f"{mlp}gate.weight"),
                per_expert=(gate, up, down),
                stacked=(
                    f"{mlp}experts.gate_proj.weight",
                    f"{mlp}experts.up_proj.weight",
                    f"{mlp}experts.down_proj.weight",
                ),
                fused=(f"{mlp}experts.gate_up_proj", f"{mlp}experts.down_proj"),
                shared_gate=f"{mlp}shared_expert_gate.weight" if shared else None,
            )
            shared_mlp = f"{mlp}shared_expert."
            where = replace(
                where,
                experts=experts,
                gate_up=(f"{shared_mlp}gate_proj.weight", f"{shared_mlp}up_proj.weight"),
                down=f"{shared_mlp}down_proj.weight",
            )
        layers.append(where)
    return replace(base, layers=tuple(layers))


QWEN_KINDS = ("gate_proj", "up_proj", "down_proj")


def qwen3_moe_spec(config: Any, max_context: int) -> ModelSpec:
    bias = bool(getattr(config, "attention_bias", False))
    base = dense_spec(
        config, max_context, family="qwen3_moe", qk_norm="head", qkv_bias=bias, o_bias=bias
    )
    experts = _experts(config, "num_experts", bool(getattr(config, "norm_topk_prob", False)))
    return _mixture(config, base, experts, None)


def qwen3_moe_tensors(config: Any) -> TensorNames:
    bias = bool(getattr(config, "attention_bias", False))
    base = llama_names(config, qk_norm=True, qkv_bias=bias, o_bias=bias)
    return _names(config, base, "mlp", QWEN_KINDS, shared=False)


def qwen2_moe_spec(config: Any, max_context: int) -> ModelSpec:
    base = dense_spec(config, max_context, family="qwen2_moe", qkv_bias=True)
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    experts = _experts(
        config, "num_experts", bool(getattr(config, "norm_topk_prob", False)),
        shared_gate=shared > 0,
    )  # fmt: skip
    return _mixture(config, base, experts, shared or None)


def qwen2_moe_tensors(config: Any) -> TensorNames:
    shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0) > 0
    return _names(config, llama_names(config, qkv_bias=True), "mlp", QWEN_KINDS, shared)


def mixtral_spec(config: Any, max_context: int) -> ModelSpec:
    windowed = getattr(config, "sliding_window", None) is not None
    types = ["sliding_attention" if windowed else "full_attention"]
    base = dense_spec(
        config, max_context, family="mixtral", types=types * int(config.num_hidden_layers)
    )
    return _mixture(config, base, _experts(config, "num_local_experts", True), None)


def mixtral_tensors(config: Any) -> TensorNames:
    return _names(config, llama_names(config), "block_sparse_moe", ("w1", "w3", "w2"), False)


QWEN3_MOE = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    spec=qwen3_moe_spec,
    tensors=qwen3_moe_tensors,
)

QWEN2_MOE = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    spec=qwen2_moe_spec,
    tensors=qwen2_moe_tensors,
)

MIXTRAL = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    spec=mixtral_spec,
    tensors=mixtral_tensors,
)
