"""`fencepost bench quality`: every weight format against fp32 on the same model, in one run.

For each format this CPU runs (adapters/engine/choose.py): perplexity on the
gate's fixed English text and its change against fp32 (the gate for a
default: within 2%), greedy agreement on the fixed chat prompts (tokens equal
position for position, and where each prompt first diverges), the bytes of
weights a decode step reads, and a one-row decode step's time on the real
model. The same measurements decide `--weights auto` at start; this prints
them all, over a longer text.
"""

from __future__ import annotations

import time

import torch

from adapters.engine.choose import cpu_flags, working_formats
from adapters.engine.model import LoadedModel, load_model
from adapters.engine.quality import GATE, greedy_agreement, passes, perplexities
from adapters.engine.runner import DEFAULT_BLOCK_SIZE, Runner


def step_and_bytes(
    loaded: LoadedModel, fmt: str, context: int = 200, steps: int = 30
) -> tuple[float, int]:
    """(median one-row decode step in ms with `context` random tokens in the cache,
    bytes of weights a step reads)."""
    positions = context + steps + 1
    blocks = -(-positions // DEFAULT_BLOCK_SIZE)
    runner = Runner(loaded, blocks, DEFAULT_BLOCK_SIZE, positions, fmt)
    table, token = list(range(blocks)), torch.tensor([17])
    runner.prefill(table, 0, torch.randint(0, runner.vocab_size, (context,)))
    times = []
    for index in range(steps):
        began = time.perf_counter()
        pages = runner.pages([table], context + index + 1)
        runner.decode(pages, torch.tensor([context + index]), token)
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2] * 1e3, runner.weight_bytes()


def main(
    model_path: str | None,
    tokens: int,
    generate: int,
    threads: int | None,
    only: tuple[str, ...] | None = None,
) -> int:
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_model(model_path)
    formats = working_formats(loaded.device, loaded.spec)
    if only is not None:
        missing = [f for f in only if f not in formats]
        if missing:
            print(f"not run: {', '.join(missing)} (no working kernel on this CPU)")
        formats = [f for f in formats if f == "fp32" or f in only]
    print(
        f"weight formats on {loaded.name}: torch kernels "
        f"{torch.backends.cpu.get_cpu_capability()}, CPU flags {' '.join(cpu_flags())}, "
        f"{torch.get_num_threads()} threads; perplexity on {tokens} tokens of reference text, "
        f"greedy agreement over {generate} tokens of each chat prompt"
    )
    scores = perplexities(loaded, [f for f in formats if f != "fp32"], tokens)
    _, reference = greedy_agreement(loaded, "fp32", None, generate)
    header = f"  {'format':7} {'perplexity':>10} {'vs fp32':>8} {'gate':>5} {'agree':>9}"
    print(header + f" {'weights MB':>10} {'1-row ms':>8}  first divergence per prompt")
    for fmt in formats:
        if fmt == "fp32":
            agreed, firsts = "-", "-"
        else:
            agreement, _ = greedy_agreement(loaded, fmt, reference, generate)
            assert agreement is not None
            agreed = f"{agreement.matching}/{agreement.total}"
            firsts = " ".join("-" if f is None else str(f) for f in agreement.first_divergence)
        change = scores[fmt] / scores["fp32"] - 1
        step_ms, weight_bytes = step_and_bytes(loaded, fmt)
        verdict = "pass" if passes(scores, fmt) else "FAIL"
        print(
            f"  {fmt:7} {scores[fmt]:10.3f} {change:+8.2%} {verdict:>5} {agreed:>9}"
            f" {weight_bytes / 1e6:10.0f} {step_ms:8.1f}  {firsts}"
        )
    print(f"  gate: perplexity within {GATE:.0%} of fp32; '-' in a divergence list: identical")
    return 0
