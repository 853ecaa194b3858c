"""Speculative decoding: tokens proposed cheaply, kept only where the target draws them itself.

A proposer guesses a decoding sequence's next few tokens; the engine
(engine.py `_verify`) runs the sequence's last token and the guesses through
the target model in one packed pass over the paged cache, exactly as a
prefill chunk runs, and draws a token at every position with the draw plain
decoding would make there (the TokenDraw of that output index: greedy, or
the uniform hashed from (seed, index)). It keeps drawn tokens while each
equals the guess before it, and the first one that differs ends the run.
Every kept token is then the token plain decoding would have produced, since
a prefilled position's logits are a decoded one's, so the text is the same
with speculation on or off, greedy or sampled, in any batch and resumed from
any cut (docs/design/engine.md, "Speculative decoding").

Two proposers:

* `NgramProposer`: the sequence's last n tokens (n from `max_ngram` down to
  `min_ngram`) looked up among its own earlier tokens, prompt and output, and
  the tokens that followed the latest earlier match proposed. No model, and
  an index per sequence updated as tokens arrive, so a lookup costs a few
  dictionary reads: strong where the answer copies its context (editing,
  code, quoted passages, repeated JSON), silent elsewhere.
* `DraftProposer`: a second, smaller model with the same tokenizer, in the
  same worker, with its own paged KV pool. Each step it catches up with what
  the target accepted (one packed pass over every proposing sequence), then
  decodes its guesses a token at a time, all sequences batched. It draws its
  guesses with the target's own TokenDraw for each index, so for a seeded
  request the draft and the target turn the same uniform number into a
  token: where their distributions are close, the guesses agree with the
  target's draws even when sampling.

`Pacer` sets how many tokens a sequence proposes from its recent verifications
(it grows while every guess is accepted, and falls back to one past the last
accepted run), and the engine gives speculation a step's budget of verified
positions (`SpeculativeOptions.step_budget`) so a large batch, already at the
compute bound, steps aside.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from adapters.engine.runner import Chunk, Runner
from adapters.engine.sampling import TokenDraw
from core.blocks import BlockManager

SPECULATIVE_KINDS = ("auto", "none", "ngram", "draft")


@dataclass(frozen=True)
class SpeculativeOptions:
    """kind: "ngram" or "draft" (engine.py takes None for none). max_tokens: the most
    a sequence proposes in one step. step_budget: the most positions a step verifies,
    decode rows and proposals together; a batch with as many decode rows proposes
    nothing. min_ngram, max_ngram: the n-gram lengths looked up, longest first."""

    kind: str = "ngram"
    max_tokens: int = 8
    step_budget: int = 12
    min_ngram: int = 2
    max_ngram: int = 4
    # what verifying costs (PassCosts, r up to step_budget); None: measured when the
    # engine starts (pass_costs)
    costs: PassCosts | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("ngram", "draft"):
            raise ValueError(f"speculative kind {self.kind!r}: ngram or draft")
        if not 1 <= self.max_tokens <= 64:
            raise ValueError(f"speculative tokens {self.max_tokens}: from 1 to 64")
        if self.step_budget < 2:
            raise ValueError(f"speculative step budget {self.step_budget}: at least 2")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"n-gram lengths {self.min_ngram}..{self.max_ngram}")
        costs = self.costs
        if costs is not None and not all(
            len(c) == self.step_budget + 1 and min(c[1:]) > 0 for c in (costs.near, costs.far)
        ):
            raise ValueError(f"pass costs: {self.step_budget} positive figures after a 0")

    def describe(self) -> str:
        looked = f"n-grams of {self.max_ngram} down to {self.min_ngram} tokens"
        what = looked if self.kind == "ngram" else "a draft model"
        return (
            f"speculative decoding: {self.kind} ({what}), up to {self.max_tokens} tokens a "
            f"sequence, at most {self.step_budget} verified positions a step"
        )


@dataclass
class SpecStats:
    """Counts over the engine's life, for /metrics and benchmarks."""

    steps: int = 0  # steps that verified proposals
    verified_rows: int = 0  # sequence-steps with proposals (each a run of accepted tokens)
    proposed: int = 0  # tokens proposed
    accepted: int = 0  # of those, equal to the target's own draw
    emitted: int = 0  # tokens the verified rows delivered (accepted, and each run's last)


class Pacer:
    """How many tokens one sequence proposes next: doubles (up to the most) while every
    guess is accepted, and drops to one more than the run just accepted otherwise.

    It also estimates the chance that the sequence's next guess is accepted: guesses
    kept against runs cut short by a wrong one (each verification ends in at most one),
    both counts decaying by DECAY a verification, from a prior of one of each. A
    sequence whose guesses were not worth verifying drifts back to the prior by
    RECOVERY a step (`idle`), so one bad stretch does not end its speculation for
    good: it is tried again."""

    __slots__ = ("kept", "length", "missed", "most")

    DECAY = 0.8
    RECOVERY = 0.05

    def __init__(self, most: int) -> None:
        self.most = most
        self.length = max(1, most // 2)
        self.kept = 1.0
        self.missed = 1.0

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.missed)

    def idle(self) -> None:
        self.kept += self.RECOVERY * (1.0 - self.kept)
        self.missed += self.RECOVERY * (1.0 - self.missed)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        self.kept = self.DECAY * self.kept + accepted
        self.missed = self.DECAY * self.missed + (accepted < proposed)
        if accepted >= proposed:
            self.length = min(self.most, self.length * 2)
        else:
            self.length = min(self.most, accepted + 1)


COST_POSITIONS = (32, 1024)  # the contexts the pass costs are measured at (or less)
COST_REPEATS = 3


@dataclass(frozen=True)
class PassCosts:
    """The seconds of one packed pass over r positions of one sequence, r = 0..most
    (near[0] = far[0] = 0), with its context at `positions[0]` (near) and at
    `positions[1]` (far): each row attends over its whole context, so a longer
    context makes every extra position dearer. `draft`: what a draft model's
    one-row step costs, in the same unit (0 for n-gram lookup): each guess a draft
    makes costs one."""

    positions: tuple[int, int]
    near: tuple[float, ...]
    far: tuple[float, ...]
    draft: float = 0.0

    def at(self, position: int) -> list[float]:
        """The costs at a context of `position`, by the straight line through the two
        measured (held at the near one below it, extended past the far one)."""
        low, high = self.positions
        share = max(position - low, 0) / max(high - low, 1)
        return [n + (f - n) * share for n, f in zip(self.near, self.far, strict=True)]

    def describe(self) -> str:
        near, far = self.near, self.far
        return (
            f"a pass over 1..{len(near) - 1} positions costs "
            + " ".join(f"{c / near[1]:.2f}" for c in near[1:])
            + f" decode steps at a context of {self.positions[0]}, "
            + " ".join(f"{c / far[1]:.2f}" for c in far[1:])
            + f" at {self.positions[1]}"
            + (f"; a draft's guess {self.draft / near[1]:.2f}" if self.draft else "")
        )


def pass_seconds(runner: Runner, chunk: Chunk, repeats: int, warm: int = 1) -> float:
    """The median seconds of `repeats` packed passes over `chunk` (logits of all its
    positions, as a verification takes them), after `warm` passes not counted."""
    device = runner.device
    took = []
    for _ in range(warm + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        runner.prefill_packed([chunk], range(chunk.tokens.shape[0]))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        took.append(time.perf_counter() - began)
    return statistics.median(took[warm:])


def pass_costs(runner: Runner, most: int, drafting: Runner | None = None) -> PassCosts:
    """PassCosts measured on the runner's idle pool, before any sequence holds a block
    (the blocks' contents are overwritten by the sequences that come): at each of
    COST_POSITIONS (as far as the context allows) the median of COST_REPEATS passes
    after a warm-up for each count, made non-decreasing (a longer pass never costs
    less); and a draft's one-row step the same way on its own idle pool."""
    if drafting is not None:
        draft = pass_costs(drafting, 1).near[1]
        return dataclasses.replace(pass_costs(runner, most), draft=draft)
    room = max(runner.max_context - most - 1, 0)
    near, far = (min(p, room) for p in COST_POSITIONS)
    table = list(range(-(-(far + most) // runner.block_size)))
    if len(table) > runner.num_blocks:
        raise ValueError("the KV pool is too small to measure speculative passes")
    device = runner.device
    tokens = torch.arange(far + most, device=device) % runner.vocab_size

    def curve(position: int) -> tuple[float, ...]:
        if position:
            runner.prefill_packed([Chunk(table, 0, tokens[:position])], [])
        costs = [0.0]
        for count in range(1, most + 1):
            chunk = Chunk(table, position, tokens[position : position + count])
            costs.append(max(pass_seconds(runner, chunk, COST_REPEATS), costs[-1]))
        return tuple(costs)

    return PassCosts((near, far), curve(near), curve(far))


MARGIN = 0.1  # what verifying guesses must gain over plain decoding, expected


def worth_verifying(
    costs: Sequence[float],
    rows: int,
    guesses: Sequence[int],
    acceptances: Sequence[float],
    per_guess: float = 0.0,
) -> list[int]:
    """How many of its guesses each decoding sequence should have verified this step, to
    make the most tokens per second: `costs[r]` is the time of a pass over r positions
    (costs[0] unused; as many entries as a step may verify), `rows` the decoding
    sequences, `guesses[i]` how many sequence i has, `acceptances[i]` the chance each of
    its guesses is accepted. Guess j of a sequence (from 1) adds acceptance**j tokens
    on average, for one more position: guesses are taken best first, and the step
    keeps the count that gives the most expected tokens over the pass's cost (and
    `per_guess` for each guess: a draft's step). None unless that beats plain
    decoding by MARGIN: the costs are measured on a machine others share, and a gain
    smaller than their noise is no gain."""
    gains = sorted(
        ((a**j, i) for i, (g, a) in enumerate(zip(guesses, acceptances, strict=True))
         for j in range(1, g + 1)),
        reverse=True,
    )  # fmt: skip
    most = min(len(gains), len(costs) - 1 - rows)
    best, best_rate, expected = 0, rows / costs[rows], float(rows)
    for taken in range(1, most + 1):
        expected += gains[taken - 1][0]
        rate = expected / (costs[rows + taken] + per_guess * taken)
        if rate > best_rate:
            best, best_rate = taken, rate
    if best_rate < (1 + MARGIN) * rows / costs[rows]:
        best = 0
    counts = [0] * len(guesses)
    for _, i in gains[:best]:  # a sequence's guesses come in order of j: a prefix each
        counts[i] += 1
    return counts


class NgramIndex:
    """One sequence's n-grams: for each of length min..max, where its latest earlier
    occurrence ended. Indexed up to one token short of the end, so that the lookup
    of the sequence's own last n tokens finds an earlier occurrence, not itself."""

    __slots__ = ("indexed", "lengths", "where")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.lengths = range(max_n, min_n - 1, -1)
        self.where: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending at positions before this are in `where`

    def propose(self, tokens: Sequence[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier occurrence of the
        longest suffix of `tokens` found."""
        end = len(tokens)
        lengths = self.lengths
        where = self.where
        for stop in range(self.indexed + 1, end):  # the n-grams ending before the last token
            for n in lengths:
                if stop >= n:
                    where[tuple(tokens[stop - n : stop])] = stop
        self.indexed = max(self.indexed, end - 1)
        for n in lengths:
            if end < n + 1:
                continue
            found = where.get(tuple(tokens[end - n : end]))
            if found is not None:
                return list(tokens[found : min(found + count, end)])
        return []


class NgramProposer:
    def __init__(self, options: SpeculativeOptions) -> None:
        self.options = options
        self._indices: dict[int, NgramIndex] = {}

    def propose(self, wanted: list[tuple[int, list[int], int, TokenDraw]]) -> list[list[int]]:
        """For each (sequence key, its tokens, how many, the next draw): the guesses."""
        out = []
        for key, tokens, count, _ in wanted:
            index = self._indices.get(key)
            if index is None:
                index = NgramIndex(self.options.min_ngram, self.options.max_ngram)
                self._indices[key] = index
            out.append(index.propose(tokens, count) if count > 0 else [])
        return out

    def forget(self, key: int) -> None:
        self._indices.pop(key, None)


@dataclass
class _Drafted:
    """What the draft's cache holds for one sequence: its tokens up to `confirmed`, and
    past them the guesses it wrote last step (the target may have kept some)."""

    confirmed: int = 0
    guesses: list[int] = field(default_factory=list)


class DraftProposer:
    """A draft model's runner and KV pool beside the target's, one state per sequence.

    The pool has as many blocks as the target's (the same sequences fit), with no
    prefix caching of its own: the draft's state of a sequence lives only as long as
    the sequence."""

    def __init__(
        self,
        runner: Runner,
        target_vocab: int,
        sample: Callable[[torch.Tensor, list[TokenDraw]], list[int]],
    ) -> None:
        self.runner = runner
        self.sample = sample  # the target's sampler (engine.py's sample_rows)
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, prefix_caching=False)
        self.vocab = min(runner.vocab_size, target_vocab)
        self._states: dict[int, _Drafted] = {}
        self.device = runner.device

    def forget(self, key: int) -> None:
        if self._states.pop(key, None) is not None:
            self.blocks.release(key)

    def propose(self, wanted: list[tuple[int, list[int], int, TokenDraw]]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in wanted]
        chunks, rows, live = [], [], []
        first = 0
        for slot, (key, tokens, count, _) in enumerate(wanted):
            if count <= 0:
                continue
            start = self._catch_up(key, tokens, count)
            if start is None:
                continue
            if max(tokens[start:]) >= self.runner.vocab_size:  # earlier ones were checked
                self.forget(key)  # a token the draft cannot read: it drafts no more here
                continue
            table = self.blocks.table(key)
            piece = torch.tensor(tokens[start:], device=self.device)
            chunks.append(Chunk(table, start, piece))
            first += piece.shape[0]
            rows.append(first - 1)
            live.append(slot)
        if not chunks:
            return out
        logits = self.runner.prefill_packed(chunks, rows)
        draws = [wanted[slot][3] for slot in live]
        guesses = self.sample(logits[:, : self.vocab], draws)
        for slot, token in zip(live, guesses, strict=True):
            out[slot].append(token)
        # one more guess a step for each sequence that wants more, all of them batched
        for step in range(1, max(wanted[slot][2] for slot in live)):
            live = [slot for slot in live if wanted[slot][2] > step]
            if not live:
                break
            keys = [wanted[slot][0] for slot in live]
            where = [len(wanted[slot][1]) - 1 + step for slot in live]
            last = [out[slot][-1] for slot in live]
            tables = [self.blocks.table(key) for key in keys]
            pages = self.runner.pages(tables, max(where) + 1)
            logits = self.runner.decode(
                pages,
                torch.tensor(where, device=self.device),
                torch.tensor(last, device=self.device),
            )
            draws = [advanced(wanted[slot][3], step) for slot in live]
            for slot, token in zip(live, self.sample(logits[:, : self.vocab], draws), strict=True):
                out[slot].append(token)
        for slot, (key, tokens, _, _) in enumerate(wanted):
            state = self._states.get(key)
            if state is not None and out[slot]:
                state.confirmed = len(tokens)
                state.guesses = out[slot][:-1]  # written to the cache; the last one is not
        return out

    def _catch_up(self, key: int, tokens: list[int], count: int) -> int | None:
        """Where this sequence's catch-up chunk starts: past every token the draft's
        cache holds that the target kept. Its blocks cover the guesses too; None when
        the draft's pool cannot hold them (this step it proposes nothing)."""
        positions = len(tokens) + count - 1
        state = self._states.get(key)
        if state is None:
            if self.blocks.needed([], positions) > self.blocks.available:
                return None
            self.blocks.allocate(key, [], positions)
            state = self._states[key] = _Drafted()
        elif not self.blocks.extend(key, positions):
            self.forget(key)
            return None
        kept = state.confirmed
        for guess in state.guesses:
            if kept >= len(tokens) or tokens[kept] != guess:
                break
            kept += 1
        state.confirmed, state.guesses = min(kept, len(tokens) - 1), []
        return state.confirmed


def advanced(draw: TokenDraw, by: int) -> TokenDraw:
    """The draw `by` tokens later in the same output."""
    return draw._replace(token_index=draw.token_index + by)
