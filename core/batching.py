"""Continuous batching's limits, and what one step computes.

core/scheduler.py decides who waits, who runs and who is preempted; this
module holds the limits it works within and its last move, plan_step(), a
pure function over the running sequences: what one forward step computes.
Every sequence that has
  finished its prefill decodes one token (running decodes are never starved);
  the rest of the step's token budget goes to prefill chunks, oldest sequence
  first, each chunk at most `max_prefill_tokens` (so a long prompt is chunked
  over several steps and never stalls the running decodes for long). A step
  with nothing to decode has nobody to stall: it may prefill up to
  `max_idle_prefill_tokens`, in chunks as large, so that requests arriving
  together at an idle engine all get their first token from one step.

The limits guarantee progress: `max_step_tokens > max_seqs`, so even a full
batch of decodes leaves room for at least one prefill token per step.
"""

from __future__ import annotations

from collections.abc import Sequence

from msgspec import Struct


class BatchLimits(Struct, frozen=True):
    max_seqs: int = 16  # sequences holding a cache slot at once
    max_context: int = 2048  # tokens one slot's cache holds (prompt + output)
    max_step_tokens: int = 256  # tokens computed by one step, decodes included
    max_prefill_tokens: int = 128  # largest prefill chunk of one sequence per step
    max_idle_prefill_tokens: int = 1024  # a step with nothing decoding: budget and chunk

    def __post_init__(self) -> None:
        if min(self.max_seqs, self.max_context, self.max_prefill_tokens) < 1:
            raise ValueError("batch limits must be positive")
        if self.max_step_tokens <= self.max_seqs:
            raise ValueError("max_step_tokens must exceed max_seqs so prefill always progresses")
        if self.max_idle_prefill_tokens < self.max_prefill_tokens:
            raise ValueError("max_idle_prefill_tokens must be at least max_prefill_tokens")


class Running(Struct, frozen=True):
    key: int
    prompt_tokens: int
    prefilled: int  # prompt tokens already in the cache

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prompt_tokens


class StepPlan(Struct, frozen=True):
    decode: tuple[int, ...]  # keys that decode one token this step
    prefill: tuple[tuple[int, int], ...]  # (key, prompt tokens to prefill this step)

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(n for _, n in self.prefill)


def plan_step(running: Sequence[Running], limits: BatchLimits) -> StepPlan:
    """Decodes first, then prefill chunks in admission order within the budget."""
    decode = tuple(seq.key for seq in running if seq.decoding)
    if decode:
        budget, largest = limits.max_step_tokens - len(decode), limits.max_prefill_tokens
    else:  # nothing to stall: prefill as much as an idle step may
        budget = largest = limits.max_idle_prefill_tokens
    prefill: list[tuple[int, int]] = []
    for seq in running:
        if budget <= 0:
            break
        if not seq.decoding:
            chunk = min(seq.prompt_tokens - seq.prefilled, largest, budget)
            prefill.append((seq.key, chunk))
            budget -= chunk
    return StepPlan(decode, tuple(prefill))
