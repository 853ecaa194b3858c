"""The decode engine: continuous batching of assignments on one model.

Engine is synchronous and single-threaded: start() and stop() queue work,
step() runs one scheduling step (core.batching decides who runs) and returns
the worker machine's input events, Decoded and DecodeDone. EngineThread runs
steps on a dedicated thread so an event loop never blocks on a forward pass.

Sampling: greedy at temperature 0; otherwise temperature, then top_p, then a
draw from a torch.Generator seeded by (request seed, token index). Each token's
randomness depends on nothing else, so a request reproduces whatever shares its
batch, and a continuation that starts at index k draws exactly what an
uninterrupted run would. A request without a seed gets one drawn at start.
"""

from __future__ import annotations

import heapq
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from adapters.engine.llama import LlamaRunner
from adapters.engine.model import LoadedModel
from core.batching import BatchLimits, Running, Waiting, admit, plan_step
from core.protocol import Assignment, Decoded, DecodeDone, DecoderFailed, GenerationRequest

EngineEvent = Decoded | DecodeDone
_MASK63 = (1 << 63) - 1


def token_seed(seed: int, index: int) -> int:
    """The generator seed for token `index` of a request seeded with `seed` (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


@dataclass
class _Sequence:
    key: int
    assignment: Assignment
    request: GenerationRequest
    seed: int
    stop_ids: frozenset[int]
    context: tuple[int, ...]  # what prefill puts in the cache: prompt + any output prefix
    slot: int = -1
    prefilled: int = 0
    generated: list[int] = field(default_factory=list)  # a continuation starts with its prefix


@dataclass
class StepTiming:
    """What the last step did, for benchmarks."""

    decode_rows: int = 0
    prefill_tokens: int = 0
    seconds: float = 0.0


class Engine:
    def __init__(
        self, loaded: LoadedModel, limits: BatchLimits | None = None, weights: str = "float"
    ) -> None:
        limits = limits or BatchLimits(max_context=min(2048, loaded.max_context))
        if limits.max_context > loaded.max_context:
            raise ValueError(f"max_context {limits.max_context} > the model's {loaded.max_context}")
        self.loaded = loaded
        self.limits = limits
        self.runner = LlamaRunner(loaded.model, limits.max_seqs, limits.max_context, weights)
        self.device = self.runner.device
        self._keys = 0
        self._waiting: dict[int, _Sequence] = {}
        self._running: dict[int, _Sequence] = {}
        self._by_assignment: dict[Assignment, int] = {}
        self._free_slots = list(range(limits.max_seqs))  # a heap: lowest slot first
        self._ended: list[EngineEvent] = []  # continuations that were over at start
        self._seeds = random.SystemRandom()
        self.last_step = StepTiming()

    # --- commands ---

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        if assignment in self._by_assignment:
            raise ValueError(f"{assignment} is already running")
        vocab = self.runner.vocab_size
        context = request.prompt_token_ids + request.output_prefix
        bad = [t for t in context if t >= vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:3]} are outside the vocabulary ({vocab})")
        self._keys += 1
        seed = request.sampling.seed
        stop_ids = self.loaded.eos_token_ids | frozenset(request.stop_token_ids)
        seq = _Sequence(
            key=self._keys,
            assignment=assignment,
            request=request,
            seed=self._seeds.getrandbits(63) if seed is None else seed,
            stop_ids=stop_ids,
            context=context,
            generated=list(request.output_prefix),
        )
        ended = request.ended_by_prefix(stop_ids)
        if ended is not None:  # nothing to add; say so in the next step
            self._ended.append(DecodeDone(assignment, ended))
            return
        self._waiting[seq.key] = seq
        self._by_assignment[assignment] = seq.key

    def stop(self, assignment: Assignment) -> None:
        """Drop an assignment at once; its slot is free for the next step."""
        key = self._by_assignment.pop(assignment, None)
        if key is None:
            return
        self._waiting.pop(key, None)
        seq = self._running.pop(key, None)
        if seq is not None:
            heapq.heappush(self._free_slots, seq.slot)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._ended)

    @property
    def active(self) -> int:
        return len(self._running)

    # --- one step ---

    def step(self) -> list[EngineEvent]:
        began = time.perf_counter()
        events: list[EngineEvent] = list(self._ended)
        self._ended.clear()
        self._admit(events)
        running = [
            Running(seq.key, len(seq.context), seq.prefilled) for seq in self._running.values()
        ]
        plan = plan_step(running, self.limits)
        if plan.decode:
            # In slot order, so that slots 0..n-1 can be read from the cache as one view.
            decoding = sorted((self._running[key] for key in plan.decode), key=lambda s: s.slot)
            self._decode(decoding, events)
        for key, count in plan.prefill:
            seq = self._running.get(key)
            if seq is not None:
                self._prefill(seq, count, events)
        self.last_step = StepTiming(
            len(plan.decode), plan.tokens - len(plan.decode), time.perf_counter() - began
        )
        return events

    def _admit(self, events: list[EngineEvent]) -> None:
        waiting = [Waiting(s.key, s.request.context_tokens) for s in self._waiting.values()]
        decision = admit(waiting, len(self._running), self.limits)
        for key in decision.rejected:
            seq = self._waiting.pop(key)
            del self._by_assignment[seq.assignment]
            events.append(DecodeDone(seq.assignment, "failed"))
        for key in decision.admitted:
            seq = self._waiting.pop(key)
            seq.slot = heapq.heappop(self._free_slots)
            self._running[key] = seq

    def _decode(self, seqs: list[_Sequence], events: list[EngineEvent]) -> None:
        device = self.device
        slots = torch.tensor([s.slot for s in seqs], device=device)
        positions = torch.tensor(
            [len(s.request.prompt_token_ids) + len(s.generated) - 1 for s in seqs], device=device
        )
        tokens = torch.tensor([s.generated[-1] for s in seqs], device=device)
        logits = self.runner.decode(slots, positions, tokens)
        picks = sample_rows(logits, [self._settings(seq) for seq in seqs])
        for seq, token in zip(seqs, picks, strict=True):
            self._emit(seq, token, events)

    def _prefill(self, seq: _Sequence, count: int, events: list[EngineEvent]) -> None:
        prompt = seq.context
        chunk = torch.tensor(prompt[seq.prefilled : seq.prefilled + count], device=self.device)
        logits = self.runner.prefill(seq.slot, seq.prefilled, chunk)
        seq.prefilled += count
        if seq.prefilled == len(prompt):
            [token] = sample_rows(logits[None], [self._settings(seq)])
            self._emit(seq, token, events)

    @staticmethod
    def _settings(seq: _Sequence) -> tuple[float, float, int, int]:
        sampling = seq.request.sampling
        return (sampling.temperature, sampling.top_p, seq.seed, len(seq.generated))

    def _emit(self, seq: _Sequence, token: int, events: list[EngineEvent]) -> None:
        index = len(seq.generated)
        seq.generated.append(token)
        events.append(Decoded(seq.assignment, index, token))
        if token in seq.stop_ids:
            self._finish(seq, "eos", events)
        elif len(seq.generated) >= seq.request.max_new_tokens:
            self._finish(seq, "length", events)

    def _finish(
        self, seq: _Sequence, reason: Literal["eos", "length"], events: list[EngineEvent]
    ) -> None:
        self.stop(seq.assignment)
        events.append(DecodeDone(seq.assignment, reason))

    def reset(self) -> list[Assignment]:
        """Forget everything (after a failed step); returns what was dropped."""
        dropped = list(self._by_assignment)
        for assignment in dropped:
            self.stop(assignment)
        return dropped


def sample_rows(logits: torch.Tensor, settings: list[tuple[float, float, int, int]]) -> list[int]:
    """One token per row of logits [rows, vocab]; settings are (temperature, top_p, seed, index).

    Greedy rows take the argmax. Sampled rows use inverse-CDF sampling with one
    uniform number from a generator seeded by (seed, index), so the same
    request, seed and index pick the same token from the same distribution,
    whatever else is in the batch. top_p keeps the smallest set of most likely
    tokens whose probability reaches top_p: it is looked for among the top 64
    first (almost always enough) and over the whole vocabulary otherwise, so
    the result is exact either way.
    """
    picks = torch.argmax(logits, dim=-1).tolist()
    sampled = [row for row, (temperature, _, _, _) in enumerate(settings) if temperature > 0]
    if not sampled:
        return [int(p) for p in picks]
    rows = torch.tensor(sampled, device=logits.device)
    temperatures = torch.tensor(
        [settings[r][0] for r in sampled], device=logits.device, dtype=torch.float32
    )
    probs = torch.softmax(logits[rows].float() / temperatures[:, None], dim=-1)
    top_probs, top_ids = torch.topk(probs, min(_NUCLEUS_PROBE, probs.shape[-1]), dim=-1)
    top_mass = top_probs.sum(dim=-1).tolist()
    for i, row in enumerate(sampled):
        _, top_p, seed, index = settings[row]
        generator = torch.Generator(device="cpu").manual_seed(token_seed(seed, index))
        uniform = float(torch.rand(1, generator=generator))
        if top_p >= 1.0:
            candidates, ids = probs[i], None
        elif top_mass[i] >= top_p:
            candidates, ids = top_probs[i], top_ids[i]
        else:
            candidates, ids = torch.sort(probs[i], descending=True)
        if top_p < 1.0:
            mass = torch.cumsum(candidates, dim=-1)
            target = torch.tensor([top_p], device=mass.device, dtype=mass.dtype)
            candidates = candidates[: int(torch.searchsorted(mass, target)) + 1]
        cumulative = torch.cumsum(candidates, dim=-1)
        target = torch.tensor([uniform * float(cumulative[-1])], device=cumulative.device)
        pick = min(int(torch.searchsorted(cumulative, target)), candidates.shape[-1] - 1)
        picks[row] = int(ids[pick]) if ids is not None else pick
    return [int(p) for p in picks]


_NUCLEUS_PROBE = 64


class EngineThread:
    """Runs an Engine's steps on its own thread; results go to `on_events`.

    start() and stop() may be called from any thread. `on_events` is called on
    the engine thread with each step's events (the runtime hands them to its
    event loop). A step that raises ends every assignment: DecoderFailed.
    """

    def __init__(
        self,
        engine: Engine,
        on_events: Callable[[list[Any]], None],
        threads: int | None = None,
    ) -> None:
        self.engine = engine
        self._on_events = on_events
        self._threads = threads
        self._commands: queue.SimpleQueue[tuple[str, Assignment, GenerationRequest | None]] = (
            queue.SimpleQueue()
        )
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fencepost-engine", daemon=True)
        self._thread.start()

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        self._commands.put(("start", assignment, request))

    def stop(self, assignment: Assignment) -> None:
        self._commands.put(("stop", assignment, None))

    def close(self, timeout_s: float = 10.0) -> None:
        self._closed.set()
        self._commands.put(("wake", Assignment("-", 1), None))
        self._thread.join(timeout_s)

    def _run(self) -> None:
        if self._threads is not None:
            torch.set_num_threads(self._threads)
        while not self._closed.is_set():
            if not self.engine.has_work():
                try:  # idle: sleep until a command arrives
                    self._apply(self._commands.get(timeout=0.5))
                except queue.Empty:
                    continue
            while True:  # take every queued command before the next step
                try:
                    self._apply(self._commands.get_nowait())
                except queue.Empty:
                    break
            if self.engine.has_work() and not self._closed.is_set():
                self._step()

    def _apply(self, command: tuple[str, Assignment, GenerationRequest | None]) -> None:
        kind, assignment, request = command
        if kind == "start" and request is not None:
            try:
                self.engine.start(assignment, request)
            except ValueError:
                self._on_events([DecodeDone(assignment, "failed")])
        elif kind == "stop":
            self.engine.stop(assignment)

    def _step(self) -> None:
        try:
            events: list[Any] = self.engine.step()
        except Exception as error:  # a broken forward pass must not kill the thread
            self.engine.reset()
            events = [DecoderFailed(f"{type(error).__name__}: {error}")]
        if events:
            self._on_events(events)
