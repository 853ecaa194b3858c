"""Choosing the weight format at start: what this CPU can run, how fast, and what passes.

CPUs differ between machines (one here has AVX-512 with BF16 and VNNI, another
had AVX2 only), so nothing is assumed. At start:

1. capability: the CPU's flags and torch's kernel level are read (for the
   log), the native kernels are compiled for the widest instruction set the CPU
   has (adapters/engine/native_build.py: AVX-512 VNNI or AVX2; logged, or why not),
   and each format's kernel is run once on a small matrix and checked against
   fp32; a format whose kernel is missing or wrong is not a candidate;
2. quality: each candidate's perplexity against fp32's on the gate text
   (adapters/engine/quality.py; measured once per model and cached);
   a candidate over the gate is dropped;
3. speed: a short microbenchmark of whole decode steps on the model itself in
   each passing format, at one row (a single stream) and at `rows` rows (a
   full batch), the whole model where its fp32 weights fit in WHOLE_BYTES, else
   2 and 8 of its layers and the rest added at the measured cost of a layer
   (decode_step_s), so the trials never hold a second copy of a large model.
   Each format's speed is the geometric mean of its two
   step times (a stream's latency and a full batch's throughput count alike),
   and the fastest wins; formats within 10% of it count as tied, and the tie
   goes to the lowest perplexity. The margin keeps the answer the same from one
   start to the next where two formats run alike (w4a16 and w4a8 at one row on
   an AVX-512 VNNI CPU, where a step reads weights rather than multiplies).

The choice and the figures behind it go to the log. On CUDA the answer is
bf16 without measuring.

A start on a busy machine can time a format at three times its quiet figure
and choose a slower one for the server's whole life, so the decision is kept
(`choice_cache`): keyed by the model file's content, the CPU's flags and
torch's kernel level, the engine's threads, the batch rows and the code that
builds and runs the formats (this file, the quantisers, the native kernel's
source), and reused by every later start with the same key, which logs it
as such. A changed key measures again; so does deleting the file, which the
log names. `--weights` bypasses all of it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from adapters.engine.code_key import code_key
from adapters.engine.files import cache_root
from adapters.engine.model import LoadedModel, model_key
from adapters.engine.spec import ModelSpec
from adapters.engine.weights import FORMATS, NATIVE, activation_dtype, projection

Say = Callable[[str], None]
GATE_TOKENS = 512  # tokens of reference text scored at start (bench quality scores more)


@dataclass(frozen=True)
class Choice:
    format: str
    reason: str  # one line for the log


def cpu_flags() -> list[str]:
    """The CPU features that matter to these kernels, as the kernel reports them."""
    from adapters.engine.native_build import cpu_flags as every_flag

    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    present = every_flag()
    return [flag for flag in wanted if flag in present]


def native_status(spec: ModelSpec | None = None) -> str:
    """One line for the log: which native kernels were built here, or why none."""
    from adapters.engine.native import model_problem
    from adapters.engine.native_build import NativeUnavailable, load

    try:
        library = load()
    except NativeUnavailable as error:
        return f"native kernels (w4a16, w4a8): not available: {error}"
    problem = model_problem(spec) if spec is not None else None
    unfit = f"; not for this model: {problem}" if problem else ""
    built = f"{library.isa}, {library.tile}-row tiles, {library.path}"
    return f"native kernels (w4a16, w4a8): {built}{unfit}"


def gpu_format(device: torch.device) -> str:
    """bf16 on a GPU that computes it (NVIDIA from Ampere on), fp16 on one that does not."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        return "fp16"
    return "bf16"


def working_formats(device: torch.device, spec: ModelSpec | None = None) -> list[str]:
    """Formats whose kernels run here and agree with fp32 on a small product (and, given
    a model, whose fused pass runs it: the native format's)."""
    if device.type != "cpu":
        return [gpu_format(device)]
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator)
    x = torch.randn(3, 128, generator=generator)
    exact = x @ weight.T
    found = []
    for fmt in FORMATS:
        if fmt == "fp16":  # a GPU's format for cards without bf16: no CPU's choice
            continue
        try:
            got = projection(weight, fmt)(x.to(activation_dtype(fmt))).float()
        except (RuntimeError, NotImplementedError, ValueError):
            continue
        error = float((got - exact).norm() / exact.norm())
        if error < 0.25:  # int4 of this random data errs 8%; a broken kernel errs ~100%
            found.append(fmt)
    if spec is not None and any(fmt in found for fmt in NATIVE):
        from adapters.engine.native import model_problem

        if model_problem(spec):
            found = [fmt for fmt in found if fmt not in NATIVE]
    return found


# The speed trials build a model of this many layers and of TRIAL_SMALL: the step of
# the whole model is the larger one's plus a layer's cost for each layer more, so no
# candidate format ever holds all its weights at once beside the others. The lever
# matters: from 2 and 4 layers a 30-layer model's step came out anywhere from 1.0 to
# 4.3 ms in three starts (each microsecond of noise in the difference counts 13
# times); from 2 and 8 it counts 3.7 times. A model whose fp32 weights fit in
# WHOLE_BYTES is timed whole: no extrapolation at all.
TRIAL_LAYERS = 8
TRIAL_SMALL = 2
WHOLE_BYTES = 2 << 30


def fp32_bytes(spec: ModelSpec) -> int:
    """About what the model's weights take in fp32: its products and the table(s)."""
    total = spec.vocab * spec.hidden * (1 if spec.tie_embeddings else 2)
    for layer in spec.layers:
        attention = layer.attention
        total += spec.hidden * attention.head_dim * 2 * (attention.heads + attention.kv_heads)
        if layer.mlp is not None:
            total += 3 * spec.hidden * layer.mlp.intermediate
        if layer.experts is not None:
            total += 3 * spec.hidden * layer.experts.intermediate * layer.experts.count
    return 4 * total


def decode_step_s(loaded: LoadedModel, fmt: str, rows: int, repeats: int = 10) -> float:
    """Seconds for one decode step of `rows` rows at position 128 on the real model in
    `fmt` (best of `repeats`): the products, norms, attention and all. A model of more
    than TRIAL_LAYERS layers, too large to time whole, is timed with TRIAL_LAYERS and
    TRIAL_SMALL, and the rest of its layers added at the measured cost of a layer."""
    layers = len(loaded.spec.layers)
    if layers <= TRIAL_LAYERS or fp32_bytes(loaded.spec) <= WHOLE_BYTES:
        return _step_s(loaded, fmt, rows, repeats, None)
    small, large = TRIAL_SMALL, TRIAL_LAYERS
    low = _step_s(loaded, fmt, rows, repeats, small)
    high = _step_s(loaded, fmt, rows, repeats, large)
    per_layer = max(0.0, (high - low) / (large - small))
    return high + per_layer * (layers - large)


def _step_s(loaded: LoadedModel, fmt: str, rows: int, repeats: int, layers: int | None) -> float:
    from adapters.engine.runner import DEFAULT_BLOCK_SIZE, Runner

    per_row = -(-160 // DEFAULT_BLOCK_SIZE)
    runner = Runner(loaded, rows * per_row, DEFAULT_BLOCK_SIZE, 160, fmt, layers=layers)
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


def choice_cache(loaded: LoadedModel, rows: int) -> Path:
    """Where the decision for this model, machine, thread count and code is kept."""
    from adapters.engine.native_build import cpu_flags as every_flag

    machine = " ".join(sorted(every_flag()))
    trials = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()  # how it measures
    key = code_key(machine, torch.backends.cpu.get_cpu_capability(),
                   str(torch.get_num_threads()), str(rows), torch.__version__, trials)  # fmt: skip
    return cache_root() / "quality" / f"choice-{model_key(loaded)}-{key}.json"


def choose(loaded: LoadedModel, rows: int, say: Say) -> Choice:
    device = loaded.device
    if device.type != "cpu":
        fmt = gpu_format(device)
        return Choice(fmt, f"{fmt} on {device.type}" + ("" if fmt == "bf16" else " (no bf16)"))
    capability = torch.backends.cpu.get_cpu_capability()
    say(f"CPU: torch kernels {capability}; flags {' '.join(cpu_flags()) or 'none of note'}")
    say(native_status(loaded.spec))
    path = choice_cache(loaded, rows)
    try:
        kept = json.loads(path.read_text())
        return Choice(
            str(kept["format"]),
            f"{kept['reason']}; decided at an earlier start with this model, CPU, thread "
            f"count and code (kept in {path}: delete it to measure again)",
        )
    except (OSError, ValueError, KeyError, TypeError):
        pass  # not decided yet here (or an unreadable file): measure
    choice = _measure(loaded, rows, say)
    try:  # a read-only cache (a baked image) is no reason not to serve
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"format": choice.format, "reason": choice.reason}))
    except OSError as error:
        say(f"could not keep the weight-format decision in {path}: {error.strerror}")
    return choice


TIED = 1.10  # speeds within this factor of the fastest count as the same


def pick(one: dict[str, float], full: dict[str, float], quality: dict[str, float]) -> str:
    """The format to serve among those timed: the least geometric mean of its step at
    one row and at full batch, where formats within TIED of it are tied and the
    lowest perplexity wins the tie."""
    speed = {fmt: (one[fmt] * full[fmt]) ** 0.5 for fmt in one}
    fastest = min(speed.values())
    tied = [fmt for fmt in speed if speed[fmt] <= TIED * fastest]
    return min(tied, key=lambda fmt: (quality.get(fmt, 0.0), speed[fmt]))


def _measure(loaded: LoadedModel, rows: int, say: Say) -> Choice:
    """The quality gate and the speed trials, and the format they choose."""
    from adapters.engine.quality import GATE, passes, perplexities

    working = working_formats(loaded.device, loaded.spec)
    quality = perplexities(loaded, [f for f in working if f != "fp32"], GATE_TOKENS, say)
    passing = [f for f in working if passes(quality, f)]
    one = {fmt: decode_step_s(loaded, fmt, 1) for fmt in passing}
    full = {fmt: decode_step_s(loaded, fmt, rows) for fmt in passing}
    chosen = pick(one, full, quality)
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
