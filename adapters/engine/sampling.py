"""Choosing tokens for a whole batch at once, on the logits' device.

The contract (docs/design/engine.md): the draw for token i of a request
depends only on (seed, i), so a request samples the same tokens alone, in any
batch, and in a continuation that starts at i. Here the uniform number of
each draw is computed from (seed, i) by a counter-based hash (splitmix64) in
int64 tensor arithmetic, which gives the same bits on every device, so the
CPU tests pin what a GPU draws; then temperature, top_p and the inverse-CDF
pick run for all rows in a few batched operations, with no per-row Python
loop and no torch.Generator.

top_p keeps the smallest set of most likely tokens whose probability reaches
top_p. Sorting a 50k vocabulary per row is what costs, so the nucleus is
looked for among the top NUCLEUS_PROBE tokens first, which almost always
hold it; a row whose probe falls short is flagged and chosen again
(`sample_whole`: among the top WIDE_PROBE, else over the whole sorted row;
`sample` returns the flags beside the picks in one tensor, so the common case
costs one copy to the host). Which tokens make the nucleus, and so the draw,
is the same whichever look finds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from core.protocol import is_sampled
from core.seeds import GOLDEN, MIX1, MIX2, signed64, splitmix64

NUCLEUS_PROBE = 64
WIDE_PROBE = 1024  # the second look, for rows the first one left short (topk, not a sort)


class TokenDraw(NamedTuple):
    """How to choose one token of one row: temperature 0 is greedy; seed and index fix
    the random draw."""

    temperature: float
    top_p: float
    seed: int
    token_index: int

    @property
    def sampled(self) -> bool:
        return is_sampled(self.temperature)


def mix64(seed: int, index: int) -> int:
    """splitmix64 of (seed, index) as an unsigned 64-bit integer (the reference)."""
    return splitmix64(seed * GOLDEN + (index + 1) * MIX1)


def token_uniform(seed: int, index: int) -> float:
    """The uniform number in [0, 1) of draw `index` of a request seeded with `seed`."""
    return (mix64(seed, index) >> 11) * 2.0**-53


def _shift_right(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch shifts signed ones arithmetically)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """token_uniform for int64 tensors of seeds and indices, elementwise, as float64.
    int64 products wrap modulo 2^64 like the reference's masked ones."""
    z = seeds * signed64(GOLDEN) + (indices + 1) * signed64(MIX1)
    z = (z ^ _shift_right(z, 30)) * signed64(MIX1)
    z = (z ^ _shift_right(z, 27)) * signed64(MIX2)
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).to(torch.float64) * 2.0**-53


def sample(logits: torch.Tensor, draws: Sequence[TokenDraw]) -> torch.Tensor:
    """One token per row of logits [rows, vocab], chosen as each row's draw says.

    Returns int64 [2, rows] on the logits' device: the picks, and a flag per row
    that is 1 where the top-NUCLEUS_PROBE probe did not reach the row's top_p
    (then call `sample_whole` for those rows). Masked tokens (logit -inf) are
    never chosen.
    """
    device, rows = logits.device, logits.shape[0]
    greedy = torch.argmax(logits, dim=-1)
    flags = torch.zeros(rows, dtype=torch.int64, device=device)
    sampled = [row for row, draw in enumerate(draws) if draw.sampled]
    if not sampled:
        return torch.stack([greedy, flags])
    probs, u, top_p = _distribution(logits, draws, sampled)
    picks = torch.empty(len(sampled), dtype=torch.int64, device=device)
    short = torch.zeros(len(sampled), dtype=torch.int64, device=device)
    whole = [i for i, row in enumerate(sampled) if draws[row].top_p >= 1.0]
    nucleus = [i for i, row in enumerate(sampled) if draws[row].top_p < 1.0]
    if whole:
        at = torch.tensor(whole, device=device)
        picks[at] = _pick(probs[at], u[at])
    if nucleus:
        at = torch.tensor(nucleus, device=device)
        top_probs, top_ids = torch.topk(probs[at], min(NUCLEUS_PROBE, probs.shape[-1]), dim=-1)
        chosen, reached = _pick_nucleus(top_probs, u[at], top_p[at])
        picks[at] = torch.gather(top_ids, 1, chosen[:, None])[:, 0]
        short[at] = (~reached).to(torch.int64)
    at = torch.tensor(sampled, device=device)
    return torch.stack([greedy.index_copy(0, at, picks), flags.index_copy(0, at, short)])


def sample_whole(logits: torch.Tensor, draws: Sequence[TokenDraw]) -> torch.Tensor:
    """The picks of sampled top_p rows chosen over the whole sorted vocabulary (the
    rare rows whose nucleus is wider than the probe). int64 [rows]."""
    rows = list(range(len(draws)))
    probs, u, top_p = _distribution(logits, draws, rows)
    wide_probs, wide_ids = torch.topk(probs, min(WIDE_PROBE, probs.shape[-1]), dim=-1)
    chosen, reached = _pick_nucleus(wide_probs, u, top_p)
    picks = torch.gather(wide_ids, 1, chosen[:, None])[:, 0]
    flat = [row for row, ok in enumerate(reached.tolist()) if not ok]
    if flat:  # a nearly flat distribution: sort the whole row (~5 ms a row on a CPU core)
        sorted_probs, sorted_ids = torch.sort(probs[flat], dim=-1, descending=True)
        chosen, _ = _pick_nucleus(sorted_probs, u[flat], top_p[flat])
        picks[flat] = torch.gather(sorted_ids, 1, chosen[:, None])[:, 0]
    return picks


def _distribution(
    logits: torch.Tensor, draws: Sequence[TokenDraw], rows: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, uniforms and top_p of the given rows."""
    device = logits.device
    temperature = torch.tensor([draws[r].temperature for r in rows], device=device)
    probs = torch.softmax(logits[rows].float() / temperature[:, None], dim=-1)
    seeds = torch.tensor([draws[r].seed for r in rows], dtype=torch.int64, device=device)
    indices = torch.tensor([draws[r].token_index for r in rows], dtype=torch.int64, device=device)
    top_p = torch.tensor([draws[r].top_p for r in rows], dtype=torch.float32, device=device)
    return probs, uniforms(seeds, indices), top_p


def _pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: the first token whose cumulative probability exceeds u x total."""
    cumulative = torch.cumsum(probs, dim=-1)
    target = _below(u, cumulative[:, -1])
    return torch.searchsorted(cumulative, target[:, None], right=True)[:, 0]


def _pick_nucleus(
    sorted_probs: torch.Tensor, u: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF over the leading tokens of descending probabilities whose mass first
    reaches top_p. Returns (position chosen, whether the given tokens reached top_p)."""
    cumulative = torch.cumsum(sorted_probs, dim=-1)
    last = cumulative.shape[-1] - 1
    cut = torch.searchsorted(cumulative, top_p[:, None])[:, 0]  # first cum >= top_p
    reached = cut <= last
    cut = cut.clamp(max=last)
    kept = torch.gather(cumulative, 1, cut[:, None])[:, 0]
    target = _below(u, kept)
    return torch.searchsorted(cumulative, target[:, None], right=True)[:, 0], reached


def _below(u: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """u x mass in mass's dtype, kept strictly below mass (rounding may reach it), so
    the first cumulative value above it always belongs to a token of non-zero
    probability at or before the one where the cumulative sum reaches mass."""
    target = (u * mass.double()).to(mass.dtype)
    return torch.minimum(target, torch.nextafter(mass, torch.zeros_like(mass)))
