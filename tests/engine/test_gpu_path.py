"""What a GPU runs, run on a CPU: every registered family through the GPU path, in bf16
and fp16, against transformers in the same dtype.

The GPU path (runner.py `gpu_path`) differs from the CPU's in what a GPU needs:
activations, rotary tables and caches in the weights' 16-bit dtype, the fused
triton kernels, the triton decode attention, and the fixed-shape decode step
the CUDA graphs capture. Here it runs with the device a CPU, triton's
interpreter running the kernels (tests/conftest.py sets TRITON_INTERPRET=1).

Two configurations:
- "fast": every case of tests/support/tiny_models.py (a new family gets this by
  having a case), bf16 and fp16, with FENCEPOST_FUSED=off and the gather decode
  attention, so prefill goes through the chunked SDPA a GPU uses; about 0.3 s a
  case. Everything else is the GPU's code.
- "kernels": the fused kernels and the triton attention (prefill row by row
  through the kernel, decode through it in the fixed-shape step), on the cases
  that cover every branch of the kernels: plain attention in both dtypes,
  windows and soft-caps (Gemma 2), q/k norms and experts (Qwen3-MoE). The
  interpreter is slow (a few seconds a case at two layers and 16 steps).

16-bit arithmetic rounds differently in each implementation, so equality of
greedy tokens cannot hold for ever on near-flat random logits. The rule:
tokens equal up to the first position d where they differ, and at d
transformers' own top-2 margin must be within twice the dtype's noise there
(the largest difference between transformers' 16-bit logits and its fp32
forward over the same tokens): a tie that rounding may break either way, not
a bug. Over all cases d averages >= 16 tokens; where tokens agree, log
probabilities are within four times the median noise. `python -m
tests.engine.test_gpu_path` prints the table (family x path x dtype x d).
"""

from __future__ import annotations

import copy
import functools
import os
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from adapters.engine.engine import Engine
from adapters.engine.model import load_model
from adapters.engine.runner import AttentionDtypeError
from core.batching import BatchLimits
from core.protocol import Assignment, Decoded, GenerationRequest
from tests.support import tiny_models
from tests.support.http_helpers import ServerThread

pytest.importorskip("triton", reason="triton (a dev dependency) runs the GPU's kernels here")
pytestmark = pytest.mark.xdist_group("gpu_path")  # one process keeps the cached results

PROMPT = [101, 2037, 7, 48000, 15, 333, 9021, 4]  # 8 tokens; windows of 12 bind past them
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FAST_STEPS = 32
# (case, dtype): each kernel branch once; two layers and 16 steps, for the interpreter's sake
KERNEL_CASES = [("llama", "bf16"), ("llama", "fp16"), ("gemma2", "bf16"), ("qwen3-moe", "bf16")]
KERNEL_STEPS, KERNEL_LAYERS = 16, 2
LIMITS = BatchLimits(max_seqs=1, max_context=128)  # one row: the interpreter runs each


@dataclass(frozen=True)
class Reference:
    """transformers' greedy run of one model in one dtype, and what its noise is."""

    tokens: list[int]
    logprobs: list[float]
    margins: list[float]  # top-1 minus top-2 logit at each step
    noise: list[float]  # max over the vocabulary of |16-bit logits - fp32 logits| a step


@dataclass(frozen=True)
class Agreement:
    case: str
    path: str
    dtype: str
    steps: int
    agreed: int  # d: the first step where the tokens differ (steps: none)
    margin: float | None  # transformers' margin at d
    noise: float | None  # the noise at d
    logprob_gap: float  # the largest |logprob difference| before d
    median_noise: float

    def row(self) -> str:
        at = "" if self.margin is None else f"margin {self.margin:.4f} noise {self.noise:.4f}"
        return (
            f"{self.case:18} {self.path:8} {self.dtype:5} d={self.agreed:2}/{self.steps}"
            f"  logprob gap {self.logprob_gap:.4f} (median noise {self.median_noise:.4f})  {at}"
        )


def reference(built: Any, dtype: torch.dtype, steps: int) -> Reference:
    model = copy.deepcopy(built).to(dtype)
    out = tiny_models.greedy(model, PROMPT, steps)
    with torch.no_grad():
        tokens = out.sequences[0, len(PROMPT) :].tolist()
        logits = torch.stack([step[0].float() for step in out.logits])
        exact = built(torch.tensor([PROMPT + tokens[:-1]])).logits[0, len(PROMPT) - 1 :].float()
    top = logits.topk(2, dim=-1).values
    chosen = torch.log_softmax(logits, dim=-1)[torch.arange(steps), tokens]
    return Reference(
        tokens, chosen.tolist(), (top[:, 0] - top[:, 1]).tolist(),
        (logits - exact).abs().amax(dim=-1).tolist(),
    )  # fmt: skip


def served(engine: Engine, steps: int) -> tuple[list[int], list[float]]:
    engine.start(Assignment("x", 1), GenerationRequest("x", tuple(PROMPT), steps, logprobs=0))
    tokens, logprobs = [], []
    for _ in range(4 * steps):
        if not engine.has_work():
            break
        for event in engine.step():
            if isinstance(event, Decoded):
                tokens.append(event.token_id)
                assert event.logprob is not None
                logprobs.append(event.logprob.logprob)
    assert len(tokens) == steps
    return tokens, logprobs


def gpu_engine(built: Any, dtype: str, path: str) -> Engine:
    """The engine on the GPU path on this CPU: `path` "fast" without the kernels, "kernels"
    with them (the start's own choice of attention, which takes triton here)."""
    attention = "gather" if path == "fast" else "auto"
    engine = Engine(
        tiny_models.loaded_of(built), LIMITS, dtype, decode="auto", attention=attention,
        gpu_path=True,
    )  # fmt: skip
    runner = engine.runner
    assert runner.gpu_path and runner.state_dtype == DTYPES[dtype]
    assert engine.static is not None, "the GPU path decodes in the fixed-shape step"
    assert runner.fused == (path == "kernels"), runner.fused_problem
    if path == "kernels":
        assert engine.static.attention.name == "triton"
    return engine


@functools.cache
def measured(case: str, path: str, dtype: str) -> Agreement:
    steps = FAST_STEPS if path == "fast" else KERNEL_STEPS
    built = tiny_models.model(case, **({} if path == "fast" else {"num_hidden_layers": 2}))
    want = reference(built, DTYPES[dtype], steps)
    saved = os.environ.get("FENCEPOST_FUSED")
    os.environ["FENCEPOST_FUSED"] = "off" if path == "fast" else ""
    try:
        tokens, logprobs = served(gpu_engine(built, dtype, path), steps)
    finally:
        os.environ.pop("FENCEPOST_FUSED")
        if saved is not None:
            os.environ["FENCEPOST_FUSED"] = saved
    agreed = next(
        (i for i, (a, b) in enumerate(zip(tokens, want.tokens, strict=True)) if a != b), steps
    )
    gaps = [abs(a - b) for a, b in zip(logprobs[:agreed], want.logprobs[:agreed], strict=True)]
    at = agreed < steps
    return Agreement(
        case, path, dtype, steps, agreed, want.margins[agreed] if at else None,
        want.noise[agreed] if at else None, max(gaps, default=0.0),
        statistics.median(want.noise),
    )  # fmt: skip


ALL = [
    *((case, "fast", dtype) for case in tiny_models.CASES for dtype in DTYPES),
    *((case, "kernels", dtype) for case, dtype in KERNEL_CASES),
]


@pytest.mark.parametrize(("case", "path", "dtype"), ALL)
def test_the_gpu_path_follows_transformers_until_a_tie_rounding_may_break(
    case: str, path: str, dtype: str
) -> None:
    got = measured(case, path, dtype)
    if got.margin is not None:
        assert got.noise is not None
        assert got.margin <= 2 * got.noise, f"a real divergence: {got.row()}"
    assert got.logprob_gap <= 4 * got.median_noise, got.row()


def test_the_gpu_path_agrees_with_transformers_for_16_tokens_on_average() -> None:
    table = [measured(*key) for key in ALL]
    print("\n" + "\n".join(row.row() for row in table))
    mean = statistics.mean(row.agreed for row in table)
    assert mean >= 16, f"greedy tokens agree for {mean:.1f} on average"


def test_an_attention_input_in_another_dtype_is_named_not_an_sdpa_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that hands attention fp32 q (Gemma 3's and Qwen3's first-run bug, from their
    q/k norms) is caught before attention, named by layer, family and format."""
    from adapters.engine import runner as runner_module

    monkeypatch.setenv("FENCEPOST_FUSED", "off")
    engine = gpu_engine(tiny_models.model("qwen3"), "bf16", "fast")
    real = runner_module.rotate_store  # hands q back after the norms and rotary
    monkeypatch.setattr(runner_module, "rotate_store", lambda *a, **k: real(*a, **k).float())
    engine.start(Assignment("x", 1), GenerationRequest("x", tuple(PROMPT), 2))
    with pytest.raises(AttentionDtypeError, match=r"layer 0: q is torch.float32 .* qwen3"):
        engine.step()


def test_the_gpu_path_on_a_cpu_needs_the_interpreter_and_a_dense_format(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built = tiny_models.model("llama")
    with pytest.raises(ValueError, match="int8 is a CPU format"):
        Engine(tiny_models.loaded_of(built), LIMITS, "int8", gpu_path=True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="set TRITON_INTERPRET=1"):
        Engine(tiny_models.loaded_of(built), LIMITS, "bf16", gpu_path=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpu-path-models")


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_gemma3_and_qwen3_serve_a_chat_in_bf16_through_the_gpu_kernels(
    case: str, folder: Path
) -> None:
    """Over HTTP with the SDK: a streamed and a whole chat, bf16, fused kernels and the
    triton attention (the configuration whose first GPU run failed), the same text."""
    from adapters.cli.serve import ServeOptions
    from adapters.openai.models import ChatModel
    from adapters.runtime.worker_host import EngineDecoder

    loaded = load_model(tiny_models.saved(case, folder, torch.bfloat16), quiet=True)
    engine = Engine(loaded, BatchLimits(max_seqs=2, max_context=256), "bf16", gpu_path=True)
    assert engine.runner.fused and engine.static is not None
    assert engine.static.attention.name == "triton"
    model = ChatModel(case, loaded.tokenizer, 256)
    # The interpreter runs a prefill for seconds, holding the GIL in long runs; a worker's
    # heartbeat may wait longer than the default 3 s, which would mark it unhealthy.
    options = ServeOptions(port=0, max_context=256, heartbeat_timeout_s=120.0)
    with ServerThread(options, EngineDecoder(engine), model) as s:
        client = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused")
        ask = dict(model=case, messages=[{"role": "user", "content": "Fences?"}], temperature=0,
                   max_tokens=6)  # fmt: skip
        whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
        chunks = client.chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 6
    assert whole.choices[0].message.content == streamed != ""


if __name__ == "__main__":  # the table for a closing note
    os.environ.setdefault("TRITON_INTERPRET", "1")
    for key in ALL:
        print(measured(*key).row(), flush=True)
