"""Remote workers over TCP: length-prefixed msgpack frames of the core's wire messages.

Router side (serve_workers): every connection must open with Register, which
names the worker id. The router hands out the epoch (Registered), or, when a
live worker already serves under that id and this is no takeover, answers
Refused and closes; the connection then belongs to that (worker id, epoch),
and any older connection of the id is closed. Frames pass to the controller as
they arrive. A malformed frame, a frame of the wrong direction, or a silent
opening closes that connection alone, with the reason logged; the controller
then hears WorkerGone and fails over or ends that worker's assignments.

Messages to a worker wait in a bounded outbox drained by one writer task; when
the outbox is full the worker is not keeping up, and its connection is closed
rather than allowed to grow memory.

Worker side (RemoteWorker): connects and registers, retrying with exponential
backoff with jitter (50 ms doubling to 30 s; reset only by a session that
lasted 10 s, so a worker that is replaced or closed at once does not storm
the router); each connection is a fresh epoch handed out by the router, so no
host clock matters. Refused, it stops and says why (`fencepost worker` exits
2). When a connection ends, everything its epoch held stops decoding, and the
worker reconnects as a new epoch.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import msgspec
import trio

from adapters.runtime.controller import Controller
from adapters.runtime.loop import Mailbox
from adapters.runtime.worker_host import Decoder, WorkerHost
from core.protocol import (
    AnyWireMessage,
    DecoderEvent,
    FromWorker,
    Refused,
    Register,
    Registered,
    ToWorker,
)
from core.wire import DEFAULT_MAX_FRAME_BYTES, FrameReader, WireError, encode_frame
from core.worker import WorkerConfig

log = logging.getLogger("fencepost.tcp")

RECEIVE_BYTES = 65_536


@dataclass(frozen=True)
class TransportLimits:
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    send_queue_messages: int = 8_192  # per connection, each direction
    registration_timeout_s: float = 5.0  # a new connection must heartbeat within this
    # The worker port is unauthenticated: what one peer can make the router hold is
    # bounded. Connections beyond these caps are closed at once; a connection that
    # has not registered may send frames of at most registration_frame_bytes (its
    # first frame is a small Heartbeat), so it buffers no more than that; a
    # registered link silent for idle_timeout_s (default: the router's heartbeat
    # timeout) is closed, not just marked unhealthy.
    max_connections: int = 128
    max_unregistered: int = 16
    registration_frame_bytes: int = 64 * 1024
    idle_timeout_s: float | None = None


class LinkClosed(Exception):
    """The connection ended; the message says why (for the log)."""


class FrameStream:
    """Whole wire messages from a byte stream; bad input ends it with LinkClosed, and
    so does silence longer than idle_timeout_s, when one is set."""

    def __init__(self, stream: trio.abc.Stream, max_frame_bytes: int) -> None:
        self.stream = stream
        self.reader = FrameReader(max_frame_bytes)
        self.idle_timeout_s = math.inf

    async def receive(self) -> list[AnyWireMessage]:
        while True:
            try:
                data = None
                with trio.move_on_after(self.idle_timeout_s):
                    data = await self.stream.receive_some(RECEIVE_BYTES)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
                raise LinkClosed(f"connection broken: {error}") from None
            if data is None:
                raise LinkClosed(f"nothing received for {self.idle_timeout_s:g}s")
            if not data:
                failed = self.reader.finish()
                raise LinkClosed(f"closed mid-frame: {failed.detail}" if failed else "closed")
            messages: list[AnyWireMessage] = []
            for item in self.reader.feed(data):
                if isinstance(item, WireError):
                    raise LinkClosed(f"{item.kind} frame: {item.detail}")
                messages.append(item)
            if messages:
                return messages


async def write_frames(stream: trio.abc.Stream, outbox: Mailbox[AnyWireMessage]) -> None:
    """Send whatever the outbox holds, one write per batch, until it is closed."""
    while True:
        try:
            batch = await outbox.take()
        except trio.EndOfChannel:
            return
        await stream.send_all(b"".join(encode_frame(message) for message in batch))


async def run_connection(
    stream: trio.abc.Stream,
    frames: FrameStream,
    outbox: Mailbox[AnyWireMessage],
    on_messages: Callable[[list[AnyWireMessage]], None],
) -> str:
    """Write the outbox and read frames until either direction ends; returns why.

    on_messages may raise LinkClosed to end the connection (a protocol violation).
    """
    reason = "closed"

    async def writer(scope: trio.CancelScope) -> None:
        nonlocal reason
        try:
            await write_frames(stream, outbox)
        except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
            reason = f"send failed: {error}"
        scope.cancel()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, nursery.cancel_scope)
        try:
            while True:
                on_messages(await frames.receive())
        except LinkClosed as closed:
            reason = str(closed)
        nursery.cancel_scope.cancel()
    return reason


# --- router side ---


class TcpLink:
    """The controller's handle on one worker connection."""

    def __init__(self, worker_id: str, epoch: int, limit: int) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.outbox: Mailbox[AnyWireMessage] = Mailbox(limit)
        self.scope = trio.CancelScope()
        self.reason: str | None = None

    def send(self, message: AnyWireMessage) -> bool:
        return self.outbox.put(message)

    def close(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.outbox.close()
        self.scope.cancel()


async def serve_workers(
    controller: Controller,
    host: str,
    port: int,
    limits: TransportLimits | None = None,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept remote workers on host:port until cancelled; reports the bound port."""
    limits = limits or TransportLimits()
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    log.info("accepting workers on %s:%d", host, bound)
    task_status.started(bound)

    census = _Census()

    async def handler(stream: trio.SocketStream) -> None:
        refusal = census.refusal(limits)
        if refusal is not None:
            census.note_refused(refusal)
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        census.open += 1
        census.unregistered += 1
        try:
            await _serve_connection(controller, stream, limits, census)
        finally:
            census.open -= 1

    await trio.serve_listeners(handler, listeners)


class _Census:
    """Connections open on the worker port, and a rate-limited log of refusals."""

    def __init__(self) -> None:
        self.open = 0
        self.unregistered = 0
        self.refused = 0
        self._logged_at = -math.inf

    def refusal(self, limits: TransportLimits) -> str | None:
        if self.open >= limits.max_connections:
            return f"{self.open} connections open (--max-connections {limits.max_connections})"
        if self.unregistered >= limits.max_unregistered:
            return f"{self.unregistered} connections not yet registered"
        return None

    def note_refused(self, why: str) -> None:
        self.refused += 1
        now = trio.current_time()
        if now - self._logged_at >= 10.0:  # once per interval, not once per attempt
            log.warning("refusing worker connections: %s (%d refused so far)", why, self.refused)
            self._logged_at = now


async def _serve_connection(
    controller: Controller, stream: trio.SocketStream, limits: TransportLimits, census: _Census
) -> None:
    try:
        peer = "{}:{}".format(*stream.socket.getpeername()[:2])
    except OSError:
        peer = "unknown peer"
    frames = FrameStream(stream, limits.registration_frame_bytes)
    link: TcpLink | None = None
    reason = "closed"
    registering = True
    try:
        first: list[AnyWireMessage] | None = None
        with trio.move_on_after(limits.registration_timeout_s):
            first = await frames.receive()
        census.unregistered -= 1
        registering = False
        if first is None:
            raise LinkClosed("no Register within the registration timeout")
        hello = first[0]
        if not isinstance(hello, Register):
            raise LinkClosed(f"opened with {type(hello).__name__}, not a Register")
        answer = controller.register(hello.worker_id, hello.takeover)
        if answer.epoch is None:
            with trio.move_on_after(1.0):
                await stream.send_all(encode_frame(Refused(hello.worker_id, answer.reason)))
            raise LinkClosed(f"refused as {hello.worker_id}: {answer.reason}")
        link = TcpLink(hello.worker_id, answer.epoch, limits.send_queue_messages)
        if not controller.attach(link):
            raise LinkClosed(f"worker {hello.worker_id} epoch {answer.epoch} is not newer")
        link.send(Registered(hello.worker_id, answer.epoch))
        log.info("worker %s epoch %d connected from %s", link.worker_id, link.epoch, peer)
        frames.reader.limit(limits.max_frame_bytes)
        idle = limits.idle_timeout_s
        frames.idle_timeout_s = (
            controller.router.config.heartbeat_timeout_s if idle is None else idle
        )
        _pass_to_controller(controller, link, first[1:])
        with link.scope:
            reason = await run_connection(
                stream, frames, link.outbox, partial(_pass_to_controller, controller, link)
            )
        reason = link.reason or reason
    except LinkClosed as closed:
        reason = str(closed)
    except (trio.BrokenResourceError, trio.ClosedResourceError) as error:
        reason = f"connection broken: {error}"
    finally:
        if registering:
            census.unregistered -= 1
        who = f"worker {link.worker_id} epoch {link.epoch}" if link else peer
        # A refusal is logged by the controller, once per interval per id.
        (log.debug if reason.startswith("refused") else log.warning)(
            "connection of %s ended: %s", who, reason
        )
        if link is not None:
            link.close(reason)
            controller.detach(link, reason)
        with trio.CancelScope(shield=True):
            await stream.aclose()


def _pass_to_controller(
    controller: Controller, link: TcpLink, messages: list[AnyWireMessage]
) -> None:
    for message in messages:
        if not isinstance(message, FromWorker):
            raise LinkClosed(f"a worker sent {type(message).__name__}, a router's message")
        controller.from_worker(link.worker_id, message)
        if link.reason is not None:
            raise LinkClosed(link.reason)  # closed meanwhile (replaced, or its queue filled)


# --- worker side ---


BACKOFF_START_S = 0.05
BACKOFF_CAP_S = 30.0
STEADY_SESSION_S = 10.0  # a session this long resets the reconnect backoff
REFUSED_RETRY_S = 1.0  # after a refusal, ask again no sooner than this


class RemoteWorker:
    """A worker process's connection loop: connect, serve one epoch, reconnect."""

    def __init__(
        self,
        host: str,
        port: int,
        config: WorkerConfig,
        decoder: Decoder,
        limits: TransportLimits | None = None,
        takeover: bool = False,
        refused_grace_s: float = 10.0,
    ) -> None:
        self.address = (host, port)
        self.takeover = takeover
        self.refused_grace_s = refused_grace_s
        self.refused: str | None = None  # the router refused our id: stop, say why
        self.config = config
        self.decoder = decoder
        self.limits = limits or TransportLimits()
        self.host: WorkerHost | None = None
        self.connected = trio.Event()
        self.sessions = 0
        self._draining = False
        self._outbox: Mailbox[AnyWireMessage] | None = None  # the current session's

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.decoder.run, self._emit, self._pace)
            backoff_s = BACKOFF_START_S
            first_refusal: float | None = None
            while True:
                try:
                    stream = await trio.open_tcp_stream(*self.address)
                except OSError as error:
                    log.warning("cannot reach the router at %s:%d: %s", *self.address, error)
                    backoff_s = await _back_off(backoff_s)
                    continue
                began = trio.current_time()
                await self._session(stream)
                if self.refused is not None:
                    # The id is taken. It may be our own previous process, which the
                    # router has not yet seen die (a host that rebooted sends no
                    # FIN): ask again a few times, then give up and say why.
                    now = trio.current_time()
                    first_refusal = now if first_refusal is None else first_refusal
                    if now - first_refusal >= self.refused_grace_s:
                        break
                    backoff_s = max(backoff_s, REFUSED_RETRY_S)
                    self.refused = None
                    backoff_s = await _back_off(backoff_s)
                    continue
                first_refusal = None
                if trio.current_time() - began >= STEADY_SESSION_S:
                    backoff_s = BACKOFF_START_S  # it served a while: come back at once
                else:  # closed soon after connecting (replaced, refused...): back off
                    backoff_s = await _back_off(backoff_s)
            nursery.cancel_scope.cancel()

    async def drain(self, grace_s: float) -> None:
        """Take no new work; wait up to grace_s for held assignments to finish and go out."""
        self._draining = True
        if self.host is not None:
            self.host.drain()
        # Between connections nothing is held (a lost connection stops its decodes),
        # so a worker that is not connected has nothing to wait for.
        with trio.move_on_after(grace_s):
            while self.host is not None and (self.host.worker.holds() or self._outbox_busy()):
                await trio.sleep(0.02)

    def _outbox_busy(self) -> bool:
        return self._outbox is not None and len(self._outbox) > 0

    async def _pace(self) -> None:
        outbox = self._outbox
        if outbox is not None:
            await outbox.wait_below(outbox.limit // 2)

    def _emit(self, events: list[DecoderEvent]) -> None:
        if self.host is not None:
            self.host.on_decoder_events(events)
        # else: between connections; the new epoch never started these

    async def _register(self, stream: trio.SocketStream, frames: FrameStream) -> int | None:
        """Ask the router for an epoch; None if it did not answer (or refused: then
        `refused` says why and the worker stops)."""
        worker_id = self.config.worker_id
        try:
            await stream.send_all(encode_frame(Register(worker_id, self.takeover)))
            reply: list[AnyWireMessage] | None = None
            with trio.move_on_after(self.limits.registration_timeout_s):
                reply = await frames.receive()
        except (LinkClosed, trio.BrokenResourceError, trio.ClosedResourceError) as error:
            log.warning("registering as %s failed: %s", worker_id, error)
            return None
        if reply is None:
            log.warning("the router did not answer the registration of %s", worker_id)
            return None
        answer = reply[0]
        if isinstance(answer, Refused):
            log.error("the router refused worker id %s: %s", worker_id, answer.reason)
            self.refused = answer.reason
            return None
        if not isinstance(answer, Registered) or answer.worker_id != worker_id:
            log.warning("the router answered the registration with %r", answer)
            return None
        return answer.epoch

    async def _session(self, stream: trio.SocketStream) -> None:
        frames = FrameStream(stream, self.limits.max_frame_bytes)
        epoch = await self._register(stream, frames)
        if epoch is None:
            with trio.CancelScope(shield=True):
                await stream.aclose()
            return
        config = msgspec.structs.replace(self.config, epoch=epoch)
        outbox: Mailbox[AnyWireMessage] = Mailbox(self.limits.send_queue_messages)
        host = WorkerHost(config, self.decoder, outbox.put)
        self.host, self._outbox = host, outbox
        self.sessions += 1
        reason = "closed"
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(host.run)
                if self._draining:
                    host.drain()
                log.info(
                    "connected to %s:%d as %s epoch %d",
                    *self.address,
                    config.worker_id,
                    config.epoch,
                )
                self.connected.set()
                nursery.start_soon(_cancel_when, host.uplink_failed, nursery.cancel_scope)
                reason = await run_connection(stream, frames, outbox, partial(_pass_to_host, host))
                nursery.cancel_scope.cancel()
        finally:
            if host.uplink_failed.is_set():
                reason = "send queue full: the router is not keeping up"
            log.warning(
                "connection to the router ended (%s); epoch %d is over", reason, config.epoch
            )
            host.stop_all()
            self.host, self._outbox = None, None
            with trio.CancelScope(shield=True):
                await stream.aclose()


async def _back_off(backoff_s: float) -> float:
    """Wait between half and all of backoff_s (the jitter keeps many workers from
    coming back in step); returns the next wait, doubled up to the cap."""
    await trio.sleep(backoff_s * random.uniform(0.5, 1.0))
    return min(BACKOFF_CAP_S, backoff_s * 2)


def _pass_to_host(host: WorkerHost, messages: list[AnyWireMessage]) -> None:
    for message in messages:
        if not isinstance(message, ToWorker):
            raise LinkClosed(f"the router sent {type(message).__name__}, a worker's message")
        host.from_router(message)


async def _cancel_when(event: trio.Event, scope: trio.CancelScope) -> None:
    await event.wait()
    scope.cancel()
