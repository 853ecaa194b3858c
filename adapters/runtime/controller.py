"""The controller: the router machine under trio, and the interface the HTTP layer uses.

Controller owns one core Router. Every input (a client's submit or cancel, a
worker's message, a lost connection, a timer) goes through `_feed`, which
hands events to Router.handle one at a time, in arrival order, and carries out
the effects: messages go to the worker's link (never waiting), timers to
Timers, deliveries to the client's RequestStream. An input that arrives while
effects are being carried out (a link that finds its queue full and reports the
worker gone) is queued and handled next (loop.Serial), so the router is never
re-entered.

The interface is free of OpenAI JSON: submit(GenerationRequest) returns a
RequestStream of deliveries (tokens in index order, then exactly one terminal
outcome); cancel(request_id); statistics().

Seeds: submit() is the one place a sampling seed is drawn. A sampled request
that comes without one gets one here, before the router sees it, so every
attempt of it (a retry, a continuation on another worker) draws exactly what
the first would have; decoders refuse a sampled request without a seed.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections import Counter, deque
from collections.abc import Hashable
from typing import Protocol

import trio
from msgspec import Struct
from msgspec.structs import replace

from adapters.runtime.loop import Serial, Timers
from core.config import RouterConfig
from core.protocol import (
    ArmTimer,
    ClientCancel,
    DeliverError,
    DeliverFinished,
    DeliverToken,
    Delivery,
    DisarmTimer,
    FromWorker,
    FromWorkerMessage,
    GenerationRequest,
    RegisterWorker,
    Registration,
    RouterEffect,
    RouterEvent,
    SendToWorker,
    Submit,
    TimerFired,
    ToWorker,
    WorkerGone,
)
from core.router import Router, RouterStatistics

log = logging.getLogger("fencepost.controller")


class WorkerLink(Protocol):
    """The controller's side of one worker connection (one worker id at one epoch)."""

    worker_id: str
    epoch: int

    def send(self, message: ToWorker) -> bool:
        """Queue a message without waiting; False when the link cannot take it."""
        ...

    def close(self, reason: str) -> None: ...


class ControllerStatistics(Struct, frozen=True):
    router: RouterStatistics
    open_streams: int
    armed_timers: int
    links: dict[str, int]  # worker id -> epoch of its connected link
    dropped_sends: dict[str, int]  # why messages to workers were not sent


class RequestStream:
    """One request's deliveries, in order; the last is DeliverFinished or DeliverError.

    Use as an async context manager: leaving it early (the client went away)
    cancels the request. Holds at most max_new_tokens + 1 items by construction.
    """

    def __init__(self, controller: Controller, request: GenerationRequest) -> None:
        self.request = request
        self._controller = controller
        self._items: deque[Delivery] = deque()
        self._lot = trio.lowlevel.ParkingLot()
        self.outcome: DeliverFinished | DeliverError | None = None
        self._read_outcome = False

    def push(self, item: Delivery) -> None:
        assert self.outcome is None, "nothing follows the terminal outcome"
        assert len(self._items) <= self.request.max_new_tokens
        if isinstance(item, DeliverFinished | DeliverError):
            self.outcome = item
        self._items.append(item)
        self._lot.unpark_all()

    def pending(self) -> list[Delivery]:
        """Take what has arrived without waiting (for consumers that batch)."""
        items = list(self._items)
        self._items.clear()
        if items and items[-1] is self.outcome:
            self._read_outcome = True
        return items

    async def wait(self) -> None:
        """Wait until at least one delivery is pending (returns at once if one is)."""
        while not self._items:
            if self._read_outcome:
                raise trio.EndOfChannel
            await self._lot.park()

    def cancel(self) -> None:
        if self.outcome is None:
            self._controller.cancel(self.request.request_id)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delivery:
        if self._read_outcome and not self._items:
            raise StopAsyncIteration
        await self.wait()
        item = self._items.popleft()
        if item is self.outcome:
            self._read_outcome = True
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()


def with_seed(request: GenerationRequest) -> GenerationRequest:
    """The request as the router should see it: sampled requests always carry a seed."""
    sampling = request.sampling
    if not sampling.sampled or sampling.seed is not None:
        return request
    return replace(request, sampling=replace(sampling, seed=secrets.randbits(63)))


class Controller:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.router = Router(config)
        self.timers = Timers(self._on_timer)
        self._streams: dict[str, RequestStream] = {}
        self._links: dict[str, WorkerLink] = {}
        self._feed: Serial[RouterEvent] = Serial(self._handle)
        self._dropped: Counter[str] = Counter()
        self._accepting = True
        self._shutdown_message: str | None = None
        self._idle = trio.lowlevel.ParkingLot()
        self.refusals: Counter[str] = Counter()
        self._refusal_logged: dict[str, float] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the router's timers; start this in a nursery before submitting."""
        task_status.started()
        await self.timers.run()

    # --- the interface for the HTTP layer ---

    def submit(self, request: GenerationRequest) -> RequestStream:
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already active")
        stream = RequestStream(self, with_seed(request))
        if not self._accepting:
            rid = request.request_id
            stream.push(DeliverError(rid, "overloaded", "the server is shutting down"))
            return stream
        self._streams[request.request_id] = stream
        self._feed(Submit(stream.request))
        return stream

    def cancel(self, request_id: str) -> None:
        if request_id in self._streams:
            self._feed(ClientCancel(request_id))

    def statistics(self) -> ControllerStatistics:
        return ControllerStatistics(
            router=self.router.statistics(),
            open_streams=len(self._streams),
            armed_timers=len(self.timers),
            links={w: link.epoch for w, link in self._links.items()},
            dropped_sends=dict(self._dropped),
        )

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests; wait up to grace_s for open ones, then cancel the rest."""
        self._accepting = False
        with trio.move_on_after(grace_s):
            while self._streams:
                await self._idle.park()
        if self._streams:
            log.warning("cancelling %d requests still open at shutdown", len(self._streams))
            self._shutdown_message = "the server shut down before the generation finished"
            for request_id in list(self._streams):
                self.cancel(request_id)

    # --- the transport's side ---

    def register(self, worker_id: str, takeover: bool = False) -> Registration:
        """A connection opened as worker_id: the router hands out an epoch or refuses.

        On success any connection still open under that id is closed (a takeover,
        or an old process the router had stopped hearing from); a refusal is logged
        once per interval per id, not once per attempt."""
        effects = self.router.handle(RegisterWorker(worker_id, takeover), trio.current_time())
        for effect in effects:
            self._apply(effect)  # a takeover's lost attempts; the answer itself is ours
        [answer] = [e for e in effects if isinstance(e, Registration)]
        if answer.epoch is None:
            now = trio.current_time()
            self.refusals[worker_id] += 1
            if now - self._refusal_logged.get(worker_id, -math.inf) >= 10.0:
                self._refusal_logged[worker_id] = now
                log.warning(
                    "refused a connection for worker %s (%d so far): %s",
                    worker_id, self.refusals[worker_id], answer.reason,
                )  # fmt: skip
            return answer
        old = self._links.pop(worker_id, None)
        if old is not None:
            old.close(f"replaced by epoch {answer.epoch}")
        return answer

    def attach(self, link: WorkerLink) -> bool:
        """A worker connected. A newer epoch replaces an older link; otherwise refused."""
        current = self._links.get(link.worker_id)
        if current is not None:
            if link.epoch <= current.epoch:
                return False
            current.close(f"replaced by epoch {link.epoch}")
            self._feed(WorkerGone(current.worker_id, current.epoch, "replaced by a newer epoch"))
        self._links[link.worker_id] = link
        return True

    def detach(self, link: WorkerLink, reason: str) -> None:
        """A connection ended; if it was the worker's current one, the worker is gone."""
        if self._links.get(link.worker_id) is link:
            del self._links[link.worker_id]
            self._feed(WorkerGone(link.worker_id, link.epoch, reason))

    def from_worker(self, worker_id: str, message: FromWorker) -> None:
        self._feed(FromWorkerMessage(worker_id, message))

    # --- carrying out the router's effects ---

    def _on_timer(self, key: Hashable) -> None:
        self._feed(TimerFired(key))  # type: ignore[arg-type]

    def _handle(self, event: RouterEvent) -> None:
        for effect in self.router.handle(event, trio.current_time()):
            self._apply(effect)

    def _apply(self, effect: RouterEffect) -> None:
        match effect:
            case SendToWorker(worker_id, message):
                self._send(worker_id, message)
            case DeliverToken():
                self._streams[effect.request_id].push(effect)
            case DeliverFinished() | DeliverError():
                self._finish(effect)
            case ArmTimer(key, deadline):
                self.timers.arm(key, deadline)
            case DisarmTimer(key):
                self.timers.disarm(key)
            case Registration():
                pass  # the answer to register(), which reads it there

    def _send(self, worker_id: str, message: ToWorker) -> None:
        link = self._links.get(worker_id)
        if link is None:
            self._dropped["no_connection"] += 1  # lost in transit, as the router allows
        elif not link.send(message):
            self._dropped["queue_full"] += 1
            del self._links[worker_id]
            link.close("send queue full: the worker is not keeping up")
            self._feed(WorkerGone(worker_id, link.epoch, "send queue full"))

    def _finish(self, outcome: DeliverFinished | DeliverError) -> None:
        stream = self._streams.pop(outcome.request_id)
        if (
            isinstance(outcome, DeliverError)
            and outcome.kind == "cancelled"
            and self._shutdown_message is not None
        ):
            outcome = DeliverError(outcome.request_id, "cancelled", self._shutdown_message)
        stream.push(outcome)
        if not self._streams:
            self._idle.unpark_all()
