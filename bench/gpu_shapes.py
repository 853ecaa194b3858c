"""The random-weight models of the device check (bench/gpu_check.py), in one copy.

The check's own process (the engine's), its anchor processes (bench/gpu_anchors.py:
HF generate and continuous batching, each in a process of its own) and
bench/kernel_build.py build the same model from a shape and a seed: build_model
draws every weight from a generator seeded with it, so two processes given the
same (shape, device, dtype, seed) hold the same weights, and the prompts are
fixed ids. Only torch and transformers: an anchor process imports nothing of the
engine.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    tie_word_embeddings: bool
    max_position: int = 4096
    config: str = "LlamaConfig"  # the family's transformers config class
    extra: tuple[tuple[str, Any], ...] = ()  # its own fields (head_dim, windows, ...)
    streams: tuple[int, ...] = ()  # the engine's stream counts, where not --streams'


SHAPES = {
    "135m": Shape("SmolLM2-135M", 576, 30, 9, 3, 1536, 49152, 100000.0, True),
    "1b": Shape("Llama-3.2-1B", 2048, 16, 32, 8, 8192, 128256, 500000.0, True),
    "8b": Shape("Llama-3-8B", 4096, 32, 32, 8, 14336, 128256, 500000.0, False),
    "qwen3-8b": Shape("Qwen3-8B", 4096, 36, 32, 8, 12288, 151936, 1000000.0, False,
                      config="Qwen3Config", extra=(("head_dim", 128),)),
    "gemma3-4b": Shape("Gemma-3-4B", 2560, 34, 8, 4, 10240, 262208, 1000000.0, True,
                       config="Gemma3TextConfig",
                       extra=(("head_dim", 256), ("query_pre_attn_scalar", 256),
                              ("sliding_window", 1024), ("rope_local_base_freq", 10000.0))),
    # A mixture: 128 experts of width 768, 8 a token (30.5B weights, 3.3B read a token);
    # 1 stream, and 64, where the experts' rows are grouped (61 GB: two stream counts).
    "qwen3-30b-a3b": Shape("Qwen3-30B-A3B", 2048, 48, 32, 4, 6144, 151936, 1000000.0, False,
                           config="Qwen3MoeConfig",
                           extra=(("head_dim", 128), ("num_experts", 128),
                                  ("num_experts_per_tok", 8), ("moe_intermediate_size", 768),
                                  ("norm_topk_prob", True)),
                           streams=(1, 64)),
    "tiny": Shape("tiny", 64, 2, 4, 2, 128, 49152, 10000.0, True),
    "tiny-moe": Shape("tiny-moe", 64, 2, 4, 2, 128, 49152, 10000.0, True,
                      config="Qwen3MoeConfig",
                      extra=(("head_dim", 16), ("num_experts", 8), ("num_experts_per_tok", 2),
                             ("moe_intermediate_size", 32), ("norm_topk_prob", True))),
}  # fmt: skip
SCALES = {"q_proj": 2.0, "k_proj": 2.0, "o_proj": 0.5, "down_proj": 0.5}  # build_model says why
PROMPT_TOKENS = 40


def build_model(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """A model of this shape and family, built on the device, with seeded weights.

    Scales, N(0, scale / fan_in): q and k 2 (attention scores spread by about
    4, so a head looks at a few positions, not at their mean), o and down 0.5,
    the rest 1; norms 1; the embedding (tied or not, also the output matrix)
    3/sqrt(hidden), so logits spread by about 3: neither flat (ties
    everywhere) nor one-hot (sampling would never vary). With plain 1/fan_in
    scales (and with GPT-2's residual scaling), attention averaged the
    context, the model's state forgot its input, and greedy output repeated
    one token from the first or second on; with these the 135M shape's
    greedy output changes at every token (measured on CPU)."""
    import transformers

    config = getattr(transformers, shape.config)(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=shape.max_position,
        rms_norm_eps=1e-5,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=shape.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,  # nothing stops early: every run makes all its tokens
        pad_token_id=0,
        **dict(shape.extra),
    )
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model: Any = transformers.AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    finally:
        torch.set_default_dtype(before)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.fill_(1.0)
            elif "embed_tokens" in name or "lm_head" in name:
                param.normal_(0.0, 3.0 / math.sqrt(shape.hidden), generator=generator)
            else:  # [out, in], or a mixture's experts stacked: [experts, out, in]
                kind = name.split(".")[-1 if param.ndim == 3 else -2]
                scale = SCALES.get(kind, 1.0) / math.sqrt(param.shape[-1])
                param.normal_(0.0, scale, generator=generator)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.eval()
    return model


def prompts(count: int) -> list[tuple[int, ...]]:
    """`count` distinct prompts of exactly PROMPT_TOKENS token ids (a chat prompt's
    opening ids, then filler; any ids serve a random-weight model)."""
    out = []
    for i in range(count):
        ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28]
        ids = [*ids, 1000 + i, *(30 + (i + j) % 200 for j in range(PROMPT_TOKENS))]
        ids = ids[:PROMPT_TOKENS]
        ids[-3] = 100 + i % 20000  # every prompt distinct
        out.append(tuple(ids))
    return out
