"""The device check of issue 13: correctness and speed of the engine on one GPU, in one run.

Builds random-weight models of real shapes on the device (no download):
SmolLM2-135M, Llama-3.2-1B and Llama-3-8B, and of two other families, Qwen3-8B
(per-head q/k norms, head size 128) and Gemma-3-4B (1 + w norms before and
after each sublayer, a tanh-GELU gate, five windowed layers in six with their
own rotary base, head size 256), and a mixture of experts, Qwen3-30B-A3B (128
experts, 8 a token; `--shapes qwen3-30b-a3b`, not in the default list: 61 GB
of bf16 to build) (SHAPES below; plain rotary frequencies, which change no
cost). On the first shape it checks:

- fp32 greedy of our Engine equals HF `generate` over 64 tokens, 4 prompts;
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
reuses another's prompt), beside HF generate eager (batch 1), HF generate with
a static cache (which transformers compiles with torch.compile on CUDA;
batch 1) and transformers' continuous batching (`generate_batch`, at the
largest stream count) in the same run; and the first-token times of 64
requests arriving at once on the 1B shape; and one stream through the eager
decode step, for what the graphs gain. It ends with the issue's goals, met
or not. Each engine's start prints its choices: the fused elementwise
kernels, the decode attention (both timed), the graphs captured (time and
memory). `--decode` and `--attention` force a path for a second run, as
FENCEPOST_FUSED=off leaves the fused kernels out.

Every loop is bounded (steps and a deadline); `--budget-s` skips what would
not fit and says so; each section prints its own traceback when it fails
and the rest still runs. The same script runs on CPU with tiny shapes (the
test suite does: tests/bench/test_gpu_check.py).

What it imports: torch, transformers and the engine's path through the
project (core.protocol uses msgspec; adapters/engine/engine.py imports
llguidance through grammar.py). The device image has torch and transformers
but neither msgspec nor llguidance, so the run carries their wheels. Here,
once, in the repository root (.gitignore ignores `.whl/`):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_31_x86_64 \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl msgspec==0.23.0 llguidance==1.9.1

(3.3 MB together). No tokenizer and no weights travel: random weights make
any token ids as good as a real prompt's, so the prompts are fixed ids.
Then the device run (`run` tool), carry [".whl"], timeout_s 420:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD \
      || exit; PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 270 \
      2>&1 | tee $OUT/gpu_check.log

Each shape's parts run goal-first (batch 1, compiled HF, the burst, the
largest batch, generate_batch; then the middle stream counts and eager HF),
so a short budget drops the least needed. Parts that did not fit print as
skipped; with device time left, a second call measures them, e.g. the same
command with `--shapes 8b --skip checks --budget-s 200`.

On CPU, in a few seconds:

    python bench/gpu_check.py --device cpu --shapes tiny --tokens 8 --streams 1,4
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a plain script

import torch

from adapters.engine.engine import DECODE_PATHS, Engine
from adapters.engine.model import LoadedModel
from adapters.engine.paged_attention import ATTENTIONS
from bench.gpu_shapes import PROMPT_TOKENS, SHAPES, Shape, build_model, prompts
from bench.measure import hf_generate_rate, memory_bandwidth_gbs, sync
from core.batching import BatchLimits
from core.protocol import Assignment, Decoded, DecodeDone, GenerationRequest, Sampling

CHECK_TOKENS = 64
CUTS = (1, 17, 45)
CHECK_PROMPTS = 4
BATCH_OF = 16
TEMPERATURE = 0.8
BURST = 64  # requests arriving at once for the first-token figure
# Of the budget, the correctness checks take at most this; the shapes share the rest.
CHECKS_SHARE_S = 90.0
STEP_LIMIT = 100_000  # no engine loop runs longer than this many steps, whatever else
ABANDONED: list[threading.Thread] = []  # calls given up on (generate_batch_rate)
PARTS = ("checks", "compile", "eager", "generate_batch", "burst")  # what --skip can leave out


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
    """A part of the check: its failure prints a traceback and the run goes on."""
    print(f"\n== {name}", flush=True)
    began = time.perf_counter()
    try:
        yield
    except Exception:
        traceback.print_exc(file=sys.stdout)
        failures.append(name)
    print(f"  ({time.perf_counter() - began:.1f} s)", flush=True)


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


def hf_rate(model: Any, prompt: tuple[int, ...], tokens: int, cap_s: float, **kw: Any) -> float:
    """HF generate tokens/s at batch 1 (bench/measure.py), with the warm-up's
    time printed: that first call is where a static cache compiles."""
    rate, warm_s = hf_generate_rate(model, prompt, tokens, cap_s=cap_s, **kw)
    print(f"    (first call, warm-up{' and compile' if kw else ''}: {warm_s:.1f} s)")
    return rate


def generate_batch_rate(
    model: Any, plist: list[tuple[int, ...]], tokens: int, timeout_s: float
) -> float:
    """transformers' continuous batching: every prompt at once, tokens/s over the call.

    Its manager runs on threads of its own, and a broken one can leave the call
    waiting for ever, so the call runs on a daemon thread of ours, given up on
    after timeout_s (main then ends the process without waiting for it)."""
    from transformers import GenerationConfig

    config = GenerationConfig(  # type: ignore[no-untyped-call]
        max_new_tokens=tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    box: dict[str, Any] = {}

    def call() -> None:
        try:
            with torch.inference_mode():
                box["results"] = model.generate_batch(
                    inputs=[list(p) for p in plist], generation_config=config, progress_bar=False
                )
            sync(next(model.parameters()).device)
        except BaseException as error:
            box["error"] = error

    began = time.perf_counter()
    worker = threading.Thread(target=call, name="generate_batch", daemon=True)
    worker.start()
    worker.join(timeout_s)
    elapsed = time.perf_counter() - began
    if worker.is_alive():
        ABANDONED.append(worker)
        raise TimeoutError(f"generate_batch did not return in {timeout_s:.0f} s; left behind")
    if "error" in box:
        raise box["error"]
    results = box["results"]
    produced = sum(len(r.generated_tokens) for r in results.values())
    return produced / elapsed


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


HF_EAGER_TOKENS = 32  # eager HF is host-bound: its rate per token is flat, 32 tell it


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
    table: dict[str, str] = dataclasses.field(default_factory=dict)

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

    def hf_compiled(self) -> None:
        if self.budget.allows(75 if self.cuda else 5, "HF static cache + torch.compile"):
            cap = min(20, self.budget.left())
            rate = hf_rate(
                self.model, self.plist[0], self.tokens, cap, cache_implementation="static"
            )
            compiled = getattr(self.model, "_compiled_call", None) is not None
            print(f"  {rate:,.1f} tok/s (transformers compiled the forward: {compiled})")
            self.results.rates[(self.key, "hf compiled")] = rate
            self.table["HF generate, static cache + compile, batch 1"] = f"{rate:,.1f}"

    def hf_eager(self) -> None:
        if self.budget.allows(10, "HF generate eager"):
            tokens = min(self.tokens, HF_EAGER_TOKENS)
            rate = hf_rate(self.model, self.plist[0], tokens, min(20, self.budget.left()))
            print(f"  {rate:,.1f} tok/s over {tokens} tokens")
            self.results.rates[(self.key, "hf eager")] = rate
            self.table["HF generate, eager, batch 1"] = f"{rate:,.1f}"

    def generate_batch(self, n: int) -> None:
        if not hasattr(self.model, "generate_batch"):
            print("  this transformers has no generate_batch")
        elif self.budget.allows(30 if self.cuda else 5, f"generate_batch at {n}"):
            timeout = max(30.0, self.budget.left())
            rate = generate_batch_rate(self.model, self.plist[:n], self.tokens, timeout)
            print(f"  {n} requests: {rate:,.1f} tok/s")
            self.results.rates[(self.key, f"generate_batch {n}")] = rate
            self.table[f"transformers generate_batch, {n} requests"] = f"{rate:,.1f}"

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

    def print_table(self) -> None:
        name = SHAPES[self.key].name
        print(f"\n{name} shape ({self.tokens} new tokens, {PROMPT_TOKENS}-token prompts), tok/s:")
        width = max((len(label) for label in self.table), default=10)
        for label in sorted(self.table, key=_table_order):
            print(f"  | {label:<{width}} | {self.table[label]:>24} |")
        if any("*" in value for value in self.table.values()):
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


def speed(
    key: str,
    device: torch.device,
    streams: list[int],
    tokens: int,
    budget: Budget,
    results: Results,
    failures: list[str],
    seed: int,
    burst: bool,
    skip: set[str],
) -> None:
    """One shape's figures, those the goals need first, so a short budget drops the rest."""
    name = SHAPES[key].name
    most = max([*streams, BURST if burst else 1])
    run = model = engine = None
    try:
        with section(f"speed, {name} shape: build", failures):
            if budget.allows(10, f"the {name} shape"):
                model, engine = build_run(key, device, most, tokens, seed)
                plist = prompts(most)
                run = ShapeRun(key, model, engine, plist, tokens, budget, results)
                # what one row's step reads (of a mixture: the experts it picks)
                bound = memory_bandwidth_gbs(device) * 1e9 / engine.runner.weight_bytes(rows=1)
                run.table["batch-1 bandwidth bound"] = f"{bound:,.0f}"
        if run is None:
            return
        # What the goals need first (batch 1 against compiled HF, the largest batch
        # against generate_batch, the burst), then the rest of the table.
        top, middle = max(streams), [n for n in streams if 1 < n < max(streams)]
        parts: list[tuple[str, Callable[[], None]]] = []
        if 1 in streams:
            parts += [("fencepost, 1 stream", functools.partial(run.fencepost, 1))]
        if "compile" not in skip:
            parts += [("HF generate, static cache + compile, batch 1", run.hf_compiled)]
        if burst and "burst" not in skip:
            parts += [(f"{BURST} requests arriving at once", run.burst)]
        if top > 1:
            parts += [(f"fencepost, {top} streams", functools.partial(run.fencepost, top))]
        if "generate_batch" not in skip:
            parts += [
                (f"transformers generate_batch, {top}", functools.partial(run.generate_batch, top))
            ]
        parts += [(f"fencepost, {n} streams", functools.partial(run.fencepost, n)) for n in middle]
        if 1 in streams:
            parts += [("fencepost, eager decode, 1 stream", run.fencepost_eager)]
        if "eager" not in skip:
            parts += [("HF generate, eager, batch 1", run.hf_eager)]
        for label, part in parts:
            with section(f"speed, {name} shape: {label}", failures):
                part()
    finally:
        if run is not None:
            run.print_table()
        run = model = engine = None
        free(device)


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
        "--shapes", default="135m,1b,8b,qwen3-8b,gemma3-4b", help=f"of {', '.join(SHAPES)}"
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
        "--skip",
        default="",
        help=f"comma-separated parts to leave out, of {', '.join(PARTS)} "
        "(generate_batch's start alone takes ~15 s on CPU)",
    )
    args = parser.parse_args(argv)
    skip = {part.strip() for part in args.skip.split(",") if part.strip()}
    if skip - set(PARTS):
        parser.error(f"unknown parts {sorted(skip - set(PARTS))}; of {', '.join(PARTS)}")
    keys = [k.strip() for k in args.shapes.split(",") if k.strip()]
    unknown = [k for k in keys if k not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; of {', '.join(SHAPES)}")
    streams = sorted({int(n) for n in args.streams.split(",")})
    device = torch.device(args.device)
    ENGINE_OPTIONS.update(decode=args.decode, attention=args.attention)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    budget = Budget(args.budget_s)
    torch.set_float32_matmul_precision("highest")  # fp32 means fp32 (no TF32) for the HF check
    import transformers

    print(
        f"gpu_check: {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}, "
        f"shapes {', '.join(keys)}, streams {streams}, {args.tokens} new tokens, "
        f"budget {args.budget_s:.0f} s, seed {args.seed}"
    )
    results, failures = Results(), list[str]()
    if "checks" not in skip:
        checks = Budget(min(CHECKS_SHARE_S, budget.left()))
        correctness(keys[0], device, checks, results, failures, args.seed)
    burst_key = "1b" if "1b" in keys else keys[0]
    for done, key in enumerate(keys):
        share = Budget(budget.left() / (len(keys) - done))  # what an earlier shape left over
        speed(
            key,
            device,
            streams,
            args.tokens,
            share,
            results,
            failures,
            args.seed,
            key == burst_key,
            skip,
        )
    goals(results, keys, streams)
    spent = time.perf_counter() - budget.began
    print(f"\ngpu_check done in {spent:.0f} s; sections failed: {', '.join(failures) or 'none'}")
    code = 1 if failures else 0
    if ABANDONED:  # a thread that never returned must not keep the process alive
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
