"""Every registered family against transformers' own forward, on every CPU decode path.

For each case of tests/support/tiny_models.py (every family has one or more): a tiny
random checkpoint saved as a user would have it is loaded through the engine's
own loader and served by the engine in fp32; its greedy tokens over 32 steps
must equal transformers' greedy `generate`, and the log probability of each
token must be within 1e-4 of transformers' scores, on the eager decode step
and on the fixed-shape step the CUDA graphs capture. Where the native fused
pass runs the family (w4a16), its logits must equal the torch forward with the
same packed weights (up to the fp16 KV cache's rounding), prefilled and decoded.
A family added to the registry with no case here fails the coverage test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from adapters.engine.engine import Engine
from adapters.engine.families import FAMILIES, family_for
from adapters.engine.model import LoadedModel, load_model
from adapters.engine.native import model_problem
from adapters.engine.native_build import NativeUnavailable, load
from adapters.engine.runner import Runner
from core.batching import BatchLimits
from core.protocol import Assignment, Decoded, GenerationRequest
from tests.support import tiny_models

STEPS = 32
PROMPT = [101, 2037, 7, 48000, 15, 333, 9021, 4]  # 8 tokens; windows of 12 bind past them


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tiny-models")


def test_every_registered_family_has_a_case() -> None:
    covered = {family_for(tiny_models.config(case)).name for case in tiny_models.CASES}
    assert covered == {family.name for family in FAMILIES}


def reference(case: str) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and each one's log probability (fp32)."""
    model = tiny_models.model(case)
    out = tiny_models.greedy(model, PROMPT, STEPS)
    tokens = out.sequences[0, len(PROMPT) :].tolist()
    logprobs = [
        float(torch.log_softmax(score[0].float(), dim=-1)[token])
        for score, token in zip(out.scores, tokens, strict=True)
    ]
    return tokens, logprobs


def served(loaded: LoadedModel, decode: str) -> tuple[list[int], list[float]]:
    engine = Engine(
        loaded, BatchLimits(max_seqs=2, max_context=128), weights="fp32", decode=decode,
        attention="gather" if decode == "static" else "auto",
    )  # fmt: skip
    engine.start(Assignment("x", 1), GenerationRequest("x", tuple(PROMPT), STEPS, logprobs=0))
    tokens, logprobs = [], []
    while engine.has_work():
        for event in engine.step():
            if isinstance(event, Decoded):
                tokens.append(event.token_id)
                assert event.logprob is not None
                logprobs.append(event.logprob.logprob)
    return tokens, logprobs


@pytest.fixture(scope="module")
def references() -> dict[str, tuple[list[int], list[float]]]:
    return {}


@pytest.mark.parametrize("decode", ["eager", "static"])
@pytest.mark.parametrize("case", list(tiny_models.CASES))
def test_greedy_tokens_and_logprobs_equal_transformers(
    case: str, decode: str, folder: Path, references: dict[str, Any]
) -> None:
    if case not in references:
        references[case] = reference(case)
    want_tokens, want_logprobs = references[case]
    loaded = load_model(tiny_models.saved(case, folder), quiet=True)
    tokens, logprobs = served(loaded, decode)
    assert tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def _native_or_skip(loaded: LoadedModel) -> None:
    try:
        load()
    except NativeUnavailable as error:
        pytest.skip(f"no native kernels here: {error}")
    if problem := model_problem(loaded.spec):
        pytest.skip(f"the fused pass does not run {loaded.family}: {problem}")


@pytest.mark.parametrize("fmt", ["w4a16", "w4a8"])
@pytest.mark.parametrize("case", list(tiny_models.CASES))
def test_the_native_pass_computes_the_torch_forward_of_its_packed_weights(
    case: str, folder: Path, fmt: str
) -> None:
    loaded = load_model(tiny_models.saved(case, folder), quiet=True)
    _native_or_skip(loaded)
    prompt = torch.tensor(PROMPT * 3)  # 24 positions over two blocks, past the windows
    native = Runner(loaded, 8, 16, 64, fmt)
    composed = Runner(loaded, 8, 16, 64, fmt)
    composed._native = None  # torch's forward over the same packed products, fp32 cache
    composed.k_cache, composed.v_cache = composed.k_cache.float(), composed.v_cache.float()
    fused, torch_forward = (r.prefill([0, 1], 0, prompt, True) for r in (native, composed))
    # only the fp16 cache differs (one-byte activations may carry its rounding a step)
    bound = 2e-3 if fmt == "w4a16" else 3e-2
    assert float((fused - torch_forward).norm() / torch_forward.norm()) < bound
    # a decoded position equals the same position prefilled, bit for bit
    stepwise = Runner(loaded, 8, 16, 64, fmt)
    stepwise.prefill([0, 1], 0, prompt[:20], True)
    got = stepwise.decode(stepwise.pages([[0, 1]], 21), torch.tensor([20]), prompt[20:21])
    assert torch.equal(got[0], fused[20])
