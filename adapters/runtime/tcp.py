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

Worker side (RemoteWorker): one worker machine and one decoder for the whole
process, and one connection task per router address. The addresses come from
the --connect names, resolved again every few seconds, so a name that stands
for several routers (a headless Service) links the worker to each of them and
follows them as they come and go. Each connection registers and learns the
router's id and the epoch that router hands out (Registered), which becomes a
link of the worker machine (RouterLinked); its frames are that router's
messages; when it ends, that router's assignments stop decoding
(RouterUnlinked) and the others go on. Each connection retries with
exponential backoff with jitter (50 ms doubling to 30 s; reset only by a
session that lasted 10 s, so a worker that is replaced or closed at once does
not storm the router); each registration is a fresh epoch, so no host clock
matters. Refused (the id is taken there), it asks again for a grace period,
then the process stops and says why (`fencepost worker` exits 2), unless it
serves other routers meanwhile (see RemoteWorker._connection).
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

import msgspec
import trio

from adapters.runtime.controller import Controller
from adapters.runtime.loop import Mailbox
from adapters.runtime.tls import Credentials, allows, failure, peer_name
from adapters.runtime.worker_host import Decoder, WorkerHost
from core.protocol import (
    AnyWireMessage,
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
    # Worker side: a router whose host vanished (power, network) sends no FIN or RST,
    # and its link would hold the worker's slots until TCP gives up on the
    # connection, which by Linux defaults takes about fifteen minutes. The worker
    # writes a heartbeat on every link each interval, so bytes left unacknowledged
    # this long mean the router is gone (TCP_USER_TIMEOUT); keepalive probes cover a
    # link with nothing to write. None leaves the system's defaults.
    router_silence_s: float | None = 10.0


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


class _Link:
    """One registered connection, either side: its epoch, its bounded outbox, the scope
    of its tasks, and why it ended (the first reason given)."""

    def __init__(self, epoch: int, limit: int) -> None:
        self.epoch = epoch
        self.outbox: Mailbox[AnyWireMessage] = Mailbox(limit)
        self.scope = trio.CancelScope()
        self.reason: str | None = None

    def close(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.outbox.close()
        self.scope.cancel()


class TcpLink(_Link):
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
        await _close(stream, raw)


async def _refuse(
    controller: Controller, stream: trio.abc.Stream, worker_id: str, reason: str
) -> LinkClosed:
    """Tell the peer why its registration is refused (a second at most); the error that
    ends its connection."""
    with trio.move_on_after(1.0):
        router_id = controller.router.config.router_id
        await stream.send_all(encode_frame(Refused(worker_id, reason, router_id)))
    return LinkClosed(f"refused as {worker_id}: {reason}")


async def _close(stream: trio.abc.Stream, raw: trio.SocketStream) -> None:
    """Close a connection, TLS or not; a TLS goodbye the peer does not take within a
    second is cut short."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(1.0):
            await stream.aclose()
        await raw.aclose()


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

Address = tuple[str, int]
Resolve = Callable[[str, int], Awaitable[set[Address]]]


async def resolve_addresses(host: str, port: int) -> set[Address]:
    """Every TCP address a name stands for (a headless Service: one per router)."""
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    return {(str(info[4][0]), int(info[4][1])) for info in infos}


class RouterLink(_Link):
    """The worker's side of one registered connection: to router `router_id`."""

    def __init__(self, router_id: str, epoch: int, address: Address, limit: int) -> None:
        super().__init__(epoch, limit)
        self.router_id = router_id
        self.address = address


class RemoteWorker:
    """A worker process: one worker machine and decoder, linked to every router found."""

    def __init__(
        self,
        targets: Sequence[Address],
        config: WorkerConfig,
        decoder: Decoder,
        limits: TransportLimits | None = None,
        takeover: bool = False,
        refused_grace_s: float = 10.0,
        resolve_interval_s: float = 5.0,
        resolve: Resolve = resolve_addresses,
        tls: Credentials | None = None,
    ) -> None:
        self.targets = list(dict.fromkeys(targets))
        self.tls = tls  # from tls.client_context: the router must show a certificate for its name
        self.takeover = takeover
        self.refused_grace_s = refused_grace_s
        self.resolve_interval_s = resolve_interval_s
        self._resolve = resolve
        self.refused: str | None = None  # a router refused our id and nobody else took us
        self.config = msgspec.structs.replace(config, router=None)  # routers join as links
        self.decoder = decoder
        self.limits = limits or TransportLimits()
        self.host = WorkerHost(self.config, decoder, self._send)
        self.links: dict[str, RouterLink] = {}  # router id -> its registered connection
        self.addresses: set[Address] = set()  # what the targets resolve to now
        self._resolved: dict[Address, set[Address]] = {}  # target -> its last good answer
        self._dialing: set[Address] = set()  # addresses with a connection task
        self._stop = trio.Event()
        self.connected = trio.Event()  # some router registered us
        self.decoding = False  # the decoder runs (readiness)
        self.sessions = 0

    async def run(self) -> None:
        """Serve until a refusal stops the worker (or until cancelled)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.decoder.run, self.host.on_decoder_events, self._pace)
            await nursery.start(self.host.run)
            self.decoding = True
            try:
                while not self._stop.is_set():
                    await self._resolve_targets()
                    for address in sorted(self.addresses - self._dialing):
                        self._dialing.add(address)
                        nursery.start_soon(self._connection, address)
                    with trio.move_on_after(self.resolve_interval_s):
                        await self._stop.wait()
            finally:
                self.decoding = False
                self.host.stop_all()
            nursery.cancel_scope.cancel()

    def ready(self) -> bool:
        """The decoder runs and at least one router has registered this worker."""
        return self.decoding and bool(self.links)

    async def drain(self, grace_s: float, handoff: bool = True) -> None:
        """Take no new work; with `handoff` give the held assignments back to their
        routers to continue elsewhere (core/worker.py), otherwise let them finish here;
        wait up to grace_s for every one to end and its last frames to go out."""
        self.host.drain(handoff)
        # A lost link stops its decodes, so whatever is held belongs to a live link.
        with trio.move_on_after(grace_s):
            while self.host.worker.holds() or self._outboxes_busy():
                await trio.sleep(0.02)

    def _outboxes_busy(self) -> bool:
        return any(len(link.outbox) > 0 for link in self.links.values())

    async def _resolve_targets(self) -> None:
        for target in self.targets:
            try:
                found = await self._resolve(*target)
            except OSError as error:  # keep the last answer: a DNS hiccup is not a router's death
                log.warning("cannot resolve %s:%d: %s", *target, error)
                continue
            if found != self._resolved.get(target) and found != {target}:  # a name's answer
                shown = ", ".join(f"{h}:{p}" for h, p in sorted(found))
                log.info("%s:%d is %s", *target, shown or "nothing")
            self._resolved[target] = found
        self.addresses = set().union(*self._resolved.values())

    async def _pace(self) -> None:
        """Return once every link's outbox is under half full (the decoder waits for
        the slowest router rather than overfill its link)."""
        for link in list(self.links.values()):
            await link.outbox.wait_below(link.outbox.limit // 2)

    def _send(self, message: FromWorker, router_id: str) -> None:
        link = self.links.get(router_id)
        if link is None:
            return  # that link is gone, and so is whoever would read this
        if not link.outbox.put(message):
            link.close("send queue full: the router is not keeping up")

    async def _connection(self, address: Address) -> None:
        """Keep one router address linked: connect, serve, reconnect with backoff;
        ends when the address no longer resolves (after its connection ended) or the
        worker stops.

        A refusal means the router has a live worker of our id. When it names a
        router this worker is linked to already, the address is a second way to
        the same router (a name resolving to two of its addresses): nothing is
        wrong, and it is asked again only now and then, in case the link ends.
        Otherwise the id may be our own previous process's, not yet seen dead (a
        host that rebooted sends no FIN): ask again for refused_grace_s. Past
        that, a worker that serves no router stops (exit 2, as with one router);
        one that serves others goes on, asking slowly, with a loud log line.
        """
        backoff_s = BACKOFF_START_S
        first_refusal: float | None = None
        try:
            while not self._stop.is_set() and address in self.addresses:
                try:
                    stream = await trio.open_tcp_stream(*address)
                except OSError as error:
                    log.warning("cannot reach the router at %s:%d: %s", *address, error)
                    backoff_s = await _back_off(backoff_s)
                    continue
                notice_silence(stream, self.limits.router_silence_s)
                secured = await self._secure(stream, address)
                if secured is None:
                    backoff_s = await _back_off(backoff_s)
                    continue
                began = trio.current_time()
                refusal = await self._session(secured, stream, address)
                now = trio.current_time()
                if isinstance(refusal, Refused) and refusal.router_id in self.links:
                    first_refusal = None
                    log.info(
                        "%s:%d reaches router %s, linked already through another address",
                        *address, refusal.router_id,
                    )  # fmt: skip
                    backoff_s = await _back_off(BACKOFF_CAP_S)
                    continue
                if refusal is not None:
                    reason = refusal.reason
                    first_refusal = now if first_refusal is None else first_refusal
                    if now - first_refusal >= self.refused_grace_s:
                        if not self.links:
                            self.refused = reason
                            self._stop.set()
                            return
                        log.error(
                            "the router at %s:%d keeps refusing worker id %s (%s) while "
                            "routers %s have it: a second address of one of them, or "
                            "another process with our id there",
                            *address, self.config.worker_id, reason, sorted(self.links),
                        )  # fmt: skip
                        backoff_s = BACKOFF_CAP_S
                    backoff_s = await _back_off(max(backoff_s, REFUSED_RETRY_S))
                    continue
                first_refusal = None
                if now - began >= STEADY_SESSION_S:
                    backoff_s = BACKOFF_START_S  # it served a while: come back at once
                else:  # closed soon after connecting (replaced, refused...): back off
                    backoff_s = await _back_off(backoff_s)
        finally:
            self._dialing.discard(address)

    async def _secure(self, raw: trio.SocketStream, address: Address) -> trio.abc.Stream | None:
        """The connection as the session uses it: TLS once the handshake passed (None,
        logged, if it failed), or the plain socket."""
        if self.tls is None:
            return raw
        # the name the address was found under: what the router's certificate must be for
        found = (target for target, got in self._resolved.items() if address in got)
        name = next(found, address)[0]
        stream = trio.SSLStream(raw, self.tls.context(), server_hostname=name)
        error: str = "no answer within the registration timeout"
        with trio.move_on_after(self.limits.registration_timeout_s):
            try:
                await stream.do_handshake()
                return stream
            except trio.BrokenResourceError as broken:
                error = failure(broken)
        log.error("TLS with the router %s at %s:%d failed: %s", name, *address, error)
        await _close(stream, raw)
        return None

    async def _register(
        self, stream: trio.abc.Stream, frames: FrameStream, address: Address
    ) -> Registered | Refused | None:
        """Ask the router for an epoch; None if it did not answer sensibly."""
        worker_id = self.config.worker_id
        where = "{}:{}".format(*address)
        try:
            await stream.send_all(encode_frame(Register(worker_id, self.takeover)))
            reply: list[AnyWireMessage] | None = None
            with trio.move_on_after(self.limits.registration_timeout_s):
                reply = await frames.receive()
        except (LinkClosed, trio.BrokenResourceError, trio.ClosedResourceError) as error:
            log.warning("registering as %s at %s failed: %s", worker_id, where, error)
            return None
        if reply is None:
            log.warning("the router at %s did not answer the registration of %s", where, worker_id)
            return None
        answer = reply[0]
        if isinstance(answer, Refused):
            log.error("the router at %s refused worker id %s: %s", where, worker_id, answer.reason)
            return answer
        if not isinstance(answer, Registered) or answer.worker_id != worker_id:
            log.warning("the router at %s answered the registration with %r", where, answer)
            return None
        return answer

    async def _session(
        self, stream: trio.abc.Stream, raw: trio.SocketStream, address: Address
    ) -> Refused | None:
        """Serve one connection to its end; the refusal if it was refused."""
        frames = FrameStream(stream, self.limits.max_frame_bytes)
        answer = await self._register(stream, frames, address)
        if not isinstance(answer, Registered):
            await _close(stream, raw)
            return answer if isinstance(answer, Refused) else None
        router_id, epoch = answer.router_id, answer.epoch
        link = RouterLink(router_id, epoch, address, self.limits.send_queue_messages)
        old = self.links.get(router_id)
        if old is not None:
            # The router registered us again, so it let the old connection go (a
            # takeover, or one it stopped hearing from): one link per router, the newer.
            old.close(f"router {router_id} registered us again from {address[0]}:{address[1]}")
        self.links[router_id] = link
        self.sessions += 1
        self.host.link(router_id, epoch)  # its first heartbeat goes out now
        self.connected.set()
        log.info(
            "linked to router %s at %s:%d as %s epoch %d (%d routers)",
            router_id or "(unnamed)", *address, self.config.worker_id, epoch, len(self.links),
        )  # fmt: skip
        reason = "closed"
        try:
            with link.scope:
                reason = await run_connection(
                    stream, frames, link.outbox, partial(self._from_router, router_id)
                )
        finally:
            reason = link.reason or reason
            link.close(reason)
            if self.links.get(router_id) is link:
                del self.links[router_id]
                self.host.unlink(router_id, reason)  # its assignments stop decoding
            log.warning(
                "link to router %s at %s:%d ended (%s); epoch %d is over",
                router_id or "(unnamed)", *address, reason, epoch,
            )  # fmt: skip
            await _close(stream, raw)
        return None

    def _from_router(self, router_id: str, messages: list[AnyWireMessage]) -> None:
        for message in messages:
            if not isinstance(message, ToWorker):
                raise LinkClosed(f"the router sent {type(message).__name__}, a worker's message")
            self.host.from_router(message, router_id)


def notice_silence(stream: trio.SocketStream, silence_s: float | None) -> None:
    """Have the kernel end the connection when the peer stops acknowledging for about
    silence_s (Linux: TCP_USER_TIMEOUT, and keepalive probes for an idle link); where
    an option is missing, the system's default stays."""
    if silence_s is None:
        return
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    names = ("TCP_USER_TIMEOUT", "TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT")
    values = (int(silence_s * 1000), max(1, int(silence_s / 2)), max(1, int(silence_s / 6)), 3)
    for name, value in zip(names, values, strict=True):
        option = getattr(socket, name, None)
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    for level, option, value in options:
        with contextlib.suppress(OSError):
            stream.setsockopt(level, option, value)


async def _back_off(backoff_s: float) -> float:
    """Wait between half and all of backoff_s (the jitter keeps many workers from
    coming back in step); returns the next wait, doubled up to the cap."""
    await trio.sleep(backoff_s * random.uniform(0.5, 1.0))
    return min(BACKOFF_CAP_S, backoff_s * 2)
