"""Remote workers over TCP, the worker side: a worker process's links (RemoteWorker).

One worker machine and one decoder for the whole process, and one connection
task per router address. The addresses come from the --connect names,
resolved again every few seconds, so a name that stands for several routers
(a headless Service) links the worker to each of them and follows them as
they come and go. Each connection registers and learns the router's id and
the epoch that router hands out (Registered), which becomes a link of the
worker machine (RouterLinked); its frames are that router's messages; when it
ends, that router's assignments stop decoding (RouterUnlinked) and the others
go on. Each connection retries with exponential backoff with jitter (50 ms
doubling to 30 s; reset only by a session that lasted 10 s, so a worker that
is replaced or closed at once does not storm the router); each registration
is a fresh epoch, so no host clock matters. Refused (the id is taken there),
it asks again for a grace period, then the process stops and says why
(`fencepost worker` exits 2), unless it serves other routers meanwhile (see
RemoteWorker._connection). The framing and the connection loop are shared
with the router side (tcp_link.py); the router side is tcp_router.py.
"""

from __future__ import annotations

import contextlib
import logging
import random
import socket
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import msgspec
import trio

from adapters.runtime.tcp_link import (
    FrameStream,
    Link,
    LinkClosed,
    TransportLimits,
    close_connection,
    run_connection,
)
from adapters.runtime.tls import Credentials, failure
from adapters.runtime.worker_host import Decoder, WorkerHost
from core.protocol import AnyWireMessage, FromWorker, Refused, Register, Registered, ToWorker
from core.wire import encode_frame
from core.worker import WorkerConfig

log = logging.getLogger("fencepost.tcp")


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


class RouterLink(Link):
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
        await close_connection(stream, raw)
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
            await close_connection(stream, raw)
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
            await close_connection(stream, raw)
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
