"""A worker under trio: the worker machine, its decoder, and its uplink to the router.

WorkerHost feeds the core Worker its events (router messages, decoder output,
heartbeat timers) one at a time and carries out its effects: messages to the
router go to the uplink (which never waits), StartDecode and StopDecode go to
the decoder. Two decoders are provided:

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
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import trio

from adapters.runtime.loop import Serial, Timers
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
    def __init__(
        self, config: WorkerConfig, decoder: Decoder, uplink: Callable[[FromWorker], bool]
    ) -> None:
        self.worker = Worker(config)
        self.decoder = decoder
        self.timers = Timers(self._on_timer)
        self._uplink = uplink
        self.feed: Serial[WorkerEvent] = Serial(self._handle)
        self.uplink_failed = trio.Event()  # the uplink refused a message: reconnect

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Announce the worker (first heartbeat) and keep its heartbeats going."""
        self.feed(WorkerStart())
        task_status.started()
        await self.timers.run()

    def from_router(self, message: ToWorker) -> None:
        self.feed(FromRouterMessage(message))

    def on_decoder_events(self, events: list[DecoderEvent]) -> None:
        for event in events:
            self.feed(event)

    def drain(self) -> None:
        self.feed(Drain())

    def stop_all(self) -> None:
        """The connection is gone: whatever this epoch holds stops decoding now."""
        for assignment in list(self.worker.holds()):
            self.decoder.stop(assignment)

    def _on_timer(self, key: object) -> None:
        self.feed(TimerFired(key))  # type: ignore[arg-type]

    def _handle(self, event: WorkerEvent) -> None:
        if isinstance(event, TimerFired | WorkerStart):  # a heartbeat may go out
            self.worker.cache = self.decoder.cache_report()
        for effect in self.worker.handle(event, trio.current_time()):
            match effect:
                case SendToRouter(message):
                    if not self._uplink(message):
                        self.uplink_failed.set()
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


class FakeDecoder:
    """One token per running assignment per step, `step_s` apart; instant when 0.

    prefill_s delays each assignment's first token (a stand-in for prompt
    processing). With step_s = 0 it only yields to the event loop between steps,
    which makes it an instant decoder for measuring the runtime. ignore_eos makes
    every request run to its max_new_tokens (fixed-length streams). hang_after
    makes it wedge for good after that many steps, as a forward pass that never
    returns would (the worker around it keeps heartbeating): a gray failure to
    test the router's progress deadlines against.
    """

    def __init__(
        self,
        step_s: float = 0.0,
        prefill_s: float = 0.0,
        ignore_eos: bool = False,
        hang_after: int | None = None,
    ):
        self.step_s = step_s
        self.prefill_s = prefill_s
        self.ignore_eos = ignore_eos
        self.hang_after = hang_after
        self._running: dict[Assignment, _FakeRun] = {}
        self._lot = trio.lowlevel.ParkingLot()
        self.steps = 0

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        ready_at = trio.current_time() + self.prefill_s
        decode = FakeDecode(assignment, request, ignore_eos=self.ignore_eos)
        self._running[assignment] = _FakeRun(ready_at, decode)
        self._lot.unpark_all()

    def stop(self, assignment: Assignment) -> None:
        self._running.pop(assignment, None)

    def cache_report(self) -> CacheReport | None:
        return None

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
            if run.decode.step(events):
                del self._running[assignment]
        self.steps += 1
        return events


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


def engine_decoder(
    loaded: LoadedModel,
    slots: int,
    max_context: int,
    weights: str,
    threads: int | None,
    *,
    prefix_caching: bool = True,
    kv_cache_tokens: int | None = None,
) -> EngineDecoder:
    """The torch engine for a loaded model: `slots` sequences of at most max_context
    tokens (capped at the model's own) sharing a KV cache of kv_cache_tokens positions
    (None: the engine's default), stepping on its own thread. The torch threads are
    set first, so that choosing the weight format measures what serving will run."""
    import torch

    from adapters.engine.engine import DEFAULT_KV_CACHE_TOKENS, Engine
    from core.batching import BatchLimits

    device = next(loaded.model.parameters()).device.type
    if threads is None:
        threads = default_threads(device)
    if threads is not None:
        torch.set_num_threads(threads)
    limits = BatchLimits(max_seqs=slots, max_context=min(max_context, loaded.max_context))
    engine = Engine(
        loaded,
        limits,
        weights=weights,
        prefix_caching=prefix_caching,
        kv_cache_tokens=kv_cache_tokens or DEFAULT_KV_CACHE_TOKENS,
    )
    return EngineDecoder(engine, threads)


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
