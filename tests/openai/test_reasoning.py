"""Thinking models over HTTP: the thinking in its own field, streamed and not, and the
request fields that control it (issue 55).

A scripted thinking model says exactly what each test writes, its tags included
(tests/support/thinking.py: OPEN and CLOSE are single tokens), so every stream is
known to the character; tests/engine/test_thinking.py runs the same over tiny
random Qwen3 and SmolLM3 checkpoints with real tokenizers, where the engine
enforces budgets and schemas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.answers import TextEgress
from adapters.openai.models import ChatModel
from adapters.openai.reasoning import AFTER, BEFORE, INSIDE, ThinkingStart
from adapters.openai.server import HttpLimits
from tests.openai.test_openai_tools import ScriptedDecoder, ScriptModel, say
from tests.support.http_helpers import ServerThread, chat_body, post_json, sse_events
from tests.support.thinking import CLOSE, OPEN, ThinkingScriptModel, thinking_tokenizer

THOUGHT = "The user greets me.\nI should greet back."
ANSWER = "Hello there!"
SCRIPT = f"{OPEN}\n{THOUGHT}\n{CLOSE}\n\n{ANSWER}"


def serve(model: ScriptModel, **limits: Any) -> ServerThread:
    options = ServeOptions(port=0, fake=True, limits=HttpLimits(**limits))
    return ServerThread(options, ScriptedDecoder(), model)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with serve(ThinkingScriptModel()) as running:
        yield running


@pytest.fixture(scope="module")
def opening_server() -> Iterator[ServerThread]:
    """Its prompts end inside an open block (R1's templates): no switch to turn it off."""
    with serve(ThinkingScriptModel(opens=True)) as running:
        yield running


@pytest.fixture(scope="module")
def plain_server() -> Iterator[ServerThread]:
    """A model without a thinking convention."""
    with serve(ScriptModel()) as running:
        yield running


def chat(server: ServerThread, **fields: Any) -> requests.Response:
    return post_json(server, "/v1/chat/completions", chat_body(**fields))


def streamed(server: ServerThread, **fields: Any) -> tuple[str, str, list[dict[str, Any]]]:
    """(thinking, content, chunks) of a streamed chat."""
    response = chat(server, stream=True, stream_options={"include_usage": True}, **fields)
    assert response.status_code == 200, response.text
    chunks = [e for e in sse_events(response.content) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    thinking = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return thinking, content, chunks


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def test_the_thinking_is_kept_out_of_the_answer_plain_and_streamed(server: ServerThread) -> None:
    say(server, SCRIPT)
    body = chat(server).json()
    message = body["choices"][0]["message"]
    assert message["content"] == ANSWER and message["reasoning_content"] == THOUGHT
    assert body["choices"][0]["finish_reason"] == "stop"
    # Every token of the block, its two tags included, is a reasoning token.
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(THOUGHT) + 4}
    assert body["usage"]["completion_tokens"] == len(SCRIPT) + 1  # and the end of sequence
    thinking, content, chunks = streamed(server)
    assert (thinking, content) == (THOUGHT, ANSWER)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    kinds = [next(k for k in d if k != "role") for d in deltas[1:] if d]
    # Thinking first, then the answer: the two never interleave.
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == len(THOUGHT) + 4


def test_the_sdk_reads_the_thinking_through_model_extra(server: ServerThread) -> None:
    say(server, SCRIPT)
    client = sdk(server)
    done = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], temperature=0
    )
    message = done.choices[0].message
    assert message.content == ANSWER
    assert (message.model_extra or {})["reasoning_content"] == THOUGHT
    assert done.usage is not None and done.usage.completion_tokens_details is not None
    assert done.usage.completion_tokens_details.reasoning_tokens == len(THOUGHT) + 4
    thinking, content = "", ""
    for chunk in client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], temperature=0, stream=True
    ):
        delta = chunk.choices[0].delta
        thinking += (delta.model_extra or {}).get("reasoning_content", "")
        content += delta.content or ""
    assert (thinking, content) == (THOUGHT, ANSWER)


@pytest.mark.parametrize(
    ("field", "keys"),
    [("reasoning", ("reasoning",)), ("both", ("reasoning_content", "reasoning"))],
)
def test_the_reasoning_field_names_the_key(field: str, keys: tuple[str, ...]) -> None:
    with serve(ThinkingScriptModel(), reasoning_field=field) as running:
        say(running, SCRIPT)
        message = chat(running).json()["choices"][0]["message"]
        assert all(message[k] == THOUGHT for k in keys)
        assert {k for k in ("reasoning_content", "reasoning") if k in message} == set(keys)
        response = chat(running, stream=True)
        deltas = [e["choices"][0]["delta"] for e in sse_events(response.content)[:-1]]
        for key in keys:
            assert "".join(d.get(key, "") for d in deltas) == THOUGHT


def test_a_model_without_a_convention_answers_as_before(plain_server: ServerThread) -> None:
    say(plain_server, SCRIPT)
    body = chat(plain_server).json()
    message = body["choices"][0]["message"]
    assert message["content"] == SCRIPT  # its "tags" are just text
    assert "reasoning_content" not in message and "completion_tokens_details" not in body["usage"]


def test_stop_strings_apply_to_the_answer_only(server: ServerThread) -> None:
    say(server, f"{OPEN}I could STOP here.{CLOSE}Go on, then STOP and more.")
    message = chat(server, stop=["STOP"]).json()["choices"][0]["message"]
    assert message == message | {
        "reasoning_content": "I could STOP here.",
        "content": "Go on, then ",
    }
    thinking, content, _ = streamed(server, stop=["STOP"])
    assert (thinking, content) == ("I could STOP here.", "Go on, then ")


def test_an_answer_that_ends_inside_its_thinking_has_thinking_alone(server: ServerThread) -> None:
    say(server, SCRIPT)
    body = chat(server, max_tokens=10).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert (
        choice["message"]["reasoning_content"] == THOUGHT[:8] and choice["message"]["content"] == ""
    )
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 10


def test_a_prompt_that_opens_the_block_starts_inside_it(opening_server: ServerThread) -> None:
    say(opening_server, f"{THOUGHT}\n{CLOSE}\n\n{ANSWER}")  # no opening tag: the prompt has it
    message = chat(opening_server).json()["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THOUGHT, ANSWER)
    assert streamed(opening_server)[:2] == (THOUGHT, ANSWER)


def test_a_model_that_does_not_open_a_block_answers_in_content(server: ServerThread) -> None:
    say(server, ANSWER)
    message = chat(server).json()["choices"][0]["message"]
    assert message["content"] == ANSWER and message["reasoning_content"] is None


def test_enable_thinking_false_closes_the_block_in_the_prompt(server: ServerThread) -> None:
    say(server, ANSWER)
    on = chat(server).json()
    for fields in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
        {"reasoning_effort": "minimal"},
    ):
        off = chat(server, **fields).json()
        assert off["choices"][0]["message"]["content"] == ANSWER
        assert off["choices"][0]["message"]["reasoning_content"] is None
        # The closed empty block the prompt ends with: OPEN \n \n CLOSE \n \n.
        assert off["usage"]["prompt_tokens"] == on["usage"]["prompt_tokens"] + 6
    # With the block closed in the prompt, whatever comes is the answer.
    say(server, SCRIPT)
    off = chat(server, chat_template_kwargs={"enable_thinking": False}).json()
    assert off["choices"][0]["message"]["content"] == SCRIPT


def test_tool_calls_are_read_from_the_answer_only(server: ServerThread) -> None:
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    fake = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    say(server, f"{OPEN}Maybe {fake}? No, Oslo.{CLOSE}\n{call}")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    choice = chat(server, tools=tools).json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == f"Maybe {fake}? No, Oslo."
    calls = choice["message"]["tool_calls"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Oslo"}]
    response = chat(server, tools=tools, stream=True)
    deltas = [e["choices"][0]["delta"] for e in sse_events(response.content)[:-1]]
    streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in streamed_calls][1:] == ['{"city": "Oslo"}']


def test_each_choice_thinks_on_its_own(server: ServerThread) -> None:
    say(server, SCRIPT)
    body = chat(server, n=2).json()
    assert [c["message"]["reasoning_content"] for c in body["choices"]] == [THOUGHT, THOUGHT]
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == 2 * (len(THOUGHT) + 4)


def test_earlier_thinking_is_accepted_under_either_name(server: ServerThread) -> None:
    say(server, ANSWER)
    for name in ("reasoning_content", "reasoning"):
        messages = [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, name: "I thought."},
            {"role": "user", "content": "and?"},
        ]
        response = post_json(server, "/v1/chat/completions", chat_body() | {"messages": messages})
        assert response.status_code == 200, response.text


def test_the_reasoning_tokens_metric_counts_the_blocks(server: ServerThread) -> None:
    def counted() -> float:
        text = requests.get(f"{server.base_url}/metrics", timeout=10).text
        found = re.search(r"^fencepost_reasoning_tokens_total (\S+)$", text, re.MULTILINE)
        assert found is not None
        return float(found.group(1))

    before = counted()
    say(server, SCRIPT)
    chat(server)
    assert counted() - before == len(THOUGHT) + 4


REFUSED = [
    ({"max_reasoning_tokens": 0}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": -3}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": "many"}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": True}, "max_reasoning_tokens"),
    ({"max_reasoning_tokens": 1.5}, "max_reasoning_tokens"),
    ({"reasoning_effort": "huge"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    (
        {"chat_template_kwargs": {"enable_thinking": False}, "max_reasoning_tokens": 5},
        "max_reasoning_tokens",
    ),
    (
        {"messages": [{"role": "user", "content": "x", "reasoning_content": "no"}]},
        "messages[0].reasoning_content",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "reasoning": 5}]},
        "messages[1].reasoning",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), REFUSED, ids=lambda f: str(f)[:50])
def test_bad_thinking_fields_are_refused_naming_the_field(
    server: ServerThread, fields: dict[str, Any], param: str
) -> None:
    response = post_json(server, "/v1/chat/completions", chat_body() | fields)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize(
    "fields", [{"reasoning_effort": "high"}, {"max_reasoning_tokens": 10}], ids=str
)
def test_thinking_fields_on_a_model_that_does_not_think_are_refused(
    plain_server: ServerThread, fields: dict[str, Any]
) -> None:
    response = post_json(plain_server, "/v1/chat/completions", chat_body() | fields)
    assert response.status_code == 400 and response.json()["error"]["param"] in fields


def test_effort_none_on_a_template_without_a_switch_is_refused(
    opening_server: ServerThread,
) -> None:
    response = chat(opening_server, reasoning_effort="none")
    assert response.status_code == 400 and response.json()["error"]["param"] == "reasoning_effort"
    say(opening_server, f"{THOUGHT}{CLOSE}{ANSWER}")
    assert chat(opening_server, reasoning_effort="high").status_code == 200


def test_the_egress_keeps_utf8_whole_across_the_boundary() -> None:
    """Byte-level BPE spells a CJK character in several tokens: each side's detokenizer
    holds a partial character until it is whole, so neither side gets a broken one."""
    tokenizer = thinking_tokenizer("qwen3")
    model = ChatModel("m", tokenizer, 2048)
    assert model.thinking is not None
    thought, answer = "考え中: 日本語 🙂", "答えは 42 です"
    ids = [model.thinking.open_id, *tokenizer.encode(thought), model.thinking.close_id]
    ids += tokenizer.encode("\n\n" + answer)
    assert len(ids) > len(thought) + len(answer)  # some characters took several tokens
    egress = TextEgress(model, (), thinking=ThinkingStart(model.thinking, BEFORE))
    content = "".join(egress.token(t) for t in ids) + egress.finish()
    assert (egress.take_reasoning(), content) == (thought, answer)
    assert egress.reasoning_tokens == len(ids) - len(tokenizer.encode("\n\n" + answer))


@pytest.mark.parametrize("state", [BEFORE, INSIDE, AFTER])
def test_the_split_follows_the_start_state(state: str) -> None:
    model = ThinkingScriptModel()
    assert model.thinking is not None
    script = SCRIPT if state != INSIDE else SCRIPT[1:]
    egress = TextEgress(model, (), thinking=ThinkingStart(model.thinking, state))
    content = "".join(egress.token(ord(c)) for c in script) + egress.finish()
    if state == AFTER:
        assert (egress.take_reasoning(), content) == ("", SCRIPT)
    else:
        assert (egress.take_reasoning(), content) == (THOUGHT, ANSWER)
