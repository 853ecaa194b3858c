"""What a model computes, as data: the shared layers a family's forward is made of.

A family (adapters/engine/families/) reads its config and says, in these terms,
what each layer does: which norms sit where, how attention is scaled, windowed
and capped, whether queries and keys are normalised, which rotary table a
layer uses, the MLP's activation, the biases; and where its tensors are in a
checkpoint (`TensorNames`). The runner (runner.py) executes any ModelSpec with
one forward pass, and each backend (torch's ops, the fixed-shape step the CUDA
graphs capture, native.c) says which features it can run, so a family is
data and a name table, not a copy of the forward.

Multipliers that are one constant per model (an embedding scale, residual and
logit multipliers, the attention scale, Gemma's 1 + w norm weights) are folded
into the weights when they are loaded (loader.py says how), so the forward
itself never multiplies by them. A layer's feed-forward part is a gated MLP, or a
mixture of experts (`Experts`: a router picks each row's top-k of many gated
MLPs and weighs their outputs), with or beside a shared MLP (Qwen2-MoE's shared
expert, whose output a sigmoid gate scales).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from adapters.engine.layers.rotary import Rotary

Activation = Literal["silu", "gelu_tanh"]
QkNorm = Literal["head", "width"]  # per head over head_dim, or over the whole projection


@dataclass(frozen=True)
class Attention:
    heads: int
    kv_heads: int
    head_dim: int
    scale: float  # multiplies q . k (folded into q's weights or q norm; GGUF blocks: q's outputs)
    rotary: int | None = 0  # index into ModelSpec.rotaries; None: no rotary (NoPE)
    window: int | None = None  # a query sees the keys of its last `window` positions
    softcap: float | None = None  # scores become tanh(s / c) * c before the mask
    qk_norm: QkNorm | None = None
    qkv_bias: bool = False
    o_bias: bool = False


@dataclass(frozen=True)
class Mlp:
    intermediate: int
    activation: Activation = "silu"
    bias: bool = False


@dataclass(frozen=True)
class Experts:
    """A mixture of experts: router logits (a [count, hidden] product), their softmax, the
    top_k largest (ties: the lower expert), divided by their sum where `renormalise`
    says; each chosen expert's gated MLP (`intermediate` wide) times its weight,
    summed. `shared_gate`: the layer's MLP is a shared expert every row runs, its
    output times sigmoid(a [1, hidden] product)."""

    count: int
    top_k: int
    intermediate: int
    renormalise: bool
    activation: Activation = "silu"
    shared_gate: bool = False


@dataclass(frozen=True)
class Layer:
    attention: Attention
    mlp: Mlp | None  # None: only experts (then `experts` is set)
    # RMSNorms: before attention and before the MLP (Llama), and/or on their outputs
    # before the residual add (Gemma 2/3 have all four, OLMo 2 only the latter).
    pre_attention: bool = True
    post_attention: bool = False
    pre_mlp: bool = True
    post_mlp: bool = False
    experts: Experts | None = None


@dataclass(frozen=True)
class ModelSpec:
    family: str
    architecture: str
    hidden: int
    vocab: int
    eps: float
    layers: tuple[Layer, ...]
    rotaries: tuple[Rotary, ...]
    trained_context: int  # max_position_embeddings
    tie_embeddings: bool = False
    norm_offset: float = 0.0  # norm weights are w + offset (Gemma: 1)
    embed_scale: float = 1.0
    residual_scale: float = 1.0  # multiplies each sublayer's output before the add
    logit_scale: float = 1.0  # multiplies the logits
    final_softcap: float | None = None
    notes: tuple[str, ...] = ()  # for the start log: choices made for this model

    @property
    def head_dim(self) -> int:
        return self.layers[0].attention.head_dim

    @property
    def kv_heads(self) -> int:
        return self.layers[0].attention.kv_heads

    @property
    def heads(self) -> int:
        return self.layers[0].attention.heads

    def features(self) -> set[str]:
        """The features beyond a plain Llama layer this model uses (what a backend may
        not run): names a backend's `problem` check looks for."""
        found: set[str] = set()
        for layer in self.layers:
            a, m, e = layer.attention, layer.mlp, layer.experts
            found |= {name for name, used in (
                ("window", a.window is not None),
                ("softcap", a.softcap is not None),
                ("qk_norm_head", a.qk_norm == "head"),
                ("qk_norm_width", a.qk_norm == "width"),
                ("qkv_bias", a.qkv_bias),
                ("o_bias", a.o_bias),
                ("no_rotary", a.rotary is None),
                ("mlp_bias", m is not None and m.bias),
                ("gelu_tanh", m is not None and m.activation == "gelu_tanh"),
                ("experts", e is not None),
                ("shared_expert", e is not None and m is not None),
                ("post_norms", layer.post_attention or layer.post_mlp),
                ("no_pre_norms", not (layer.pre_attention and layer.pre_mlp)),
            ) if used}  # fmt: skip
        if any(r.dim != self.head_dim for r in self.rotaries):
            found.add("partial_rotary")
        if self.final_softcap is not None:
            found.add("final_softcap")
        return found


@dataclass(frozen=True)
class LayerTensors:
    """Checkpoint names of one layer's tensors. A projection given as several names is
    their rows concatenated (q, k, v; gate, up); as one name, already fused (Phi-3).
    None: the layer has no such tensor."""

    qkv: tuple[str, ...]
    o: str
    gate_up: tuple[str, ...]
    down: str
    qkv_bias: tuple[str, ...] | None = None
    o_bias: str | None = None
    gate_up_bias: tuple[str, ...] | None = None
    down_bias: str | None = None
    pre_attention: str | None = None
    post_attention: str | None = None
    pre_mlp: str | None = None
    post_mlp: str | None = None
    q_norm: str | None = None
    k_norm: str | None = None
    experts: ExpertTensors | None = None  # gate_up and down are then the shared expert's


@dataclass(frozen=True)
class ExpertTensors:
    """Where a mixture's tensors are. Each expert's gate, up and down matrices are found
    as a checkpoint holds them (checkpoint.expert_matrix): one tensor per expert as
    saved (`per_expert`, with `{e}` for its number: Hugging Face's files), else one
    3-D tensor per kind stacked over the experts (`stacked`: a GGUF's ffn_gate_exps,
    under the Hugging Face module name gguf's table maps), else transformers' own
    in-memory layout (`fused`: gate|up [experts, 2 * width, hidden], down)."""

    router: tuple[str, ...]  # the first the checkpoint has (Mixtral's in memory: mlp.gate)
    per_expert: tuple[str, str, str]  # gate, up, down
    stacked: tuple[str, str, str]
    fused: tuple[str, str]
    shared_gate: str | None = None


@dataclass(frozen=True)
class TensorNames:
    embed: str
    final_norm: str
    lm_head: str | None  # None: tied to the embedding
    layers: tuple[LayerTensors, ...] = field(default_factory=tuple)
