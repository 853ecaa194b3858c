"""Speculative decoding never changes a token: guesses kept only where the model draws them.

On the embedded default model (the native format, where a prefilled position
equals a decoded one bit for bit): greedy and seeded answers, their log
probabilities, a JSON-schema answer, a budget that ends inside an accepted
run, continuations from any cut and mixed batches are the same with
speculation off, by n-gram and by a draft model; and speculation did run
(guesses were accepted), so the equality is not that of two plain runs. On
tiny random checkpoints of several families (torch's fp32 forward) the same
for greedy and seeded requests, a draft of another family proposing. Every
KV block is back in the pool at the end.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from adapters.engine.build import speculation
from adapters.engine.choose import working_formats
from adapters.engine.engine import Engine, draft_problem
from adapters.engine.grammar import json_schema_grammar
from adapters.engine.model import LoadedModel, chat_token_ids, load_model
from adapters.engine.options import EngineOptions
from adapters.engine.speculative import (
    NgramIndex,
    Pacer,
    PassCosts,
    SpeculativeOptions,
    pass_costs,
    worth_verifying,
)
from core.batching import BatchLimits
from core.protocol import (
    Assignment,
    Constraint,
    Decoded,
    DecodeDone,
    GenerationRequest,
    Sampling,
    TokenLogprob,
)
from tests.support import tiny_models

pytestmark = pytest.mark.xdist_group("default_model")

PARAGRAPH = (
    "The old lighthouse stood on the northern cliff for more than two hundred years. "
    "Every night its keeper climbed the narrow stairs, trimmed the wick and polished the "
    "great lens until it shone. Ships passing in the dark relied on its steady beam to "
    "find the harbour and avoid the rocks below."
)
EDIT = f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}"
LIMITS = BatchLimits(max_seqs=8, max_context=1024, max_step_tokens=96, max_prefill_tokens=64)
# Every guess pays (a pass costs the same over any count): these engines verify all they
# can, whatever this machine measures, so the equalities below are of the most speculation.
FLAT = PassCosts((0, 1024), (0.0, *[1.0] * 12), (0.0, *[1.0] * 12))
NGRAM = SpeculativeOptions("ngram", 6, costs=FLAT)
DRAFT = SpeculativeOptions("draft", 4, costs=FLAT)

Output = dict[str, tuple[list[int], list[TokenLogprob | None], str | None]]


def chat(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": text}]))


def run(engine: Engine, requests: list[GenerationRequest]) -> Output:
    for request in requests:
        engine.start(Assignment(request.request_id, 1), request)
    out: Output = {r.request_id: ([], [], None) for r in requests}
    for _ in range(10_000):
        if not engine.has_work():
            blocks = engine.blocks
            assert blocks.free_blocks() + blocks.cached_blocks() == blocks.num_blocks
            return out
        for event in engine.step():
            tokens, records, _ = out[event.assignment.request_id]
            if isinstance(event, Decoded):
                assert event.index == len(tokens) + len(_prefix(requests, event))
                tokens.append(event.token_id)
                records.append(event.logprob)
            elif isinstance(event, DecodeDone):
                out[event.assignment.request_id] = (tokens, records, event.reason)
    raise AssertionError("the engine never finished")


def _prefix(requests: list[GenerationRequest], event: Decoded) -> tuple[int, ...]:
    return next(r.output_prefix for r in requests if r.request_id == event.assignment.request_id)


@pytest.fixture(scope="module")
def default() -> LoadedModel:
    return load_model(quiet=True)


def native_format() -> str:
    for fmt in ("w4a8", "w4a16"):
        if fmt in working_formats(torch.device("cpu")):
            return fmt
    pytest.skip("no native kernels on this CPU: the default model has no exact fast path")


def test_guesses_come_from_earlier_occurrences_and_the_pacer_follows_acceptance() -> None:
    index = NgramIndex(2, 3)
    tokens = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert index.propose(tokens, 3) == [8, 9, 1]  # 5 6 7 was seen, followed by 8 9 1
    assert index.propose([*tokens, 8, 4], 3) == []  # 8 4 never was
    assert index.propose([*tokens, 8, 4, 1, 5], 2) == [6, 7]  # its latest occurrence
    assert NgramIndex(2, 3).propose([1, 2, 3, 4], 4) == []  # its own suffix is no match
    pacer = Pacer(8)
    assert pacer.length == 4
    pacer.update(4, 4)
    assert pacer.length == 8
    pacer.update(8, 2)
    assert pacer.length == 3
    pacer.update(3, 0)
    assert pacer.length == 1
    kept, missed = 0.8**3 + 4 * 0.8**2 + 2 * 0.8, 0.8**3 + 0.8 + 1
    assert pacer.acceptance == pytest.approx(kept / (kept + missed))
    for _ in range(200):  # its guesses were not worth verifying for a while
        pacer.idle()
    assert pacer.acceptance == pytest.approx(0.5, abs=1e-3)  # back to the prior: tried again
    with pytest.raises(ValueError, match="ngram or draft"):
        SpeculativeOptions("medusa")


def test_guesses_are_verified_only_where_they_pay_for_their_positions() -> None:
    # a CPU's curve: a second position is nearly free, the sixth doubles the pass
    cpu = [0.0, 1.0, 1.05, 1.3, 1.4, 1.5, 2.6, 2.7, 2.8, 2.9]
    assert worth_verifying(cpu, 1, [8], [0.9]) == [4]  # 1 + .9 + .81 + .73 + .66 over 1.5
    assert worth_verifying(cpu, 1, [8], [0.2]) == [1]  # only the nearly free one
    assert worth_verifying(cpu, 1, [2], [0.9]) == [2]  # it has no more
    assert worth_verifying(cpu, 2, [3, 3], [0.9, 0.1]) == [3, 0]  # the likely ones first
    assert worth_verifying([0.0, 1.0, 2.0, 3.0], 1, [3], [0.99]) == [0]  # none pays
    assert worth_verifying(cpu, 9, [3], [1.0]) == [0]  # no room left in the step
    costs = PassCosts((100, 1100), (0.0, 1.0, 1.2), (0.0, 2.0, 3.2))
    assert costs.at(0) == [0.0, 1.0, 1.2] and costs.at(600) == [0.0, 1.5, 2.2]
    assert costs.at(2100) == [0.0, 3.0, 5.2]


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_the_default_model_gives_the_same_tokens_and_logprobs_with_speculation(
    default: LoadedModel, kind: str
) -> None:
    fmt = native_format()
    prompt = chat(default, EDIT)
    greedy = GenerationRequest("g", prompt, 120, logprobs=2)
    seeded = GenerationRequest("s", prompt, 120, Sampling(0.7, 0.9, 11), logprobs=1)
    short = GenerationRequest("t", prompt, 9)  # its budget ends inside an accepted run
    others = [
        GenerationRequest(
            f"n{i}", chat(default, f"Name {i + 2} colours."), 30, Sampling(0.9, 1.0, i)
        )
        for i in range(3)
    ]
    plain = run(Engine(default, LIMITS, fmt), [greedy, seeded, short])
    options, draft = (NGRAM, None) if kind == "ngram" else (DRAFT, (default, fmt))
    alone = Engine(default, LIMITS, fmt, speculative=options, draft=draft)
    assert run(alone, [greedy]) == {"g": plain["g"]}
    assert alone.spec_stats.accepted > 20, alone.spec_stats  # long runs were accepted
    mixed = Engine(default, LIMITS, fmt, speculative=options, draft=draft)
    together = run(mixed, [*others, greedy, seeded, short])
    for key in ("g", "s", "t"):
        assert together[key] == plain[key], key
    assert len(plain["t"][0]) == 9 and plain["t"][2] == "length"
    assert mixed.cache_report().spec_accepted == mixed.spec_stats.accepted > 0
    # continuations from any cut, as a resume or a handoff sends them
    for cut in (1, 7, 50):
        for request in (greedy, seeded):
            whole = plain[request.request_id][0]
            name = f"{request.request_id}{cut}"
            rest = GenerationRequest(
                name, prompt, 120, request.sampling, output_prefix=tuple(whole[:cut])
            )
            assert whole[:cut] + run(alone, [rest])[name][0] == whole, name


def test_a_json_schema_answer_is_the_same_with_speculation(default: LoadedModel) -> None:
    fmt = native_format()
    schema = {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "string", "maxLength": 40},
                "minItems": 4,
                "maxItems": 5,
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    }
    constraint = Constraint(json_schema_grammar(schema))
    prompt = chat(default, 'Put "red fence post" six times in a JSON list of items.')
    requests = [
        GenerationRequest("j", prompt, 100, constraint=constraint),
        GenerationRequest("k", prompt, 100, Sampling(0.8, 0.95, 5), constraint=constraint),
    ]
    plain = run(Engine(default, LIMITS, fmt), requests)
    engine = Engine(default, LIMITS, fmt, speculative=NGRAM)
    assert run(engine, requests) == plain
    assert engine.spec_stats.proposed > 0
    answer = json.loads(default.tokenizer.decode(plain["j"][0], skip_special_tokens=True))
    assert 4 <= len(answer["items"]) <= 5


def test_auto_speculates_by_ngram_where_it_measured_faster_and_exact(
    default: LoadedModel,
) -> None:
    def chosen(fmt: str, **asked: str) -> str:
        options, draft = speculation(default, EngineOptions(**asked), fmt)  # type: ignore[arg-type]
        assert (draft is None) == (options is None or options.kind != "draft")
        return "none" if options is None else options.kind

    assert chosen("w4a8") == chosen("w4a16") == "ngram"  # the native formats
    assert chosen("fp32") == chosen("bf16") == "none"  # torch's: prefill and decode round
    assert chosen("fp32", speculative="ngram") == "ngram"  # asked for by name
    assert chosen("w4a8", speculative="none") == "none"
    assert chosen("w4a8", draft_model=default.source) == "draft"
    with pytest.raises(ValueError, match="is for --speculative draft"):
        chosen("w4a8", speculative="ngram", draft_model=default.source)


def test_a_draft_needs_the_same_tokenizer(default: LoadedModel, tmp_path: Path) -> None:
    assert draft_problem(default, default) is None
    with pytest.raises(ValueError, match="needs --draft-model"):
        Engine(default, LIMITS, native_format(), speculative=DRAFT)


FAMILIES = ["llama", "qwen3", "gemma3", "qwen3-moe"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("speculative-families")


@pytest.mark.parametrize("case", FAMILIES)
def test_tiny_families_give_the_same_tokens_with_speculation(case: str, folder: Path) -> None:
    loaded = load_model(tiny_models.saved(case, folder), quiet=True)
    drafter = load_model(
        tiny_models.saved("llama" if case != "llama" else "qwen3", folder), quiet=True
    )
    # a prompt that repeats itself: a random model's answer soon repeats too
    prompt = chat(loaded, "post fence post fence post fence post fence post fence")
    requests = [
        GenerationRequest("g", prompt, 48),
        # temperature 0.02: a nucleus of ~10 of a random model's nearly flat logits
        # (test_family_serving says why)
        GenerationRequest("s", prompt, 48, Sampling(0.02, 0.9, 7)),
    ]
    plain = run(Engine(loaded, LIMITS), requests)
    measured = SpeculativeOptions("ngram", 6)  # its costs measured as the engine starts
    for options, draft in (
        (NGRAM, None), (measured, None), (DRAFT, (loaded, "fp32")), (DRAFT, (drafter, "fp32"))
    ):  # fmt: skip
        engine = Engine(loaded, LIMITS, speculative=options, draft=draft)
        assert run(engine, requests) == plain, (options.kind, draft and draft[0].family)
        if options.costs is not None:
            assert engine.spec_stats.proposed > 0
    costs = pass_costs(Engine(loaded, LIMITS).runner, 12)
    for curve in (costs.near, costs.far):
        assert curve[0] == 0 and curve[1] > 0 and all(a <= b for a, b in itertools.pairwise(curve))
    assert costs.positions == (32, min(1024, LIMITS.max_context - 13))
