"""The HTTP port's front door: a request without a key is refused before Hypercorn sees it.

Hypercorn spends about half a millisecond of CPU on a connection before the
application's first line runs (its protocol objects, h11's parser, the ASGI
scope, a task group), which made a flood of keyless requests saturate the
router's event loop at about 1,000 a second. So the router accepts its HTTP
connections itself. A connection's first request head (the bytes up to the
blank line, up to 64 KiB) is read here and judged:

- a well-formed HTTP/1.x head for a path that needs a key, with no accepted
  key in its one Authorization header, is answered the same 401 as the ASGI
  check gives (auth.py), byte for byte in its body, and closed;
- everything else (the right key, an open path, an open port, HTTP/2, a
  head this parser does not vouch for) is handed to Hypercorn unchanged:
  the bytes read so far are replayed ahead of the socket's, and the ASGI
  check in FencepostApp.asgi still judges every request, including the later
  ones of a keep-alive connection.

So the front door can only refuse earlier what the application would
refuse; it never admits anything the application would not. With no key
configured nothing is read here and every connection goes to Hypercorn at once.

A refusal closes gracefully: the answer, then end-of-file, then up to 64 KiB
or 1 s of what the client still sends is read and dropped, so the kernel
does not reset the connection (which can destroy the answer in flight) for
unread bytes of a body that was never wanted.

The rest mirrors Hypercorn's own trio worker (hypercorn.trio.run.worker_serve,
which offers no hook between accept and protocol): the app's lifespan, one
task per connection, and on shutdown a grace period for open responses.
"""

from __future__ import annotations

import email.utils
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any
from urllib.parse import unquote

import trio
from hypercorn.config import Config
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app

from adapters.openai.auth import REFUSAL_BODY, REFUSAL_HEADERS, ApiKeys

HEAD_LIMIT = 64 * 1024  # above h11's 16 KiB for an incomplete head: a longer one
# that arrives whole is taken by h11, and padding must not get past the door
LINGER_BYTES = 64 * 1024
LINGER_S = 1.0
_STATUS_AND_HEADERS = b"HTTP/1.1 401 Unauthorized\r\n" + b"".join(
    name + b": " + value + b"\r\n" for name, value in REFUSAL_HEADERS
)


def request_path(head: bytes) -> tuple[str, bytes | None] | None:
    """(path, the Authorization value) of an HTTP/1.x request head, or None
    when the head is not one this parser vouches for (then Hypercorn judges)."""
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        return None
    target = parts[1]
    if not target.startswith(b"/"):
        return None  # absolute or asterisk form: rare, left to Hypercorn
    authorization: bytes | None = None
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            return None  # malformed or folded: Hypercorn answers it
        if name.lower() == b"authorization":
            if authorization is not None:
                return None  # two of them: which one counts is Hypercorn's call
            authorization = value.strip()
    path = target.split(b"?", 1)[0].split(b"#", 1)[0]
    try:
        return unquote(path.decode("ascii"), errors="strict"), authorization
    except UnicodeError:
        return None


class _Replayed(trio.abc.HalfCloseableStream):
    """A socket stream whose first bytes, already read by the front door, are
    read again: what Hypercorn's TCPServer receives is what the client sent."""

    def __init__(self, stream: trio.SocketStream, first: bytes) -> None:
        self._stream = stream
        self._first = first
        self.socket = stream.socket  # TCPServer reads the addresses from it

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._first:
            size = len(self._first) if max_bytes is None else max_bytes
            data, self._first = self._first[:size], self._first[size:]
            await trio.lowlevel.checkpoint()
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


class FrontDoor:
    """Judges each connection's first request head; see the module's docstring."""

    def __init__(
        self, keys: ApiKeys, on_refused: Callable[[], None], head_timeout_s: float
    ) -> None:
        self.keys = keys
        self._on_refused = on_refused
        self._head_timeout_s = head_timeout_s
        self._date = (0, b"")

    def refuses(self, head: bytes) -> bool:
        """Whether this request head is one the application would refuse with 401."""
        parsed = request_path(head)
        if parsed is None:
            return False
        path, authorization = parsed
        return self.keys.needs_key(path) and not self.keys.admits(authorization)

    def _answer(self) -> bytes:
        second = int(time.time())
        if self._date[0] != second:  # the Date header, formatted once a second
            self._date = (second, email.utils.formatdate(second, usegmt=True).encode())
        date = b"date: " + self._date[1] + b"\r\nserver: fencepost\r\n\r\n"
        return _STATUS_AND_HEADERS + date + REFUSAL_BODY

    async def first_request(self, stream: trio.SocketStream) -> bytes | None:
        """The bytes to hand on, or None when the connection was refused or ended."""
        received = b""
        with trio.move_on_after(self._head_timeout_s):
            while b"\r\n\r\n" not in received and len(received) <= HEAD_LIMIT:
                try:
                    chunk = await stream.receive_some(HEAD_LIMIT)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return None
                if not chunk:
                    return received or None
                received += chunk
            head = received.split(b"\r\n\r\n", 1)[0]
            if b"\r\n\r\n" not in received or not self.refuses(head):
                return received
            self._on_refused()
            try:
                await stream.send_all(self._answer())
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return None
            await _linger(stream)
            return None
        return None  # no whole head within the time a client may idle: closed


async def _linger(stream: trio.SocketStream) -> None:
    """Read and drop what the client still sends, briefly, so closing does not reset."""
    left = LINGER_BYTES
    with trio.move_on_after(LINGER_S):
        while left > 0:
            try:
                chunk = await stream.receive_some(min(left, 16 * 1024))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if not chunk:
                return
            left -= len(chunk)


async def serve_http(
    app: Callable[..., Awaitable[None]],
    config: Config,
    door: FrontDoor,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve `app` on config.bind through the front door until shutdown_trigger
    returns; then open responses have config.graceful_timeout to finish."""
    wrapped = wrap_app(app, config.wsgi_max_body_size, "asgi")
    state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            sockets = config.create_sockets()
            listeners = []
            binds = []
            for sock in sockets.insecure_sockets:
                sock.listen(config.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
                binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")

            async def connection(stream: trio.SocketStream) -> None:
                first = b"" if door.keys.open else await door.first_request(stream)
                if first is None:
                    await stream.aclose()
                    return
                replayed = _Replayed(stream, first) if first else stream
                state_now = ConnectionState(state.copy())
                await TCPServer(wrapped, config, context, state_now, replayed).run()  # type: ignore[arg-type]

            async with trio.open_nursery() as accepting:
                accepting.start_soon(
                    partial(
                        trio.serve_listeners, connection, listeners, handler_nursery=connections
                    )
                )
                task_status.started(binds)
                await shutdown_trigger()
                accepting.cancel_scope.cancel()  # no new connections
            await context.terminated.set()  # keep-alive connections close after their response
            connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()
