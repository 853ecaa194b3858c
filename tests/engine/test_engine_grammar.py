"""Constrained decoding in the engine, on the tiny random llama with a byte vocabulary.

The tiny model's 97 ids are read as printable ASCII (0..94), eos (95) and a
newline (96), so any output is text and a grammar can hold it to JSON.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import pytest
import torch
from transformers import LlamaForCausalLM

from adapters.engine.engine import Engine
from adapters.engine.grammar import GrammarError, forbidden_penalty, json_schema_grammar
from adapters.engine.model import LoadedModel
from core.batching import BatchLimits
from core.protocol import Assignment, Constraint, GenerationRequest, Sampling
from tests.engine.test_engine import PROMPTS, VOCAB, run, tiny_llama

EOS = 95
SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "pick": {"enum": ["x", "yy"]},
        "ok": {"type": "boolean"},
    },
    "required": ["n", "pick", "ok"],
    "additionalProperties": False,
}
GRAMMAR = Constraint(json_schema_grammar(SCHEMA))


class ByteTokens:
    """llguidance's view of the tiny vocabulary."""

    def __init__(self) -> None:
        self.eos_token_id = EOS
        self.bos_token_id = None
        self.special_token_ids = [EOS]
        self.tokens = [bytes([32 + i]) for i in range(95)] + [b"<eos>", b"\n"]

    def __call__(self, text: str) -> list[int]:
        return [96 if b == 10 else b - 32 for b in text.encode()]


def text(tokens: list[int | str]) -> str:
    return "".join(chr(t + 32) for t in tokens if isinstance(t, int) and t < EOS)


def byte_level() -> Any:
    """llguidance's tokenizer for the byte vocabulary of ByteTokens."""
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(ByteTokens()))


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, 256)


@pytest.fixture(scope="module")
def byte_tokenizer() -> Any:
    return byte_level()


def engine(model: LlamaForCausalLM, tokenizer: Any, kv_cache_tokens: int = 4096) -> Engine:
    limits = BatchLimits(max_seqs=4, max_context=256, max_step_tokens=16, max_prefill_tokens=5)
    loaded = LoadedModel.from_model(model, None, "tiny", frozenset({EOS}), 256, "built in the test")
    return Engine(
        loaded, limits, grammar_tokenizer=tokenizer, kv_cache_tokens=kv_cache_tokens, block_size=8
    )


def constrained(rid: str, prompt: tuple[int, ...], **fields: Any) -> GenerationRequest:
    return GenerationRequest(rid, prompt, 80, constraint=GRAMMAR, **fields)


def test_greedy_constrained_output_is_valid_json_that_ends_with_eos(
    tiny: LlamaForCausalLM, byte_tokenizer: Any
) -> None:
    out = run(engine(tiny, byte_tokenizer), [constrained("c", PROMPTS[0])])["c"]
    assert out[-2:] == [EOS, "eos"]
    answer = json.loads(text(out))
    assert set(answer) == {"n", "pick", "ok"}
    assert 0 <= answer["n"] <= 999 and answer["pick"] in ("x", "yy")
    assert isinstance(answer["ok"], bool)
    free = run(engine(tiny, byte_tokenizer), [GenerationRequest("f", PROMPTS[0], 20)])["f"]
    assert free[:5] != out[:5]  # the random model left alone does not write JSON


def test_constrained_output_is_the_same_alone_and_in_a_batch(
    tiny: LlamaForCausalLM, byte_tokenizer: Any
) -> None:
    alone = run(engine(tiny, byte_tokenizer), [constrained("x", PROMPTS[2])])["x"]
    crowd = [
        constrained("a", PROMPTS[0]),
        GenerationRequest("b", PROMPTS[1], 30, Sampling(0.9, 0.9, 7)),
        constrained("c", PROMPTS[1], sampling=Sampling(1.0, 1.0, 3)),
    ]
    together = run(engine(tiny, byte_tokenizer), [*crowd, constrained("x", PROMPTS[2])])
    assert together["x"] == alone
    json.loads(text(together["c"]))  # a sampled constrained row is valid JSON too


def test_preempted_constrained_sequences_go_on_unchanged(
    tiny: LlamaForCausalLM, byte_tokenizer: Any
) -> None:
    requests = [constrained(f"p{i}", PROMPTS[i % 3], sampling=Sampling(0.9, 1.0, i))
                for i in range(4)]  # fmt: skip
    roomy = run(engine(tiny, byte_tokenizer), requests)
    tight = engine(tiny, byte_tokenizer, kv_cache_tokens=14 * 8)  # one row needs up to 13
    assert run(tight, requests) == roomy
    assert tight.preemptions > 0
    for out in roomy.values():
        json.loads(text(out))


def test_seeded_constrained_sampling_reproduces(
    tiny: LlamaForCausalLM, byte_tokenizer: Any
) -> None:
    request = constrained("s", PROMPTS[1], sampling=Sampling(1.0, 0.9, 1234))
    first = run(engine(tiny, byte_tokenizer), [request])["s"]
    assert run(engine(tiny, byte_tokenizer), [request])["s"] == first
    json.loads(text(first))


@pytest.mark.parametrize("k", [1, 5, 9])
@pytest.mark.parametrize("sampling", [Sampling(0.0), Sampling(1.0, 0.9, 77)])
def test_a_continuation_goes_on_as_the_undisturbed_run(
    tiny: LlamaForCausalLM, byte_tokenizer: Any, k: int, sampling: Sampling
) -> None:
    whole = run(engine(tiny, byte_tokenizer), [constrained("w", PROMPTS[0], sampling=sampling)])
    whole = whole["w"]
    prefix = tuple(t for t in whole[:k] if isinstance(t, int))
    resumed = constrained("w", PROMPTS[0], output_prefix=prefix, sampling=sampling)
    assert [*prefix, *run(engine(tiny, byte_tokenizer), [resumed])["w"]] == whole


def test_a_bad_grammar_or_prefix_fails_that_request_alone(
    tiny: LlamaForCausalLM, byte_tokenizer: Any
) -> None:
    eng = engine(tiny, byte_tokenizer)
    bad = GenerationRequest("bad", PROMPTS[0], 10, constraint=Constraint("start: ("))
    with pytest.raises(GrammarError):
        eng.start(Assignment("bad", 1), bad)
    not_json = constrained("p", PROMPTS[0], output_prefix=(ord("x") - 32,))
    with pytest.raises(GrammarError):
        eng.start(Assignment("p", 1), not_json)
    out = run(eng, [constrained("ok", PROMPTS[0])])["ok"]
    assert out[-1] == "eos" and json.loads(text(out))


def test_a_repeated_grammar_compiles_once(tiny: LlamaForCausalLM, byte_tokenizer: Any) -> None:
    eng = engine(tiny, byte_tokenizer)
    run(eng, [constrained(f"r{i}", PROMPTS[i % 3]) for i in range(4)])
    assert eng.grammars().compiled_count == 1


def test_a_model_without_a_tokenizer_refuses_constraints(tiny: LlamaForCausalLM) -> None:
    eng = engine(tiny, None)
    with pytest.raises(GrammarError, match="no tokenizer"):
        eng.start(Assignment("c", 1), constrained("c", PROMPTS[0]))


def test_the_penalty_forbids_exactly_the_tokens_whose_bit_is_clear() -> None:
    allowed = {0, 5, 31, 32, 63, 64, 95}
    bitmask = torch.zeros((1, 3), dtype=torch.int32)
    for token in allowed:
        word, bit = divmod(token, 32)
        bitmask[0, word] |= torch.tensor(1 << bit, dtype=torch.int64).to(torch.int32)
    penalty = forbidden_penalty(bitmask, 100, torch.float32)  # 3 words: 96..99 forbidden
    assert {int(t) for t in torch.nonzero(penalty[0] == 0)} == allowed
    probs = torch.softmax(torch.randn(1, 100) + penalty, dim=-1)
    assert {int(t) for t in torch.nonzero(probs[0])} == allowed
