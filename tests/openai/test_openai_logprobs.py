"""logprobs and top_logprobs over 127.0.0.1 (fake model), and the entries' bookkeeping.

The fake model gives every token a made-up logprob record, a pure function of
its context (core/fake_model.py), so every entry a client sees is known here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.logprobs import LogprobEntries, token_text
from adapters.openai.models import FakeChatModel
from adapters.openai.normalize import ChatMessage, choice_seed
from core.fake_model import FakeContext, reference_output
from core.protocol import GenerationRequest, Sampling, TokenLogprob
from tests.support.http_helpers import ServerThread, chat_body, sse_events
from tests.support.http_helpers import post_json as post

MODEL = FakeChatModel("fake", 2048)
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True)) as running:
        yield running


def reference(
    prompt: list[int], max_tokens: int, top: int, sampling: Sampling | None = None
) -> list[tuple[int, TokenLogprob]]:
    """The fake model's tokens of an undisturbed run, each with its record."""
    sampling = sampling or Sampling()
    request = GenerationRequest("x", tuple(prompt), max_tokens, sampling, logprobs=top)
    tokens, _ = reference_output(request)
    context, out = FakeContext(request), []
    for token in tokens:
        out.append((token, context.record(token, top)))
        context.feed(token)
    return out


def chat_prompt(content: str) -> list[int]:
    return MODEL.tokenize_chat([ChatMessage("user", content)])


def candidate(token_id: int, logprob: float) -> dict[str, Any]:
    raw = MODEL.token_bytes(token_id)
    return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}


def chat_entries(expected: list[tuple[int, TokenLogprob]]) -> list[dict[str, Any]]:
    return [
        candidate(token, record.logprob)
        | {"top_logprobs": [candidate(t, v) for t, v in record.top]}
        for token, record in expected
    ]


def streamed_chat(reply: requests.Response) -> tuple[str, list[dict[str, Any]]]:
    """A streamed chat choice's text and entries; each chunk's entries spell its text."""
    text, entries = "", []
    for event in sse_events(reply.content)[:-1]:
        [choice] = event["choices"]
        content = choice["delta"].get("content", "")
        text += content
        if choice["logprobs"] is not None:
            got = choice["logprobs"]["content"]
            assert "".join(e["token"] for e in got) == content
            assert choice["logprobs"]["refusal"] is None
            entries += got
    return text, entries


@pytest.mark.parametrize("top", [0, 3, 20])
def test_chat_entries_are_the_models_records_streamed_or_not(
    server: ServerThread, top: int
) -> None:
    expected = reference(chat_prompt("tell me"), 40, top)
    payload = chat_body("tell me", max_tokens=40, logprobs=True, top_logprobs=top)
    done = post(server, CHAT, payload).json()
    [choice] = done["choices"]
    assert choice["logprobs"] == {"content": chat_entries(expected), "refusal": None}
    assert len(choice["logprobs"]["content"]) == done["usage"]["completion_tokens"]
    text, entries = streamed_chat(post(server, CHAT, payload | {"stream": True}))
    assert (text, entries) == (choice["message"]["content"], chat_entries(expected))


def test_top_logprobs_descend_and_are_as_many_as_asked(server: ServerThread) -> None:
    payload = chat_body("order", max_tokens=20, logprobs=True, top_logprobs=5)
    [choice] = post(server, CHAT, payload).json()["choices"]
    for entry in choice["logprobs"]["content"]:
        values = [c["logprob"] for c in entry["top_logprobs"]]
        assert len(values) == 5 and values == sorted(values, reverse=True)


def test_without_logprobs_the_field_stays_null(server: ServerThread) -> None:
    [choice] = post(server, CHAT, chat_body("x", max_tokens=5, logprobs=False)).json()["choices"]
    assert choice["logprobs"] is None
    for event in sse_events(post(server, CHAT, chat_body("x", max_tokens=5, stream=True)).content):
        assert event == "[DONE]" or event["choices"][0]["logprobs"] is None


def test_the_openai_sdk_reads_chat_logprobs(server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
    expected = reference(chat_prompt("sdk"), 12, 2)
    done = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "sdk"}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = done.choices[0].logprobs.content  # type: ignore[union-attr]
    assert [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in content] == [
        (r.logprob, [v for _, v in r.top]) for _, r in expected
    ]
    stream = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "sdk"}], max_tokens=12,
        temperature=0, logprobs=True, top_logprobs=2, stream=True,
    )  # fmt: skip
    streamed = [e.token for chunk in stream if chunk.choices and chunk.choices[0].logprobs
                for e in chunk.choices[0].logprobs.content or []]  # fmt: skip
    assert streamed == [e.token for e in content]
    completion = client.completions.create(model="fake", prompt="sdk", max_tokens=6, logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == completion.usage.completion_tokens  # type: ignore[union-attr]


def completion_expected(prompt: str, max_tokens: int, top: int) -> dict[str, Any]:
    expected = reference(MODEL.tokenize(prompt), max_tokens, top)
    offsets, offset = [], 0
    for token, _ in expected:
        offsets.append(offset)
        offset += len(MODEL.decode([token]))
    return {
        "tokens": [token_text(MODEL.token_bytes(t)) for t, _ in expected],
        "token_logprobs": [r.logprob for _, r in expected],
        "top_logprobs": [{token_text(MODEL.token_bytes(t)): v for t, v in r.top}
                         for _, r in expected],
        "text_offset": offsets,
    }  # fmt: skip


@pytest.mark.parametrize("top", [0, 2, 5])
def test_completion_logprobs_streamed_or_not(server: ServerThread, top: int) -> None:
    payload = {"model": "fake", "prompt": "once", "max_tokens": 30, "temperature": 0,
               "logprobs": top}  # fmt: skip
    [choice] = post(server, COMPLETIONS, payload).json()["choices"]
    assert choice["logprobs"] == completion_expected("once", 30, top)
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                    "text_offset": []}  # fmt: skip
    text = ""
    for event in sse_events(post(server, COMPLETIONS, payload | {"stream": True}).content)[:-1]:
        [chunk] = event["choices"]
        if chunk["logprobs"] is not None:
            assert chunk["logprobs"]["text_offset"][0] == len(text)  # where its text begins
            assert "".join(chunk["logprobs"]["tokens"]) == chunk["text"]
            for key, values in chunk["logprobs"].items():
                merged[key] += values
        text += chunk["text"]
    assert (text, merged) == (choice["text"], choice["logprobs"])


def test_each_of_n_choices_has_its_own_entries(server: ServerThread) -> None:
    payload = chat_body("dice", max_tokens=16, n=2, temperature=0.8, seed=5, logprobs=True,
                        top_logprobs=1)  # fmt: skip
    choices = post(server, CHAT, payload).json()["choices"]
    for choice in choices:
        sampling = Sampling(0.8, 1.0, choice_seed(5, choice["index"]))
        expected = reference(chat_prompt("dice"), 16, 1, sampling)
        assert choice["logprobs"]["content"] == chat_entries(expected)
    assert choices[0]["logprobs"] != choices[1]["logprobs"]


def test_a_stop_string_keeps_the_entries_of_the_tokens_whose_text_was_sent(
    server: ServerThread,
) -> None:
    expected = reference(chat_prompt("go"), 200, 1)
    words = [MODEL.decode([t]) for t, _ in expected]
    full = "".join(words)
    stop = next(w for w in words[3:] if w and full.find(w) > len("".join(words[:3])))
    cut = full.find(stop)
    payload = chat_body("go", max_tokens=200, stop=stop, logprobs=True, top_logprobs=1)
    [choice] = post(server, CHAT, payload).json()["choices"]
    assert choice["message"]["content"] == full[:cut]
    # Every token whose text begins before the cut, and none after.
    kept = [i for i in range(len(words)) if len("".join(words[:i])) < cut]
    assert 0 < len(kept) < len(words)
    assert choice["logprobs"]["content"] == chat_entries([expected[i] for i in kept])
    text, entries = streamed_chat(post(server, CHAT, payload | {"stream": True}))
    assert (text, entries) == (full[:cut], choice["logprobs"]["content"])


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"logprobs": False, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (CHAT, {"logprobs": 1}, "logprobs"),
        (COMPLETIONS, {"logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"logprobs": True}, "logprobs"),
        (COMPLETIONS, {"logprobs": 1, "echo": True}, "echo"),
    ],
)
def test_bad_logprobs_fields_are_400_naming_them(
    server: ServerThread, path: str, fields: dict[str, Any], param: str
) -> None:
    base = chat_body("x") if path == CHAT else {"model": "fake", "prompt": "x"}
    reply = post(server, path, base | fields)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


def record(value: float) -> TokenLogprob:
    return TokenLogprob(value, ())


def test_a_held_back_character_takes_its_tokens_entries_with_it() -> None:
    entries = LogprobEntries(lambda t: bytes([t]))
    entries.add(0xC3, record(-1.0), "")  # the first byte of a character: no text yet
    assert entries.release("") == []
    entries.add(0xA9, record(-2.0), "é")
    released = entries.release("é")
    assert [(e.chosen.raw, e.chosen.token, e.offset) for e in released] == [
        (b"\xc3", "\\xc3", 0), (b"\xa9", "\\xa9", 0)
    ]  # fmt: skip


def test_at_a_stop_cut_entries_after_it_are_dropped_and_at_eos_none_are() -> None:
    entries = LogprobEntries(lambda t: b"w")
    for text in ("ab", "cd", "ef"):
        entries.add(1, record(-1.0), text)
    assert [e.offset for e in entries.finish("abc", stopped=True)] == [0, 2]
    entries = LogprobEntries(lambda t: b"w")
    entries.add(1, record(-1.0), "ab")
    entries.add(0, record(float("-inf")), "")  # eos: no text of its own
    done = entries.finish("ab", stopped=False)
    assert [(e.offset, e.chosen.logprob) for e in done] == [(0, -1.0), (2, -9999.0)]
