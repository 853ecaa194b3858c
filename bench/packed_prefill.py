"""Batched prefill, side by side in one run: first-token latency of N chat prompts
arriving at once, every prefill chunk of a step in one forward pass (the engine)
against one forward per chunk (how the engine prefilled before), alternating
rounds on the same loaded model, format and thread count; then one-stream decode.

    PYTHONPATH=. .venv/bin/python bench/packed_prefill.py [--weights int4] [--threads 1]

Prefix caching is off for the bursts, so every round computes every prompt (the
chat template's shared system prompt would otherwise come cached after round one);
`fencepost bench engine --shared-prefix` times the cached case.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F

from adapters.engine.engine import Engine
from adapters.engine.layers.attention import attend_chunk, read
from adapters.engine.model import LoadedModel, chat_token_ids, load_model
from adapters.engine.quality import text_tokens
from adapters.engine.runner import Chunk, Runner
from core.batching import BatchLimits
from core.protocol import Assignment, Decoded, DecoderEvent, GenerationRequest

QUESTIONS = [
    "What is the capital of France, and why is it famous?",
    "Give me three tips for sleeping better at night.",
    "Explain what a prime number is to a ten year old.",
    "How do I boil an egg so that the yolk stays soft?",
    "Write a haiku about autumn leaves falling in the rain.",
    "What are the main differences between cats and dogs?",
    "Suggest a name for a small bakery by the sea.",
    "Why is the sky blue during the day and red at sunset?",
    "How many legs does a spider have, and why so many?",
    "Describe the water cycle in two short sentences.",
    "What should I pack for a weekend hiking trip?",
    "Translate 'good morning, friend' into Spanish.",
    "List four planets of the solar system and one fact each.",
    "What is the difference between weather and climate?",
    "Recommend a board game for a family of four.",
    "How does a bicycle stay upright when it moves?",
]


PREFIX = 300


class ChunkByChunk(Engine):
    """The engine as it prefilled before: one forward pass per chunk."""

    def _prefill(self, chunks: list[Any], events: list[DecoderEvent]) -> None:
        for chunk in chunks:
            super()._prefill([chunk], events)


def burst(engine: Engine, prompts: list[tuple[int, ...]], tag: str) -> list[float]:
    """Start every prompt at once (one new token each): seconds to each first token."""
    for i, prompt in enumerate(prompts):
        engine.start(Assignment(f"{tag}-{i}", 1), GenerationRequest(f"{tag}-{i}", prompt, 1))
    began, first = time.perf_counter(), []
    while engine.has_work():
        events = engine.step()
        first += [time.perf_counter() - began for e in events if isinstance(e, Decoded)]
    return sorted(first)


def decode_rate(engine: Engine, prompt: tuple[int, ...], tokens: int) -> float:
    """One stream's tokens/s after its first token."""
    engine.start(Assignment("one", 1), GenerationRequest("one", prompt, tokens))
    engine.step()
    began, count = time.perf_counter(), 0
    while engine.has_work():
        count += sum(isinstance(e, Decoded) for e in engine.step())
    return count / (time.perf_counter() - began)


def best_s(run: Any, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return min(times)


def forward_choices(runner: Runner, count: int, chunk: int, cached: int) -> str:
    """The prefill forward alone for `count` chunks of `chunk` tokens, each after
    `cached` positions of its own: one packed pass against one pass per chunk
    (best of 5, alternating), each chunk's last row through lm_head."""
    size = runner.block_size
    width = -(-(cached + chunk) // size)
    chunks = [
        Chunk(list(range(i * width, (i + 1) * width)), cached, torch.arange(chunk) + 100 + i)
        for i in range(count)
    ]
    rows = [(i + 1) * chunk - 1 for i in range(count)]
    packed, apart = [], []
    for _ in range(5):
        packed.append(best_s(lambda: runner.prefill_packed(chunks, rows), 1))
        apart.append(best_s(lambda: [runner.prefill_packed([c], [chunk - 1]) for c in chunks], 1))
    a, b = min(packed), min(apart)
    return (
        f"  prefill forward, {count} chunks of {chunk} after {cached} cached: packed "
        f"{a * 1e3:.0f} ms, per chunk {b * 1e3:.0f} ms ({a / b:.2f})"
    )


@torch.inference_mode()
def attention_choices(runner: Runner, count: int, chunk: int, cached: int) -> str:
    """One layer's prefill attention for `count` chunks of `chunk` tokens, each after
    `cached` positions of its own: a loop of one product per chunk (what prefill_packed
    does) against one product over every chunk's keys with a block-causal mask."""
    heads, kv, dim, size = runner.heads, runner.kv_heads, runner.head_dim, runner.block_size
    width = -(-(cached + chunk) // size)
    tables = [list(range(i * width, (i + 1) * width)) for i in range(count)]
    q = torch.randn(count * chunk, heads, dim)
    k_cache, v_cache = runner.k_cache[0], runner.v_cache[0]
    buffers = [torch.empty(0), torch.empty(0)]  # the gathers' own, reused as the runner's are
    spans = []
    for table in tables:
        pages = runner.pages([table], cached + chunk)
        positions = torch.arange(cached, cached + chunk)
        span = torch.arange(pages.length)
        spans.append((pages, (span[None, :] <= positions[:, None])[None, None]))

    def loop() -> None:
        for i, (pages, mask) in enumerate(spans):
            queries = q[i * chunk : (i + 1) * chunk]
            attend_chunk(queries, k_cache, v_cache, pages, mask, None, size, buffers)

    every = runner.pages(tables, cached + chunk)  # one gather of every chunk's blocks
    length = every.length
    own = torch.arange(count).repeat_interleave(chunk)  # each query's sequence
    key_seq = torch.arange(count).repeat_interleave(length)
    key_pos = torch.arange(length).repeat(count)
    query_pos = torch.arange(cached, cached + chunk).repeat(count)
    allowed = (own[:, None] == key_seq[None, :]) & (key_pos[None, :] <= query_pos[:, None])
    mask = allowed[None, None]

    def masked() -> None:
        keys = read(k_cache, every, size, buffers, 0).reshape(1, kv, count * length, dim)
        values = read(v_cache, every, size, buffers, 1).reshape(1, kv, count * length, dim)
        F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True, scale=1.0
        )

    a, b = best_s(loop), best_s(masked)
    return (
        f"  attention, one layer, {count} chunks of {chunk} after {cached} cached: loop "
        f"{a * 1e3:.2f} ms, one masked product {b * 1e3:.2f} ms ({b / a:.1f}x the loop)"
    )


@torch.inference_mode()
def folding_decodes(runner: Runner, decodes: int, prefill: int) -> str:
    """Every layer's products (qkv, o, gate_up, down) for `decodes` rows and `prefill`
    tokens as two calls each (decodes and prefill apart) against one over both: the
    most folding decodes into the packed pass could save on the products."""
    hidden = runner.embed.shape[1]
    a, b = torch.randn(decodes, hidden), torch.randn(prefill, hidden)
    both = torch.cat([a, b])

    def products(x: torch.Tensor) -> None:
        for layer in runner.layers:
            x16 = x.to(runner.dtype)
            layer.qkv(x16)
            layer.o(x16)
            inner = layer.gate_up(x16).chunk(2, dim=-1)[0].contiguous()
            layer.down(inner)

    apart, together = best_s(lambda: (products(a), products(b))), best_s(lambda: products(both))
    return (
        f"  products of all layers, {decodes} decode rows + {prefill} prefill tokens: two calls "
        f"{apart * 1e3:.1f} ms, one call {together * 1e3:.1f} ms ({together / apart:.2f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", default="int4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--counts", default="8,16")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    loaded: LoadedModel = load_model(quiet=True)
    loaded = dataclasses.replace(loaded, eos_token_ids=frozenset())
    prompts = [
        tuple(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": q}])) for q in QUESTIONS
    ]
    lengths = [len(p) for p in prompts]
    print(
        f"{args.weights}, {torch.get_num_threads()} torch thread(s), prompts of "
        f"{min(lengths)}..{max(lengths)} tokens (mean {statistics.mean(lengths):.0f})"
    )
    limits = BatchLimits(max_seqs=16, max_context=2048)
    engines = {
        "packed": Engine(loaded, limits, args.weights, prefix_caching=False),
        "per chunk": ChunkByChunk(loaded, limits, args.weights, prefix_caching=False),
    }
    for engine in engines.values():
        burst(engine, prompts[:2], "warm")
    for count in [int(c) for c in args.counts.split(",")]:
        p50: dict[str, list[float]] = {name: [] for name in engines}
        last: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):
            for name, engine in engines.items():
                first = burst(engine, prompts[:count], f"{count}-{r}")
                p50[name].append(first[len(first) // 2])
                last[name].append(first[-1])
        med = {n: (statistics.median(p50[n]), statistics.median(last[n])) for n in engines}
        (pp, pl), (cp, cl) = med["packed"], med["per chunk"]
        print(
            f"  {count:2} prompts at once: first token p50 / last, median of {args.rounds} "
            f"rounds: packed {pp * 1e3:6.1f} / {pl * 1e3:6.1f} ms, per chunk "
            f"{cp * 1e3:6.1f} / {cl * 1e3:6.1f} ms; packed/per chunk {pp / cp:.2f} / {pl / cl:.2f}"
        )
    cached = {
        "packed": Engine(loaded, limits, args.weights),
        "per chunk": ChunkByChunk(loaded, limits, args.weights),
    }
    text = text_tokens(loaded, PREFIX * (args.rounds + 1))
    endings = [tuple(prompts[i][-1 - i % 8 :]) for i in range(16)]  # 1..8 tokens each
    lasts: dict[str, list[float]] = {name: [] for name in cached}
    for r in range(args.rounds):
        prefix = tuple(text[r * PREFIX : (r + 1) * PREFIX])  # new each round
        for name, engine in cached.items():
            lasts[name].append(burst(engine, [(*prefix, *e) for e in endings], f"p{r}")[-1])
    pb, cb = (statistics.median(lasts[n]) for n in cached)
    print(
        f"  16 prompts sharing a new {PREFIX}-token prefix at once (prefix cache on): last "
        f"first token, median of {args.rounds} rounds: packed {pb * 1e3:6.1f} ms, per chunk "
        f"{cb * 1e3:6.1f} ms; packed/per chunk {pb / cb:.2f}"
    )
    runner = engines["packed"].runner
    for count, chunk, cached in ((8, 41, 0), (16, 41, 0), (15, 17, 288), (4, 128, 0)):
        print(forward_choices(runner, count, chunk, cached))
    for count, chunk, cached in ((8, 45, 0), (16, 45, 0), (16, 8, 300), (4, 128, 0)):
        print(attention_choices(runner, count, chunk, cached))
    for decodes, prefill in ((16, 45), (16, 128), (16, 256)):
        print(folding_decodes(runner, decodes, prefill))
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(6):  # alternating which goes first
        for name in sorted(engines, reverse=r % 2 == 1):
            rates[name].append(decode_rate(engines[name], prompts[0], 64))
    mid = {n: statistics.median(r) for n, r in rates.items()}
    print(
        f"  one stream, 64 tokens, median of 6: packed {mid['packed']:.1f} tok/s, per chunk "
        f"{mid['per chunk']:.1f} tok/s; ratio {mid['packed'] / mid['per chunk']:.2f} (the "
        "decode path is the same code: this is the noise floor)"
    )


if __name__ == "__main__":
    main()
