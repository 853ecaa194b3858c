"""One TCP link between a router and a worker, as both sides use it.

The wire is length-prefixed msgpack frames of the core's wire messages
(core/wire.py). This module owns what the two sides share: the limits of a
link (TransportLimits), whole messages out of a byte stream (FrameStream),
the loop that writes a link's outbox and reads its frames until either
direction ends (run_connection), a registered connection's handle (Link) and
how a connection, TLS or not, is closed. The router side is tcp_router.py,
the worker side tcp_worker.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

from adapters.runtime.loop import Mailbox
from core.protocol import AnyWireMessage
from core.wire import DEFAULT_MAX_FRAME_BYTES, FrameReader, WireError, encode_frame

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


class Link:
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


async def close_connection(stream: trio.abc.Stream, raw: trio.SocketStream) -> None:
    """Close a connection, TLS or not; a TLS goodbye the peer does not take within a
    second is cut short."""
    with trio.CancelScope(shield=True):
        with trio.move_on_after(1.0):
            await stream.aclose()
        await raw.aclose()
