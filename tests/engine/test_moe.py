"""Mixtures of experts beyond what tests/engine/test_families.py checks of every family.

test_families holds each mixture (Qwen3-MoE, Qwen2-MoE with a shared expert,
Mixtral) to transformers' greedy tokens and log probabilities on the eager and
fixed-shape steps, and the native pass to the torch forward of its packed
weights. Here: the grouping itself (each expert's products run once a step over
every row that chose it), a row's bits the same alone and beside rows that share
its experts on the native path, and GGUF files whose experts are stacked as
llama.cpp writes them: read as transformers' own GGUF loader reads them, and run
as shipped under w4a16.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from adapters.engine.runner import Runner
from tests.engine.test_gguf_blocks import Entry, loaded_gguf, write_gguf
from tests.support import tiny_models

PROMPTS = [[101, 2037, 7, 48000, 15, 333], [9, 8, 7, 6, 5, 4, 3], [4000, 12, 77], [1, 2],
           [31000, 17, 17, 17, 900], [640, 641, 642, 643, 644, 645, 646, 647]]  # fmt: skip


def prefilled(runner: Runner) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """PROMPTS prefilled, two blocks each -> (tables, positions, next tokens)."""
    tables = [[2 * i, 2 * i + 1] for i in range(len(PROMPTS))]
    for table, prompt in zip(tables, PROMPTS, strict=True):
        runner.prefill(table, 0, torch.tensor(prompt))
    positions = torch.tensor([len(p) for p in PROMPTS])
    return tables, positions, torch.tensor([p[-1] + 1 for p in PROMPTS])


def _native_or_skip() -> None:
    from adapters.engine.native_build import NativeUnavailable, load

    try:
        load()
    except NativeUnavailable as error:
        pytest.skip(f"no native kernels here: {error}")


class Counted:
    """A projection that counts its calls and the rows they took."""

    def __init__(self, inner: Any, calls: list[int]) -> None:
        self.inner, self.calls, self.nbytes = inner, calls, inner.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(x.shape[0])
        return self.inner(x)


def test_each_expert_runs_once_a_step_over_every_row_that_chose_it() -> None:
    built = tiny_models.model("qwen3-moe")
    runner = Runner(tiny_models.loaded_of(built), 16, 16, 64, "fp32")
    tables, positions, tokens = prefilled(runner)
    calls: dict[tuple[int, int], list[int]] = {}
    for index, weights in enumerate(runner.layers):
        if weights.moe is not None:
            for e, product in enumerate(weights.moe.gate_up):
                weights.moe.gate_up[e] = Counted(product, calls.setdefault((index, e), []))
    runner.decode(runner.pages(tables, 16), positions, tokens)
    sparse = [i for i, layer in enumerate(runner.spec.layers) if layer.experts is not None]
    assert sparse == [0, 2]  # the config's mlp_only_layers keeps layer 1 dense
    rows, top_k = len(PROMPTS), 2
    for layer in sparse:
        runs = [calls[layer, e] for e in range(8)]
        assert all(len(r) <= 1 for r in runs)  # once a step, or not at all
        assert sum(sum(r) for r in runs) == rows * top_k  # every (row, rank) once
        assert max(sum(r) for r in runs) > 1  # some expert took several rows at once


@pytest.mark.parametrize("fmt", ["w4a16", "w4a8"])
@pytest.mark.parametrize("case", ["qwen3-moe", "qwen2-moe-shared", "mixtral"])
def test_a_rows_bits_are_the_same_alone_and_beside_rows_sharing_its_experts(
    case: str, fmt: str
) -> None:
    _native_or_skip()
    built = tiny_models.model(case)
    loaded = tiny_models.loaded_of(built)
    together = Runner(loaded, 16, 16, 64, fmt)
    tables, positions, tokens = prefilled(together)
    batch = together.decode(together.pages(tables, 16), positions, tokens)
    for row in range(len(PROMPTS)):
        alone = Runner(loaded, 16, 16, 64, fmt)
        alone.prefill(tables[row], 0, torch.tensor(PROMPTS[row]))
        one = alone.decode(alone.pages([tables[row]], 16), positions[row : row + 1],
                           tokens[row : row + 1])  # fmt: skip
        assert torch.equal(one[0], batch[row]), row


def moe_gguf(path: Path, types: dict[str, str], arch: str = "qwen3moe", experts: int = 8) -> Any:
    """A 2-layer mixture of random blocks, experts stacked, and its config: Qwen3-MoE
    (arch qwen3moe), Qwen2-MoE (qwen2moe: q/k/v biases and a shared expert with its
    gate), or Mixtral as llama.cpp writes it (arch llama: its q and k rows permuted, no
    q/k norms)."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    hidden, width, heads, kv_heads, head_dim, vocab = 256, 256, 4, 2, 64, 300
    sizes = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=2,
                 num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                 num_experts_per_tok=2, max_position_embeddings=128)  # fmt: skip
    if arch == "llama":
        config = MixtralConfig(**sizes, intermediate_size=width, num_local_experts=experts)
    elif arch == "qwen2moe":
        config = Qwen2MoeConfig(**sizes, intermediate_size=512, moe_intermediate_size=width,
                                shared_expert_intermediate_size=width, num_experts=experts,
                                norm_topk_prob=False)  # fmt: skip
    else:
        config = Qwen3MoeConfig(**sizes, intermediate_size=512, moe_intermediate_size=width,
                                num_experts=experts, norm_topk_prob=True)  # fmt: skip
    entries: list[Entry] = [("token_embd.weight", "Q4_K", vocab, hidden)]
    for layer in range(2):
        at = f"blk.{layer}"
        entries += [(f"{at}.attn_norm.weight",), (f"{at}.ffn_norm.weight",),
                    (f"{at}.attn_q.weight", "Q4_K", heads * head_dim, hidden),
                    (f"{at}.attn_k.weight", "Q4_K", kv_heads * head_dim, hidden),
                    (f"{at}.attn_v.weight", "Q6_K", kv_heads * head_dim, hidden),
                    (f"{at}.attn_output.weight", "Q4_K", hidden, heads * head_dim)]  # fmt: skip
        if arch == "qwen2moe":  # the shared expert, as llama.cpp names it
            entries += [(f"{at}.ffn_gate_shexp.weight", "Q4_K", width, hidden),
                        (f"{at}.ffn_up_shexp.weight", "Q4_K", width, hidden),
                        (f"{at}.ffn_down_shexp.weight", "Q6_K", hidden, width)]  # fmt: skip
    entries += [("output_norm.weight",), ("output.weight", "Q6_K", vocab, hidden)]
    extra = _moe_tensors(types, experts, hidden, width, head_dim if arch == "qwen3moe" else None)
    if arch == "qwen2moe":
        extra += _qwen2_extras(hidden, heads * head_dim, kv_heads * head_dim)
    write_gguf(path, arch, hidden, entries, seed=1, extra=extra)
    return config


def _qwen2_extras(hidden: int, q_size: int, kv_size: int) -> list[tuple[str, np.ndarray, Any]]:
    """Each layer's q/k/v biases and the shared expert's gate vector."""
    rng = np.random.default_rng(3)
    out: list[tuple[str, np.ndarray, Any]] = []
    for layer in range(2):
        at = f"blk.{layer}"
        for name, size in (("attn_q", q_size), ("attn_k", kv_size), ("attn_v", kv_size)):
            bias = (0.2 * rng.standard_normal(size)).astype(np.float32)
            out.append((f"{at}.{name}.bias", bias, None))
        gate = (0.5 * rng.standard_normal(hidden)).astype(np.float32)
        out.append((f"{at}.ffn_gate_inp_shexp.weight", gate, None))
    return out


def _moe_tensors(types: dict[str, str], experts: int, hidden: int, width: int,
                 q_norm: int | None) -> list[tuple[str, np.ndarray, Any]]:  # fmt: skip
    """Each layer's q/k norms (`q_norm` wide; None: none), router (F32) and stacked experts
    of `types`."""
    from tests.engine.test_gguf_blocks import random_blocks

    rng = np.random.default_rng(2)
    out: list[tuple[str, np.ndarray, Any]] = []
    for layer in range(2):
        at = f"blk.{layer}"
        for name in ("attn_q_norm", "attn_k_norm") if q_norm else ():
            norm = (1 + 0.2 * rng.standard_normal(q_norm)).astype(np.float32)
            out.append((f"{at}.{name}.weight", norm, None))
        router = (0.5 * rng.standard_normal((experts, hidden))).astype(np.float32)
        out.append((f"{at}.ffn_gate_inp.weight", router, None))
        for short, (rows, cols) in (("gate", (width, hidden)), ("up", (width, hidden)),
                                    ("down", (hidden, width))):  # fmt: skip
            kind = types[short]
            stack = np.stack([random_blocks(kind, rows, cols, seed=int(rng.integers(1 << 30)))
                              for _ in range(experts)])  # fmt: skip
            out.append((f"{at}.ffn_{short}_exps.weight", stack, gguf.GGMLQuantizationType[kind]))
    return out


@pytest.mark.parametrize(("arch", "down"), [("qwen3moe", "Q6_K"), ("qwen3moe", "Q5_0"),
                                           ("qwen2moe", "Q6_K"), ("llama", "Q6_K")])  # fmt: skip
def test_a_gguf_mixture_runs_as_shipped_and_predicts_what_its_dequantised_weights_do(
    tmp_path: Path, arch: str, down: str
) -> None:
    _native_or_skip()
    path = tmp_path / "moe.gguf"
    config = moe_gguf(path, {"gate": "Q4_K", "up": "Q8_0", "down": down}, arch)
    prompt = torch.tensor([5, 17, 250, 3, 99, 42, 7, 180, 64, 11, 299, 0, 128, 31, 77, 8])
    shipped = Runner(loaded_gguf(path, config), 8, 16, 64, "w4a16")
    sources = shipped.weight_sources
    assert sources["Q8_0 as shipped"] == 2 * 8  # each expert's up matrix, per layer
    if down == "Q5_0":  # a type the kernels lack: requantised per expert, and said so
        assert sources["Q5_0 -> fencepost 8-bit groups (requantised)"] == 2 * 8
    got = shipped.prefill([0, 1], 0, prompt, every_position=True)
    fp32 = Runner(loaded_gguf(path, config), 8, 16, 64, "fp32").prefill([0, 1], 0, prompt, True)
    # The same weights; the activations' 16-bit integers and the fp16 cache differ, and
    # where a row's router is near a tie between two experts, that can pick the other
    # (a few positions then differ by up to 1%, as they would between any two engines).
    per_position = (got - fp32).norm(dim=-1) / fp32.norm(dim=-1)
    assert float(per_position.median()) < 2e-3 and float(per_position.max()) < 3e-2
    assert torch.equal(got.argmax(dim=-1), fp32.argmax(dim=-1))


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_a_gguf_mixture_reads_as_transformers_own_gguf_loader_reads_it(
    tmp_path: Path, arch: str
) -> None:
    """The experts' slices, gate and up, the router and a shared expert as transformers
    maps the file (its loader dequantizes the stacked tensors into its own layout)."""
    import transformers

    path = tmp_path / "moe.gguf"
    config = moe_gguf(path, {"gate": "Q4_K", "up": "Q4_K", "down": "Q6_K"}, arch)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, config=config, dtype=torch.float32
    ).eval()
    prompt = torch.tensor([5, 17, 250, 3, 99, 42, 7, 180, 64, 11, 299, 0])
    with torch.no_grad():
        want = hf(prompt[None]).logits[0]
    got = Runner(loaded_gguf(path, config), 8, 16, 64, "fp32").prefill([0], 0, prompt, True)
    assert float((got - want).norm() / want.norm()) < 1e-5


def test_a_mixtral_gguf_is_read_as_mixtral_with_its_expert_width(tmp_path: Path) -> None:
    """llama.cpp writes Mixtral as architecture llama with experts; transformers' GGUF
    reader would make it a Llama config without them."""
    from transformers import LlamaConfig

    from adapters.engine.families import family_for
    from adapters.engine.model import _gguf_mixture

    path = tmp_path / "mixtral.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.expert_count", 8)
    writer.add_uint32("llama.expert_used_count", 3)
    writer.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    llama = LlamaConfig(**tiny_models.SMALL)
    config = _gguf_mixture(llama, path)
    assert config.model_type == "mixtral" and config.num_local_experts == 8
    assert config.hidden_size == llama.hidden_size and config.num_experts_per_tok == 3
    assert family_for(config).name == "mixtral"
