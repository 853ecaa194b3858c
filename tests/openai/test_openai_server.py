"""The OpenAI-compatible server over a real TCP listener on 127.0.0.1 (fake model)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.egress import ClientLimits
from adapters.openai.models import FakeChatModel
from adapters.openai.normalize import ChatMessage
from adapters.openai.server import HttpLimits
from adapters.runtime.worker_host import FakeDecoder
from core.fake_model import reference_output, reference_tokens
from core.protocol import DecoderFailed, GenerationRequest
from tests.support.http_helpers import ServerThread, chat_body, sse_events

MODEL = FakeChatModel("fake", 2048)


def expected(content: str, max_tokens: int, ignore_eos: bool = False) -> tuple[str, str, int]:
    """What the fake model answers: text, finish_reason, completion tokens."""
    prompt = tuple(MODEL.tokenize_chat([ChatMessage("user", content)]))
    request = GenerationRequest("x", prompt, max_tokens)
    if ignore_eos:
        tokens = reference_tokens(request, max_tokens)
        return MODEL.decode(tokens), "length", max_tokens
    tokens, reason = reference_output(request)
    return MODEL.decode(tokens), "stop" if reason == "eos" else "length", len(tokens)


def post(server: ServerThread, body: Any, **kw: Any) -> requests.Response:
    return requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30, **kw)


def wait_settled(server: ServerThread, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.statistics()
        if stats.open_streams == 0 and all(w.held == 0 for w in stats.router.workers):
            return
        time.sleep(0.02)
    raise AssertionError(f"requests still open: {server.statistics()}")


def metric(server: ServerThread, name: str) -> float:
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True)) as running:
        yield running


def test_models_and_health(server: ServerThread) -> None:
    listing = requests.get(f"{server.base_url}/v1/models", timeout=10).json()
    assert listing["object"] == "list"
    assert [(m["id"], m["object"]) for m in listing["data"]] == [("fake", "model")]
    assert requests.get(f"{server.base_url}/v1/models/fake", timeout=10).json()["id"] == "fake"
    missing = requests.get(f"{server.base_url}/v1/models/gpt-9", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    health = requests.get(f"{server.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["healthy_workers"] == 1


def test_a_completion_returns_the_models_text_and_usage(server: ServerThread) -> None:
    reply = post(server, chat_body("tell me", max_tokens=40))
    assert reply.status_code == 200
    body = reply.json()
    text, finish, completion = expected("tell me", 40)
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": text, "refusal": None}
    assert choice["finish_reason"] == finish
    prompt = len(MODEL.tokenize_chat([ChatMessage("user", "tell me")]))
    assert body["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def test_a_stream_has_the_openai_shape_and_the_same_text(server: ServerThread) -> None:
    reply = post(server, chat_body("tell me", max_tokens=40, stream=True,
                                   stream_options={"include_usage": True}))  # fmt: skip
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = sse_events(reply.content)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    assert {c["id"] for c in [*chunks, usage_chunk]} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all(c["usage"] is None for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text, finish, completion = expected("tell me", 40)
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == finish
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == completion
    plain = post(server, chat_body("tell me", max_tokens=40, stream=True))
    assert all("usage" not in c for c in sse_events(plain.content)[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_the_text_before_them_and_cancel_generation(
    server: ServerThread, stream: bool
) -> None:
    full, _, _ = expected("say a lot", 300, ignore_eos=False)
    stop = full[len(full) // 2 : len(full) // 2 + 7]  # something the model will produce
    before = full[: full.find(stop)]
    reply = post(server, chat_body("say a lot", max_tokens=300, stop=[stop, "never seen"],
                                   stream=stream))  # fmt: skip
    if stream:
        events = sse_events(reply.content)
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        finish = events[-2]["choices"][0]["finish_reason"]
    else:
        text = reply.json()["choices"][0]["message"]["content"]
        finish = reply.json()["choices"][0]["finish_reason"]
    assert (text, finish) == (before, "stop")
    wait_settled(server)


ERROR_CASES = [
    # (description, request kwargs, status, code, param)
    ("not JSON", {"data": b"{nope", "headers": {"Content-Type": "application/json"}},
     400, None, None),
    ("not an object", {"json": [1, 2]}, 400, None, None),
    ("wrong content type", {"data": b"model=fake", "headers": {"Content-Type": "text/plain"}},
     400, "unsupported_content_type", None),
    ("too large", {"json": chat_body("x" * 2_000_000)}, 413, "request_too_large", None),
    ("unknown model", {"json": chat_body(model="gpt-9")}, 404, "model_not_found", "model"),
    ("too long", {"json": chat_body("x" * 3000)}, 400, "context_length_exceeded", "messages"),
    ("n=17", {"json": chat_body(n=17)}, 400, None, "n"),
    ("n=0", {"json": chat_body(n=0)}, 400, None, "n"),
    ("tools", {"json": chat_body(tools=[{"type": "function"}], stream=True)}, 400, None,
     "tools[0].function"),
    ("image", {"json": chat_body(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}])},
     400, None, "messages[0].content[0]"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "kwargs", "status", "code", "param"), ERROR_CASES)
def test_bad_input_gets_the_openai_error_envelope(
    server: ServerThread, what: str, kwargs: dict[str, Any], status: int, code: str | None,
    param: str | None,
) -> None:  # fmt: skip
    reply = requests.post(f"{server.base_url}/v1/chat/completions", timeout=30, **kwargs)
    assert reply.status_code == status, what
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert (error["code"], error["param"]) == (code, param)


def test_unknown_routes_and_methods_get_the_envelope_too(server: ServerThread) -> None:
    for reply, status in [
        (requests.get(f"{server.base_url}/v1/nothing", timeout=10), 404),
        (requests.put(f"{server.base_url}/v1/chat/completions", timeout=10), 405),
    ]:
        assert reply.status_code == status
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_no_worker_is_a_503_before_any_stream_starts() -> None:
    options = ServeOptions(port=0, fake=True, local_worker=False)
    with ServerThread(options) as server:
        for stream in (False, True):
            reply = post(server, chat_body(stream=stream))
            assert reply.status_code == 503
            assert reply.json()["error"]["code"] == "no_worker"
        assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 503


class FailingDecoder(FakeDecoder):
    """A fake decoder whose whole decoder breaks after `after` steps."""

    def __init__(self, after: int) -> None:
        super().__init__(step_s=0.005, ignore_eos=True)
        self.after = after

    def _step(self, ready: list[Any]) -> list[Any]:
        if self.steps >= self.after:
            for assignment, _ in ready:
                self.stop(assignment)
            self.steps = 0
            return [DecoderFailed("injected")]
        return super()._step(ready)


def test_an_error_after_the_stream_started_is_sent_in_stream_then_done() -> None:
    with ServerThread(ServeOptions(port=0, fake=True), decoder=FailingDecoder(after=5)) as server:
        events = sse_events(post(server, chat_body(max_tokens=100, stream=True)).content)
        assert events[-1] == "[DONE]"
        error = events[-2]["error"]
        assert (error["code"], error["type"]) == ("failed", "server_error")
        content = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
        assert content == expected("hello", 5, ignore_eos=True)[0]
        wait_settled(server)


def raw_request(
    port: int, body: dict[str, Any], rcvbuf: int | None = None, trailing: bytes = b""
) -> socket.socket:
    """A socket that has sent one chat request (then `trailing`, bytes past its body)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload + trailing)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_disconnect_cancels_the_request(stream: bool) -> None:
    decoder = FakeDecoder(step_s=0.01, ignore_eos=True)
    with ServerThread(ServeOptions(port=0, fake=True), decoder=decoder) as server:
        sock = raw_request(server.serving.http_port, chat_body(max_tokens=1500, stream=stream))
        deadline = time.monotonic() + 30
        while server.statistics().router.requests_by_phase.get("streaming") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        if stream:
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        sock.close()  # 15 s of generation left
        # cancelled, not finished: 15 s of generation were left, and the outcome says so
        wait_settled(server, timeout_s=10)
        assert server.statistics().router.outcomes == {"cancelled": 1}
        assert metric(server, 'fencepost_requests_total{outcome="cancelled"}') == 1


LAST_CHUNK = b"data: [DONE]\n\n\r\n0\r\n\r\n"  # [DONE], then the end of the chunked body


def read_sse_until_done(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    while not data.endswith(LAST_CHUNK) and (chunk := sock.recv(65536)):
        data += chunk
    return data


def sse_from_chunked(raw: bytes) -> list[Any]:
    """Undo HTTP/1.1 chunked framing, then parse the SSE events."""
    body = raw.split(b"\r\n\r\n", 1)[1]
    out = b""
    while body:
        size_line, rest = body.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2 :]
    return sse_events(out)


def test_a_slow_reader_does_not_hold_back_a_fast_one_and_gets_all_its_text() -> None:
    decoder = FakeDecoder(step_s=0.002, ignore_eos=True)
    with ServerThread(ServeOptions(port=0, fake=True), decoder=decoder) as server:
        body = chat_body("slow", max_tokens=1500, stream=True)
        slow = raw_request(server.serving.http_port, body, rcvbuf=4096)
        for i in range(3):  # while the slow client reads nothing
            reply = post(server, chat_body(f"fast {i}", max_tokens=200, stream=True))
            events = sse_events(reply.content)
            text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
            assert text == expected(f"fast {i}", 200, ignore_eos=True)[0]
        events = sse_from_chunked(read_sse_until_done(slow, 30))
        slow.close()
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
        assert text == expected("slow", 1500, ignore_eos=True)[0]
        wait_settled(server)


def test_a_client_past_the_ceiling_is_cancelled_and_disconnected_alone() -> None:
    limits = HttpLimits(client=ClientLimits(max_events=64, high_water_bytes=8192,
                                            low_water_bytes=4096, ceiling_bytes=65536))  # fmt: skip
    options = ServeOptions(port=0, fake=True, max_context=300_000, limits=limits)
    decoder = FakeDecoder(ignore_eos=True)
    model = FakeChatModel("fake", 300_000)
    with ServerThread(options, decoder=decoder, model=model) as server:
        body = chat_body("stuck", max_tokens=200_000, stream=True)
        stuck = raw_request(server.serving.http_port, body, rcvbuf=4096)
        deadline = time.monotonic() + 60
        while metric(server, 'fencepost_requests_total{outcome="overflow"}') < 1:
            assert time.monotonic() < deadline, "the stuck client was never cut off"
            reply = post(server, chat_body("meanwhile", max_tokens=50))
            assert (
                reply.json()["choices"][0]["message"]["content"]
                == (expected("meanwhile", 50, ignore_eos=True)[0])
            )
            time.sleep(0.05)
        wait_settled(server)
        stuck.settimeout(10)
        received = b""
        while chunk := stuck.recv(1 << 20):  # the server closed the connection
            received += chunk
        assert not received.endswith(LAST_CHUNK)
        stuck.close()


def test_the_official_openai_sdk_works_with_only_base_url_changed(server: ServerThread) -> None:
    text, finish, _ = expected("sdk", 30)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    completion = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "sdk"}], max_tokens=30, temperature=0
    )
    assert completion.choices[0].message.content == text
    assert completion.choices[0].finish_reason == finish
    chunks = list(client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "sdk"}], max_tokens=30, stream=True,
        stream_options={"include_usage": True}, temperature=0,
    ))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "x"}], n=17
        )
    assert bad.value.status_code == 400 and bad.value.param == "n"  # type: ignore[attr-defined]

    async def use_async() -> tuple[str | None, str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        done = await aclient.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "sdk"}], max_tokens=30,
            temperature=0,
        )  # fmt: skip
        streamed = ""
        async for chunk in await aclient.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "sdk"}], max_tokens=30,
            stream=True, temperature=0,
        ):  # fmt: skip
            streamed += chunk.choices[0].delta.content or ""
        await aclient.close()
        return done.choices[0].message.content, streamed

    assert asyncio.run(use_async()) == (text, text)


def test_metrics_count_outcomes_tokens_and_latencies(server: ServerThread) -> None:
    before = metric(server, "fencepost_completion_tokens_total")
    _, _, completion = expected("count me", 20)
    post(server, chat_body("count me", max_tokens=20))
    assert metric(server, "fencepost_completion_tokens_total") == before + completion
    # a refusal of its own: which other tests share this server depends on the order
    # and on how a parallel run spreads them
    refused = requests.post(
        f"{server.base_url}/v1/chat/completions", json={"model": "fake"}, timeout=10
    )
    assert refused.status_code == 400
    text = requests.get(f"{server.base_url}/metrics", timeout=10).text
    for name in (
        "fencepost_time_to_first_token_seconds_bucket",
        "fencepost_inter_token_latency_seconds_bucket",
        "fencepost_active_requests",
        "fencepost_queue_depth",
        'fencepost_requests_total{outcome="rejected_400"}',
    ):
        assert name in text


def test_a_refused_request_does_not_spoil_its_keep_alive_connection(server: ServerThread) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    with requests.Session() as session:  # one connection, reused where the server allows
        refused = [
            session.post(url, data=b'{"model": "fake"}', timeout=10),  # no content type
            session.post(url, data=b"{}" * 700_000, timeout=10,
                         headers={"Content-Type": "application/json"}),  # too large
            session.post(f"{server.base_url}/v1/nothing", data=b"{}" * 1000, timeout=10),
        ]  # fmt: skip
        assert [r.status_code for r in refused] == [400, 413, 404]
        reply = session.post(url, json=chat_body(max_tokens=3), timeout=10)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] > 0


def test_sampled_requests_without_a_seed_get_one_and_differ(server: ServerThread) -> None:
    # Each gets its own seed (so a resumed stream can draw what its first worker
    # would have); with the same explicit seed the answer repeats.
    texts = [post(server, chat_body("dice", max_tokens=30, temperature=1.0)).json()
             for _ in range(2)]  # fmt: skip
    assert (
        texts[0]["choices"][0]["message"]["content"]
        != (texts[1]["choices"][0]["message"]["content"])
    )
    seeded = [post(server, chat_body("dice", max_tokens=30, temperature=1.0, seed=7)).json()
              for _ in range(2)]  # fmt: skip
    contents = {r["choices"][0]["message"]["content"] for r in seeded}
    assert len(contents) == 1


def read_until_eof(sock: socket.socket, timeout_s: float) -> tuple[bytes, float | None]:
    """Everything the server sends, and when it closed (None: still open at timeout)."""
    sock.settimeout(0.05)
    start, data = time.monotonic(), b""
    while time.monotonic() - start < timeout_s:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return data, time.monotonic() - start
        if not chunk:
            return data, time.monotonic() - start
        data += chunk
    return data, None


# The timers under test are short; every other way the socket could end (keep-alive,
# the read's own patience) is a minute away, so "closed by this timer" and "closed at
# once" are told apart by tens of seconds, which no busy machine's lag comes near.
OTHER_TIMERS_S = 60.0


def test_an_unfinished_body_gets_a_408_and_the_socket_is_closed_at_once() -> None:
    options = ServeOptions(
        port=0, fake=True, limits=HttpLimits(body_timeout_s=0.5),
        keep_alive_timeout_s=OTHER_TIMERS_S,
    )  # fmt: skip
    with ServerThread(options) as server:
        sock = socket.create_connection(("127.0.0.1", server.serving.http_port))
        with sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mo'
            )
            data, closed_after = read_until_eof(sock, timeout_s=OTHER_TIMERS_S / 2)
            head, _, body = data.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408"), data
            assert json.loads(body)["error"]["type"] == "invalid_request_error"
            # The 408 comes after the body timeout and the close with it, not when the
            # keep-alive timer would have ended the connection.
            assert closed_after is not None, "the server kept the socket after its 408"
            assert 0.4 < closed_after < OTHER_TIMERS_S / 3, closed_after
        # The server is unharmed and serves the next client.
        assert post(server, chat_body(max_tokens=3)).status_code == 200


def test_bytes_past_the_declared_body_are_refused_and_the_socket_closed() -> None:
    options = ServeOptions(port=0, fake=True, keep_alive_timeout_s=OTHER_TIMERS_S)
    with ServerThread(options) as server:
        port, body = server.serving.http_port, chat_body(max_tokens=3)
        with raw_request(port, body, trailing=b"not a request at all\r\n\r\n") as sock:
            data, closed_after = read_until_eof(sock, timeout_s=OTHER_TIMERS_S / 2)
        # The declared request is answered; what follows it is not HTTP, gets
        # a 400, and the connection ends there (not at the keep-alive timeout).
        assert data.startswith(b"HTTP/1.1 200"), data
        assert b"HTTP/1.1 400" in data, data
        assert closed_after is not None and closed_after < OTHER_TIMERS_S / 3, closed_after


def test_an_idle_keep_alive_connection_is_closed_after_its_timeout() -> None:
    with ServerThread(ServeOptions(port=0, fake=True, keep_alive_timeout_s=1.0)) as server:
        with raw_request(server.serving.http_port, chat_body(max_tokens=3)) as sock:
            data, closed_after = read_until_eof(sock, timeout_s=OTHER_TIMERS_S / 2)
        assert data.startswith(b"HTTP/1.1 200"), data
        assert closed_after is not None and closed_after > 0.8, closed_after
        # Headers that never end are cut by the same timer, however they trickle: a
        # line every 0.3 s would keep the connection for 20 s if each reset it.
        sock = socket.create_connection(("127.0.0.1", server.serving.http_port))
        with sock:
            start, closed = time.monotonic(), False
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\n")
            while not closed and time.monotonic() - start < 20:
                time.sleep(0.3)
                try:
                    sock.sendall(b"X-Trickle: 1\r\n")
                    data, closed_after = read_until_eof(sock, timeout_s=0.05)
                    closed = closed_after is not None
                except (BrokenPipeError, ConnectionResetError):
                    data, closed = b"", True
            assert data == b"" and closed, "trickled headers kept the connection open"
            assert time.monotonic() - start > 0.8  # ... but not before the timer ran out
