"""A worker under trio: the worker machine, its decoder, and its uplinks to routers.

WorkerHost feeds the core Worker its events (router messages, links made and
lost, decoder output, heartbeat timers) one at a time and carries out its
effects: a message for a router goes to the uplink with that router's id (the
uplink never waits, and drops what is meant for a link that is gone),
StartDecode and StopDecode go to the decoder. One host lives as long as its
process; routers come and go as links (RouterLinked, RouterUnlinked). Two decoders are provided:

- EngineDecoder: the torch engine on its own thread (adapters.engine); its
  events come back into the trio loop with run_sync_soon, so the loop never
  waits on a forward pass.
- FakeDecoder: a deterministic, instant stand-in for tests and for measuring
  the runtime's own overhead. It runs core's fake model (core/fake_model.py),
  the simulator's too: autoregressive and deterministic, so every worker
  agrees on every greedy or seeded output, and a continuation goes on exactly
  where its prefix ends.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from adapters.runtime.loop import Serial, Timers
from core.blocks import BlockManager
from core.fake_model import FakeDecode
from core.protocol import (
    ArmTimer,
    Assignment,
    CacheReport,
    DecoderEvent,
    DisarmTimer,
    Drain,
    FromRouterMessage,
    FromWorker,
    GenerationRequest,
    RouterLinked,
    RouterUnlinked,
    SendToRouter,
    StartDecode,
    StopDecode,
    TimerFired,
    ToWorker,
    WorkerEvent,
    WorkerStart,
)
from core.worker import Worker, WorkerConfig

if TYPE_CHECKING:
    from adapters.engine.engine import Engine, EngineThread
    from adapters.engine.model import LoadedModel

log = logging.getLogger("fencepost.worker")

Emit = Callable[[list[DecoderEvent]], None]
Pace = Callable[[], Awaitable[None]]
Uplink = Callable[[FromWorker, str], None]
"""Send a message to the router of this id; never waits (a full link is the uplink's
business: it closes that link)."""


async def no_pace() -> None:
    """For an uplink that never fills (the in-process one)."""


class Decoder(Protocol):
    def start(self, assignment: Assignment, request: GenerationRequest) -> None: ...

    def stop(self, assignment: Assignment) -> None: ...

    def cache_report(self) -> CacheReport | None:
        """What the decoder's prefix cache holds now (None: it has none). Called on
        the event loop before each heartbeat, so it must be cheap: a snapshot."""
        ...

    async def run(
        self,
        emit: Emit,
        pace: Pace = no_pace,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Decode until cancelled, passing each step's events to `emit`.

        `pace` returns once the uplink has room again; a decoder that can
        outrun the link awaits it between steps instead of overfilling it.
        """
        ...


class WorkerHost:
    def __init__(self, config: WorkerConfig, decoder: Decoder, uplink: Uplink) -> None:
        self.worker = Worker(config)
        self.decoder = decoder
        self.timers = Timers(self._on_timer)
        self._uplink = uplink
        self.feed: Serial[WorkerEvent] = Serial(self._handle)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Announce the worker (first heartbeat) and keep its heartbeats going."""
        self.feed(WorkerStart())
        task_status.started()
        await self.timers.run()

    def from_router(self, message: ToWorker, router_id: str = "") -> None:
        self.feed(FromRouterMessage(message, router_id))

    def link(self, router_id: str, epoch: int) -> None:
        """A connection to this router registered under `epoch`."""
        self.feed(RouterLinked(router_id, epoch))

    def unlink(self, router_id: str, reason: str) -> None:
        """The connection to this router is gone: its assignments stop decoding."""
        self.feed(RouterUnlinked(router_id, reason))

    def on_decoder_events(self, events: list[DecoderEvent]) -> None:
        for event in events:
            self.feed(event)

    def drain(self, handoff: bool = True) -> None:
        """No new work; with handoff, the routers are given the streams back."""
        self.feed(Drain(handoff))

    def stop_all(self) -> None:
        """The host is going away: whatever it holds stops decoding now."""
        for assignment in list(self.worker.holds()):
            self.decoder.stop(assignment)

    def _on_timer(self, key: object) -> None:
        self.feed(TimerFired(key))  # type: ignore[arg-type]

    def _handle(self, event: WorkerEvent) -> None:
        if isinstance(event, TimerFired | WorkerStart):  # a heartbeat may go out
            self.worker.cache = self.decoder.cache_report()
        for effect in self.worker.handle(event, trio.current_time()):
            match effect:
                case SendToRouter(message, router_id):
                    self._uplink(message, router_id)
                case StartDecode(assignment, request):
                    self.decoder.start(assignment, request)
                case StopDecode(assignment):
                    self.decoder.stop(assignment)
                case ArmTimer(key, deadline):
                    self.timers.arm(key, deadline)
                case DisarmTimer(key):
                    self.timers.disarm(key)


@dataclass(slots=True)
class _FakeRun:
    ready_at: float  # prefill ends; the first token may come
    decode: FakeDecode
    sequence: int | None  # its blocks in the FakeDecoder's pool (None: admitted uncached)
    prompt_tokens: int
    written: list[int]  # tokens whose keys and values its blocks hold, once prefilled
    committed_blocks: int = 0  # full blocks of `written` committed to the pool


FAKE_BLOCK_SIZE = 16
FAKE_CACHE_KEYS = 256  # chain keys a heartbeat carries


class FakeDecoder:
    """One token per running assignment per step, `step_s` apart; instant when 0.

    prefill_s delays each assignment's first token (a stand-in for prompt
    processing). With step_s = 0 it only yields to the event loop between steps,
    which makes it an instant decoder for measuring the runtime. ignore_eos makes
    every request run to its max_new_tokens (fixed-length streams). hang_after
    makes it wedge for good after that many steps, as a forward pass that never
    returns would (the worker around it keeps heartbeating): a gray failure to
    test the router's progress deadlines against.

    It models a paged KV cache with prefix caching (core/blocks.py), so that
    routing and benches see what a real engine's cache would do: each assignment
    holds blocks for its context (prompt and output prefix) and the positions it
    may write, the context's cached prefix is found at start, and the first token
    waits prefill_s + prefill_s_per_token per context token not found cached.
    The context is committed when prefill ends, each output token as the next
    step writes it (so the next turn of a conversation, resending the answer,
    finds it too), and the blocks are released when the assignment ends or stops.
    Prefills overlap (each is a delay of its own); only the first token's time
    depends on the cache. An assignment the pool cannot hold (every block held
    by running ones) is admitted uncached: it computes its whole context and
    holds no blocks. The worker machine has accepted it against its slots
    already, so waiting would only add a queue the router cannot see; failing it
    would turn a full cache into errors.
    """

    def __init__(
        self,
        step_s: float = 0.0,
        prefill_s: float = 0.0,
        ignore_eos: bool = False,
        hang_after: int | None = None,
        *,
        prefill_s_per_token: float = 0.0,
        prefix_caching: bool = True,
        kv_cache_tokens: int = 32768,
    ):
        self.step_s = step_s
        self.prefill_s = prefill_s
        self.prefill_s_per_token = prefill_s_per_token
        self.ignore_eos = ignore_eos
        self.hang_after = hang_after
        self._running: dict[Assignment, _FakeRun] = {}
        self._lot = trio.lowlevel.ParkingLot()
        self.steps = 0
        self.blocks = BlockManager(
            max(1, kv_cache_tokens // FAKE_BLOCK_SIZE), FAKE_BLOCK_SIZE, prefix_caching
        )
        self._sequences = itertools.count()
        self.prompt_tokens = 0  # context tokens submitted for prefill, over the decoder's life
        self.computed_tokens = 0  # ... and those not found cached
        self.uncached_admissions = 0  # assignments the pool could not hold
        self._report: CacheReport | None = None  # rebuilt on demand after a change

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        self.stop(assignment)  # a repeated start replaces the old run and frees its blocks
        prompt = request.prompt_token_ids
        context = (*prompt, *request.output_prefix)
        capacity = self.blocks.num_blocks * self.blocks.block_size
        positions = max(len(context), min(request.context_tokens, capacity))
        sequence: int | None = None
        cached = 0
        if self.blocks.needed(context, positions) <= self.blocks.available:
            sequence = next(self._sequences)
            cached = self.blocks.allocate(sequence, context, positions)
        else:
            self.uncached_admissions += 1
        computed = len(context) - cached
        self.prompt_tokens += len(context)
        self.computed_tokens += computed
        self._report = None
        ready_at = trio.current_time() + self.prefill_s + self.prefill_s_per_token * computed
        decode = FakeDecode(assignment, request, ignore_eos=self.ignore_eos)
        self._running[assignment] = _FakeRun(ready_at, decode, sequence, len(prompt), list(prompt))
        self._lot.unpark_all()

    def stop(self, assignment: Assignment) -> None:
        run = self._running.pop(assignment, None)
        if run is not None:
            self._release(run)

    def cache_report(self) -> CacheReport | None:
        if self._report is None:
            self._report = CacheReport(
                self.blocks.block_size,
                keys=self.blocks.summary(FAKE_CACHE_KEYS),
                prefill_rate=1 / self.prefill_s_per_token if self.prefill_s_per_token else 0.0,
                prompt_tokens=self.prompt_tokens,
                computed_tokens=self.computed_tokens,
                total_blocks=self.blocks.num_blocks,
                free_blocks=self.blocks.free_blocks(),
                cached_blocks=self.blocks.cached_blocks(),
            )
        return self._report

    async def run(
        self,
        emit: Emit,
        pace: Pace = no_pace,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        while True:
            await pace()
            if not self._running:
                await self._lot.park()
                continue
            now = trio.current_time()
            ready = [(a, run) for a, run in self._running.items() if run.ready_at <= now]
            if not ready:
                with trio.move_on_at(min(run.ready_at for run in self._running.values())):
                    await self._lot.park()
                continue
            if self.hang_after is not None and self.steps >= self.hang_after:
                log.warning("fake decoder hangs after %d steps (--fake-hang-after)", self.steps)
                await trio.sleep_forever()
            emit(self._step(ready))
            if self.step_s > 0:
                await trio.sleep(self.step_s)
            else:
                await trio.lowlevel.checkpoint()

    def _step(self, ready: list[tuple[Assignment, _FakeRun]]) -> list[DecoderEvent]:
        events: list[DecoderEvent] = []
        for assignment, run in ready:
            done = run.decode.step(events)
            self._commit(run)
            if done:
                del self._running[assignment]
                self._release(run)
        self.steps += 1
        return events

    def _commit(self, run: _FakeRun) -> None:
        """Key the run's newly full blocks: its context, and every output token but the
        last (a token's keys and values are written when the next step reads it)."""
        if run.sequence is None:
            return
        output = run.decode.generation.output  # the output prefix, then new tokens
        while len(run.written) < run.prompt_tokens + len(output) - 1:
            run.written.append(output[len(run.written) - run.prompt_tokens])
        if len(run.written) // FAKE_BLOCK_SIZE > run.committed_blocks:
            self.blocks.commit(run.sequence, run.written)
            run.committed_blocks = len(run.written) // FAKE_BLOCK_SIZE
            self._report = None

    def _release(self, run: _FakeRun) -> None:
        if run.sequence is not None:
            self.blocks.release(run.sequence)
            self._report = None


def default_threads(device_type: str) -> int | None:
    """torch CPU threads when the engine shares the machine with the event loop.

    On CPU, torch's default (every core) leaves the event loop, the HTTP layer
    and the sockets to preempt the matrix work, and every preemption stalls a
    whole parallel op: measured on 2 cores, serving lost 28-46% of the engine's
    own throughput that way, against 4-13% with one core left free (engine.md).
    """
    if device_type != "cpu":
        return None
    return max(1, (os.cpu_count() or 2) - 1)


def serving_threads(device_type: str, weights: str) -> int | None:
    """The engine's threads when serving in the weight format `weights` and none were
    given: every core for the native format, whose threads meet a handful of times a
    layer and lose little to the event loop (engine.md: 1.5-1.6x over one thread on 2
    cores); default_threads for torch's formats."""
    if device_type == "cpu" and weights == "w4a16":
        return os.cpu_count() or 1
    return default_threads(device_type)


def serving_engine(
    loaded: LoadedModel,
    slots: int,
    max_context: int | None,
    weights: str,
    threads: int | None,
    *,
    prefix_caching: bool = True,
    kv_cache_tokens: int | None = None,
    decode: str = "auto",
    attention: str = "auto",
) -> tuple[Engine, int | None]:
    """The torch engine for a loaded model as serving runs it, and its CPU threads:
        `slots` sequences of at most max_context tokens (None: the model's own; cut to the
        pool when the pool is smaller) sharing a KV cache of kv_cache_tokens positions
        (None: sized from the memory the weights leave, logged), decoding as
    `decode` and `attention` say (Engine's arguments). The torch
        threads are set first, so that choosing the weight format measures what serving
        will run; threads=None and the native format chosen: every core (default_threads
        says why torch's formats leave one free)."""
    import torch

    from adapters.engine.console import say
    from adapters.engine.engine import Engine
    from core.batching import BatchLimits

    device = loaded.device.type
    chosen_threads = threads
    if threads is None:
        threads = default_threads(device)
    if threads is not None:
        torch.set_num_threads(threads)
    context = min(max_context or loaded.max_context, loaded.max_context)
    limits = BatchLimits(max_seqs=slots, max_context=context)
    engine = Engine(
        loaded,
        limits,
        weights=weights,
        prefix_caching=prefix_caching,
        kv_cache_tokens=kv_cache_tokens,
        decode=decode,
        attention=attention,
    )
    if chosen_threads is None and engine.runner.format == "w4a16":
        threads = serving_threads(device, "w4a16")
        say(f"weights w4a16: the engine takes all {threads} CPU threads")
    return engine, threads


class EngineDecoder:
    """The torch engine (adapters.engine.Engine) stepping on its own thread.

    threads=None: one core is left to the event loop (default_threads).
    """

    def __init__(self, engine: Engine, threads: int | None = None) -> None:
        self.engine = engine
        self.threads = threads if threads is not None else default_threads(engine.device.type)
        self._thread: EngineThread | None = None

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        assert self._thread is not None, "start the decoder (run) before giving it work"
        self._thread.start(assignment, request)

    def stop(self, assignment: Assignment) -> None:
        if self._thread is not None:
            self._thread.stop(assignment)

    def cache_report(self) -> CacheReport | None:
        return self.engine.cache_report()

    async def run(
        self,
        emit: Emit,
        pace: Pace = no_pace,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        # `pace` is not consulted: a model's steps make hundreds of events a
        # second at most, orders of magnitude below what a link drains.
        from adapters.engine.engine import EngineThread

        token = trio.lowlevel.current_trio_token()

        def from_engine_thread(events: list[DecoderEvent]) -> None:
            # If the event loop is gone, so is everyone who wanted these events.
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(emit, events)

        self._thread = EngineThread(self.engine, from_engine_thread, self.threads)
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            thread, self._thread = self._thread, None
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.close)
