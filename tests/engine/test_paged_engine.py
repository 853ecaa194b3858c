"""The paged KV cache on the real default model (fp32, greedy): prefix caching, preemption.

Every test compares token for token against a run that cannot have used what
it tests (no prefix cache, or a pool too big to preempt), so a wrong block
table, a block shared before it was written, or a recompute that drifts by a
position shows up as different tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from adapters.engine.engine import Engine
from adapters.engine.model import LoadedModel, chat_token_ids, load_model
from adapters.engine.quality import text_tokens
from adapters.runtime.worker_host import EngineDecoder
from core.batching import BatchLimits
from core.protocol import Assignment, Decoded, DecodeDone, GenerationRequest, Sampling
from tests.engine.test_engine import run

# One worker of a parallel run holds this module's loaded model (pytest-xdist).
pytestmark = pytest.mark.xdist_group("paged_engine")


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread, as serving runs it: on a busy 2-core machine two threads
    made these tests 20x slower (every parallel op waits for its slowest half)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(quiet=True)


@pytest.fixture(scope="module")
def text(loaded: LoadedModel) -> list[int]:
    return text_tokens(loaded, 1200)


def engine(loaded: LoadedModel, max_seqs: int = 4, **options: object) -> Engine:
    limits = BatchLimits(max_seqs=max_seqs, max_context=512)
    return Engine(loaded, limits, "fp32", **options)  # type: ignore[arg-type]


def ask(loaded: LoadedModel, document: str, question: str) -> tuple[int, ...]:
    content = f"{document}\n\n{question}"
    return tuple(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": content}]))


def test_a_cached_long_prefix_gives_the_tokens_of_an_uncached_run(
    loaded: LoadedModel, text: list[int]
) -> None:
    document = loaded.tokenizer.decode(text[:200])
    first = GenerationRequest("first", ask(loaded, document, "Summarize this."), 8)
    second = GenerationRequest("second", ask(loaded, document, "Who wrote this text?"), 16)
    cached = engine(loaded)
    run(cached, [first])
    computed_before = cached.cache_report().computed_tokens
    with_cache = run(cached, [second])["second"]
    without = run(engine(loaded, prefix_caching=False), [second])["second"]
    assert with_cache == without
    computed = cached.cache_report().computed_tokens - computed_before
    shared = cached.blocks.block_size * (150 // cached.blocks.block_size)
    assert computed <= len(second.prompt_token_ids) - shared  # >= 150 tokens came cached
    report = EngineDecoder(cached).cache_report()
    assert report is not None and report == cached.cache_report()
    assert report.prompt_tokens == len(first.prompt_token_ids) + len(second.prompt_token_ids)
    assert report.computed_tokens < report.prompt_tokens
    assert report.prefill_rate > 0 and len(report.keys) > 0


def test_choices_of_one_prompt_started_together_compute_it_once(
    loaded: LoadedModel, text: list[int]
) -> None:
    """n choices (or a burst of chats with one system prompt) arrive in one step: the
    first computes the shared blocks, the others wait for them instead of computing
    them beside it, and an unrelated request is not held up."""
    prompt = tuple(text[400:500])
    choices = [GenerationRequest(f"c{i}", prompt, 12, Sampling(0.8, seed=i + 1)) for i in range(3)]
    other = GenerationRequest("other", tuple(text[600:650]), 12)
    eng = engine(loaded)
    for request in (*choices, other):
        eng.start(Assignment(request.request_id, 1), request)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in (*choices, other)}
    for step in range(200):
        for event in eng.step():
            if isinstance(event, Decoded):
                tokens[event.assignment.request_id].append(event.token_id)
        if step == 0:
            assert eng.active == 2  # the first choice and the unrelated request
        if not eng.has_work():
            break
    size = eng.blocks.block_size
    tail = len(prompt) - size * ((len(prompt) - 1) // size)  # what a sharer computes
    report = eng.cache_report()
    assert report.computed_tokens == len(prompt) + 2 * tail + len(other.prompt_token_ids)
    alone = run(engine(loaded, prefix_caching=False), [*choices, other])
    assert {rid: [*out, "length"] for rid, out in tokens.items()} == alone


def test_a_continuation_reuses_its_own_earlier_output_and_goes_on_exactly(
    loaded: LoadedModel, text: list[int]
) -> None:
    prompt = tuple(text[300:380])
    eng = engine(loaded)
    whole = run(eng, [GenerationRequest("w", prompt, 40)])["w"]
    assert whole[-1] == "length"
    prefix = tuple(int(t) for t in whole[:36])  # type: ignore[call-overload]
    hits_before = eng.blocks.hits
    computed_before = eng.cache_report().computed_tokens
    continuation = GenerationRequest("c", prompt, 40, output_prefix=prefix)
    assert run(eng, [continuation])["c"] == whole[36:]
    # 80 + 36 tokens of context: every full block but the last was found cached,
    # the answer's own blocks included.
    assert eng.blocks.hits - hits_before == 112
    assert eng.cache_report().computed_tokens - computed_before == 4


def test_preemption_under_a_tiny_pool_changes_no_token(
    loaded: LoadedModel, text: list[int]
) -> None:
    requests = [GenerationRequest(f"p{i}", tuple(text[i * 50 : i * 50 + 40]), 40) for i in range(4)]
    endless = dataclasses.replace(loaded, eos_token_ids=frozenset())
    roomy = run(Engine(endless, BatchLimits(max_seqs=4, max_context=512), "fp32"), requests)
    tight = Engine(
        endless, BatchLimits(max_seqs=4, max_context=512), "fp32", kv_cache_tokens=12 * 16
    )
    pressed = run(tight, requests)
    assert tight.preemptions > 0
    assert pressed == roomy
    assert all(out[-1] == "length" for out in pressed.values())
    assert tight.blocks.holders() == 0


def test_sixty_four_short_chats_all_run_at_once_in_the_default_pool(
    loaded: LoadedModel, text: list[int]
) -> None:
    eng = engine(loaded, max_seqs=64)
    requests = [GenerationRequest(f"c{i}", tuple(text[i * 9 : i * 9 + 60]), 32) for i in range(64)]
    for request in requests:
        eng.start(Assignment(request.request_id, 1), request)
    eng.step()
    assert eng.active == 64  # every one admitted in the first step
    ended = 0
    while eng.has_work():
        events = eng.step()
        ended += sum(isinstance(e, DecodeDone) and e.reason != "failed" for e in events)
    assert ended == 64
    assert eng.preemptions == 0
