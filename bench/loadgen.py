"""A streaming chat client for load runs: trio sockets, h11, SSE, timestamps.

One call of `stream_chat` is one client request: it records when the first
content arrived, the gaps between content chunks, the usage the server
reported, and how it ended. Clients can read slowly (a small receive buffer
and a pause between reads) or hang up after a few chunks, to stand in for
the clients a real server meets. Loopback only: the bench passes 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field
from typing import Any

import h11
import trio

RECEIVE_BYTES = 65_536


@dataclass
class StreamResult:
    status: int = 0
    ttft_s: float | None = None  # request sent -> first non-empty content delta
    gaps_s: list[float] = field(default_factory=list)  # between content chunks
    completion_tokens: int = 0  # as the server's usage says; see tokens
    prompt_tokens: int = 0  # as the server's usage says (0: it sent none)
    content_chunks: int = 0
    content: str = ""  # the streamed text, every delta joined
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None  # the OpenAI error's code, when the server sent one
    done: bool = False  # saw data: [DONE]
    hung_up: bool = False  # this client disconnected on purpose
    elapsed_s: float = 0.0


def tokens_of(result: StreamResult) -> int:
    """Completion tokens: the server's usage, or for a server that sends none (one token
    per chunk, as llama-cpp-python streams) the content chunks."""
    return result.completion_tokens or result.content_chunks


@dataclass(frozen=True)
class ClientBehaviour:
    slow_read_s: float | None = None  # pause between reads of slow_read_bytes
    slow_read_bytes: int = 1024
    receive_buffer: int | None = None  # SO_RCVBUF, set before connecting
    hang_up_after: int | None = None  # content chunks, then close the socket


FAST = ClientBehaviour()


async def _connect(host: str, port: int, receive_buffer: int | None) -> trio.SocketStream:
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect((host, port))
    return trio.SocketStream(sock)


async def stream_chat(
    host: str,
    port: int,
    body: dict[str, Any],
    behaviour: ClientBehaviour = FAST,
    timeout_s: float = 300.0,
) -> StreamResult:
    result = StreamResult()
    payload = json.dumps(body | {"stream": True, "stream_options": {"include_usage": True}})
    began = trio.current_time()
    last: float | None = None
    chunks = 0
    with trio.move_on_after(timeout_s) as scope:
        stream = await _connect(host, port, behaviour.receive_buffer)
        try:
            conn = h11.Connection(h11.CLIENT)
            await stream.send_all(_post(conn, f"{host}:{port}", payload.encode()))
            buffer = b""
            body_bytes = b""
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    if behaviour.slow_read_s is not None:
                        await trio.sleep(behaviour.slow_read_s)
                        data = await stream.receive_some(behaviour.slow_read_bytes)
                    else:
                        data = await stream.receive_some(RECEIVE_BYTES)
                    conn.receive_data(data)
                    continue
                if isinstance(event, h11.Response):
                    result.status = event.status_code
                elif isinstance(event, h11.Data):
                    if result.status != 200:
                        body_bytes += event.data
                        continue
                    buffer += event.data
                    *frames, buffer = buffer.split(b"\n\n")
                    for frame in frames:
                        now = trio.current_time()
                        if _on_frame(frame, result):
                            if result.ttft_s is None:
                                result.ttft_s = now - began
                            elif last is not None:
                                result.gaps_s.append(now - last)
                            last = now
                            chunks += 1
                            result.content_chunks += 1
                    if behaviour.hang_up_after is not None and chunks >= behaviour.hang_up_after:
                        result.hung_up = True
                        break
                elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                    break
            if result.status != 200 and result.error is None:
                result.error = body_bytes.decode(errors="replace")[:200] or f"HTTP {result.status}"
        except (trio.BrokenResourceError, h11.RemoteProtocolError, OSError) as error:
            result.error = f"{type(error).__name__}: {error}"
        finally:
            await stream.aclose()
    if scope.cancelled_caught:
        result.error = f"timed out after {timeout_s}s"
    result.elapsed_s = trio.current_time() - began
    return result


def _post(conn: h11.Connection, host: str, payload: bytes) -> bytes:
    """The bytes of one POST of `payload` to the chat endpoint, asking to close after."""
    request = h11.Request(
        method="POST",
        target="/v1/chat/completions",
        headers=[
            ("Host", host),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(payload))),
            ("Connection", "close"),
        ],
    )
    return (
        conn.send(request) + conn.send(h11.Data(payload)) + (conn.send(h11.EndOfMessage()) or b"")
    )


def _on_frame(frame: bytes, result: StreamResult) -> bool:
    """Apply one SSE frame; True when it carried content."""
    if not frame.startswith(b"data: "):
        return False
    data = frame[6:]
    if data == b"[DONE]":
        result.done = True
        return False
    event = json.loads(data)
    if "error" in event:
        result.error = event["error"].get("message", "error")
        result.error_code = event["error"].get("code")
        return False
    if event.get("usage"):
        result.completion_tokens = event["usage"]["completion_tokens"]
        result.prompt_tokens = event["usage"].get("prompt_tokens", 0)
    content = False
    for choice in event.get("choices", []):
        text = choice.get("delta", {}).get("content")
        if text:
            content = True
            result.content += text
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]
    return content
