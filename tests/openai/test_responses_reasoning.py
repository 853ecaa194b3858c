"""The Responses API for a thinking model, over 127.0.0.1 with the official SDK: the
reasoning item before the answer (plain, streamed, stored), its events in order,
reasoning tokens in the usage, `reasoning.effort` (none turns thinking off), its
refusals, and reasoning carried into the next turn, by previous_response_id or
sent back as an input item. A model that does not think answers as before
(test_openai_responses.py)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseReasoningItem,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)

from adapters.cli.serve import ServeOptions
from adapters.openai.normalize import ChatMessage
from adapters.openai.tools import Tool, ToolCall
from core.protocol import Assignment, GenerationRequest
from tests.openai.test_openai_responses import CALL, WEATHER, events, post, sdk
from tests.openai.test_openai_tools import ScriptedDecoder, ScriptModel, say
from tests.support.http_helpers import ServerThread
from tests.support.thinking import CLOSE, OPEN, ThinkingScriptModel

THOUGHT = "Let me think. 日本"
ANSWER = "The answer."
SCRIPT = f"{OPEN}\n{THOUGHT}\n{CLOSE}\n\n{ANSWER}"
THINKING_TOKENS = len(f"{OPEN}\n{THOUGHT}\n{CLOSE}")  # the block, its tags included


class RecordingModel(ThinkingScriptModel):
    """A thinking script model that keeps the messages of every prompt it renders."""

    def __init__(self, opens: bool = False) -> None:
        super().__init__(opens)
        self.seen: list[list[ChatMessage]] = []

    def tokenize_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: tuple[Tool, ...] = (),
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        self.seen.append(list(messages))
        return super().tokenize_chat(messages, tools, template_kwargs, add_generation_prompt)


class RecordingDecoder(ScriptedDecoder):
    """A scripted decoder that keeps the last request it started."""

    def __init__(self) -> None:
        super().__init__()
        self.last: GenerationRequest | None = None

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        self.last = request
        super().start(assignment, request)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    options = ServeOptions(port=0, fake=True)
    with ServerThread(options, RecordingDecoder(), RecordingModel()) as running:
        yield running


@pytest.fixture(scope="module")
def opens() -> Iterator[ServerThread]:
    """A model whose prompt opens the block (R1's templates): it cannot turn thinking off."""
    options = ServeOptions(port=0, fake=True)
    with ServerThread(options, ScriptedDecoder(), ThinkingScriptModel(opens=True)) as running:
        yield running


@pytest.fixture(scope="module")
def plain() -> Iterator[ServerThread]:
    """A model that does not think."""
    with ServerThread(ServeOptions(port=0, fake=True), ScriptedDecoder(), ScriptModel()) as running:
        yield running


def seen(server: ServerThread) -> list[ChatMessage]:
    """The messages of the last prompt the model rendered."""
    model = server.model
    assert isinstance(model, RecordingModel)
    return model.seen[-1]


def without_ids(value: Any) -> Any:
    """An output as its shape: every item id and call id taken out."""
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    if isinstance(value, dict):
        return {k: without_ids(v) for k, v in value.items() if k not in ("id", "call_id")}
    return value


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "summary": [], "content": content, "status": status}


# --- the answer ---


def test_the_sdk_reads_the_reasoning_item_before_the_answer(server: ServerThread) -> None:
    say(server, SCRIPT)
    done = sdk(server).responses.create(
        model="fake", input="hi", reasoning={"effort": "high", "summary": "auto"}
    )
    assert done.status == "completed"
    assert done.output_text == ANSWER  # the thinking is not the answer's text
    thought, message = done.output
    assert isinstance(thought, ResponseReasoningItem)
    assert thought.id.startswith("rs_") and thought.status == "completed"
    assert thought.summary == []  # a summary is accepted, none is written
    assert thought.content is not None
    assert [(c.type, c.text) for c in thought.content] == [("reasoning_text", THOUGHT)]
    assert message.type == "message" and message.status == "completed"
    assert done.reasoning is not None
    assert (done.reasoning.effort, done.reasoning.summary) == ("high", "auto")
    usage = done.usage
    assert usage is not None
    assert usage.output_tokens == len(SCRIPT) + 1  # and the end token
    assert usage.output_tokens_details.reasoning_tokens == THINKING_TOKENS
    # The effort reaches the template as chat's reasoning_effort would.
    assert seen(server) == [ChatMessage("user", "hi")]


def test_a_stream_is_the_reasoning_events_then_the_message_events(server: ServerThread) -> None:
    say(server, SCRIPT)
    got = events(post(server, {"model": "fake", "input": "hi", "stream": True}).content)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    kinds = [kind for kind, _ in got]
    thinking = [k for k in kinds if k == "response.reasoning_text.delta"]
    texts = [k for k in kinds if k == "response.output_text.delta"]
    assert thinking and texts
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *thinking,
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *texts,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for kind, data in got:
        by_kind.setdefault(kind, []).append(data)
    added = [d["item"] for d in by_kind["response.output_item.added"]]
    assert [(i["type"], i["status"]) for i in added] == [
        ("reasoning", "in_progress"),
        ("message", "in_progress"),
    ]
    rs_id, msg_id = added[0]["id"], added[1]["id"]
    deltas = by_kind["response.reasoning_text.delta"]
    assert {(d["item_id"], d["output_index"], d["content_index"]) for d in deltas} == {
        (rs_id, 0, 0)
    }
    assert "".join(d["delta"] for d in deltas) == THOUGHT
    [done] = by_kind["response.reasoning_text.done"]
    assert (done["item_id"], done["output_index"], done["text"]) == (rs_id, 0, THOUGHT)
    assert {d["output_index"] for d in by_kind["response.output_text.delta"]} == {1}
    assert "".join(d["delta"] for d in by_kind["response.output_text.delta"]) == ANSWER
    finished = [d["item"] for d in by_kind["response.output_item.done"]]
    assert finished[0] | {"id": None} == reasoning_item(THOUGHT) | {"id": None}
    assert finished[1]["id"] == msg_id
    response = by_kind["response.completed"][0]["response"]
    assert response["output"] == finished
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == THINKING_TOKENS
    # The plain answer holds the same items.
    say(server, SCRIPT)
    body = post(server, {"model": "fake", "input": "hi"}).json()
    assert without_ids(body["output"]) == without_ids(response["output"])


def test_the_sdk_streams_the_typed_reasoning_events(server: ServerThread) -> None:
    say(server, SCRIPT)
    client = sdk(server)
    streamed = list(client.responses.create(model="fake", input="hi", stream=True))
    numbers = [event.sequence_number for event in streamed]
    assert all(a < b for a, b in itertools.pairwise(numbers))
    kinds = [type(event) for event in streamed]
    first_text = kinds.index(ResponseTextDeltaEvent)
    assert kinds[:4] == [
        ResponseCreatedEvent,
        ResponseInProgressEvent,
        ResponseOutputItemAddedEvent,
        ResponseContentPartAddedEvent,
    ]
    assert ResponseReasoningTextDeltaEvent in kinds[:first_text]
    assert kinds[first_text - 5 : first_text] == [
        ResponseReasoningTextDoneEvent,
        ResponseContentPartDoneEvent,
        ResponseOutputItemDoneEvent,
        ResponseOutputItemAddedEvent,
        ResponseContentPartAddedEvent,
    ]
    thinking = [e for e in streamed if isinstance(e, ResponseReasoningTextDeltaEvent)]
    assert "".join(e.delta for e in thinking) == THOUGHT
    assert all(e.output_index == 0 and e.content_index == 0 for e in thinking)
    [text_done] = [e for e in streamed if isinstance(e, ResponseTextDoneEvent)]
    assert text_done.output_index == 1 and text_done.text == ANSWER
    last = streamed[-1]
    assert isinstance(last, ResponseCompletedEvent)
    assert last.response.output_text == ANSWER
    assert isinstance(last.response.output[0], ResponseReasoningItem)
    # The SDK's stream helper accumulates the same response.
    say(server, SCRIPT)
    with client.responses.stream(model="fake", input="hi") as stream:
        final = stream.get_final_response()
    assert final.output_text == ANSWER
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_thinking_the_budget_cut_is_incomplete(server: ServerThread) -> None:
    say(server, SCRIPT)
    body = {"model": "fake", "input": "hi", "max_output_tokens": 6}
    plain = post(server, body).json()
    assert plain["status"] == "incomplete"
    assert plain["incomplete_details"] == {"reason": "max_output_tokens"}
    thought, message = plain["output"]
    # Six tokens: the tag, "\n", "L", "e", "t", " " (thinking is trimmed at its ends).
    assert thought | {"id": None} == reasoning_item("Let", "incomplete") | {"id": None}
    assert message["type"] == "message" and message["status"] == "incomplete"
    assert message["content"][0]["text"] == ""
    assert plain["usage"]["output_tokens_details"]["reasoning_tokens"] == 6
    say(server, SCRIPT)
    got = events(post(server, body | {"stream": True}).content)
    kind, last = got[-1]
    assert kind == "response.incomplete"
    assert without_ids(last["response"]["output"]) == without_ids(plain["output"])


def test_a_call_after_thinking_is_the_second_item(server: ServerThread) -> None:
    say(server, f"{OPEN}I need the weather.{CLOSE}\n{CALL}")
    body = {"model": "fake", "input": "weather in Paris?", "tools": [WEATHER]}
    done = post(server, body).json()
    thought, call = done["output"]
    assert thought["content"][0]["text"] == "I need the weather."
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    say(server, f"{OPEN}I need the weather.{CLOSE}\n{CALL}")
    got = events(post(server, body | {"stream": True}).content)
    calls = [d for k, d in got if k.startswith("response.function_call_arguments")]
    assert calls and {d["output_index"] for d in calls} == {1}


def test_an_answer_that_starts_inside_the_block_thinks_first(opens: ServerThread) -> None:
    say(opens, f"Hmm.{CLOSE}Yes.")
    done = sdk(opens).responses.create(model="fake", input="hi")
    assert [item.type for item in done.output] == ["reasoning", "message"]
    thought = done.output[0]
    assert isinstance(thought, ResponseReasoningItem) and thought.content is not None
    assert thought.content[0].text == "Hmm." and done.output_text == "Yes."


# --- reasoning.effort ---


@pytest.mark.parametrize("effort", ["none", "minimal"])
def test_effort_none_turns_thinking_off(server: ServerThread, effort: str) -> None:
    say(server, ANSWER)
    on = post(server, {"model": "fake", "input": "hi", "reasoning": {"effort": "high"}}).json()
    say(server, ANSWER)
    off = post(server, {"model": "fake", "input": "hi", "reasoning": {"effort": effort}}).json()
    # The prompt now ends in a closed, empty block (the template's enable_thinking false).
    closed = len(f"{OPEN}\n\n{CLOSE}\n\n")
    assert off["usage"]["input_tokens"] == on["usage"]["input_tokens"] + closed
    assert [item["type"] for item in off["output"]] == ["message"]
    assert off["output"][0]["content"][0]["text"] == ANSWER
    assert off["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    assert off["reasoning"] == {"effort": effort, "summary": None}


def test_a_model_that_does_not_think_answers_as_before(plain: ServerThread) -> None:
    say(plain, ANSWER)
    body = post(plain, {"model": "fake", "input": "hi", "reasoning": {"effort": None}}).json()
    assert [item["type"] for item in body["output"]] == ["message"]
    assert body["reasoning"] == {"effort": None, "summary": None}
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"reasoning": {"summary": "auto"}}, "reasoning"),
        ({"max_reasoning_tokens": 10}, "max_reasoning_tokens"),
    ],
)
def test_reasoning_settings_for_a_model_that_does_not_think_are_a_400(
    plain: ServerThread, extra: dict[str, Any], param: str
) -> None:
    reply = post(plain, {"model": "fake", "input": "x"} | extra)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "xhigh"}}, "reasoning.effort"),
        ({"reasoning": {"effort": 3}}, "reasoning.effort"),
        ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
        ({"reasoning": {"context": "all_turns"}}, "reasoning.context"),
        ({"reasoning": "high"}, "reasoning"),
        ({"max_reasoning_tokens": 0}, "max_reasoning_tokens"),
        ({"reasoning": {"effort": "none"}, "max_reasoning_tokens": 5}, "max_reasoning_tokens"),
        ({"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "summary": []},
                    {"role": "user", "content": "y"}]}, "input[1]"),
        ({"input": [{"type": "reasoning", "content": [{"type": "output_text", "text": "t"}]},
                    {"role": "assistant", "content": "a"}]}, "input[0].content[0]"),
        ({"input": [{"type": "reasoning", "summary": "t"},
                    {"role": "assistant", "content": "a"}]}, "input[0].summary"),
    ],
)  # fmt: skip
def test_bad_reasoning_settings_are_a_400_naming_the_field(
    server: ServerThread, extra: dict[str, Any], param: str
) -> None:
    reply = post(server, {"model": "fake", "input": "x"} | extra)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_effort_none_where_the_template_cannot_turn_thinking_off_is_a_400(
    opens: ServerThread,
) -> None:
    reply = post(opens, {"model": "fake", "input": "x", "reasoning": {"effort": "none"}})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "reasoning.effort"
    say(opens, f"Hmm.{CLOSE}Yes.")
    reply = post(opens, {"model": "fake", "input": "x", "reasoning": {"effort": "low"}})
    assert reply.status_code == 200 and reply.json()["reasoning"]["effort"] == "low"


def test_a_thinking_budget_passes_through(server: ServerThread) -> None:
    decoder = server.decoder
    assert isinstance(decoder, RecordingDecoder)
    say(server, ANSWER)
    assert post(server, {"model": "fake", "input": "hi"}).status_code == 200
    assert decoder.last is not None and decoder.last.constraint is None  # free thinking
    say(server, SCRIPT)
    reply = post(server, {"model": "fake", "input": "hi", "max_reasoning_tokens": 5})
    assert reply.status_code == 200, reply.text
    # The block's grammar (reasoning.after_thinking) bounds it; the script model ignores it.
    assert decoder.last is not None and decoder.last.constraint is not None
    assert f"<[^{ord(CLOSE)}]>{{0,5}}" in decoder.last.constraint.grammar


# --- the next turn ---


def test_previous_response_id_carries_the_reasoning_to_the_next_turn(
    server: ServerThread,
) -> None:
    say(server, SCRIPT)
    first = post(server, {"model": "fake", "input": "hi"}).json()
    stored = sdk(server).responses.retrieve(first["id"])
    assert stored.to_dict()["output"] == first["output"]
    assert isinstance(stored.output[0], ResponseReasoningItem)
    say(server, "More.")
    second = post(
        server, {"model": "fake", "input": "and then?", "previous_response_id": first["id"]}
    ).json()
    assert second["status"] == "completed"
    assert seen(server) == [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", ANSWER, reasoning=THOUGHT),
        ChatMessage("user", "and then?"),
    ]
    items = sdk(server).responses.input_items.list(second["id"], order="asc").data
    assert [item.type for item in items] == ["message", "reasoning", "message", "message"]


def test_reasoning_items_sent_back_are_the_next_assistant_turns(server: ServerThread) -> None:
    say(server, "ok")
    thought = {"type": "reasoning", "summary": [], "content": [
        {"type": "reasoning_text", "text": THOUGHT}]}  # fmt: skip
    summary = [{"type": "summary_text", "text": "Thought briefly."}]
    summary_only = {"type": "reasoning", "summary": summary, "encrypted_content": "opaque"}
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather",
            "arguments": '{"city": "Paris"}'}  # fmt: skip
    body = {
        "model": "fake",
        "store": False,
        "tools": [WEATHER],
        "input": [
            {"role": "user", "content": "hi"},
            thought,
            {"role": "assistant", "content": ANSWER},
            {"role": "user", "content": "weather?"},
            summary_only,
            call,
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    }
    reply = post(server, body)
    assert reply.status_code == 200, reply.text
    assert seen(server) == [
        ChatMessage("user", "hi"),
        ChatMessage("assistant", ANSWER, reasoning=THOUGHT),
        ChatMessage("user", "weather?"),
        ChatMessage(
            "assistant",
            "",
            (ToolCall("c1", "get_weather", '{"city": "Paris"}'),),
            reasoning="Thought briefly.",
        ),
        ChatMessage("tool", "sunny", (), "c1"),
    ]


def test_a_model_that_does_not_think_accepts_reasoning_items(plain: ServerThread) -> None:
    say(plain, "ok")
    thought = {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]}
    body = {"model": "fake", "input": [
        {"role": "user", "content": "hi"}, thought, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "again"}]}  # fmt: skip
    reply = post(plain, body)
    assert reply.status_code == 200, reply.text
    assert [item["type"] for item in reply.json()["output"]] == ["message"]
