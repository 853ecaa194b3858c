"""An Engine stepping on its own thread, so that an event loop never waits on a forward
pass: commands (start, stop, close) cross over a queue, each step's events come back
through a callback, and a step that raises ends every assignment instead of the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from adapters.engine.engine import Engine
from core.protocol import Assignment, DecodeDone, DecoderEvent, DecoderFailed, GenerationRequest


@dataclass(frozen=True, slots=True)
class Start:
    """Begin decoding an assignment."""

    assignment: Assignment
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Stop:
    """Drop an assignment at once."""

    assignment: Assignment


@dataclass(frozen=True, slots=True)
class Close:
    """Wake the thread so it sees it is closed."""


Command = Start | Stop | Close


class EngineThread:
    """Runs an Engine's steps on its own thread; results go to `on_events`.

    start() and stop() may be called from any thread; they queue commands,
    which the thread takes, all of them, before each step. `on_events` is
    called on the engine thread with each step's events (the runtime hands them
    to its event loop). A step that raises ends every assignment: DecoderFailed.
    """

    def __init__(
        self,
        engine: Engine,
        on_events: Callable[[list[DecoderEvent]], None],
        threads: int | None = None,
    ) -> None:
        self.engine = engine
        self._on_events = on_events
        self._threads = threads
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fencepost-engine", daemon=True)
        self._thread.start()

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        self._commands.put(Start(assignment, request))

    def stop(self, assignment: Assignment) -> None:
        self._commands.put(Stop(assignment))

    def close(self, timeout_s: float = 10.0) -> None:
        self._closed.set()
        self._commands.put(Close())
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

    def _apply(self, command: Command) -> None:
        match command:
            case Start(assignment, request):
                try:
                    self.engine.start(assignment, request)
                except ValueError:
                    self._on_events([DecodeDone(assignment, "failed")])
            case Stop(assignment):
                self.engine.stop(assignment)
            case Close():
                pass  # the loop checks _closed

    def _step(self) -> None:
        events: list[DecoderEvent]
        try:
            events = self.engine.step()
        except Exception as error:  # a broken forward pass must not kill the thread
            self.engine.reset()
            events = [DecoderFailed(f"{type(error).__name__}: {error}")]
        if events:
            self._on_events(events)
