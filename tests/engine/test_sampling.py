"""The batched sampler (adapters/engine/sampling.py): exact draws from (seed, index),
batch invariance, the distribution it samples, top_p, and masked tokens."""

from __future__ import annotations

import math

import pytest
import torch

from adapters.engine import sampling
from adapters.engine.engine import sample_rows
from adapters.engine.sampling import (
    NUCLEUS_PROBE,
    TokenDraw,
    _pick,
    _pick_nucleus,
    mix64,
    sample,
    sample_whole,
    token_uniform,
    uniforms,
)

VOCAB = 1000


picks = sample_rows  # what the engine calls: the probe, then the whole-row fix-up


def test_tensor_uniforms_equal_the_integer_reference_bit_for_bit() -> None:
    edges = [-(2**63), -(2**63) + 1, -1, 0, 1, 2**62, 2**63 - 1]
    seeds = sorted({*edges, *range(-50, 50, 7), 123456789123, -987654321987})
    indices = [0, 1, 2, 17, 1023, 2**31 - 1, 2**40]
    pairs = [(s, i) for s in seeds for i in indices]
    got = uniforms(
        torch.tensor([s for s, _ in pairs], dtype=torch.int64),
        torch.tensor([i for _, i in pairs], dtype=torch.int64),
    ).tolist()
    assert got == [token_uniform(s, i) for s, i in pairs]
    assert all(0.0 <= u < 1.0 for u in got)
    assert len(set(got)) == len(got)
    assert mix64(0, 0) != mix64(0, 1) != mix64(1, 0)


def test_uniforms_are_spread_evenly() -> None:
    values = uniforms(torch.full((20_000,), 42), torch.arange(20_000)).tolist()
    counts = [0] * 10
    for value in values:
        counts[int(value * 10)] += 1
    assert all(abs(c - 2000) < 4 * math.sqrt(2000) for c in counts)


def test_each_row_draws_the_same_alone_and_in_any_batch() -> None:
    torch.manual_seed(3)
    logits = torch.randn(6, VOCAB) * 3
    draws = [
        TokenDraw(0.0, 1.0, 5, 0),
        TokenDraw(1.0, 0.8, 5, 7),
        TokenDraw(0.7, 1.0, 6, 2),
        TokenDraw(1.3, 0.95, -9, 40),
        TokenDraw(0.0, 0.5, 1, 1),
        TokenDraw(2.0, 1.0, 2**63 - 1, 3),
    ]
    together = picks(logits, draws)
    assert together[0] == int(torch.argmax(logits[0]))
    assert together[4] == int(torch.argmax(logits[4]))
    for row, draw in enumerate(draws):
        assert picks(logits[row : row + 1], [draw]) == [together[row]]
    order = [5, 3, 1, 0, 4, 2]
    assert picks(logits[order], [draws[r] for r in order]) == [together[r] for r in order]
    moved = [TokenDraw(d.temperature, d.top_p, d.seed, d.token_index + 1) for d in draws]
    assert picks(logits, moved) != together  # another index is another draw


def test_draws_follow_the_distribution_after_temperature() -> None:
    logits = torch.full((1, VOCAB), -math.inf)
    logits[0, :4] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    temperature = 0.8
    expected = torch.softmax(logits[0, :4] / temperature, dim=-1).tolist()
    draws = [TokenDraw(temperature, 1.0, seed, 0) for seed in range(4000)]
    counts = [0] * VOCAB
    for token in picks(logits.expand(len(draws), VOCAB), draws):
        counts[token] += 1
    assert sum(counts[:4]) == len(draws)  # masked (-inf) tokens never come up
    for token, p in enumerate(expected):
        sigma = math.sqrt(len(draws) * p * (1 - p))
        assert abs(counts[token] - len(draws) * p) < 4 * sigma


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.full((1, VOCAB), -30.0)
    logits[0, 3], logits[0, 4] = 5.0, 4.0  # ~73% and ~27%; everything else ~0
    assert {picks(logits, [TokenDraw(1.0, 0.5, s, 0)])[0] for s in range(60)} == {3}
    assert {picks(logits, [TokenDraw(1.0, 0.99, s, 0)])[0] for s in range(60)} == {3, 4}


def test_a_nucleus_wider_than_the_probe_is_chosen_over_the_whole_row() -> None:
    flat = torch.zeros(1, VOCAB)
    flat[0, 500:] = -math.inf  # 500 equally likely tokens
    draws = [TokenDraw(1.0, 0.5, seed, 0) for seed in range(400)]
    batch = flat.expand(len(draws), VOCAB)
    _, short = sample(batch, draws).tolist()
    assert all(short)  # the top 64 hold 12.8% of the mass, not 50%
    chosen = picks(batch, draws)
    assert all(0 <= token < 500 for token in chosen)
    assert len(set(chosen)) > 100  # spread over the ~250-token nucleus
    narrow = torch.full((1, VOCAB), -math.inf)
    narrow[0, 7], narrow[0, 9] = 1.0, 0.5
    assert sample(narrow, [TokenDraw(1.0, 0.9, 1, 0)]).tolist()[1] == [0]


def test_the_probe_and_the_whole_row_agree_where_both_apply() -> None:
    torch.manual_seed(5)
    logits = torch.randn(32, VOCAB) * 4
    draws = [TokenDraw(1.0, 0.7, seed, seed) for seed in range(32)]
    chosen, short = sample(logits, draws).tolist()
    assert not any(short) and NUCLEUS_PROBE < VOCAB
    assert sample_whole(logits, draws).tolist() == chosen


def test_rounding_never_picks_a_masked_token_at_the_end_of_the_row() -> None:
    probs = torch.zeros(1, VOCAB)
    probs[0, 0] = 1.0  # the only allowed token is the first
    almost_one = torch.tensor([1 - 2.0**-53], dtype=torch.float64)
    assert float(almost_one.float()) == 1.0  # in float32, u x mass would reach mass
    assert _pick(probs, almost_one).tolist() == [0]
    chosen, reached = _pick_nucleus(probs, almost_one, torch.tensor([0.9]))
    assert chosen.tolist() == [0] and reached.tolist() == [True]
    seeds = [s for s in range(3000) if token_uniform(s, 0) > 0.999]
    logits = torch.log(probs)
    assert seeds and all(picks(logits, [TokenDraw(1.0, 1.0, s, 0)]) == [0] for s in seeds)


def test_a_nucleus_wider_than_the_second_look_is_chosen_over_the_sorted_row(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flat = torch.zeros(1, 5000)  # 5,000 equally likely tokens: the nucleus holds 2,500
    draws = [TokenDraw(1.0, 0.5, seed, 0) for seed in range(300)]
    chosen = picks(flat.expand(len(draws), 5000), draws)
    assert all(0 <= token < 5000 for token in chosen)
    assert len(set(chosen)) > 250
    # a narrower nucleus gives the same draws whichever look finds it
    torch.manual_seed(8)
    peaked = torch.randn(8, 5000) * 2
    narrow = [TokenDraw(1.0, 0.6, seed, 1) for seed in range(8)]
    via_probe = picks(peaked, narrow)
    assert sample_whole(peaked, narrow).tolist() == via_probe
    monkeypatch.setattr(sampling, "WIDE_PROBE", 1)  # every row now goes to the sort
    assert sample_whole(peaked, narrow).tolist() == via_probe
