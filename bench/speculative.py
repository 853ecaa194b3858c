"""`fencepost bench engine --speculative KIND`: decoding with and without speculation, side by side.

Three parts, on one model, one process, the two sides alternating round by
round (the best round of each is printed, and their ratio):

The side that runs first alternates from round to round as well.

* editing: one greedy stream rewriting a given ~300-word paragraph with two
  small changes, the task n-gram lookup is for. tokens/s over the whole
  request (prefill included) and over its decode steps alone, the acceptance,
  and whether the two texts are the same token for token;
* chat: distinct questions whose answers do not repeat their prompt, at each
  --concurrency (one stream greedy, more streams sampled with a seed each),
  stopping at EOS: speculation must not make this slower;
* the verification cost curve: the target's time for one packed pass over a
  sequence's last token and k guesses (k = 0 is a plain decode step) at a
  position of --position, and the speed-up it implies where a guess is
  accepted with probability 50%, 70% or 90% (the expected run, divided by
  the pass's cost relative to a decode step; a draft model's own time not
  counted).

With KIND draft, --draft-model names the draft (default: the model itself,
which shows acceptance, not speed) and --draft-weights its format.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import msgspec
import torch

from adapters.engine.build import weight_format
from adapters.engine.engine import Engine
from adapters.engine.model import LoadedModel, chat_token_ids, load_model
from adapters.engine.runner import Chunk
from adapters.engine.speculative import SpeculativeOptions, pass_seconds
from core.protocol import Assignment, Decoded, GenerationRequest, Sampling

# About 300 words of plain prose, written for this benchmark.
PARAGRAPH = (
    "The village of Hallow End sits at the mouth of a narrow valley, where the river slows "
    "before it reaches the sea. Most of the houses are built from grey stone taken from the "
    "quarry on the eastern ridge, and their roofs are covered with dark slate that shines "
    "after rain. In the middle of the village there is a small square with a fountain, a "
    "bakery that opens before dawn and a library that is only open on Tuesdays and "
    "Saturdays. The people who live there are mostly farmers and fishermen, although in "
    "recent years a few artists have moved into the old mill beside the bridge. Every "
    "autumn the village holds a market where families sell apples, honey, wool and "
    "smoked fish, and visitors come from the towns along the coast to buy them. The "
    "market lasts for three days, and on the last evening there is music in the square "
    "until long after midnight. Children run between the stalls while their parents "
    "argue about the price of cheese and the quality of the harvest. The oldest building "
    "in the village is the church, which was built more than six hundred years ago and "
    "still has its original bell. The bell is rung every morning at seven o'clock by a "
    "retired teacher who has climbed the tower stairs for over thirty years. Beyond the "
    "church, a path leads up through the woods to a viewpoint where you can see the whole "
    "valley, the river and, on a clear day, the islands far out in the bay. Walkers often "
    "stop there to rest, eat their lunch and watch the boats returning to the harbour in "
    "the late afternoon. In winter the path is muddy and few people climb it, but the "
    "view is said to be even better when the trees have lost their leaves."
)
EDIT = (
    "Rewrite the paragraph below with two changes: the village is called Willow Ford "
    "instead of Hallow End, and the market lasts for four days instead of three. Keep every "
    "other word exactly as it is.\n\n" + PARAGRAPH
)
# Questions whose answers are new text, not copies of the prompt.
QUESTIONS = (
    "Why is the sky blue during the day and red at sunset?",
    "Give me three tips for learning to play the guitar.",
    "What are the main differences between a virus and a bacterium?",
    "Explain how a bicycle stays upright while it is moving.",
    "What should I pack for a week-long hiking trip in the mountains?",
    "Describe the water cycle in simple terms.",
    "How do bees make honey?",
    "What is the difference between weather and climate?",
    "Suggest a healthy breakfast that takes less than ten minutes to make.",
    "Why do cats purr?",
    "How does a refrigerator keep food cold?",
    "What are some good ways to improve my sleep?",
    "Explain what a black hole is to a ten-year-old.",
    "How did people navigate at sea before GPS?",
    "What makes a good job interview answer?",
    "Why do leaves change colour in autumn?",
)
ACCEPTANCES = (0.5, 0.7, 0.9)
COST_TOKENS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


class Side(NamedTuple):
    rate: float  # tokens/s over the whole run
    decode_rate: float  # tokens/s over the steps that prefilled nothing
    tokens: dict[str, list[int]]  # each request's output
    proposed: int
    accepted: int
    verified_rows: int


def run_side(
    engine: Engine, requests: list[GenerationRequest], round_: int, step_limit: int
) -> Side:
    """Every request at once, to the end: the rates, the outputs and the speculation
    counts this run added."""
    stats = engine.spec_stats
    before = (stats.proposed, stats.accepted, stats.verified_rows)
    outputs: dict[str, list[int]] = {}
    named: dict[str, list[int]] = {}  # by this round's request id
    for request in requests:
        rid = f"{request.request_id}-r{round_}"
        engine.start(Assignment(rid, 1), msgspec.structs.replace(request, request_id=rid))
        outputs[request.request_id] = named[rid] = []
    produced, decoded, decode_s, steps = 0, 0, 0.0, 0
    began = time.perf_counter()
    while engine.has_work() and steps < step_limit:
        steps += 1
        events = engine.step()
        made = 0
        for event in events:
            if isinstance(event, Decoded):
                named[event.assignment.request_id].append(event.token_id)
                made += 1
        produced += made
        if engine.last_step.prefill_tokens == 0:
            decoded += made
            decode_s += engine.last_step.seconds
    elapsed = time.perf_counter() - began
    if engine.has_work():
        raise RuntimeError(f"the run did not end within {step_limit} steps")
    return Side(
        produced / elapsed,
        decoded / max(decode_s, 1e-9),
        outputs,
        stats.proposed - before[0],
        stats.accepted - before[1],
        stats.verified_rows - before[2],
    )


def compare(
    label: str, plain: Engine, speculating: Engine, requests: list[GenerationRequest], rounds: int
) -> None:
    """Alternate the two engines over `rounds` rounds; print the best of each side, their
    ratio, whether every output matched and what speculation accepted."""
    limit = 4 * sum(r.max_new_tokens for r in requests) + 64
    offs: list[Side] = []
    ons: list[Side] = []
    for round_ in range(rounds):  # which side goes first alternates too
        if round_ % 2:
            ons.append(run_side(speculating, requests, round_, limit))
        offs.append(run_side(plain, requests, round_, limit))
        if not round_ % 2:
            ons.append(run_side(speculating, requests, round_, limit))
    off = max(offs, key=lambda side: side.rate)
    on = max(ons, key=lambda side: side.rate)
    same = all(side.tokens == offs[0].tokens for side in offs + ons)
    made = sum(len(tokens) for tokens in on.tokens.values())
    accepted = on.accepted / on.proposed if on.proposed else 0.0
    per_step = on.accepted / on.verified_rows if on.verified_rows else 0.0
    print(
        f"  {label}: {made} tokens, off {off.rate:7.1f} tok/s, on {on.rate:7.1f} tok/s "
        f"({on.rate / off.rate:.2f}x); decode steps alone off {off.decode_rate:7.1f}, on "
        f"{on.decode_rate:7.1f} ({on.decode_rate / max(off.decode_rate, 1e-9):.2f}x)"
    )
    print(
        f"      identical text: {'yes' if same else 'NO'}; {on.accepted} of {on.proposed} "
        f"guesses accepted ({accepted:.0%}), {per_step:.2f} accepted per verified row"
    )


def _chat(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": text}]))


def cost_curve(engine: Engine, position: int, repeats: int = 15) -> list[tuple[int, float]]:
    """(guesses, median seconds) of one packed pass over a sequence's last token and
    that many guesses at `position`, on this engine's runner (its pool otherwise idle)."""
    runner = engine.runner
    most = max(COST_TOKENS) + 1
    needed = -(-(position + most) // runner.block_size)
    if needed > runner.num_blocks or position + most > runner.max_context:
        raise ValueError(f"position {position} does not fit this engine's pool and context")
    table = list(range(needed))
    device = engine.device
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, runner.vocab_size, (position + most,), generator=generator)
    filled = 0
    while filled < position:  # the context before `position`, in prefill-sized chunks
        count = min(256, position - filled)
        chunk = Chunk(table, filled, context[filled : filled + count].to(device))
        runner.prefill_packed([chunk], [])
        filled += count
    curve = []
    for guesses in COST_TOKENS:
        chunk = Chunk(table, position, context[position : position + guesses + 1].to(device))
        curve.append((guesses, pass_seconds(runner, chunk, repeats, warm=2)))
    return curve


def expected_run(acceptance: float, guesses: int) -> float:
    """Tokens a verification delivers on average when each guess is accepted with
    probability `acceptance` independently: the accepted prefix plus the target's own."""
    return sum(acceptance**i for i in range(guesses + 1))


def print_cost_curve(curve: list[tuple[int, float]], position: int) -> None:
    base = curve[0][1]
    heads = "  ".join(f"{int(a * 100)}%" for a in ACCEPTANCES)
    print(f"  verification cost at position {position} (k guesses, k + 1 positions; "
          f"speed-up implied at {heads} acceptance):")  # fmt: skip
    for guesses, seconds in curve:
        implied = "  ".join(
            f"{expected_run(a, guesses) * base / seconds:4.2f}x" for a in ACCEPTANCES
        )
        print(f"    k={guesses:2d}: {seconds * 1e3:6.2f} ms ({seconds / base:4.2f}x a decode step)"
              f"   {implied}")  # fmt: skip


def main(
    loaded: LoadedModel,
    engine_of: Callable[..., Engine],
    kind: str,
    concurrency: list[int],
    tokens: int,
    speculative_tokens: int,
    draft_model: str | None,
    draft_weights: str,
    rounds: int,
    position: int,
) -> int:
    options = SpeculativeOptions(kind, speculative_tokens)
    draft = None
    if kind == "draft":
        source = draft_model or loaded.source
        model = load_model(source, quiet=True, max_context=loaded.max_context, device=loaded.device)
        draft = (model, weight_format(model, draft_weights, max(concurrency)))
        print(f"  draft: {model.name} ({model.family}) in {draft[1]}"
              f"{' (the model itself)' if draft_model is None else ''}")  # fmt: skip
    print(f"  {options.describe()}; {rounds} rounds a side, alternating, best shown")
    plain = engine_of(loaded)
    speculating = engine_of(loaded, speculative=options, draft=draft)
    warm = [GenerationRequest("warm", _chat(loaded, QUESTIONS[0]), 8, Sampling(0.0, 1.0, 0))]
    run_side(plain, warm, 0, 64)
    run_side(speculating, warm, 0, 64)
    edit = GenerationRequest("edit", _chat(loaded, EDIT), 600, Sampling(0.0, 1.0, 0))
    label = f"editing, 1 stream, greedy, prompt {len(edit.prompt_token_ids)} tokens"
    compare(label, plain, speculating, [edit], rounds)
    for n in concurrency:
        requests = [
            GenerationRequest(
                f"chat-{n}-{i}",
                _chat(loaded, QUESTIONS[i % len(QUESTIONS)]),
                tokens,
                Sampling(0.0, 1.0, 0) if n == 1 else Sampling(0.7, 0.95, i),
            )
            for i in range(n)
        ]
        how = "greedy" if n == 1 else "sampled, seeded"
        compare(f"chat, {n} stream{'s' if n > 1 else ''}, {how}", plain, speculating, requests,
                rounds)  # fmt: skip
    # last: the curve writes its own KV over blocks the plain engine's prefix cache holds
    print_cost_curve(cost_curve(plain, position), position)
    return 0
