"""Every prefill chunk of a step in one forward pass (Engine._prefill, Runner.
prefill_packed) gives the same events as one forward per chunk, which is how the engine
prefilled before: tokens, stop reasons and logprob records, on the tiny llama in every
weight format and on the real default model."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch
from transformers import LlamaForCausalLM

from adapters.engine.engine import Engine, logprob_records, sample_rows
from adapters.engine.model import LoadedModel, chat_token_ids, load_model
from adapters.engine.quality import text_tokens
from adapters.engine.runner import Chunk
from adapters.engine.weights import FORMATS
from core.batching import BatchLimits
from core.protocol import (
    Assignment,
    Decoded,
    DecoderEvent,
    GenerationRequest,
    Sampling,
)
from tests.engine.test_engine import tiny_llama
from tests.engine.test_engine_grammar import EOS, GRAMMAR, byte_level

# One worker of a parallel run holds this module's loaded model (pytest-xdist).
pytestmark = pytest.mark.xdist_group("packed_prefill")

VOCAB = 97
SHARED = tuple(range(40, 72))  # two blocks of 16: a prefix-cache hit for whoever follows


class ChunkByChunk(Engine):
    """The engine as it prefilled before packing: one forward pass per chunk, through
    prefill(), and each completing sequence sampled alone (the reference, kept apart
    from Engine._prefill so that a mistake there cannot hide in both)."""

    def _prefill(self, chunks: list[Any], events: list[DecoderEvent]) -> None:
        scheduler = self.scheduler
        for seq, count in chunks:
            prefilled, _ = scheduler.progress(seq.key)
            tokens = scheduler.tokens(seq.key)
            chunk = torch.tensor(tokens[prefilled : prefilled + count])
            logits = self.runner.prefill(self.blocks.table(seq.key), prefilled, chunk)
            complete = scheduler.prefilled(seq.key, count)
            self._computed_tokens += count
            self.blocks.commit(seq.key, tokens[: prefilled + count])
            if complete:
                logits = logits[None]
                if seq.matcher is not None:
                    grammars = self.grammars()
                    pending = grammars.penalties([seq.matcher], logits.shape[-1])
                    logits = grammars.apply(logits, [0], pending)
                draws = [seq.draw()]
                [token] = sample_rows(logits, draws)
                [record] = logprob_records(logits, [token], draws, [seq.request.logprobs])
                self._emit(seq, token, events, record)


class Packing(Engine):
    """The engine, counting the most chunks it packed into one pass."""

    most_chunks = 0

    def _prefill(self, chunks: list[Any], events: list[DecoderEvent]) -> None:
        self.most_chunks = max(self.most_chunks, len(chunks))
        super()._prefill(chunks, events)


@pytest.fixture(scope="module")
def tiny() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, 256)


@pytest.fixture(scope="module")
def byte_tokenizer() -> Any:
    return byte_level()


def events(eng: Engine, waves: list[list[GenerationRequest]]) -> list[DecoderEvent]:
    """Start each wave's requests at once and step until the engine is idle, wave
    after wave: every event, in order."""
    out: list[DecoderEvent] = []
    for wave in waves:
        for request in wave:
            eng.start(Assignment(request.request_id, 1), request)
        while eng.has_work():
            out.extend(eng.step())
    return out


def assert_same(got: list[DecoderEvent], want: list[DecoderEvent]) -> None:
    """The same events in the same order, token for token; logprob values equal to
    within rounding: a product over more rows may round its last bits otherwise, and
    over 30 layers that moves a logprob by ~1e-5 (measured on the default model)."""
    assert [without_logprob(e) for e in got] == [without_logprob(e) for e in want]
    for mine, theirs in zip(got, want, strict=True):
        if isinstance(mine, Decoded) and mine.logprob is not None:
            assert isinstance(theirs, Decoded) and theirs.logprob is not None
            ids = [i for i, _ in mine.logprob.top]
            assert ids == [i for i, _ in theirs.logprob.top]
            values = [mine.logprob.logprob, *(v for _, v in mine.logprob.top)]
            expected = [theirs.logprob.logprob, *(v for _, v in theirs.logprob.top)]
            assert values == pytest.approx(expected, rel=1e-4, abs=1e-4)


def without_logprob(event: DecoderEvent) -> DecoderEvent:
    if isinstance(event, Decoded):
        return msgspec.structs.replace(event, logprob=None)
    return event


def tiny_waves() -> list[list[GenerationRequest]]:
    seeded = Sampling(0.9, 0.95, seed=7)
    together = [
        GenerationRequest("short", (9, 8), 30),
        GenerationRequest("mid", (1, 2, 3, 4, 5, 6, 7), 30, seeded, logprobs=3),
        GenerationRequest("long", tuple(range(11, 50)), 30, logprobs=0),
        GenerationRequest("hit", (*SHARED, 3, 4, 5), 30, seeded),
        GenerationRequest("hit-long", (*SHARED, *range(20, 41)), 30, logprobs=2),
        GenerationRequest("more", tuple(range(50, 60)), 30, output_prefix=(5, 6, 7)),
        GenerationRequest("json", (3, 1, 4, 1, 5), 40, seeded, constraint=GRAMMAR),
        GenerationRequest("json-greedy", tuple(range(60, 81)), 40, constraint=GRAMMAR),
    ]
    return [[GenerationRequest("warm", SHARED, 4)], together]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pool_blocks", [256, 6])
def test_packed_prefill_gives_the_events_of_one_forward_per_chunk(
    tiny: LlamaForCausalLM, byte_tokenizer: Any, fmt: str, pool_blocks: int
) -> None:
    """Eight prompts of 2..53 tokens arriving together, in chunks of 5 packed up to 24
    tokens a step: greedy, seeded, logprobs, prefix hits, a continuation, grammars;
    with a pool of 6 blocks, preemption too."""
    loaded = LoadedModel.from_model(tiny, None, "tiny", frozenset({EOS}), 256, "built in the test")
    limits = BatchLimits(
        max_seqs=8,
        max_context=256,
        max_step_tokens=24,
        max_prefill_tokens=5,
        max_idle_prefill_tokens=12,
    )
    options: dict[str, Any] = {
        "grammar_tokenizer": byte_tokenizer,
        "kv_cache_tokens": pool_blocks * 16,
    }
    packed = Packing(loaded, limits, fmt, **options)
    alone = ChunkByChunk(loaded, limits, fmt, **options)
    got = events(packed, tiny_waves())
    assert_same(got, events(alone, tiny_waves()))
    assert packed.blocks.hits > 0 and packed.most_chunks >= (4 if pool_blocks == 256 else 2)
    assert (packed.preemptions > 0) == (pool_blocks == 6)
    assert len({e.assignment.request_id for e in got}) == 9


def test_every_position_prefill_is_the_one_chunk_case_of_the_packed_pass(
    tiny: LlamaForCausalLM,
) -> None:
    """prefill(every_position=True), what the quality scorer reads, equals the rows of
    a packed pass that holds the same chunk beside another sequence's."""
    loaded = LoadedModel.from_model(tiny, None, "tiny", frozenset(), 256, "built in the test")
    eng = Engine(loaded, BatchLimits(max_seqs=4, max_context=256))
    runner = eng.runner
    tokens = torch.tensor(range(3, 30))
    whole = runner.prefill(list(range(0, 4)), 0, tokens, every_position=True)
    last = runner.prefill(list(range(0, 4)), 0, tokens)
    other = Chunk(list(range(4, 8)), 0, torch.tensor(range(50, 70)))
    both = runner.prefill_packed([other, Chunk(list(range(8, 12)), 0, tokens)], range(20, 47))
    assert whole.shape == (27, VOCAB)
    torch.testing.assert_close(last, whole[-1], rtol=1e-5, atol=1e-5)  # lm_head over 1 row
    torch.testing.assert_close(both, whole, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(quiet=True)


@pytest.mark.parametrize("fmt", ["fp32", "int4"])
def test_packed_prefill_on_the_default_model_changes_no_token(
    loaded: LoadedModel, fmt: str
) -> None:
    """Six chats of different lengths at once, four sharing a document (prefix hits
    after the first), in chunks of 48 packed into one pass a step."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        text = loaded.tokenizer.decode(text_tokens(loaded, 120)[:120])
        questions = ["Summarize.", "Who wrote it?", "Is it long?", "Name a word in it."]
        chats = [f"{text}\n\n{q}" for q in questions] + ["Hi!", "What is two plus two?"]
        prompts = [
            tuple(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": c}])) for c in chats
        ]
        sampled = Sampling(0.8, 0.9, seed=11)
        requests = [
            GenerationRequest(
                f"c{i}", p, 6, sampled if i % 2 else Sampling(), logprobs=i % 3 or None
            )
            for i, p in enumerate(prompts)
        ]
        limits = BatchLimits(
            max_seqs=8, max_context=512, max_prefill_tokens=48, max_idle_prefill_tokens=96
        )
        waves = [requests[:1], requests[1:]]
        packed = Packing(loaded, limits, fmt)
        got = events(packed, waves)
        assert_same(got, events(ChunkByChunk(loaded, limits, fmt), waves))
        assert packed.blocks.hits > 0 and packed.most_chunks >= 3
    finally:
        torch.set_num_threads(threads)
