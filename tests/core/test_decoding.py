"""The stop rule and output bookkeeping every decoder shares, and core's fake model."""

from __future__ import annotations

import pytest

from core.decoding import Generation, stop_reason
from core.fake_model import (
    EOS_TOKEN,
    FakeContext,
    FakeDecode,
    reference_output,
    reference_tokens,
)
from core.protocol import (
    Assignment,
    Decoded,
    DecodeDone,
    DecoderEvent,
    GenerationRequest,
    Sampling,
)

A = Assignment("r", 1)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        ((), None),
        ((4,), None),
        ((4, 9), "eos"),  # 9 is a stop id
        ((4, 4, 4), "length"),  # the budget (3) is used
        ((4, 4, 9), "eos"),  # a stop token that also fills the budget is eos
    ],
)
def test_stop_reason(output: tuple[int, ...], expected: str | None) -> None:
    assert stop_reason(output, 3, {9}) == expected


def test_a_generation_numbers_tokens_from_its_prefix_and_stops_by_the_rule() -> None:
    request = GenerationRequest("r", (1, 2), 5, output_prefix=(7, 8))
    generation = Generation(A, request, {9})
    assert generation.ended_at_start() is None
    events: list[DecoderEvent] = []
    assert not generation.emit(6, events)
    assert generation.emit(9, events)
    assert events == [Decoded(A, 2, 6), Decoded(A, 3, 9), DecodeDone(A, "eos")]
    assert generation.output == [7, 8, 6, 9]


@pytest.mark.parametrize(
    ("prefix", "reason"), [((3, 3, 3), "length"), ((3, 9), "eos"), ((3,), None)]
)
def test_a_continuation_whose_prefix_had_ended_ends_at_once(
    prefix: tuple[int, ...], reason: str | None
) -> None:
    request = GenerationRequest("r", (1,), 3, output_prefix=prefix)
    done = Generation(A, request, {9}).ended_at_start()
    assert done == (None if reason is None else DecodeDone(A, reason))  # type: ignore[arg-type]


def _decode_all(run: FakeDecode) -> list[DecoderEvent]:
    events: list[DecoderEvent] = []
    for _ in range(10_000):
        if run.step(events):
            return events
    raise AssertionError("the fake decode never ended")


def test_the_fake_model_continues_exactly_where_its_prefix_ends() -> None:
    request = GenerationRequest("r", (5, 6, 7), 300)
    whole, reason = reference_output(request)
    assert reason in ("eos", "length")
    for k in (1, 7, len(whole) - 1):
        tokens, again = reference_output(request, prefix=tuple(whole[:k]))
        assert (tokens, again) == (whole, reason)
    assert reference_tokens(request, len(whole)) == whole


def test_the_fake_model_stops_at_eos_and_request_stop_ids_unless_told_to_ignore_them() -> None:
    request = GenerationRequest("r", (5, 6, 7), 400)
    free = reference_tokens(request, 400)
    first_eos = free.index(EOS_TOKEN)  # the fake model ends about one token in 89
    events = _decode_all(FakeDecode(A, request))
    assert events[-1] == DecodeDone(A, "eos")
    assert [e.token_id for e in events if isinstance(e, Decoded)] == free[: first_eos + 1]
    stop_at = free[1] if free[1] != EOS_TOKEN else free[2]
    stopped = GenerationRequest("r", (5, 6, 7), 400, stop_token_ids=(stop_at,))
    events = _decode_all(FakeDecode(A, stopped))
    assert [e.token_id for e in events if isinstance(e, Decoded)][-1] == stop_at
    events = _decode_all(FakeDecode(A, request, ignore_eos=True))
    assert events[-1] == DecodeDone(A, "length")
    assert [e.token_id for e in events if isinstance(e, Decoded)] == free


def test_a_salt_changes_the_draw_and_a_seed_fixes_it() -> None:
    request = GenerationRequest("r", (5, 6, 7), 50)
    assert reference_tokens(request, 50, salt=1) != reference_tokens(request, 50, salt=2)
    assert reference_tokens(request, 50, salt=1) == reference_tokens(request, 50, salt=1)


def test_a_record_is_the_contexts_whichever_draw_reaches_it() -> None:
    """As a real model's logprobs: two attempts (salts) or two seeds that reach one position
    with the same tokens score a token alike; another context or token scores it apart."""
    unseeded = GenerationRequest("r", (5, 6, 7), 50, Sampling(temperature=0.7))
    seeded = GenerationRequest("r", (5, 6, 7), 50, Sampling(temperature=0.7, seed=11))
    prefix = tuple(reference_tokens(unseeded, 19, salt=1))
    records = {
        FakeContext(request, salt, prefix).record(EOS_TOKEN, 5)
        for request in (unseeded, seeded)
        for salt in (0, 1, 2, 300)
    }
    assert len(records) == 1
    (record,) = records
    assert len(record.top) == 5
    other_token = FakeContext(unseeded, 1, prefix).record(prefix[0], 5)
    other_context = FakeContext(unseeded, 1, (*prefix[:-1], prefix[-1] + 1)).record(EOS_TOKEN, 5)
    other_prompt = FakeContext(GenerationRequest("r", (5, 6, 8), 50), 1, prefix)
    assert record not in (other_token, other_context, other_prompt.record(EOS_TOKEN, 5))
