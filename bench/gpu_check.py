"""The device check of issues 13 and 52: correctness and speed of the engine on one GPU, in one run.

Builds random-weight models of real shapes on the device (no download;
bench/gpu_shapes.py): SmolLM2-135M, Llama-3.2-1B and Llama-3-8B, and of two
other families, Qwen3-8B (per-head q/k norms, head size 128) and Gemma-3-4B
(1 + w norms before and after each sublayer, a tanh-GELU gate, five windowed
layers in six with their own rotary base, head size 256); and a mixture of
experts, Qwen3-30B-A3B (128 experts, 8 a token, 61 GB of bf16), which joins
the default list on a device of at least 100 GiB (the run's second line says
whether it joined and why) and whose engine runs at 1 and 64 streams, where
the experts' rows are grouped (plain rotary frequencies, which change no
cost). On the first shape it checks:

- fp32 greedy of our Engine equals HF `generate` over 64 tokens, 4 prompts
  (eager HF, the one HF call left in this process: the check's reference);
- decode paths, bf16 greedy, 4 prompts together: the CUDA graphs' replay
  against the same fixed-shape step run without capture (the same kernels:
  must be equal), and against the eager step (other kernels: reported);
- bf16 greedy: each prompt alone against the same prompt in a batch of 16;
  resume exactness: a GenerationRequest with output_prefix = the first k
  tokens (k = 1, 17, 45) continues exactly as the uninterrupted run (the 12
  resumes run together as one batch, against each prompt's run alone);
- seeded sampling at temperature 0.8: the same two checks.

Then for every shape: tokens/s of the Engine at 1, 16, 64 and 256 streams
(40-token prompt, 128 new tokens, EOS ignored, prefix cache off so no stream
reuses another's prompt); the first-token times of 64 requests arriving at
once on the 1B shape; one stream through the eager decode step, for what the
graphs gain; and what verifying k speculative guesses costs (one pass over a
sequence's last token and k guesses at position 512, k = 0..16, with the
speed-up implied at 50/70/90% acceptance; `--skip verify` leaves it out).
Beside them HF's anchors, each in a process of its own
(bench/gpu_anchors.py), never in the engine's (in one device run in nine the
engine failed with a CUDA "unspecified launch failure" at 256 streams in a
process where HF's compiled static-cache generate had run before): HF
generate with a static cache (which transformers compiles with torch.compile
on CUDA; batch 1), transformers' continuous batching (`generate_batch`, at
the largest stream count, called outside inference mode: its manager's
thread updates tensors the caller made, and every request is checked whole)
and HF generate eager (batch 1). An anchor's process builds the same model
from the shape and the seed, prints its pid (each row says it is not the
engine's) and leaves its figure as JSON; its crash or its timeout fails its
section with the process's stderr, and the run goes on. The anchors run once
this process has freed the shape's model. It ends with the issue's goals,
met or not. Each engine's start prints its choices: the fused elementwise
kernels, the decode attention (both timed), the graphs captured (time and
memory). `--decode` and `--attention` force a path for a second run, as
FENCEPOST_FUSED=off leaves the fused kernels out.

`--repeat N` runs the engine's largest stream count (256 by default) of one
shape (`--repeat-shape`, the first) N more times, each in a fresh process
(this script's `--engine-part`), after the shapes: a fault is a nonzero
exit, a timeout or an error raised, and each is reported with its run's
index and the stage the process had begun (build, or the batch itself),
with its stderr; "repeat: k/N runs faulted" closes the run, and a fault
fails it. (FENCEPOST_GPU_CHECK_FAULT=i makes run i raise, for the tests.)
`--sanitize` runs that batch once more, 8 tokens, under compute-sanitizer's
memcheck (on PATH or in /usr/local/cuda*/bin), and reports its ERROR
SUMMARY; without CUDA or without the tool it says so and skips.
`--check-indices` runs both with FENCEPOST_CHECK_INDICES=1: every token,
position and block id a step hands its kernels checked on the host first
(adapters/engine/index_check.py), so an index out of bounds is named where
it arises, not at a later synchronisation; the repeats' rates are then lower.

Every loop is bounded (steps and a deadline) and every child process by a
timeout (the cap of CHILD_S, or the budget left, the lesser); `--budget-s`
skips what would not fit and says so; each section prints its own traceback
when it fails and the rest still runs. The correctness checks take at most
90 s of the budget; --repeat keeps N x 20 s of it on CUDA (at most 40%) from
the shapes, --sanitize 240 s (at most 30%); the shapes share the rest, each
shape's engine at most half of its share, its anchors the remainder. The
same script runs on CPU with tiny shapes (the test suite does:
tests/bench/test_gpu_check.py).

What it imports: torch, transformers and the engine's path through the
project (core.protocol uses msgspec; adapters/engine/engine.py imports
llguidance through grammar.py). The device image has torch and transformers
but neither msgspec nor llguidance, so the run carries their wheels,
msgspec==0.23.0 and llguidance==1.9.1. Here, once, in the repository root
(.gitignore ignores `.whl/`):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_31_x86_64 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0 llguidance==1.9.1

(3.3 MB together). No tokenizer and no weights travel: random weights make
any token ids as good as a real prompt's, so the prompts are fixed ids.
Then the whole device run, one command (`run` tool), carry [".whl"],
timeout_s 510:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
      || exit; PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 420 \
      --repeat 10 2>&1 | tee $OUT/gpu_check.log

About 7.5 minutes with the install (a session has 15 minutes of device time,
the machine's start included); an estimate, not yet a device's measurement.
Of the 420 s: the checks up to 90; the ten repeats 168 (a run starts while
20 s are left: about 17 s a fresh process fits all ten, slower ones leave
the last as not run, unless the shapes left time over); the five shapes the
rest, about 30 s each: each shape's engine figures, not most of HF's anchors
(torch.compile's first call alone is about a minute). So this run answers
the fault question and the engine's figures; a second session measures the
anchors, e.g. the same command with `--shapes 135m,1b,8b --skip checks` in
place of `--repeat 10` (140 s a shape). Each shape's parts run goal-first
(the engine: batch 1, the burst, the largest batch, then the middle stream
counts and the eager step; the anchors: compiled HF, generate_batch, then
eager HF), so a short budget drops the least needed, and what did not fit
prints as skipped. The sanitizer: `--shapes 135m --skip checks,speed
--sanitize --budget-s 300` (timeout_s 360); where a repeat faulted, the
same `--repeat 10` with `--check-indices` next (its read-back each step
synchronises, as CUDA_LAUNCH_BLOCKING=1 did, under which the fault was
not seen: a clean run there does not clear the indices); the mixture, on an H200:
`--shapes qwen3-30b-a3b --skip checks`.

On CPU, in about a minute:

    python bench/gpu_check.py --device cpu --shapes tiny,tiny-moe --tokens 8 --streams 1,4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a plain script

import torch

from adapters.engine.engine import DECODE_PATHS, Engine
from adapters.engine.model import LoadedModel
from adapters.engine.paged_attention import ATTENTIONS
from bench import speculative as speculative_bench
from bench.gpu_shapes import PROMPT_TOKENS, prompts
from bench.gpu_shapes import SHAPES as SHAPES  # bench/kernel_build.py takes these three from here
from bench.gpu_shapes import Shape as Shape
from bench.gpu_shapes import build_model as build_model
from bench.measure import memory_bandwidth_gbs, sync
from core.batching import BatchLimits
from core.protocol import Assignment, Decoded, DecodeDone, GenerationRequest, Sampling

CHECK_TOKENS = 64
CUTS = (1, 17, 45)
CHECK_PROMPTS = 4
BATCH_OF = 16
TEMPERATURE = 0.8
BURST = 64  # requests arriving at once for the first-token figure
VERIFY_POSITION = 512  # the context speculative verification is timed at
# Of the budget, the correctness checks take at most this; the shapes share the rest.
CHECKS_SHARE_S = 90.0
STEP_LIMIT = 100_000  # no engine loop runs longer than this many steps, whatever else
# What --skip can leave out; "speed" is every shape's speed part, the engine's and HF's.
PARTS = ("checks", "speed", "compile", "eager", "generate_batch", "burst", "verify")
DEFAULT_SHAPES = ("135m", "1b", "8b", "qwen3-8b", "gemma3-4b")
# The mixture joins the default list on a device of at least this much memory: 61 GB of
# bf16 weights, built by this process for its engine and again by each HF anchor's.
MIXTURE, MIXTURE_GIB = "qwen3-30b-a3b", 100.0
# A child process: (seconds the budget must have left to start it, its timeout's cap),
# on CUDA and on CPU. Its timeout is the cap or what the budget has left, the lesser.
CHILD_S = {
    "compiled": ((75, 150), (5, 120)),  # torch.compile's first call on CUDA
    "generate_batch": ((30, 120), (5, 120)),
    "eager": ((10, 60), (5, 120)),
    "repeat": ((20, 120), (5, 120)),  # a fresh engine: capture, warm-up, the largest batch
    "sanitize": ((60, 240), (5, 120)),  # memcheck runs kernels many times slower
}
# Of a shape's share of the budget, its engine's parts take at most this; HF's anchors,
# after them, what is left.
ENGINE_SHARE = 0.5
# The budget kept from the shapes for --repeat's runs (N times a run's need, at most
# this share) and --sanitize's (its cap, at most this share).
REPEAT_SHARE = 0.4
SANITIZE_SHARE = 0.3
SANITIZE_TOKENS = 8  # the sanitizer's run is short: its kernels run many times slower
# Test-only: a --repeat run whose index (1-based) this names fails on purpose.
FAULT_ENV = "FENCEPOST_GPU_CHECK_FAULT"
STAGE = "stage: "  # how an engine-part child marks its progress (a fault names the last)


# --- time ---


class Budget:
    """Wall-clock seconds for the whole run; sections ask before they start."""

    def __init__(self, seconds: float) -> None:
        self.began = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.began)

    def allows(self, need_s: float, what: str) -> bool:
        if self.left() >= need_s:
            return True
        print(f"  skipped {what}: needs ~{need_s:.0f} s, {max(self.left(), 0):.0f} s left")
        return False

    def deadline(self, cap_s: float) -> float:
        """A perf_counter deadline: at most cap_s from now, never past the budget."""
        return time.perf_counter() + max(0.0, min(cap_s, self.left()))


@contextmanager
def section(name: str, failures: list[str]) -> Iterator[None]:
    """A part of the check: its failure prints a traceback (a child's: its own
    output) and the run goes on."""
    print(f"\n== {name}", flush=True)
    began = time.perf_counter()
    try:
        yield
    except ChildFault as fault:
        print(f"  FAILED: {fault}")
        failures.append(name)
    except Exception:
        traceback.print_exc(file=sys.stdout)
        failures.append(name)
    print(f"  ({time.perf_counter() - began:.1f} s)", flush=True)


# --- child processes ---


class ChildFault(Exception):
    """A child process that crashed, hung or raised: its section fails, the run goes on."""


@dataclasses.dataclass(frozen=True)
class Child:
    """What a child process left: its exit, its output and the JSON it wrote."""

    code: int | None  # None: killed at its timeout
    seconds: float
    stdout: str
    stderr: str
    result: dict[str, Any] | None

    @property
    def fault(self) -> str | None:
        """Why this run counts as a fault, or None."""
        if self.code is None:
            return f"timed out after {self.seconds:.0f} s, killed"
        if self.code < 0:
            return f"killed by {signal.Signals(-self.code).name}"
        if self.code != 0:
            return f"exit status {self.code}"
        if self.result is None:
            return "exited 0 without writing its result"
        return None

    @property
    def stage(self) -> str:
        """The last stage an engine-part child said it began (its output's STAGE lines)."""
        stages = [ln[len(STAGE) :] for ln in self.stdout.splitlines() if ln.startswith(STAGE)]
        return stages[-1] if stages else "before its first stage"

    def tail(self, chars: int = 2500) -> str:
        """The end of its stderr (of its stdout where stderr is empty), indented."""
        text = (self.stderr.strip() or self.stdout.strip())[-chars:]
        return "\n".join(f"    | {line}" for line in text.splitlines())


def run_child(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> Child:
    """Run `command --result FILE` in a process group of its own, bounded by timeout_s
    (the whole group is killed then: a tool's own children included), and read the
    JSON it left in FILE."""
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as folder:
        path = Path(folder) / "result.json"
        began = time.perf_counter()
        process = subprocess.Popen(
            [*command, "--result", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            errors="replace",
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},  # a kill keeps its lines
            start_new_session=True,
        )
        code: int | None
        try:
            out, err = process.communicate(timeout=max(1.0, timeout_s))
            code = process.returncode
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):  # it ended on its own meanwhile
                os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            code = None
        seconds = time.perf_counter() - began
        result = json.loads(path.read_text()) if code == 0 and path.exists() else None
    return Child(code, seconds, out, err, result)


def child_s(kind: str, cuda: bool) -> tuple[float, float]:
    """(seconds needed to start it, its timeout's cap) of a child of this kind."""
    on_cuda, on_cpu = CHILD_S[kind]
    return on_cuda if cuda else on_cpu


# --- models ---


def loaded(model: Any, shape: Shape) -> LoadedModel:
    """The engine's view of a random model; no EOS, so no run stops early."""
    return LoadedModel.from_model(
        model, None, shape.name, frozenset(), shape.max_position, "random"
    )


# --- driving the engine ---


@dataclasses.dataclass
class Run:
    outputs: dict[str, list[int]]  # request id -> tokens emitted, in index order
    first_token_s: dict[str, float]
    seconds: float
    steps: int
    decode_step_s: list[float]
    finished: bool  # False: the deadline came first


def drive(engine: Engine, requests: Sequence[GenerationRequest], deadline: float) -> Run:
    """Start every request at once and step until all are done or the deadline comes
    (the rest are then stopped)."""
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    first: dict[str, float] = {}
    for request in requests:
        engine.start(Assignment(request.request_id, 1), request)
    began = time.perf_counter()
    steps, decode_steps = 0, []
    while engine.has_work() and steps < STEP_LIMIT and time.perf_counter() < deadline:
        events = engine.step()
        steps += 1
        now = time.perf_counter() - began
        if engine.last_step.prefill_tokens == 0:
            decode_steps.append(engine.last_step.seconds)
        for event in events:
            if isinstance(event, Decoded):
                rid = event.assignment.request_id
                outputs[rid].append(event.token_id)
                first.setdefault(rid, now)
            elif isinstance(event, DecodeDone) and event.reason == "failed":
                raise RuntimeError(f"{event.assignment.request_id} failed in the engine")
    seconds = time.perf_counter() - began
    finished = not engine.has_work()
    for request in requests:
        engine.stop(Assignment(request.request_id, 1))
    return Run(outputs, first, seconds, steps, decode_steps, finished)


def drive_whole(
    engine: Engine, requests: Sequence[GenerationRequest], deadline: float
) -> dict[str, list[int]]:
    """drive() for a check: a run cut at its deadline cannot be compared, so it fails."""
    run = drive(engine, requests, deadline)
    if not run.finished:
        raise TimeoutError(f"{len(requests)} requests not done by the deadline: no rate")
    return run.outputs


# Engine(decode=..., attention=...) for every engine of the run (main sets them from
# --decode and --attention); make_engine's own arguments override them.
ENGINE_OPTIONS: dict[str, str] = {}


def make_engine(
    model: LoadedModel, weights: str, streams: int, tokens: int, **options: str
) -> Engine:
    context = PROMPT_TOKENS + max(tokens, CHECK_TOKENS) + 16
    limits = BatchLimits(
        max_seqs=streams,
        max_context=max(256, context),
        max_step_tokens=max(256, streams + 128),
    )
    per_sequence = -(-context // 16) + 1
    return Engine(
        model,
        limits,
        weights=weights,
        prefix_caching=False,
        kv_cache_tokens=max(4096, streams * per_sequence * 16),
        **(ENGINE_OPTIONS | options),  # type: ignore[arg-type]
    )


def request(rid: str, prompt: tuple[int, ...], tokens: int, **fields: Any) -> GenerationRequest:
    return GenerationRequest(rid, prompt, tokens, **fields)


# --- correctness ---


def rate_line(label: str, hits: int, total: int, where: list[str]) -> tuple[int, int]:
    detail = f"; differs: {', '.join(where)}" if where else ""
    print(f"  {label}: {hits}/{total}{detail}")
    return hits, total


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_hf_equality(
    model: Any, engine: Engine, plist: list[tuple[int, ...]], tokens: int, deadline: float
) -> tuple[int, int]:
    """fp32 greedy: our engine, each prompt alone, against HF generate (the prompts are of
    one length, so HF runs them as one unpadded batch)."""
    device = next(model.parameters()).device
    inputs = torch.tensor(plist, device=device)
    with torch.inference_mode():
        out = model.generate(
            inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            max_time=max(1.0, deadline - time.perf_counter()),
        )
    hf = [row[len(plist[0]) :].tolist() for row in out]
    hits, where = 0, []
    for i, prompt in enumerate(plist):
        ours = drive_whole(engine, [request(f"fp32-{i}", prompt, tokens)], deadline)[f"fp32-{i}"]
        diff = first_difference(ours, hf[i])
        hits += diff is None
        if diff is not None:
            where.append(f"prompt {i} at token {diff}")
    return rate_line(
        f"fp32 greedy equals HF generate over {tokens} tokens", hits, len(plist), where
    )


def check_invariance(
    engine: Engine,
    plist: list[tuple[int, ...]],
    others: list[tuple[int, ...]],
    tokens: int,
    sampling: Sampling,
    label: str,
    deadline: float,
) -> list[tuple[int, int]]:
    """Alone against in a batch of BATCH_OF, and resumed from each cut; returns the rates."""
    seeded = sampling.temperature > 0

    def sampled(i: int) -> Sampling:
        return Sampling(sampling.temperature, sampling.top_p, 1000 + i) if seeded else sampling

    alone = []
    for i, prompt in enumerate(plist):
        one = [request(f"a{i}", prompt, tokens, sampling=sampled(i))]
        alone.append(drive_whole(engine, one, deadline)[f"a{i}"])
    made = [t for out in alone for t in out]
    print(f"  {label}: {len(set(made))} distinct tokens in the {len(made)} made alone")
    batch = [request(f"b{i}", p, tokens, sampling=sampled(i)) for i, p in enumerate(plist)]
    batch += [
        request(f"o{j}", p, tokens, sampling=sampled(100 + j))
        for j, p in enumerate(others[: BATCH_OF - len(plist)])
    ]
    together = drive_whole(engine, batch, deadline)
    hits, where = 0, []
    for i in range(len(plist)):
        diff = first_difference(together[f"b{i}"], alone[i])
        hits += diff is None
        if diff is not None:
            where.append(f"prompt {i} at token {diff}")
    rates = [rate_line(f"{label}: alone = in a batch of {len(batch)}", hits, len(plist), where)]
    cuts = [k for k in CUTS if k < tokens]
    resumes = [
        request(f"r{i}-{k}", prompt, tokens, sampling=sampled(i), output_prefix=tuple(alone[i][:k]))
        for i, prompt in enumerate(plist)
        for k in cuts
    ]
    resumed = drive_whole(engine, resumes, deadline)
    hits, where = 0, []
    for i in range(len(plist)):
        for k in cuts:
            diff = first_difference(alone[i][:k] + resumed[f"r{i}-{k}"], alone[i])
            hits += diff is None
            if diff is not None:
                where.append(f"prompt {i} cut {k} at token {diff}")
    rates.append(
        rate_line(
            f"{label}: resumed from k = {', '.join(map(str, cuts))} (together)",
            hits,
            len(resumes),
            where,
        )
    )
    return rates


def check_decode_paths(
    model: LoadedModel, plist: list[tuple[int, ...]], tokens: int, deadline: float
) -> list[tuple[int, int]]:
    """The same greedy batch through three decode paths. On CUDA: graphs replayed
    against the same fixed-shape step run without capture (the same kernels on the
    same inputs: must be equal), then against the eager step (other kernels: a rate).
    On CPU, where nothing is captured: the fixed-shape step against the eager one."""
    cuda = model.device.type == "cuda"
    weights = "bf16" if cuda else "fp32"
    first = make_engine(model, weights, BATCH_OF, tokens, decode="graphs" if cuda else "static")
    assert first.static is not None
    attention = first.static.attention.name
    others = [("static", attention)] if cuda else []
    others.append(("eager", "auto"))
    batch = [request(f"p{i}", p, tokens) for i, p in enumerate(plist)]
    ours = drive_whole(first, batch, deadline)
    del first
    rates = []
    name = "graphs" if cuda else "static"
    for path, chosen in others:
        engine = make_engine(model, weights, BATCH_OF, tokens, decode=path, attention=chosen)
        theirs = drive_whole(engine, batch, deadline)
        del engine
        hits, where = 0, []
        for i in range(len(plist)):
            diff = first_difference(ours[f"p{i}"], theirs[f"p{i}"])
            hits += diff is None
            if diff is not None:
                where.append(f"prompt {i} at token {diff}")
        label = f"decode {name} ({attention} attention) = {path} decode, {weights} greedy"
        rates.append(rate_line(label, hits, len(plist), where))
    return rates


# --- speed ---


ANCHORS = Path(__file__).resolve().parent / "gpu_anchors.py"
# Each anchor: its --skip part, its table row (n: the requests) and its Results key.
ANCHOR_ROWS = {
    "compiled": ("compile", "HF generate, static cache + compile, batch 1", "hf compiled"),
    "generate_batch": ("generate_batch", "transformers generate_batch, {n} requests",
                       "generate_batch {n}"),
    "eager": ("eager", "HF generate, eager, batch 1", "hf eager"),
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Setting:
    """What every child process is told of the run (main sets it from the arguments)."""

    device: torch.device
    tokens: int
    seed: int
    threads: int | None
    decode: str = "auto"
    attention: str = "auto"
    check_indices: bool = False  # --check-indices: the --repeat and --sanitize runs check

    def env(self) -> dict[str, str]:
        """What a --repeat or --sanitize child's environment adds."""
        return {"FENCEPOST_CHECK_INDICES": "1"} if self.check_indices else {}

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def common(self) -> list[str]:
        threads = [] if self.threads is None else ["--threads", str(self.threads)]
        return ["--device", str(self.device), "--seed", str(self.seed), *threads]


def anchor(
    kind: str, key: str, n: int, setting: Setting, budget: Budget, results: Results
) -> str | None:
    """One HF anchor in a process of its own (bench/gpu_anchors.py), never this one: it
    builds the same model from the shape and the seed. Its table value, or None where
    the budget left no room; a crash or a timeout raises ChildFault with its stderr."""
    need_s, cap_s = child_s(kind, setting.cuda)
    if not budget.allows(need_s, ANCHOR_ROWS[kind][1].format(n=n)):
        return None
    command = [sys.executable, str(ANCHORS), "--anchor", kind, "--shape", key]
    command += ["--tokens", str(setting.tokens), "--streams", str(n), *setting.common()]
    command += ["--cap-s", f"{min(20.0, budget.left()):.0f}"]
    child = run_child(command, min(cap_s, budget.left()))
    for line in child.stdout.splitlines():
        print(line)
    if child.fault is not None or child.result is None:
        raise ChildFault(f"the {kind} anchor's process: {child.fault}\n{child.tail()}")
    pid, rate = int(child.result["pid"]), float(child.result["rate"])
    print(f"  (measured in process {pid}, not the engine's {os.getpid()})")
    results.anchor_pids[(key, kind)] = pid
    results.rates[(key, ANCHOR_ROWS[kind][2].format(n=n))] = rate
    return f"{rate:,.1f}"


def weight_bytes(model: Any) -> int:
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) not in seen:
            seen.add(id(param))
            total += param.numel() * param.element_size()
    return total


# --- the run ---


@dataclasses.dataclass
class Results:
    rates: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    # (label, hits, total, every one must hit: else >= 95%)
    checks: list[tuple[str, int, int, bool]] = dataclasses.field(default_factory=list)
    first_token_p50_s: float | None = None
    first_token_shape: str = ""
    # (shape, anchor) -> the pid of the process that measured it
    anchor_pids: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    summary: list[str] = dataclasses.field(default_factory=list)  # the last lines: repeat, ...


def correctness(
    key: str,
    device: torch.device,
    budget: Budget,
    results: Results,
    failures: list[str],
    seed: int,
) -> None:
    shape = SHAPES[key]
    plist = prompts(CHECK_PROMPTS + BATCH_OF)
    checks, others = plist[:CHECK_PROMPTS], plist[CHECK_PROMPTS:]
    fast = torch.bfloat16 if device.type == "cuda" else torch.float32
    fast_weights = "bf16" if device.type == "cuda" else "fp32"
    with section(f"correctness, {shape.name} shape: fp32 against HF generate", failures):
        if budget.allows(20, "the fp32 check"):
            model = build_model(shape, device, torch.float32, seed)
            engine = make_engine(loaded(model, shape), "fp32", BATCH_OF, CHECK_TOKENS)
            hits, total = check_hf_equality(
                model, engine, checks, CHECK_TOKENS, budget.deadline(60)
            )
            results.checks.append(("fp32 greedy = HF generate", hits, total, True))
            del engine, model
            free(device)
    dtype_name = str(fast).removeprefix("torch.")
    model = None
    try:
        for label, sampling in (
            (f"{dtype_name} greedy", Sampling()),
            (f"{dtype_name} sampled, temperature {TEMPERATURE}", Sampling(TEMPERATURE, 1.0, 0)),
        ):
            with section(f"correctness, {shape.name} shape: {label}", failures):
                if not budget.allows(15, f"the {label} checks"):
                    continue
                if model is None:
                    model = build_model(shape, device, fast, seed)
                engine = make_engine(loaded(model, shape), fast_weights, BATCH_OF, CHECK_TOKENS)
                rates = check_invariance(
                    engine, checks, others, CHECK_TOKENS, sampling, label, budget.deadline(60)
                )
                results.checks.append((f"{label}, batch-invariant", *rates[0], False))
                results.checks.append((f"{label}, resume-exact", *rates[1], False))
                del engine
    finally:
        del model
        free(device)
    with section(f"correctness, {shape.name} shape: decode paths", failures):
        if budget.allows(15, "the decode path check"):
            model = build_model(shape, device, fast, seed)
            rates = check_decode_paths(
                loaded(model, shape), checks, CHECK_TOKENS, budget.deadline(40)
            )
            # The first rate is a goal (graphs replay the uncaptured step's kernels; on
            # CPU the fixed-shape step is fp32 like the eager one); on CUDA the second,
            # against the eager step's other kernels, is only reported.
            results.checks.append(("decode graphs = uncaptured" if device.type == "cuda"
                                   else "fixed-shape decode = eager", *rates[0], True))  # fmt: skip
            del model
            free(device)


def free(device: torch.device) -> None:
    import gc

    torch._dynamo.reset()  # compiled HF forwards hold their model's weights
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclasses.dataclass
class ShapeRun:
    """One shape's model, engine and figures; each method is one part of its speed check."""

    key: str
    model: Any
    engine: Engine
    plist: list[tuple[int, ...]]
    tokens: int
    budget: Budget
    results: Results
    table: dict[str, str]

    @property
    def cuda(self) -> bool:
        return bool(self.model.device.type == "cuda")

    def fencepost(self, n: int) -> None:
        if self.budget.allows(5, f"fencepost at {n} streams"):
            rate = self._measure(self.engine, n, f"fencepost, {n} stream{'s' if n > 1 else ''}")
            self.results.rates[(self.key, f"fencepost {n}")] = rate

    def fencepost_eager(self) -> None:
        """One stream through the eager decode step (no graphs): what capture gains."""
        if not self.budget.allows(5, "fencepost eager decode at 1 stream"):
            return
        weights = "bf16" if self.cuda else "fp32"
        engine = make_engine(
            loaded(self.model, SHAPES[self.key]), weights, 1, self.tokens, decode="eager"
        )
        drive(engine, [request("warm-eager", self.plist[0], 4)], self.budget.deadline(20))
        self._measure(engine, 1, "fencepost, eager decode, 1 stream")

    def _measure(self, engine: Engine, n: int, label: str) -> float:
        """tokens/s of n streams at once on `engine`, printed and put in the table."""
        batch = [request(f"s{n}-{i}", p, self.tokens) for i, p in enumerate(self.plist[:n])]
        run = drive(engine, batch, self.budget.deadline(25))
        made = sum(len(v) for v in run.outputs.values())
        rate = made / run.seconds
        step = statistics.median(run.decode_step_s) if run.decode_step_s else 0.0
        note = "" if run.finished else f", cut at the deadline after {made} tokens"
        print(f"  {rate:,.1f} tok/s (decode step p50 {step * 1e3:.1f} ms{note})")
        cut = "" if run.finished else "*"
        self.table[label] = f"{rate:,.1f}{cut} (step {step * 1e3:.1f} ms)"
        return rate

    def verification(self) -> None:
        """What speculative decoding's verification costs on this shape: one packed pass
        over a sequence's last token and k guesses at position 512, k = 0..16, and the
        speed-up it implies at 50/70/90% acceptance (bench/speculative.py). Last of the
        engine's parts: it writes its own keys and values over the idle pool."""
        if not self.budget.allows(5, "the verification cost curve"):
            return
        runner = self.engine.runner
        held = min(runner.max_context, runner.num_blocks * runner.block_size)
        position = min(VERIFY_POSITION, held - max(speculative_bench.COST_TOKENS) - 1)
        position -= position % runner.block_size  # a whole block short of the pool's end
        if position < runner.block_size:
            print(f"  skipped: this engine holds {held} positions")
            return
        curve = speculative_bench.cost_curve(self.engine, position)
        speculative_bench.print_cost_curve(curve, position)
        for guesses, seconds in curve:
            if guesses in (0, 4, 8):
                self.table[f"verify {guesses} guesses (ms)"] = f"{seconds * 1e3:.2f}"

    def burst(self) -> None:
        if not self.budget.allows(5, "the first-token burst"):
            return
        batch = [request(f"burst{i}", p, 1) for i, p in enumerate(self.plist[:BURST])]
        run = drive(self.engine, batch, self.budget.deadline(20))
        times = sorted(run.first_token_s.values())
        p50 = statistics.median(times) if times else float("nan")
        last = times[-1] if times else float("nan")
        print(
            f"  first tokens: p50 {p50 * 1e3:.1f} ms, last {last * 1e3:.1f} ms, "
            f"{len(times)}/{BURST} in {run.steps} steps"
        )
        self.results.first_token_p50_s = p50
        self.results.first_token_shape = SHAPES[self.key].name
        self.table[f"first token p50, {BURST} at once (ms)"] = f"{p50 * 1e3:.1f}"


def print_table(key: str, tokens: int, table: dict[str, str]) -> None:
    name = SHAPES[key].name
    print(f"\n{name} shape ({tokens} new tokens, {PROMPT_TOKENS}-token prompts), tok/s:")
    width = max((len(label) for label in table), default=10)
    for label in sorted(table, key=_table_order):
        print(f"  | {label:<{width}} | {table[label]:>24} |")
    if any("*" in value for value in table.values()):
        print("  (* cut at its deadline: the rate over the tokens made)")


def _table_order(label: str) -> tuple[int, int]:
    kinds = ("fencepost", "HF generate, eager", "HF generate, static", "transformers", "first", "b")
    kind = next((i for i, k in enumerate(kinds) if label.startswith(k)), len(kinds))
    digits = "".join(c for c in label.split(",")[-1] if c.isdigit())
    return kind, int(digits or 0)


def build_run(
    key: str, device: torch.device, most: int, tokens: int, seed: int
) -> tuple[Any, Engine]:
    """The shape's model (bf16 on CUDA) and an engine for `most` streams, warmed up."""
    shape = SHAPES[key]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    began = time.perf_counter()
    model = build_model(shape, device, dtype, seed)
    engine = make_engine(
        loaded(model, shape), "bf16" if device.type == "cuda" else "fp32", most, tokens
    )
    sync(device)
    print(
        f"  hidden {shape.hidden}, layers {shape.layers}, heads {shape.heads}/"
        f"{shape.kv_heads} kv, intermediate {shape.intermediate}, vocab {shape.vocab}, "
        f"rope theta {shape.rope_theta:g}, tied {shape.tie_word_embeddings}; "
        f"{weight_bytes(model) / 1e9:.2f} GB of {str(dtype).removeprefix('torch.')} weights; "
        f"built in {time.perf_counter() - began:.1f} s"
    )
    plist = prompts(min(16, most))
    deadline = time.perf_counter() + 60
    drive(engine, [request("warm", plist[0], 4)], deadline)
    drive(engine, [request(f"warm{i}", p, 2) for i, p in enumerate(plist)], deadline)
    return model, engine


def shape_streams(key: str, streams: list[int]) -> list[int]:
    """The engine's stream counts for this shape: its own where it names them."""
    return sorted(SHAPES[key].streams) or streams


def speed(
    key: str,
    setting: Setting,
    streams: list[int],
    budget: Budget,
    results: Results,
    failures: list[str],
    burst: bool,
    skip: set[str],
) -> None:
    """One shape's figures: the engine's in this process, then HF's anchors, each in a
    process of its own, once this one has freed the shape's model (two copies of the
    mixture's 61 GB need not fit). Of each, the parts the goals need first, so a short
    budget drops the rest; the engine takes at most ENGINE_SHARE of the shape's budget."""
    name, device, tokens = SHAPES[key].name, setting.device, setting.tokens
    streams = shape_streams(key, streams)
    top, middle = max(streams), [n for n in streams if 1 < n < max(streams)]
    table: dict[str, str] = {}
    engine_budget = Budget(budget.left() * ENGINE_SHARE)
    run = None
    try:
        with section(f"speed, {name} shape: build", failures):
            if budget.allows(10, f"the {name} shape"):
                most = max([*streams, BURST if burst else 1])
                model, engine = build_run(key, device, most, tokens, setting.seed)
                plist = prompts(most)
                run = ShapeRun(key, model, engine, plist, tokens, engine_budget, results, table)
                # what one row's step reads (of a mixture: the experts it picks)
                bound = memory_bandwidth_gbs(device) * 1e9 / engine.runner.weight_bytes(rows=1)
                table["batch-1 bandwidth bound"] = f"{bound:,.0f}"
                del model, engine
        parts: list[tuple[str, Callable[[], None]]] = []
        if run is not None:
            if 1 in streams:
                parts += [("fencepost, 1 stream", functools.partial(run.fencepost, 1))]
            if burst and "burst" not in skip:
                parts += [(f"{BURST} requests arriving at once", run.burst)]
            if top > 1:
                parts += [(f"fencepost, {top} streams", functools.partial(run.fencepost, top))]
            parts += [
                (f"fencepost, {n} streams", functools.partial(run.fencepost, n)) for n in middle
            ]
            if 1 in streams:
                parts += [("fencepost, eager decode, 1 stream", run.fencepost_eager)]
            if "verify" not in skip:
                parts += [("speculative verification cost", run.verification)]
        for label, part in parts:
            with section(f"speed, {name} shape: {label}", failures):
                part()
        run = None
        free(device)
        # HF's anchors: compiled (batch 1's goal), generate_batch (the largest batch's), eager.
        for kind, n in (("compiled", 1), ("generate_batch", top), ("eager", 1)):
            skip_as, row, _ = ANCHOR_ROWS[kind]
            if skip_as in skip:
                continue
            with section(f"speed, {name} shape: {row.format(n=n)}", failures):
                value = anchor(kind, key, n, setting, budget, results)
                if value is not None:
                    table[row.format(n=n)] = value
    finally:
        run = None
        free(device)
        if table:
            print_table(key, tokens, table)


# --- one part again, alone in fresh processes: --repeat, --sanitize ---


def part_command(
    key: str, n: int, tokens: int, setting: Setting, index: int, cap_s: float
) -> list[str]:
    """This script for the engine's batch of n streams alone (--engine-part)."""
    script = str(Path(__file__).resolve())
    command = [sys.executable, script, "--engine-part", "--shapes", key, "--streams", str(n)]
    command += ["--tokens", str(tokens), "--decode", setting.decode]
    command += ["--attention", setting.attention, "--repeat-index", str(index)]
    return [*command, "--budget-s", f"{cap_s:.0f}", *setting.common()]


def engine_part(key: str, n: int, setting: Setting, index: int, cap_s: float, out: Path) -> int:
    """--engine-part: one shape's engine, warmed up, then n streams at once, alone in this
    process (a --repeat run, or the sanitizer's); its figure goes to `out` as JSON. It
    says each stage it begins (STAGE lines), so a crash's report names where it was."""
    print(f"{STAGE}start", flush=True)
    print(f"  engine part alone in process {os.getpid()}, run {index}", flush=True)
    if os.environ.get(FAULT_ENV) == str(index):
        raise RuntimeError(f"{FAULT_ENV}={index}: the fault a test asked of run {index}")
    print(f"{STAGE}build", flush=True)
    began = time.perf_counter()
    _model, engine = build_run(key, setting.device, n, setting.tokens, setting.seed)
    print(f"{STAGE}fencepost, {n} streams", flush=True)
    batch = [request(f"s{n}-{i}", p, setting.tokens) for i, p in enumerate(prompts(n))]
    run = drive(engine, batch, began + cap_s)
    sync(setting.device)
    made = sum(len(v) for v in run.outputs.values())
    checked = engine.runner.check_indices
    result = {"pid": os.getpid(), "rate": made / run.seconds, "finished": run.finished,
              "checked": checked}  # fmt: skip
    out.write_text(json.dumps(result))
    print(f"{STAGE}done", flush=True)
    return 0


def repeat(
    key: str, runs: int, setting: Setting, streams: list[int], budget: Budget,
    results: Results, failures: list[str],
) -> None:  # fmt: skip
    """--repeat: the engine's largest batch of one shape, `runs` times, each in a fresh
    process; every fault (a nonzero exit, a timeout, an error raised) is reported with
    its run's index and the stage it was in, and fails the check."""
    name, top = SHAPES[key].name, max(shape_streams(key, streams))
    need_s, cap_s = child_s("repeat", setting.cuda)
    label = f"fencepost, {top} streams"
    faults: list[str] = []
    ran = 0
    with section(f"repeat: {name} shape, {label}, {runs} fresh processes", failures):
        for index in range(1, runs + 1):
            if not budget.allows(need_s, f"repeat {index}/{runs}"):
                break
            timeout_s = min(cap_s, budget.left())
            # its own deadline comes first: a run cut there is a figure, a kill is a fault
            command = part_command(key, top, setting.tokens, setting, index, 0.8 * timeout_s)
            child = run_child(command, timeout_s, setting.env())
            ran += 1
            if child.fault is None and child.result is not None:
                cut = "" if child.result["finished"] else ", cut at its deadline"
                cut += ", indices checked" if child.result["checked"] else ""
                print(f"  repeat {index}/{runs}: {child.result['rate']:,.1f} tok/s{cut} "
                      f"(process {child.result['pid']}, {child.seconds:.1f} s)")  # fmt: skip
                continue
            where = f"repeat {index}/{runs}, {name} shape: {label}, stage {child.stage}"
            print(f"  FAULT in {where}: {child.fault}\n{child.tail()}")
            faults.append(f"{where} ({child.fault})")
            failures.append(f"repeat {index}/{runs}")
        line = f"repeat: {len(faults)}/{ran} runs faulted"
        if ran < runs:
            line += f" ({runs - ran} of the {runs} asked not run: the budget)"
        print(f"  {line}")
        results.summary += [line, *(f"  faulted: {where}" for where in faults)]


SANITIZER_SUMMARY = re.compile(r"ERROR SUMMARY: (\d+) error")


def sanitizer() -> str | None:
    """compute-sanitizer's path: on PATH, else in a CUDA toolkit's usual place."""
    found = shutil.which("compute-sanitizer")
    folders = ["/usr/local/cuda/bin", *sorted(map(str, Path("/usr/local").glob("cuda-*/bin")))]
    for candidate in [found, *(f"{folder}/compute-sanitizer" for folder in folders)]:
        if candidate is not None and os.access(candidate, os.X_OK):
            return candidate
    return None


def sanitize(
    key: str, setting: Setting, streams: list[int], budget: Budget, results: Results,
    failures: list[str],
) -> None:  # fmt: skip
    """--sanitize: one short run of the engine's largest batch under compute-sanitizer's
    memcheck, in a process of its own; its error summary is the verdict. Without CUDA or
    without the tool it says so and skips (no failure)."""
    name, top = SHAPES[key].name, max(shape_streams(key, streams))
    need_s, cap_s = child_s("sanitize", setting.cuda)
    with section(
        f"sanitize: memcheck, {name} shape, {top} streams, {SANITIZE_TOKENS} tokens", failures
    ):
        tool, why = sanitizer(), None
        if not setting.cuda:
            why = "not a CUDA device"
        elif tool is None:
            why = "no compute-sanitizer, neither on PATH nor in /usr/local/cuda*/bin"
        elif not budget.allows(need_s, "the sanitizer's run"):
            why = "no budget left"
        if why is not None or tool is None:
            results.summary.append(f"sanitize: skipped ({why})")
            print(f"  {results.summary[-1]}")
            return
        timeout_s = min(cap_s, budget.left())
        command = part_command(key, top, SANITIZE_TOKENS, setting, 0, 0.8 * timeout_s)
        child = run_child([tool, "--tool", "memcheck", *command], timeout_s, setting.env())
        text = child.stdout + child.stderr
        reports = [line for line in text.splitlines() if line.startswith("=========")]
        for line in reports[:40]:
            print(f"    {line}")
        counts = SANITIZER_SUMMARY.findall(text)
        verdict = f"{counts[-1]} errors" if counts else "no error summary"
        results.summary.append(f"sanitize: memcheck, {verdict}" + (
            f"; {child.fault}" if child.fault else ""))  # fmt: skip
        print(f"  {results.summary[-1]} ({child.seconds:.0f} s)")
        if not counts or int(counts[-1]) > 0 or child.fault is not None:
            raise ChildFault(f"{results.summary[-1]}, stage {child.stage}\n{child.tail()}")


def default_shapes(memory_gib: float | None) -> tuple[list[str], str]:
    """The default --shapes, and why the mixture is in it or not (memory_gib: the CUDA
    device's total memory; None: not a CUDA device)."""
    keys = list(DEFAULT_SHAPES)
    if memory_gib is None:
        return keys, f"{MIXTURE} left out: not a CUDA device"
    have = f"the device has {memory_gib:.0f} GiB"
    if memory_gib >= MIXTURE_GIB:
        return [*keys, MIXTURE], (
            f"{MIXTURE} added: {have}, >= {MIXTURE_GIB:.0f} (61 GB of bf16 weights; "
            "its engine at 1 and 64 streams, where the experts' rows are grouped)"
        )
    return keys, (
        f"{MIXTURE} left out: {have}, < {MIXTURE_GIB:.0f} (61 GB of bf16 weights and their "
        f"caches); --shapes {MIXTURE} asks for it"
    )


def goals(results: Results, keys: list[str], streams: list[int]) -> None:
    print("\n== goals (issue 13)")

    def say(goal: str, met: bool | None, detail: str) -> None:
        verdict = "not measured" if met is None else ("met" if met else "NOT met")
        print(f"  [{verdict}] {goal}: {detail}")

    rates = results.rates
    for key in keys:
        ours, theirs = rates.get((key, "fencepost 1")), rates.get((key, "hf compiled"))
        name = SHAPES[key].name
        if ours is None or theirs is None:
            say(f"{name} batch-1 >= 1.2x HF static + compile", None, "a figure is missing")
        else:
            say(
                f"{name} batch-1 >= 1.2x HF static + compile",
                ours >= 1.2 * theirs,
                f"{ours:,.1f} against {theirs:,.1f} tok/s ({ours / theirs:.2f}x)",
            )
        if key == "8b":
            detail = "not run" if ours is None else f"{ours:,.1f} tok/s"
            say("8B batch-1 >= 165 tok/s", None if ours is None else ours >= 165, detail)
    top = max(streams)
    for key, floor in (("1b", 10_000.0), ("135m", 15_000.0)):
        if key not in keys:
            continue
        ours = rates.get((key, f"fencepost {top}"))
        hf = rates.get((key, f"generate_batch {top}"))
        name = SHAPES[key].name
        if top != 256 or ours is None:
            say(f"{name} 256 streams >= {floor:,.0f} tok/s", None, f"largest run {top} streams")
        else:
            say(f"{name} 256 streams >= {floor:,.0f} tok/s", ours >= floor, f"{ours:,.0f} tok/s")
            if hf is not None:
                say(
                    f"{name} 256 streams >= 3x generate_batch",
                    ours >= 3 * hf,
                    f"{ours:,.0f} against {hf:,.0f} ({ours / hf:.2f}x)",
                )
    p50 = results.first_token_p50_s
    say(
        f"{BURST} at once on the 1B shape: first token p50 <= 100 ms",
        None if p50 is None or results.first_token_shape != SHAPES["1b"].name else p50 <= 0.1,
        "not run" if p50 is None else f"{p50 * 1e3:.1f} ms on {results.first_token_shape}",
    )
    for label, hits, total, every in results.checks:
        met = total > 0 and (hits == total if every else hits / total >= 0.95)
        say(f"{label} ({'all' if every else '>= 95%'})", met, f"{hits}/{total}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"of {', '.join(SHAPES)} (default {','.join(DEFAULT_SHAPES)}, and {MIXTURE} on "
        f"a device of >= {MIXTURE_GIB:.0f} GiB)",
    )
    parser.add_argument("--streams", default="1,16,64,256")
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    parser.add_argument("--budget-s", type=float, default=270.0)
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument(
        "--decode", choices=DECODE_PATHS, default="auto",
        help="the engines' decode path (auto: CUDA graphs on a GPU, eager on CPU)",
    )  # fmt: skip
    parser.add_argument(
        "--attention", choices=("auto", *ATTENTIONS), default="auto",
        help="the fixed-shape step's attention (auto: measured at each engine's start)",
    )  # fmt: skip
    parser.add_argument(
        "--skip", default="", help=f"comma-separated parts to leave out, of {', '.join(PARTS)}"
    )
    parser.add_argument(
        "--repeat", type=int, default=0, metavar="N",
        help="run the largest stream count's engine part N more times, each in a fresh process",
    )  # fmt: skip
    parser.add_argument("--repeat-shape", default=None, help="--repeat's shape (the first)")
    parser.add_argument(
        "--sanitize", action="store_true",
        help="one short run of the largest stream count under compute-sanitizer memcheck",
    )  # fmt: skip
    parser.add_argument(
        "--check-indices", action="store_true",
        help="the --repeat and --sanitize runs with FENCEPOST_CHECK_INDICES=1 (slower steps)",
    )  # fmt: skip
    # A child's own: run one engine part alone, and write its figure to --result.
    parser.add_argument("--engine-part", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--repeat-index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    if skip - set(PARTS):
        parser.error(f"unknown parts {sorted(skip - set(PARTS))}; of {', '.join(PARTS)}")
    device = torch.device(args.device)
    if args.shapes is None:
        memory = None
        if device.type == "cuda":
            memory = torch.cuda.get_device_properties(device).total_memory / 2**30
        keys, why = default_shapes(memory)
    else:
        keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
        why = "the shapes asked for"
    unknown = [k for k in [*keys, args.repeat_shape or keys[0]] if k not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; of {', '.join(SHAPES)}")
    streams = sorted({int(n) for n in args.streams.split(",")})
    setting = Setting(
        device, args.tokens, args.seed, args.threads, args.decode, args.attention,
        args.check_indices,
    )  # fmt: skip
    ENGINE_OPTIONS.update(decode=args.decode, attention=args.attention)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32 (no TF32) for the HF check
    if args.engine_part:
        if args.result is None:
            parser.error("--engine-part writes its figure to --result")
        return engine_part(keys[0], max(streams), setting, args.repeat_index, args.budget_s,
                           args.result)  # fmt: skip
    budget = Budget(args.budget_s)
    import transformers

    print(
        f"gpu_check: {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"shapes {', '.join(keys)}, streams {streams}, {args.tokens} new tokens, "
        f"budget {args.budget_s:.0f} s, seed {args.seed}, this process {os.getpid()}"
    )
    print(f"shapes: {why}")
    results, failures = Results(), list[str]()
    if "checks" not in skip:
        checks = Budget(min(CHECKS_SHARE_S, budget.left()))
        correctness(keys[0], device, checks, results, failures, args.seed)
    # --repeat's and --sanitize's runs come last; what they may need is kept from the shapes.
    repeat_key = args.repeat_shape or keys[0]
    cuda, runs = device.type == "cuda", max(0, args.repeat)
    kept_s = min(runs * child_s("repeat", cuda)[0], REPEAT_SHARE * args.budget_s)
    if args.sanitize and cuda and sanitizer() is not None:
        kept_s += min(child_s("sanitize", cuda)[1], SANITIZE_SHARE * args.budget_s)
    shapes = Budget(budget.left() - kept_s)
    burst_key = "1b" if "1b" in keys else keys[0]
    for done, key in enumerate([] if "speed" in skip else keys):
        share = Budget(shapes.left() / (len(keys) - done))  # what an earlier shape left over
        speed(key, setting, streams, share, results, failures, key == burst_key, skip)
    if runs:
        repeat(repeat_key, runs, setting, streams, budget, results, failures)
    if args.sanitize:
        sanitize(repeat_key, setting, streams, budget, results, failures)
    goals(results, keys, streams)
    spent = time.perf_counter() - budget.began
    print()
    for line in results.summary:
        print(line)
    print(f"gpu_check done in {spent:.0f} s; sections failed: {', '.join(failures) or 'none'}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
