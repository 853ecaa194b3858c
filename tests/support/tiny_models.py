"""Tiny random checkpoints of every family, built by transformers from each family's own
config class, with the tokenizer of the default model, saved as a user would have them.

Norm weights and biases are perturbed after the random init (transformers starts
norms at one, Gemma's at zero, and biases at zero), so that a forward pass that
ignored a norm, its offset or a bias gives other tokens. Each CASE is small
(hidden 64, two or three layers; the default tokenizer's 49,152 tokens make
the embedding the biggest tensor): a few MB on disk, built in about a second.
Windows are shorter than the tests' sequences, so that a window the engine
ignored shows too.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import torch
import transformers

VOCAB = 49152  # the default model's tokenizer
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
)


def _llama3_rope() -> dict[str, Any]:
    return {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip


def _longrope(pairs: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(3)
    short = (1 + torch.rand(pairs, generator=generator)).tolist()
    long = (2 + 4 * torch.rand(pairs, generator=generator)).tolist()
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": short,
            "long_factor": long, "partial_rotary_factor": 0.5}  # fmt: skip


# name -> (config class name, settings); each registered family has at least one.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "llama-3.1-rope": ("LlamaConfig", {"rope_parameters": _llama3_rope()}),
    "llama-tied-head128-biases": ("LlamaConfig", {"tie_word_embeddings": True, "head_dim": 128,
                                                  "attention_bias": True, "mlp_bias": True}),
    "llama-linear-rope": ("LlamaConfig", {"rope_parameters": {"rope_type": "linear", "factor": 4.0,
                                                              "rope_theta": 10000.0}}),
    "llama-yarn-rope": ("LlamaConfig", {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
        "original_max_position_embeddings": 64}}),
    "smollm3": ("SmolLM3Config", {"no_rope_layer_interval": 2, "tie_word_embeddings": True,
                                  "pad_token_id": None, "bos_token_id": None,
                                  "eos_token_id": None}),
    "mistral": ("MistralConfig", {"sliding_window": 12, "head_dim": 16}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 12,
                                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16,
                                    "sliding_window": 12, "sliding_window_pattern": 2,
                                    "rope_theta": 100000.0, "rope_local_base_freq": 1000.0,
                                    "final_logit_softcapping": 8.0}),
    "phi3": ("Phi3Config", {"rope_parameters": _longrope(4), "pad_token_id": 0,
                            "original_max_position_embeddings": 2048}),
    "granite": ("GraniteConfig", {"embedding_multiplier": 3.0, "attention_multiplier": 0.3,
                                  "residual_multiplier": 0.5, "logits_scaling": 2.5}),
    "olmo2": ("Olmo2Config", {"attention_bias": True, "eos_token_id": None}),
    # Mixtures: 8 experts, 2 a token; the second Qwen layer dense (mlp_only_layers).
    "qwen3-moe": ("Qwen3MoeConfig", {"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "norm_topk_prob": True,
                                     "mlp_only_layers": [1]}),
    "qwen2-moe-shared": ("Qwen2MoeConfig", {"num_experts": 8, "num_experts_per_tok": 3,
                                            "moe_intermediate_size": 32,
                                            "shared_expert_intermediate_size": 64,
                                            "norm_topk_prob": False}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2,
                                  "sliding_window": 12}),
}  # fmt: skip


def config(case: str, **overrides: Any) -> Any:
    kind, settings = CASES[case]
    options = SMALL | settings | overrides
    built = getattr(transformers, kind)(**options)
    built.architectures = [
        kind.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")
    ]
    return built


def model(case: str, seed: int = 0, **overrides: Any) -> Any:
    """The random model of `case`, norms and biases perturbed (see the module docstring);
    `overrides` change its config (e.g. num_hidden_layers=2)."""
    torch.manual_seed(seed)
    built = transformers.AutoModelForCausalLM.from_config(config(case, **overrides)).eval()
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in built.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                noise = torch.randn(parameter.shape, generator=generator)
                parameter.add_(0.2 * noise)
    return built


@cache
def default_tokenizer() -> Any:
    from adapters.engine.model import load_boundary

    return load_boundary(quiet=True).tokenizer


def saved(
    case: str, folder: Path, dtype: torch.dtype = torch.float32, shard: str | None = None
) -> Path:
    """`case` saved under folder/case (safetensors in `dtype`, sharded at `shard` when
    given, e.g. "2MB"), with the default tokenizer: a checkpoint as downloaded."""
    target = folder / case
    if not (target / "config.json").is_file():
        built = model(case).to(dtype)
        built.save_pretrained(target, **({"max_shard_size": shard} if shard else {}))
        default_tokenizer().save_pretrained(target)
    return target


BUILDERS: dict[str, Callable[[], Any]] = {case: (lambda c=case: model(c)) for case in CASES}


def loaded_of(built: Any, name: str = "tiny") -> Any:
    """A model built in the test, as the engine takes it (read through its state dict)."""
    from adapters.engine.model import LoadedModel

    context = min(int(built.config.max_position_embeddings), 2048)
    return LoadedModel.from_model(built, None, name, frozenset(), context, "built in the test")


def greedy(model: Any, prompt: list[int], steps: int) -> Any:
    """transformers' greedy `generate` of exactly `steps` tokens after `prompt`, with each
    step's scores and raw logits (a dict-like output)."""
    with torch.no_grad():
        return model.generate(
            torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
            output_scores=True, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
        )  # fmt: skip
