"""Remote workers over TCP, the router side: the worker port (serve_workers).

Every connection must open with Register, which names the worker id. The
router hands out the epoch (Registered), or, when a live worker already serves
under that id and this is no takeover, answers Refused and closes; the
connection then belongs to that (worker id, epoch), and any older connection
of the id is closed. Frames pass to the controller as they arrive. A malformed
frame, a frame of the wrong direction, or a silent opening closes that
connection alone, with the reason logged; the controller then hears
WorkerGone and fails over or ends that worker's assignments.

Messages to a worker wait in a bounded outbox drained by one writer task; when
the outbox is full the worker is not keeping up, and its connection is closed
rather than allowed to grow memory. The framing and the connection loop are
shared with the worker side (tcp_link.py); the worker side is tcp_worker.py.
"""

from __future__ import annotations

import logging
import math
from functools import partial

import trio

from adapters.runtime.controller import Controller
from adapters.runtime.tcp_link import (
    FrameStream,
    Link,
    LinkClosed,
    TransportLimits,
    close_connection,
    run_connection,
)
from adapters.runtime.tls import Credentials, allows, failure, peer_name
from core.protocol import AnyWireMessage, FromWorker, Refused, Register, Registered
from core.wire import encode_frame

log = logging.getLogger("fencepost.tcp")


class TcpLink(Link):
    """The controller's handle on one worker connection."""

    def __init__(self, worker_id: str, epoch: int, limit: int) -> None:
        super().__init__(epoch, limit)
        self.worker_id = worker_id

    def send(self, message: AnyWireMessage) -> bool:
        return self.outbox.put(message)


async def serve_workers(
    controller: Controller,
    host: str,
    port: int,
    limits: TransportLimits | None = None,
    *,
    tls: Credentials | None = None,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept remote workers on host:port until cancelled; reports the bound port.
    With `tls` (made with tls.server_context), a connection must pass a mutual TLS handshake
    and register under an id its certificate allows before anything else."""
    limits = limits or TransportLimits()
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()[1]
    log.info("accepting workers on %s:%d%s", host, bound, " (mutual TLS)" if tls else "")
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
            await _serve_connection(controller, stream, limits, census, tls)
        finally:
            census.open -= 1

    await trio.serve_listeners(handler, listeners)


class _Census:
    """Connections open on the worker port, and rate-limited logs of refusals: of
    connections over the caps, and of peers that failed to authenticate."""

    PEERS_REMEMBERED = 1024  # refused peers whose counts are kept (oldest forgotten)

    def __init__(self) -> None:
        self.open = 0
        self.unregistered = 0
        self.refused = 0
        self._logged_at = -math.inf
        # (host, kind of refusal) -> [refused, last logged]
        self.impostors: dict[tuple[str, str], list[float]] = {}

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

    def note_impostor(self, host: str, kind: str, why: str) -> None:
        """A peer refused for its credentials: logged once per 10 s per host and kind of
        refusal (each TLS failure OpenSSL names, the wrong identity, a timeout), with a
        count."""
        now = trio.current_time()
        seen = self.impostors.pop((host, kind), None) or [0, -math.inf]
        seen[0] += 1
        if now - seen[1] >= 10.0:
            log.warning("refused a worker connection from %s: %s (%d so far)", host, why, seen[0])
            seen[1] = now
        self.impostors[host, kind] = seen  # most recent last
        if len(self.impostors) > self.PEERS_REMEMBERED:
            del self.impostors[next(iter(self.impostors))]


async def _serve_connection(
    controller: Controller,
    raw: trio.SocketStream,
    limits: TransportLimits,
    census: _Census,
    tls: Credentials | None,
) -> None:
    try:
        host, port = raw.socket.getpeername()[:2]
        peer = f"{host}:{port}"
    except OSError:
        host = peer = "unknown peer"
    stream: trio.abc.Stream = raw
    link: TcpLink | None = None
    reason = "closed"
    registering = True
    try:
        certified: str | None = None
        handshaken = tls is None
        first: list[AnyWireMessage] | None = None
        frames = FrameStream(raw, limits.registration_frame_bytes)
        # One deadline for the handshake and the Register both.
        with trio.move_on_after(limits.registration_timeout_s):
            if tls is not None:
                stream = frames.stream = trio.SSLStream(raw, tls.context(), server_side=True)
                try:
                    await stream.do_handshake()
                except trio.BrokenResourceError as error:
                    why = failure(error)
                    census.note_impostor(host, why, why)
                    raise LinkClosed(f"refused: TLS handshake failed: {why}") from None
                certified, handshaken = peer_name(stream), True
            first = await frames.receive()
        if not handshaken:
            census.note_impostor(
                host, "timeout", "no TLS handshake within the registration timeout"
            )
            raise LinkClosed("refused: no TLS handshake within the registration timeout")
        census.unregistered -= 1
        registering = False
        if first is None:
            raise LinkClosed("no Register within the registration timeout")
        hello = first[0]
        if not isinstance(hello, Register):
            raise LinkClosed(f"opened with {type(hello).__name__}, not a Register")
        if tls is not None and not allows(certified, hello.worker_id):
            why = f"its certificate ({certified!r}) does not name worker id {hello.worker_id!r}"
            census.note_impostor(host, "identity", why)
            raise await _refuse(controller, stream, hello.worker_id, why)
        answer = controller.register(hello.worker_id, hello.takeover)
        if answer.epoch is None:
            raise await _refuse(controller, stream, hello.worker_id, answer.reason)
        link = TcpLink(hello.worker_id, answer.epoch, limits.send_queue_messages)
        if not controller.attach(link):
            raise LinkClosed(f"worker {hello.worker_id} epoch {answer.epoch} is not newer")
        router_id = controller.router.config.router_id
        link.send(Registered(hello.worker_id, answer.epoch, router_id))
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
        await close_connection(stream, raw)


async def _refuse(
    controller: Controller, stream: trio.abc.Stream, worker_id: str, reason: str
) -> LinkClosed:
    """Tell the peer why its registration is refused (a second at most); the error that
    ends its connection."""
    with trio.move_on_after(1.0):
        router_id = controller.router.config.router_id
        await stream.send_all(encode_frame(Refused(worker_id, reason, router_id)))
    return LinkClosed(f"refused as {worker_id}: {reason}")


def _pass_to_controller(
    controller: Controller, link: TcpLink, messages: list[AnyWireMessage]
) -> None:
    for message in messages:
        if not isinstance(message, FromWorker):
            raise LinkClosed(f"a worker sent {type(message).__name__}, a router's message")
        controller.from_worker(link.worker_id, message)
        if link.reason is not None:
            raise LinkClosed(link.reason)  # closed meanwhile (replaced, or its queue filled)
