"""What users see at the edges of the HTTP server: roles in the prompt, failures without
streaming, usage after a stop string, SSE headers, keep-alive after many refusals."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.models import FakeChatModel
from adapters.openai.normalize import ChatMessage
from adapters.runtime.worker_host import FakeDecoder
from core.fake_model import reference_output, reference_tokens
from core.protocol import GenerationRequest
from tests.openai.test_openai_server import FailingDecoder, post, wait_settled
from tests.support.http_helpers import ServerThread, chat_body, sse_events

MODEL = FakeChatModel("fake", 2048)


def answer(messages: list[ChatMessage], max_tokens: int) -> tuple[str, int]:
    """The fake model's greedy answer to these messages: text, prompt tokens."""
    prompt = tuple(MODEL.tokenize_chat(messages))
    tokens, _ = reference_output(GenerationRequest("x", prompt, max_tokens))
    return MODEL.decode(tokens), len(prompt)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True)) as running:
        yield running


ROLES = ["system", "developer", "user", "assistant"]


@pytest.mark.parametrize("role", ROLES)
def test_each_role_reaches_the_prompt_as_itself(server: ServerThread, role: str) -> None:
    messages = [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}]
    reply = post(server, chat_body(messages=messages, max_tokens=40)).json()
    expected, prompt_tokens = answer([ChatMessage(role, "be brief"), ChatMessage("user", "hi")], 40)
    assert reply["usage"]["prompt_tokens"] == prompt_tokens
    assert reply["choices"][0]["message"]["content"] == expected
    # rendered as any other role, the same words would have been another prompt
    for other in ROLES:
        if other != role:
            swapped, _ = answer([ChatMessage(other, "be brief"), ChatMessage("user", "hi")], 40)
            assert swapped != expected


def test_a_failed_generation_without_streaming_is_a_5xx_error_never_a_200() -> None:
    with ServerThread(ServeOptions(port=0, fake=True), decoder=FailingDecoder(after=5)) as server:
        reply = post(server, chat_body(max_tokens=100))
        assert reply.status_code >= 500
        assert reply.headers["content-type"] == "application/json"
        error = reply.json()["error"]
        assert (error["code"], error["type"]) == ("failed", "server_error")
        assert "choices" not in reply.json()
        wait_settled(server)


def tokens_through_stop(content: str, stop: str, max_tokens: int) -> int:
    """How many tokens the fake model sends until the text first contains `stop`."""
    prompt = tuple(MODEL.tokenize_chat([ChatMessage("user", content)]))
    tokens = reference_tokens(GenerationRequest("x", prompt, max_tokens), max_tokens)
    for count in range(1, len(tokens) + 1):
        if stop in MODEL.decode(tokens[:count]):
            return count
    raise AssertionError("the stop string never appears")


@pytest.mark.parametrize("stream", [False, True])
def test_usage_after_a_stop_string_counts_what_was_generated_and_the_slot_frees_at_once(
    stream: bool,
) -> None:
    decoder = FakeDecoder(step_s=0.01, ignore_eos=True)  # 2,000 tokens would take 20 s
    with ServerThread(ServeOptions(port=0, fake=True), decoder=decoder) as server:
        prompt = tuple(MODEL.tokenize_chat([ChatMessage("user", "stop soon")]))
        text = MODEL.decode(reference_tokens(GenerationRequest("x", prompt, 60), 60))
        stop = text[100:106]  # something the model says early on
        body = chat_body("stop soon", max_tokens=2000, stop=stop, stream=stream)
        if stream:
            body["stream_options"] = {"include_usage": True}
        began = time.monotonic()
        reply = post(server, body)
        usage = sse_events(reply.content)[-2]["usage"] if stream else reply.json()["usage"]
        assert usage["completion_tokens"] == tokens_through_stop("stop soon", stop, 2000)
        # The slot is back, and the decoder stopped, long before 2,000 tokens (20 s):
        # bounds a busy machine's lag does not reach, that decoding on would break.
        wait_settled(server, timeout_s=15)
        assert time.monotonic() - began < 15
        assert decoder.steps < 1500


def test_sse_responses_carry_the_headers_proxies_need(server: ServerThread) -> None:
    reply = post(server, chat_body(max_tokens=3, stream=True))
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers["cache-control"] == "no-cache"
    assert reply.headers["x-accel-buffering"] == "no"


REFUSALS: list[tuple[str, dict[str, Any], int]] = [
    ("no content type, no body", {"data": b""}, 400),
    ("no content type, 5 KB", {"data": b"x" * 5000}, 400),
    ("text/plain, 60 KB", {"data": b"y" * 60_000, "headers": {"Content-Type": "text/plain"}}, 400),
    ("bad JSON", {"data": b"{nope", "headers": {"Content-Type": "application/json"}}, 400),
    ("too large", {"data": b"{}" * 600_000, "headers": {"Content-Type": "application/json"}}, 413),
    ("unknown model", {"json": chat_body(model="nope")}, 404),
    ("n=0", {"json": chat_body(n=0)}, 400),
]


def test_hundreds_of_refused_then_valid_pairs_on_one_connection_never_hang(
    server: ServerThread,
) -> None:
    url = f"{server.base_url}/v1/chat/completions"
    with requests.Session() as session:
        for i in range(300):
            what, kwargs, status = REFUSALS[i % len(REFUSALS)]
            refused = session.post(url, timeout=10, **kwargs)
            assert refused.status_code == status, what
            assert set(refused.json()["error"]) == {"message", "type", "param", "code"}
            valid = session.post(url, json=chat_body(f"pair {i}", max_tokens=2), timeout=10)
            assert valid.status_code == 200, (i, what)
            assert valid.json()["usage"]["completion_tokens"] >= 1
    wait_settled(server)
