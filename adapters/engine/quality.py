"""The quality gate: how much a weight format changes what the model predicts.

Two measures, each against fp32 on the same model:

- perplexity on a fixed English text, teacher-forced: every position's logits
  from prefill, the mean negative log-likelihood of the next token. The text
  is a fixed part of Python's own reference documentation
  (`pydoc_data.topics`, shipped with every CPython), so nothing is downloaded
  and every machine scores the same words.
- greedy agreement on fixed chat prompts: the tokens each format generates
  greedily, compared with fp32's: where they first differ, and how many of N
  match position for position.

The gate for a default format is perplexity within 2% of fp32 (GATE). Results
are cached per model and text length, so a server decides at start without
measuring again (adapters/engine/choose.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adapters.engine.code_key import code_key
from adapters.engine.files import cache_root
from adapters.engine.model import LoadedModel, chat_token_ids, model_key
from adapters.engine.runner import DEFAULT_BLOCK_SIZE, Runner

GATE = 0.02  # a default format's perplexity may exceed fp32's by at most 2%
TOPICS = ("naming", "exceptions", "execmodel", "truth", "if", "while", "for", "try", "function")
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain what a fence post error is.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me two tips for a job interview.",
)


def reference_text() -> str:
    """The fixed English text the gate scores: a few topics of Python's reference."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in TOPICS if name in topics)


def text_tokens(loaded: LoadedModel, count: int) -> list[int]:
    ids = loaded.tokenizer(reference_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < count + 1:
        raise ValueError(f"the reference text has only {len(ids)} tokens")
    return [int(t) for t in ids[: count + 1]]


def perplexity(runner: Runner, tokens: list[int], chunk: int = 256) -> float:
    """exp(mean NLL of each token given all before it), prefilled in chunks into one
    sequence that holds every block of the runner's pool."""
    if len(tokens) > runner.max_context:
        raise ValueError(f"{len(tokens)} tokens do not fit a context of {runner.max_context}")
    ids = torch.tensor(tokens, device=runner.device)
    table = list(range(runner.num_blocks))
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, chunk):
        end = min(start + chunk, len(tokens) - 1)
        logits = runner.prefill(table, start, ids[start:end], every_position=True)
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        targets = ids[start + 1 : end + 1]
        total -= float(log_probs.gather(1, targets[:, None]).sum())
        count += end - start
    return math.exp(total / count)


@dataclass(frozen=True)
class Agreement:
    """Greedy output of a format against fp32's, over all prompts."""

    matching: int  # tokens equal position for position
    total: int
    first_divergence: list[int | None]  # per prompt: the first differing index, None if none


def greedy_agreement(
    loaded: LoadedModel, fmt: str, reference: dict[str, list[int]] | None, tokens: int
) -> tuple[Agreement | None, dict[str, list[int]]]:
    """Generate `tokens` greedily for each chat prompt; compare with `reference` (fp32's)."""
    from adapters.engine.engine import Engine
    from core.batching import BatchLimits
    from core.protocol import Assignment, Decoded, GenerationRequest

    engine = Engine(loaded, BatchLimits(max_seqs=len(CHAT_PROMPTS), max_context=512), fmt)
    for i, prompt in enumerate(CHAT_PROMPTS):
        ids = chat_token_ids(loaded.tokenizer, [{"role": "user", "content": prompt}])
        engine.start(Assignment(f"p{i}", 1), GenerationRequest(f"p{i}", tuple(ids), tokens))
    outputs: dict[str, list[int]] = {f"p{i}": [] for i in range(len(CHAT_PROMPTS))}
    while engine.has_work():
        for event in engine.step():
            if isinstance(event, Decoded):
                outputs[event.assignment.request_id].append(event.token_id)
    if reference is None:
        return None, outputs
    matching, total, firsts = 0, 0, []
    for key, ref in reference.items():
        mine = outputs[key]
        pairs = list(zip(ref, mine, strict=False))
        matching += sum(a == b for a, b in pairs)
        total += max(len(ref), len(mine))
        diverged = [i for i, (a, b) in enumerate(pairs) if a != b]
        if not diverged and len(ref) != len(mine):
            diverged = [len(pairs)]
        firsts.append(diverged[0] if diverged else None)
    return Agreement(matching, total, firsts), outputs


def gate_cache(loaded: LoadedModel, tokens: int) -> Path:
    return cache_root() / "quality" / f"{model_key(loaded)}-{tokens}.json"


def perplexities(
    loaded: LoadedModel, formats: list[str], tokens: int, say: Any = None
) -> dict[str, float]:
    """Perplexity of each format (and fp32) on `tokens` tokens of the reference text,
    from the cache where measured before; new measurements are added to it."""
    path = gate_cache(loaded, tokens)
    known: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}
    names = {fmt: cache_name(fmt) for fmt in ["fp32", *formats]}
    missing = [fmt for fmt in ["fp32", *formats] if names[fmt] not in known]
    if missing:
        ids = text_tokens(loaded, tokens)
        for fmt in missing:
            if say is not None:
                say(f"quality gate: scoring {fmt} weights on {tokens} tokens of reference text")
            blocks = -(-(tokens + 1) // DEFAULT_BLOCK_SIZE)
            runner = Runner(loaded, blocks, DEFAULT_BLOCK_SIZE, tokens + 1, fmt)
            known[names[fmt]] = perplexity(runner, ids)
            del runner
        # Written only when something was measured: a cache baked into a read-only
        # image stays as it is.
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1, sort_keys=True))
    return {fmt: known[names[fmt]] for fmt in ["fp32", *formats]}


def cache_name(fmt: str) -> str:
    """The gate cache's key for a format: its name and a hash of the code that makes
    it (the quantisers, the native kernel's source), so a changed quantiser or kernel
    is scored again instead of reusing an older one's perplexity. (fp32 is the
    reference, kept by name.)"""
    if fmt == "fp32":
        return fmt
    return f"{fmt}-{code_key()}"


def passes(perplexity_of: dict[str, float], fmt: str) -> bool:
    return perplexity_of[fmt] <= perplexity_of["fp32"] * (1 + GATE)
