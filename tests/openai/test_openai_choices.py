"""n choices per request, chat and legacy completions, over 127.0.0.1 (fake model)."""

from __future__ import annotations

import json
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from adapters.cli.serve import ServeOptions
from adapters.runtime.worker_host import FakeDecoder
from tests.openai.test_openai_completions import body as completion_body
from tests.openai.test_openai_completions import expected as expected_completion
from tests.openai.test_openai_completions import streamed_choices
from tests.openai.test_openai_server import FailingDecoder, expected, wait_settled
from tests.support.http_helpers import ServerThread, chat_body, sse_events
from tests.support.http_helpers import post_json as post

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True)) as running:
        yield running


def chat_choices(server: ServerThread, stream: bool, **fields: Any) -> tuple[list[str], Any]:
    """The texts of a chat completion's choices in index order, and its usage."""
    payload = chat_body("roll the dice", max_tokens=24, **fields)
    if stream:
        payload |= {"stream": True, "stream_options": {"include_usage": True}}
        texts, finishes, usage = streamed_choices(post(server, CHAT, payload), chat=True)
        assert sorted(finishes) == sorted(texts) == list(range(len(texts)))
        return [texts[i] for i in range(len(texts))], usage
    done = post(server, CHAT, payload).json()
    assert [c["index"] for c in done["choices"]] == list(range(len(done["choices"])))
    assert all(c["message"]["role"] == "assistant" for c in done["choices"])
    return [c["message"]["content"] for c in done["choices"]], done["usage"]


def completion_choices(
    server: ServerThread, stream: bool, prompt: Any = "roll the dice", **fields: Any
) -> tuple[list[str], Any]:
    payload = completion_body(prompt, max_tokens=24, **fields)
    if stream:
        payload |= {"stream": True, "stream_options": {"include_usage": True}}
        texts, finishes, usage = streamed_choices(post(server, COMPLETIONS, payload))
        assert sorted(finishes) == list(range(len(finishes)))
        return [texts.get(i, "") for i in range(len(finishes))], usage
    done = post(server, COMPLETIONS, payload).json()
    assert [c["index"] for c in done["choices"]] == list(range(len(done["choices"])))
    return [c["text"] for c in done["choices"]], done["usage"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_n_choices_at_temperature_0_are_all_the_greedy_answer(
    server: ServerThread, stream: bool
) -> None:
    texts, usage = chat_choices(server, stream, n=3)
    text, _, completion = expected("roll the dice", 24)
    assert texts == [text] * 3
    prompt = usage["prompt_tokens"]
    single = post(server, CHAT, chat_body("roll the dice", max_tokens=24)).json()["usage"]
    assert prompt == single["prompt_tokens"]  # the prompt counts once, not once per choice
    assert usage["completion_tokens"] == 3 * completion
    assert usage["total_tokens"] == prompt + 3 * completion
    wait_settled(server)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_seeded_choices_differ_and_the_response_repeats(
    server: ServerThread, stream: bool
) -> None:
    first, usage = chat_choices(server, stream, n=3, temperature=1.0, seed=11)
    again, usage_again = chat_choices(server, stream, n=3, temperature=1.0, seed=11)
    assert len(set(first)) == 3  # three different samples
    assert (again, usage_again) == (first, usage)  # and the same three every time
    alone, _ = chat_choices(server, stream, temperature=1.0, seed=11)
    assert alone == first[:1]  # choice 0 keeps the seed: n=1 samples as before
    unseeded, _ = chat_choices(server, stream, n=3, temperature=1.0)
    assert len(set(unseeded)) == 3  # each choice gets its own random seed


@pytest.mark.parametrize("stream", [False, True])
def test_completion_choices_are_prompt_major_and_usage_counts_each_prompt_once(
    server: ServerThread, stream: bool
) -> None:
    prompts = ["alpha", "beta gamma"]
    texts, usage = completion_choices(server, stream, prompts, n=3)
    answers = [expected_completion(p, 24) for p in prompts]
    # choice index = prompt index * n + i
    assert texts == [answers[0][0]] * 3 + [answers[1][0]] * 3
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    assert usage["completion_tokens"] == 3 * sum(n for _, _, n in answers)
    wait_settled(server)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_seeded_choices_differ_and_the_response_repeats(
    server: ServerThread, stream: bool
) -> None:
    fields = {"n": 3, "temperature": 1.0, "seed": 5}
    first, usage = completion_choices(server, stream, ["one", "two"], **fields)
    again, usage_again = completion_choices(server, stream, ["one", "two"], **fields)
    assert len(set(first[:3])) == 3 and len(set(first[3:])) == 3
    assert (again, usage_again) == (first, usage)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_is_on_every_choice(server: ServerThread, stream: bool) -> None:
    texts, _ = completion_choices(server, stream, ["ab", "cd"], n=2, echo=True)
    assert texts == [p + expected_completion(p, 24)[0] for p in ("ab", "ab", "cd", "cd")]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("n", [0, 17, 2.0, True, "2"])
def test_n_outside_1_to_16_is_refused_naming_n(server: ServerThread, path: str, n: Any) -> None:
    payload = chat_body(n=n) if path == CHAT else completion_body(n=n)
    reply = post(server, path, payload)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "n"


def test_the_openai_sdk_reads_n_choices(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    messages: Any = [{"role": "user", "content": "sdk"}]
    chat = client.chat.completions.create(
        model="fake", messages=messages, max_tokens=20, temperature=0.8, seed=3, n=3
    )
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert len({c.message.content for c in chat.choices}) == 3
    chunks = list(client.chat.completions.create(
        model="fake", messages=messages, max_tokens=20, temperature=0.8, seed=3, n=3,
        stream=True, stream_options={"include_usage": True},
    ))  # fmt: skip
    streamed: dict[int, str] = defaultdict(str)
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == [c.message.content for c in chat.choices]
    assert chunks[-1].usage is not None and chat.usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    legacy = client.completions.create(
        model="fake", prompt=["x", "y"], max_tokens=20, temperature=0, n=2
    )
    assert [c.index for c in legacy.choices] == [0, 1, 2, 3]
    assert [c.text for c in legacy.choices] == [
        expected_completion(p, 20)[0] for p in ("x", "x", "y", "y")
    ]
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="fake", prompt="x", n=17)
    assert bad.value.param == "n"  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_an_error_in_one_choice_ends_the_stream_in_stream_and_cancels_the_rest(
    path: str,
) -> None:
    with ServerThread(ServeOptions(port=0, fake=True), decoder=FailingDecoder(after=5)) as server:
        fields = {"max_tokens": 100, "n": 3, "stream": True}
        payload = chat_body(**fields) if path == CHAT else completion_body(**fields)
        events = sse_events(post(server, path, payload).content)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "failed"
        assert all("choices" in e for e in events[:-2])
        wait_settled(server)


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_client_disconnect_cancels_every_choice(path: str, stream: bool) -> None:
    decoder = FakeDecoder(step_s=0.01, ignore_eos=True)
    with ServerThread(ServeOptions(port=0, fake=True), decoder=decoder) as server:
        fields = {"max_tokens": 1500, "n": 3, "stream": stream}
        payload = json.dumps(chat_body(**fields) if path == CHAT else completion_body(**fields))
        sock = socket.create_connection(("127.0.0.1", server.serving.http_port))
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n{payload}".encode()
        )
        deadline = time.monotonic() + 30
        while server.statistics().router.requests_by_phase.get("streaming") != 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock.close()  # 15 s of generation left for each
        # cancelled, not finished: 15 s of generation were left, and the outcome says so
        wait_settled(server, timeout_s=10)
        assert server.statistics().router.outcomes == {"cancelled": 3}
