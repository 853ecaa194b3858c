"""The legacy POST /v1/completions over a real TCP listener on 127.0.0.1 (fake model)."""

from __future__ import annotations

import json
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.models import FakeChatModel
from adapters.runtime.worker_host import FakeDecoder
from core.fake_model import VOCAB, reference_output
from core.protocol import GenerationRequest
from tests.openai.test_openai_server import FailingDecoder, wait_settled
from tests.support.http_helpers import ServerThread, sse_events

MODEL = FakeChatModel("fake", 2048)


def expected(prompt: str | list[int], max_tokens: int = 16) -> tuple[str, str, int]:
    """The fake model's greedy completion of a raw prompt: text, finish_reason, tokens."""
    ids = tuple(MODEL.tokenize(prompt) if isinstance(prompt, str) else prompt)
    tokens, reason = reference_output(GenerationRequest("x", ids, max_tokens))
    return MODEL.decode(tokens), "stop" if reason == "eos" else "length", len(tokens)


def body(prompt: Any = "once upon a time", **fields: Any) -> dict[str, Any]:
    return {"model": "fake", "prompt": prompt, "temperature": 0} | fields


def post(server: ServerThread, payload: Any) -> requests.Response:
    return requests.post(f"{server.base_url}/v1/completions", json=payload, timeout=30)


def streamed_choices(
    reply: requests.Response, chat: bool = False
) -> tuple[dict[int, str], dict[int, str], Any]:
    """Per choice index: the streamed text and finish_reason; and the usage chunk's usage.
    Checks that nothing follows a choice's finish chunk, and (chat) that each choice
    opens with the role."""
    events = sse_events(reply.content)
    assert events[-1] == "[DONE]"
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    usage = None
    for event in events[:-1]:
        assert event["object"] == ("chat.completion.chunk" if chat else "text_completion")
        if not event["choices"]:
            usage = event["usage"]
            continue
        [choice] = event["choices"]
        index = choice["index"]
        assert index not in finishes, "a chunk after the choice's finish chunk"
        if chat:
            if index not in texts:
                assert choice["delta"].get("role") == "assistant", "the first chunk has the role"
            texts[index] += choice["delta"].get("content", "")
        else:
            assert choice["logprobs"] is None
            texts[index] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[index] = choice["finish_reason"]
    return dict(texts), finishes, usage


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True)) as running:
        yield running


def test_a_string_prompt_completes_as_is_with_the_default_16_tokens(server: ServerThread) -> None:
    reply = post(server, body("once upon a time"))
    assert reply.status_code == 200
    done = reply.json()
    text, finish, completion = expected("once upon a time")
    assert done["object"] == "text_completion" and done["id"].startswith("cmpl-")
    assert done["choices"] == [{"text": text, "index": 0, "logprobs": None,
                                "finish_reason": finish}]  # fmt: skip
    prompt = len("once upon a time")  # the fake tokenizer: a token per character
    assert done["usage"] == {"prompt_tokens": prompt, "completion_tokens": completion,
                             "total_tokens": prompt + completion}  # fmt: skip
    assert completion <= 16


def test_several_prompts_are_one_choice_each_in_order_and_usage_sums(server: ServerThread) -> None:
    prompts = ["alpha", "beta gamma", "epsilon", "delta"]
    done = post(server, body(prompts, max_tokens=30)).json()
    answers = [expected(p, 30) for p in prompts]
    assert [(c["index"], c["text"], c["finish_reason"]) for c in done["choices"]] == [
        (i, text, finish) for i, (text, finish, _) in enumerate(answers)
    ]
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(n for _, _, n in answers)
    assert done["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                             "total_tokens": prompt_tokens + completion}  # fmt: skip


def test_several_prompts_stream_interleaved_choices_then_usage_then_done(
    server: ServerThread,
) -> None:
    prompts = [f"story number {i}" for i in range(5)]
    payload = body(prompts, max_tokens=40, stream=True, stream_options={"include_usage": True})
    reply = post(server, payload)
    assert reply.headers["content-type"].startswith("text/event-stream")
    texts, finishes, usage = streamed_choices(reply)
    answers = [expected(p, 40) for p in prompts]
    assert texts == {i: text for i, (text, _, _) in enumerate(answers) if text}
    assert finishes == {i: finish for i, (_, finish, _) in enumerate(answers)}
    assert usage["completion_tokens"] == sum(n for _, _, n in answers)
    assert usage["prompt_tokens"] == sum(len(p) for p in prompts)
    events = sse_events(reply.content)
    assert all(e["usage"] is None for e in events[:-2])  # only the last chunk has it
    wait_settled(server)


def test_token_id_prompts_reach_the_model_unchanged(server: ServerThread) -> None:
    ids = MODEL.tokenize("the same prompt")
    as_ids = post(server, body(ids, max_tokens=20)).json()
    as_text = post(server, body("the same prompt", max_tokens=20)).json()
    assert as_ids["choices"][0]["text"] == as_text["choices"][0]["text"]
    assert as_ids["choices"][0]["text"] == expected(ids, 20)[0]
    nested = post(server, body([ids, [1, 2, 3]], max_tokens=20)).json()
    assert [c["text"] for c in nested["choices"]] == [expected(ids, 20)[0],
                                                     expected([1, 2, 3], 20)[0]]  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("prompts", [["echo me", "and me"], [[3, 4], [5]]])
def test_echo_puts_the_prompt_before_the_completion(
    server: ServerThread, stream: bool, prompts: list[Any]
) -> None:
    reply = post(server, body(prompts, max_tokens=10, echo=True, stream=stream))
    # text echoes as it came; token ids as their decoded text
    echoes = [p if isinstance(p, str) else MODEL.decode(p) for p in prompts]
    wanted = [echo + expected(p, 10)[0] for echo, p in zip(echoes, prompts, strict=True)]
    if stream:
        texts, _, _ = streamed_choices(reply)
        assert [texts[0], texts[1]] == wanted
        first = {}
        for event in sse_events(reply.content)[:-1]:
            first.setdefault(event["choices"][0]["index"], event["choices"][0]["text"])
        assert first == {0: echoes[0], 1: echoes[1]}  # each choice's first chunk
    else:
        assert [c["text"] for c in reply.json()["choices"]] == wanted


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_end_each_choice_before_them(server: ServerThread, stream: bool) -> None:
    full, _, _ = expected("go on and on", 300)
    stop = full[len(full) // 2 : len(full) // 2 + 7]
    reply = post(server, body("go on and on", max_tokens=300, stop=[stop, "never"], stream=stream))
    if stream:
        texts, finishes, _ = streamed_choices(reply)
        text, finish = texts[0], finishes[0]
    else:
        [choice] = reply.json()["choices"]
        text, finish = choice["text"], choice["finish_reason"]
    assert (text, finish) == (full[: full.find(stop)], "stop")
    wait_settled(server)


def test_the_token_budget_ends_a_choice_with_length(server: ServerThread) -> None:
    prompt = next(f"short {i}" for i in range(50) if expected(f"short {i}", 3)[1] == "length")
    [choice] = post(server, body(prompt, max_tokens=3)).json()["choices"]
    assert choice["finish_reason"] == "length"
    assert choice["text"] == expected(prompt, 3)[0]


REFUSALS = [
    # (what, fields, param)
    ("suffix", {"suffix": "the end"}, "suffix"),
    ("logprobs past 20", {"logprobs": 21}, "logprobs"),
    ("logprobs with echo", {"logprobs": 1, "echo": True}, "echo"),
    ("best_of", {"best_of": 2}, "best_of"),
    ("n past 16", {"n": 17}, "n"),
    ("n of 0", {"n": 0}, "n"),
    ("penalty", {"presence_penalty": 0.5}, "presence_penalty"),
    ("echo not a boolean", {"echo": "yes"}, "echo"),
    ("17 prompts", {"prompt": ["p"] * 17}, "prompt"),
    ("token id past the vocabulary", {"prompt": [1, VOCAB]}, "prompt"),
    ("negative token id", {"prompt": [[1, 2], [-1]]}, "prompt"),
    ("empty prompt", {"prompt": ""}, "prompt"),
    ("no prompt", {"prompt": None}, "prompt"),
    ("mixed list", {"prompt": ["a", 1]}, "prompt"),
    ("text and token ids", {"prompt": ["a", [1]]}, "prompt"),
    ("boolean token", {"prompt": [True, 2]}, "prompt"),
    ("past the context", {"prompt": "x" * 2040, "max_tokens": 9}, "prompt"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}},
     "stream_options"),
    ("temperature", {"temperature": 3}, "temperature"),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "fields", "param"), REFUSALS)
def test_unsupported_or_invalid_fields_get_a_400_naming_them(
    server: ServerThread, what: str, fields: dict[str, Any], param: str
) -> None:
    reply = post(server, body() | fields)
    assert reply.status_code == 400, what
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), what
    assert error["message"]


def test_the_neutral_values_of_refused_fields_are_accepted(server: ServerThread) -> None:
    neutral = {"suffix": "", "logprobs": None, "best_of": 1, "n": 1, "presence_penalty": 0,
               "frequency_penalty": 0, "user": "someone", "seed": 3, "top_p": 0.5}  # fmt: skip
    reply = post(server, body(**neutral))
    assert reply.status_code == 200, reply.text
    assert post(server, body(model="gpt-9")).status_code == 404


def test_an_error_after_the_stream_started_is_sent_in_stream_then_done() -> None:
    with ServerThread(ServeOptions(port=0, fake=True), decoder=FailingDecoder(after=5)) as server:
        reply = post(server, body(["a", "b"], max_tokens=100, stream=True))
        events = sse_events(reply.content)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "failed"
        assert all("choices" in e for e in events[:-2])
        plain = post(server, body(["a", "b"], max_tokens=100))
        assert plain.status_code == 500 and plain.json()["error"]["code"] == "failed"
        wait_settled(server)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_disconnect_cancels_every_choice(stream: bool) -> None:
    decoder = FakeDecoder(step_s=0.01, ignore_eos=True)
    with ServerThread(ServeOptions(port=0, fake=True), decoder=decoder) as server:
        payload = json.dumps(body(["a", "b", "c"], max_tokens=1500, stream=stream)).encode()
        sock = socket.create_connection(("127.0.0.1", server.serving.http_port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        deadline = time.monotonic() + 30
        while server.statistics().router.requests_by_phase.get("streaming") != 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sock.close()  # 15 s of generation left for each
        # cancelled, not finished: 15 s of generation were left, and the outcome says so
        wait_settled(server, timeout_s=10)
        assert server.statistics().router.outcomes == {"cancelled": 3}


def test_the_official_openai_sdk_completes_streamed_and_not(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    text, finish, completion = expected("sdk prompt", 30)
    done = client.completions.create(model="fake", prompt="sdk prompt", max_tokens=30,
                                     temperature=0)  # fmt: skip
    assert (done.choices[0].text, done.choices[0].finish_reason) == (text, finish)
    assert done.usage is not None and done.usage.completion_tokens == completion
    both = client.completions.create(model="fake", prompt=["sdk prompt", "other"],
                                     max_tokens=30, temperature=0)  # fmt: skip
    assert [c.text for c in both.choices] == [text, expected("other", 30)[0]]
    chunks = list(client.completions.create(
        model="fake", prompt="sdk prompt", max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == completion
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="fake", prompt="x", suffix="y")
    assert bad.value.param == "suffix"  # type: ignore[attr-defined]
