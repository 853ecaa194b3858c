"""`fencepost bench engine`: the decode engine against HF generate, in one run.

Prints, on the same model, prompt and settings: HF `model.generate`
single-stream tokens/s (what a user would write first), fencepost
single-stream tokens/s, aggregate tokens/s at several concurrency levels,
decode step latency p50/p99, peak RSS, and how close batch-1 decoding comes
to the memory-bandwidth bound (every weight read once per token).

EOS is ignored on both sides (HF: min_new_tokens), so every run generates
exactly the requested number of tokens and the rates compare like for like.

With --logprobs K every concurrency level runs twice over, alternating
without and with log probabilities (the chosen token plus the top K, for every
stream), and prints the best rate of each side by side: what asking for
logprobs costs.

With --shared-prefix N it also times the first token of a request that
starts with N tokens of text already in the prefix cache (an earlier request
with another question computed them) against one whose N tokens are new, and
the first tokens of a burst of requests (the largest --concurrency) that share a
new N-token prefix and arrive together.

With --constrained (or --json-schema FILE) it also runs, at each concurrency,
the same number of streams asking for JSON, once free and once constrained
to the schema (default: TYPICAL_SCHEMA), side by side on one engine that stops
at EOS: a stream that ends early is replaced, so the batch stays full.

With --speculative KIND it runs, in place of the rows above, decoding with and
without speculation side by side (bench/speculative.py): an editing task, chat
at each concurrency, and the cost of verifying k guesses.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch

from adapters.engine.build import weight_format
from adapters.engine.engine import Engine, logprob_records
from adapters.engine.grammar import json_schema_grammar
from adapters.engine.model import LoadedModel, chat_token_ids, load_model
from adapters.engine.options import DEFAULT_KV_CACHE_TOKENS
from adapters.engine.runner import DEFAULT_BLOCK_SIZE
from adapters.engine.sampling import TokenDraw
from bench import measure
from bench import speculative as speculative_bench
from core.batching import BatchLimits
from core.protocol import Assignment, Constraint, Decoded, DecodeDone, GenerationRequest, Sampling

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
JSON_PROMPT = "Invent three people and describe each of them as JSON."
# A typical structured-output schema: typed fields, an enum, an array, a nested object.
TYPICAL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "height_m": {"type": "number"},
        "member": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "height_m", "member", "colour", "tags", "address"],
    "additionalProperties": False,
}


def _prompt_ids(loaded: LoadedModel) -> tuple[int, ...]:
    return tuple(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": PROMPT}]))


def transformers_model(loaded: LoadedModel) -> Any:
    """transformers' own model of the same checkpoint, for the baseline rows: built here,
    by transformers, from the files the engine read (the engine never builds one)."""
    from transformers import AutoModelForCausalLM

    source = Path(loaded.source)
    if source.suffix == ".gguf":
        folder, options = source.parent, {"gguf_file": source.name}
    else:
        folder, options = source, {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **options)
    return model.to(loaded.device).eval()


def hf_generate_rate(loaded: LoadedModel, prompt: tuple[int, ...], tokens: int) -> float:
    """transformers' generate on the same weights in fp32, batch 1 (after a short
    warm-up): the baseline the engine's figures are ratios to."""
    rate, _ = measure.hf_generate_rate(transformers_model(loaded), prompt, tokens, warm_tokens=4)
    return rate


def engine_run(
    engine: Engine,
    prompt: tuple[int, ...],
    concurrent: int,
    tokens: int,
    logprobs: int | None = None,
) -> tuple[float, list[float]]:
    """(aggregate tokens/s, seconds of each decode-only step) for `concurrent` requests,
    each asking for `logprobs` alternatives (None: no log probabilities)."""
    for i in range(concurrent):
        sampling = Sampling(0.0 if concurrent == 1 else 0.7, 0.95, i)
        rid = f"bench-{concurrent}-{i}-{logprobs}"
        request = GenerationRequest(rid, prompt, tokens, sampling, logprobs=logprobs)
        engine.start(Assignment(rid, 1), request)
    produced = 0
    decode_steps: list[float] = []
    began = time.perf_counter()
    while engine.has_work():
        events = engine.step()
        produced += sum(1 for e in events if isinstance(e, Decoded))
        if engine.last_step.prefill_tokens == 0:
            decode_steps.append(engine.last_step.seconds)
    return produced / (time.perf_counter() - began), decode_steps


class RefilledRun(NamedTuple):
    rate: float  # tokens/s over the whole run
    decode_rate: float  # tokens/s over decode-only steps (no prefill of a replacement)
    requests: int  # requests started


def refilled_run(
    engine: Engine,
    prompt: tuple[int, ...],
    concurrent: int,
    tokens: int,
    constraint: Constraint | None,
) -> RefilledRun:
    """`concurrent` streams until they have made concurrent * tokens tokens; a stream
    that ends early is replaced by a new one, so the batch stays full, and the run
    stops at the target (no tail of a few late replacements)."""
    target, limit = concurrent * tokens, 50 * concurrent
    started = 0
    live: set[Assignment] = set()

    def start() -> None:
        nonlocal started
        rid = f"refill-{concurrent}-{started}-{constraint is not None}"
        sampling = Sampling(0.0 if concurrent == 1 else 0.7, 0.95, started)
        request = GenerationRequest(rid, prompt, tokens, sampling, constraint=constraint)
        engine.start(Assignment(rid, 1), request)
        live.add(Assignment(rid, 1))
        started += 1

    for _ in range(concurrent):
        start()
    produced, decoded, decode_s = 0, 0, 0.0
    began = time.perf_counter()
    while engine.has_work() and produced < target:
        events = engine.step()
        produced += sum(1 for e in events if isinstance(e, Decoded))
        if engine.last_step.prefill_tokens == 0:
            decoded += engine.last_step.decode_rows
            decode_s += engine.last_step.seconds
        for event in events:
            if isinstance(event, DecodeDone):
                live.discard(event.assignment)
                if started < limit:
                    start()
    for assignment in live:
        engine.stop(assignment)
    elapsed = time.perf_counter() - began
    return RefilledRun(produced / elapsed, decoded / max(decode_s, 1e-9), started)


def constrained_comparison(
    engine: Engine, loaded: LoadedModel, schema: dict[str, Any], concurrency: list[int], tokens: int
) -> None:
    """Tokens/s of JSON-asking streams, free and constrained, at each concurrency (best
    of three alternating runs each: the machine may be shared). Constrained streams
    end when their JSON is complete and are replaced, so the whole-run rate also
    pays for the replacements' prefills; the decode-step rate is the masks' cost."""
    prompt = tuple(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": JSON_PROMPT}]))
    constraint = Constraint(json_schema_grammar(schema))
    refilled_run(engine, prompt, 1, 8, constraint)  # warm up: the grammar tokenizer, compiling
    grammars = engine.grammars()
    print(f"  constrained decoding ({len(constraint.grammar)}-character grammar), best of 3:")
    for n in concurrency:
        free = constrained = RefilledRun(0.0, 0.0, 0)
        requests = 0
        masks_before = grammars.mask_seconds, grammars.mask_calls, grammars.mask_wait_seconds
        for _ in range(3):
            run = refilled_run(engine, prompt, n, tokens, None)
            free = RefilledRun(max(free.rate, run.rate), max(free.decode_rate, run.decode_rate), 0)
            run = refilled_run(engine, prompt, n, tokens, constraint)
            constrained = RefilledRun(
                max(constrained.rate, run.rate), max(constrained.decode_rate, run.decode_rate), 0
            )
            requests += run.requests
        calls = grammars.mask_calls - masks_before[1]
        per_step = (grammars.mask_seconds - masks_before[0]) / max(calls, 1)
        waited = (grammars.mask_wait_seconds - masks_before[2]) / max(calls, 1)
        label = f"{n:2} stream{'s' if n > 1 else ' '}"
        print(
            f"    {label}, whole run:    free {free.rate:7.1f} tok/s, constrained "
            f"{constrained.rate:7.1f} tok/s ({constrained.rate / free.rate - 1:+.1%}); "
            f"{requests} constrained requests for {3 * n} streams"
        )
        print(
            f"    {label}, decode steps: free {free.decode_rate:7.1f} tok/s, constrained "
            f"{constrained.decode_rate:7.1f} tok/s "
            f"({constrained.decode_rate / free.decode_rate - 1:+.1%}); "
            f"masks {per_step * 1e3:.2f} ms per step, {waited * 1e3:.2f} ms of it waited for"
        )


def first_token_s(engine: Engine, rid: str, prompt: tuple[int, ...]) -> tuple[float, int]:
    """(seconds to the first token, tokens computed, not found cached) of one request."""
    computed = engine.cache_report().computed_tokens
    engine.start(Assignment(rid, 1), GenerationRequest(rid, prompt, 1))
    began = time.perf_counter()
    first = None
    while engine.has_work():
        events = engine.step()
        if first is None and any(isinstance(e, Decoded) for e in events):
            first = time.perf_counter() - began
    assert first is not None
    return first, engine.cache_report().computed_tokens - computed


def burst_first_tokens(
    engine: Engine, prefix: tuple[int, ...], endings: list[tuple[int, ...]]
) -> tuple[list[float], int]:
    """Requests sharing `prefix` (not cached yet) started at once: each one's seconds
    to its first token, sorted, and the tokens computed for all of them."""
    computed = engine.cache_report().computed_tokens
    for i, ending in enumerate(endings):
        engine.start(
            Assignment(f"burst-{i}", 1), GenerationRequest(f"burst-{i}", (*prefix, *ending), 1)
        )
    began, first = time.perf_counter(), []
    while engine.has_work():
        events = engine.step()
        first += [time.perf_counter() - began for e in events if isinstance(e, Decoded)]
    return sorted(first), engine.cache_report().computed_tokens - computed


def shared_prefix_ttft(engine: Engine, loaded: LoadedModel, prefix_tokens: int) -> None:
    """First-token time with a cached prefix of `prefix_tokens` tokens, and without."""
    from adapters.engine.quality import text_tokens

    text = text_tokens(loaded, 3 * prefix_tokens)
    question = _prompt_ids(loaded)
    for label, prefix in (
        ("a", text[:prefix_tokens]),
        ("b", text[prefix_tokens : 2 * prefix_tokens]),
    ):
        cold, cold_computed = first_token_s(engine, f"cold-{label}", (*prefix, *question))
        other = (*prefix, *reversed(question))  # the same prefix, another ending
        warm, warm_computed = first_token_s(engine, f"warm-{label}", other)
        print(
            f"  TTFT, {prefix_tokens}-token prefix ({label}): first use {cold * 1e3:7.1f} ms "
            f"({cold_computed} tokens computed), seen before {warm * 1e3:7.1f} ms "
            f"({warm_computed} computed)"
        )
    count = engine.limits.max_seqs
    endings = [(*question[: 1 + i % len(question)], i + 1) for i in range(count)]
    first, computed = burst_first_tokens(
        engine, tuple(text[2 * prefix_tokens : 3 * prefix_tokens]), endings
    )
    print(
        f"  burst of {count} requests sharing a new {prefix_tokens}-token prefix: first token "
        f"p50 {first[len(first) // 2] * 1e3:.0f} ms, last {first[-1] * 1e3:.0f} ms, "
        f"{computed} tokens computed of {sum(prefix_tokens + len(e) for e in endings)}"
    )


def logprobs_overhead(
    engine: Engine, prompt: tuple[int, ...], concurrent: int, tokens: int, top: int
) -> None:
    """Tokens/s without and with logprobs (top `top`), alternating runs, best of two; and
    the median time of logprob_records alone on logits of that many rows, against the
    median decode step with logprobs (a steadier figure on a busy machine)."""
    plain: list[float] = []
    asking: list[float] = []
    steps: list[float] = []
    for _ in range(2):
        plain.append(engine_run(engine, prompt, concurrent, tokens)[0])
        rate, asking_steps = engine_run(engine, prompt, concurrent, tokens, top)
        asking.append(rate)
        steps += asking_steps
    without, with_ = max(plain), max(asking)
    print(
        f"  {concurrent:2} stream{'s' if concurrent > 1 else ' '}: {without:8.1f} tok/s without "
        f"logprobs, {with_:8.1f} tok/s with logprobs {top} ({with_ / without - 1:+.1%})"
    )
    logits = torch.randn(concurrent, engine.runner.vocab_size, device=engine.device)
    draws = [TokenDraw(0.7, 0.95, i, 0) for i in range(concurrent)]
    picks = torch.argmax(logits, dim=-1).tolist()
    took = []
    for _ in range(30):
        began = time.perf_counter()
        logprob_records(logits, picks, draws, [top] * concurrent)
        took.append(time.perf_counter() - began)
    alone, step = statistics.median(took), statistics.median(steps) if steps else float("nan")
    print(
        f"      logprob_records alone: {alone * 1e3:.2f} ms a step, "
        f"{alone / step:.1%} of the median decode step ({step * 1e3:.1f} ms)"
    )


def main(
    model_path: str | None,
    tokens: int,
    concurrency: list[int],
    threads: int | None,
    weights: str = "float",
    prefix_caching: bool = True,
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
    shared_prefix: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    logprobs: int | None = None,
    schema: dict[str, Any] | None = None,
    device: str = "auto",
    decode: str = "auto",
    attention: str = "auto",
    speculative: dict[str, Any] | None = None,
) -> int:
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_model(model_path, device=device)
    # Generate every requested token: no early stop on EOS on either side.
    endless = dataclasses.replace(loaded, eos_token_ids=frozenset())
    prompt = _prompt_ids(loaded)
    device = loaded.device
    print(
        f"engine bench: {loaded.name} ({loaded.family}) on {device}, "
        f"{torch.get_num_threads()} torch threads, prompt {len(prompt)} tokens, "
        f"{tokens} new tokens per request, engine weights {weights}, "
        f"prefix cache {'on' if prefix_caching else 'off'}, KV cache "
        f"{'sized from free memory' if kv_cache_tokens is None else f'{kv_cache_tokens} tokens'} "
        f"in blocks of {block_size}, decode {decode}"
    )
    limits = BatchLimits(max_seqs=max(concurrency), max_context=2048)
    weights = weight_format(loaded, weights, limits.max_seqs)
    engine_of = functools.partial(
        Engine,
        limits=limits,
        weights=weights,
        prefix_caching=prefix_caching,
        kv_cache_tokens=kv_cache_tokens,
        block_size=block_size,
        decode=decode,
        attention=attention,
    )
    if speculative is not None:  # its own comparison, in place of the rows below
        return speculative_bench.main(loaded, engine_of, concurrency=concurrency, tokens=tokens,
                                      **speculative)  # fmt: skip
    hf = hf_generate_rate(loaded, prompt, tokens)
    print(f"  HF generate, 1 stream:              {hf:8.1f} tok/s   (1.00x)")
    engine = engine_of(endless)
    engine_run(engine, prompt, 1, 8)  # warm up
    rows = []
    steps_at_max: list[float] = []
    for n in concurrency:
        if logprobs is not None:
            logprobs_overhead(engine, prompt, n, tokens, logprobs)
        rate, steps = engine_run(engine, prompt, n, tokens)
        rows.append((n, rate))
        if n == max(concurrency):
            steps_at_max = steps
        label = f"fencepost, {n} stream{'s' if n > 1 else ' '}:"
        print(f"  {label:35} {rate:8.1f} tok/s   ({rate / hf:.2f}x)")
    if steps_at_max:
        ordered = sorted(steps_at_max)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        p50 = statistics.median(ordered)
        print(
            f"  decode step at {max(concurrency)} streams: p50 {p50 * 1e3:.1f} ms, "
            f"p99 {p99 * 1e3:.1f} ms"
        )
    single = next((rate for n, rate in rows if n == 1), None)
    weight_bytes = engine.runner.weight_bytes(rows=1)
    bandwidth = measure.memory_bandwidth_gbs(torch.device(loaded.device or "cpu"))
    bound = bandwidth * 1e9 / weight_bytes
    print(f"  weights read per decode step: {weight_bytes / 1e6:.0f} MB")
    if any(layer.experts for layer in engine.runner.spec.layers):
        most = max(concurrency)
        print(
            f"  (a mixture: the experts one row picks; at {most} rows, evenly spread, "
            f"{engine.runner.weight_bytes(rows=most) / 1e6:.0f} MB of the "
            f"{engine.runner.weight_bytes() / 1e6:.0f} MB held)"
        )
    print(f"  memory copy bandwidth: {bandwidth:.1f} GB/s (read + write)")
    if single is not None:
        print(
            f"  batch-1 bandwidth bound {bound:.1f} tok/s; fencepost 1 stream reaches "
            f"{single / bound:.0%} of it"
        )
    if shared_prefix is not None:
        shared_prefix_ttft(engine, loaded, shared_prefix)
    if schema is not None:
        stopping = engine_of(loaded)  # this one stops at EOS
        constrained_comparison(stopping, loaded, schema, concurrency, tokens)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"  peak RSS: {peak_mib:.0f} MiB")
    return 0
