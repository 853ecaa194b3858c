"""The HTTP port's front door (adapters/openai/front.py): keyless requests refused
before Hypercorn, everything else handed to it byte for byte."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from adapters.cli.serve import ServeOptions
from adapters.openai.auth import REFUSAL_BODY, ApiKeys
from adapters.openai.front import FrontDoor, request_path
from tests.support.http_helpers import ServerThread, chat_body

KEY = "sk-front-door-0123456789"


def test_a_head_is_read_for_its_path_and_its_one_authorization() -> None:
    head = b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: a\r\nAUTHORIZATION:  Bearer k \r\n"
    assert request_path(head.rstrip(b"\r\n")) == ("/v1/chat/completions", b"Bearer k")
    assert request_path(b"GET /%68ealth HTTP/1.0\r\nHost: a") == ("/health", None)
    for vouched_for_by_nobody in (
        b"PRI * HTTP/2.0",  # HTTP/2 with prior knowledge
        b"GET http://a/v1/models HTTP/1.1\r\nHost: a",  # absolute form
        b"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer a\r\nauthorization: Bearer b",
        b"GET /v1/models HTTP/1.1\r\nX-A: 1\r\n  folded",
        b"GET /v1/models HTTP/1.1\r\nNo colon here",
        b"GET  /v1/models HTTP/1.1",
        b"GET /v1/%ff HTTP/1.1",
    ):
        assert request_path(vouched_for_by_nobody) is None, vouched_for_by_nobody


def test_the_door_refuses_only_what_the_application_would() -> None:
    door = FrontDoor(ApiKeys([KEY]), lambda: None, 1.0)
    assert door.refuses(b"POST /v1/responses HTTP/1.1\r\nHost: a")
    assert door.refuses(b"GET /metrics HTTP/1.1\r\nAuthorization: Bearer nope")
    assert not door.refuses(f"GET /v1/models HTTP/1.1\r\nAuthorization: Bearer {KEY}".encode())
    assert not door.refuses(b"GET /live HTTP/1.1\r\nHost: a")
    assert not door.refuses(b"PRI * HTTP/2.0")  # left to the ASGI check
    assert not FrontDoor(ApiKeys(), lambda: None, 1.0).refuses(b"POST /v1/responses HTTP/1.1")


@pytest.fixture(scope="module")
def guarded() -> Iterator[tuple[ServerThread, int]]:
    options = ServeOptions(port=0, fake=True, api_keys=(KEY,), keep_alive_timeout_s=1.0)
    with ServerThread(options) as server:
        yield server, int(server.base_url.rsplit(":", 1)[1])


def _request(path: str, body: bytes = b"", key: str | None = KEY, close: bool = False) -> bytes:
    lines = [f"POST {path} HTTP/1.1" if body else f"GET {path} HTTP/1.1", "Host: 127.0.0.1"]
    if key is not None:
        lines.append(f"Authorization: Bearer {key}")
    if body:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    if close:
        lines.append("Connection: close")
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def _responses(sock: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """Read `count` non-streamed responses (each with a Content-Length) off the socket."""
    buffer, found = b"", []
    deadline = time.monotonic() + 20
    while len(found) < count and time.monotonic() < deadline:
        while b"\r\n\r\n" in buffer and len(found) < count:
            head, rest = buffer.split(b"\r\n\r\n", 1)
            lines = head.decode().split("\r\n")
            pairs = (line.split(": ", 1) for line in lines[1:])
            headers = {name.lower(): value for name, value in pairs}
            size = int(headers["content-length"])
            if len(rest) < size:
                break
            found.append((int(lines[0].split()[1]), headers, rest[:size]))
            buffer = rest[size:]
        if len(found) < count:
            chunk = sock.recv(65536)
            if not chunk:
                break
            buffer += chunk
    return found


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=20)


def test_a_keyless_request_is_answered_by_the_door_and_closed(
    guarded: tuple[ServerThread, int],
) -> None:
    _, port = guarded
    with _connect(port) as sock:
        sock.sendall(_request("/v1/chat/completions", json.dumps(chat_body()).encode(), key=None))
        [(status, headers, body)] = _responses(sock, 1)
        assert sock.recv(10) == b""  # closed after the answer, without a reset
    assert status == 401 and body == REFUSAL_BODY
    assert headers["server"] == "fencepost"  # the door's answer, not Hypercorn's
    assert headers["www-authenticate"].startswith("Bearer") and headers["connection"] == "close"


def test_a_keyed_connection_is_handed_on_whole_and_each_later_request_still_checked(
    guarded: tuple[ServerThread, int],
) -> None:
    _, port = guarded
    chat = json.dumps(chat_body(max_tokens=3)).encode()
    with _connect(port) as sock:
        # Three requests in one write: the door reads them all with the first head,
        # and Hypercorn must still see every byte of them, in order.
        sock.sendall(_request("/v1/chat/completions", chat) + _request("/v1/models")
                     + _request("/health", key=None))  # fmt: skip
        answers = _responses(sock, 3)
        assert [status for status, _, _ in answers] == [200, 200, 200], answers
        assert json.loads(answers[0][2])["choices"][0]["message"]["content"]
        assert json.loads(answers[1][2])["data"][0]["id"] == "fake"
        # The same connection, a request without the key: the application refuses it.
        sock.sendall(_request("/v1/models", key=None))
        [(status, headers, body)] = _responses(sock, 1)
    assert status == 401 and body == REFUSAL_BODY
    assert headers["server"] != "fencepost"  # Hypercorn's answer: the ASGI check refused it


def test_a_head_sent_a_byte_at_a_time_is_served(guarded: tuple[ServerThread, int]) -> None:
    _, port = guarded
    with _connect(port) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for byte in _request("/v1/models", close=True):
            sock.send(bytes([byte]))
        [(status, _, body)] = _responses(sock, 1)
    assert status == 200 and b'"fake"' in body


def test_what_the_door_does_not_vouch_for_is_answered_by_hypercorn(
    guarded: tuple[ServerThread, int],
) -> None:
    _, port = guarded
    padded = b"X-Pad: " + b"a" * 20_000 + b"\r\nHost:"
    with _connect(port) as sock:  # a long head, whole: the door reads and refuses it
        sock.sendall(_request("/v1/models", key=None).replace(b"Host:", padded))
        [(status, headers, _)] = _responses(sock, 1)
    assert status == 401 and headers["server"] == "fencepost"
    with _connect(port) as sock:  # 70 KB of a head never finished: Hypercorn's to refuse
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nX-Pad: " + b"a" * 70_000)
        received = sock.recv(65536)
    assert received.split(b" ", 2)[1] in (b"400", b"431"), received[:200]
    with _connect(port) as sock:  # two Authorization headers: the application judges
        request = _request("/v1/models", key="wrong").replace(
            b"Host:", f"Authorization: Bearer {KEY}\r\nHost:".encode()
        )
        sock.sendall(request)
        [(status, headers, _)] = _responses(sock, 1)
    assert status in (200, 401) and headers["server"] != "fencepost"


def test_a_silent_connection_is_closed_after_the_keep_alive_time(
    guarded: tuple[ServerThread, int],
) -> None:
    _, port = guarded
    with _connect(port) as sock:
        began = time.monotonic()
        sock.sendall(b"GET /v1/mod")  # never finished
        assert sock.recv(10) == b""
        assert time.monotonic() - began < 10  # the 1 s keep-alive time, with slack
