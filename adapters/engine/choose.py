"""Choosing the weight format at start: what this CPU can run, how fast, and what passes.

CPUs differ between machines (one here has AVX-512 with BF16 and VNNI, another
had AVX2 only), so nothing is assumed. At start:

1. capability: the CPU's flags and torch's kernel level are read (for the
   log), the native kernels are compiled for the widest instruction set the CPU
   has (adapters/engine/native.py: AVX-512 VNNI or AVX2; logged, or why not),
   and each format's kernel is run once on a small matrix and checked against
   fp32; a format whose kernel is missing or wrong is not a candidate;
2. quality: each candidate's perplexity against fp32's on the gate text
   (adapters/engine/quality.py; measured once per model and cached);
   a candidate over the gate is dropped;
3. speed: a short microbenchmark of whole decode steps on the model itself in
   each passing format, at one row (a single stream) and at `rows` rows (a
   full batch); the fastest at one row wins, unless it is more than 1.5x
   slower than another passing format at full batch.

The choice and the figures behind it go to the log. On CUDA the answer is
bf16 without measuring.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from adapters.engine.model import LoadedModel
from adapters.engine.weights import FORMATS, activation_dtype, projection

Say = Callable[[str], None]
GATE_TOKENS = 512  # tokens of reference text scored at start (bench quality scores more)


@dataclass(frozen=True)
class Choice:
    format: str
    reason: str  # one line for the log


def cpu_flags() -> list[str]:
    """The CPU features that matter to these kernels, as the kernel reports them."""
    from adapters.engine.native import cpu_flags as every_flag

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    present = every_flag()
    return [flag for flag in wanted if flag in present]


def native_status(model: Any = None) -> str:
    """One line for the log: which native kernels were built here, or why none."""
    from adapters.engine.native import NativeUnavailable, load, shape_problem

    try:
        library = load()
    except NativeUnavailable as error:
        return f"native kernels (w4a16): not available: {error}"
    problem = shape_problem(model.config) if model is not None else None
    unfit = f"; not for this model: {problem}" if problem else ""
    return f"native kernels (w4a16): {library.isa}, {library.tile}-row tiles, {library.path}{unfit}"


def working_formats(device: torch.device, model: Any = None) -> list[str]:
    """Formats whose kernels run here and agree with fp32 on a small product (and, given
    a model, whose fused pass takes its shapes: the native format's)."""
    if device.type != "cpu":
        return ["bf16"]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator)
    x = torch.randn(3, 128, generator=generator)
    exact = x @ weight.T
    found = []
    for fmt in FORMATS:
        try:
            got = projection(weight, fmt)(x.to(activation_dtype(fmt))).float()
        except (RuntimeError, NotImplementedError, ValueError):
            continue
        error = float((got - exact).norm() / exact.norm())
        if error < 0.25:  # int4 of this random data errs 8%; a broken kernel errs ~100%
            found.append(fmt)
    if model is not None and "w4a16" in found:
        from adapters.engine.native import shape_problem

        if shape_problem(model.config):
            found.remove("w4a16")
    return found


def decode_step_s(model: Any, fmt: str, rows: int, repeats: int = 5) -> float:
    """Seconds for one decode step of `rows` rows at position 128 on the real model in
    `fmt` (best of `repeats`): the products, norms, attention and all."""
    from adapters.engine.llama import DEFAULT_BLOCK_SIZE, LlamaRunner

    per_row = -(-160 // DEFAULT_BLOCK_SIZE)
    runner = LlamaRunner(model, rows * per_row, DEFAULT_BLOCK_SIZE, 160, fmt)
    tables = [list(range(row * per_row, (row + 1) * per_row)) for row in range(rows)]
    pages = runner.pages(tables, 129)
    positions = torch.full((rows,), 128)
    tokens = torch.zeros(rows, dtype=torch.long)
    runner.decode(pages, positions, tokens)  # warm
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        runner.decode(pages, positions, tokens)
        best = min(best, time.perf_counter() - began)
    return best


def choose(loaded: LoadedModel, rows: int, say: Say) -> Choice:
    device = next(loaded.model.parameters()).device
    if device.type != "cpu":
        return Choice("bf16", f"bf16 on {device.type}")
    from adapters.engine.quality import GATE, passes, perplexities

    capability = torch.backends.cpu.get_cpu_capability()
    working = working_formats(device, loaded.model)
    say(f"CPU: torch kernels {capability}; flags {' '.join(cpu_flags()) or 'none of note'}")
    say(native_status(loaded.model))
    quality = perplexities(loaded, [f for f in working if f != "fp32"], GATE_TOKENS, say)
    passing = [f for f in working if passes(quality, f)]
    one = {fmt: decode_step_s(loaded.model, fmt, 1) for fmt in passing}
    full = {fmt: decode_step_s(loaded.model, fmt, rows) for fmt in passing}
    best_full = min(full.values())
    eligible = [f for f in passing if full[f] <= 1.5 * best_full]
    chosen = min(eligible, key=lambda f: one[f])
    figures = "; ".join(
        f"{fmt}: {one[fmt] * 1e3:.1f} ms at 1 row, {full[fmt] * 1e3:.1f} ms at {rows}, "
        f"perplexity {quality[fmt]:.3f}" + ("" if fmt in passing else " (fails the gate)")
        for fmt in working
        if fmt in one
    )
    failed = [f for f in working if f not in passing]
    if failed:
        figures += f"; over the {GATE:.0%} gate: " + ", ".join(
            f"{f} {quality[f]:.3f}" for f in failed
        )
    return Choice(chosen, f"weights {chosen}, chosen by measurement ({figures})")
