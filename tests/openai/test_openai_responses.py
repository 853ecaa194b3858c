"""The Responses API over 127.0.0.1 with the official SDK (only base_url changed): plain and
streamed answers, tools and their round trips, structured output, the store and
previous_response_id, logprobs, and every refusal naming its field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pydantic
import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.normalize import ChatMessage
from adapters.openai.tools import Tool, ToolCall
from tests.openai.test_openai_logprobs import MODEL as FAKE
from tests.openai.test_openai_logprobs import chat_entries, reference
from tests.openai.test_openai_server import FailingDecoder, wait_settled
from tests.openai.test_openai_tools import ScriptedDecoder, ScriptModel, say
from tests.support.http_helpers import ServerThread

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True), ScriptedDecoder(), ScriptModel()) as running:
        yield running


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def post(server: ServerThread, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{server.base_url}/v1/responses", json=body, timeout=30)


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event line, decoded data) of each SSE block; the two must name the same type."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append((lines["event"], data))
    return out


def prompt_tokens(messages: list[ChatMessage], tools: tuple[Tool, ...] = ()) -> int:
    return len(ScriptModel().tokenize_chat(messages, tools))


# --- plain and streamed text ---


def test_the_sdk_creates_a_response_and_reads_output_text(server: ServerThread) -> None:
    say(server, "Hello there.")
    done = sdk(server).responses.create(
        model="fake", input="hi", instructions="Be brief.", metadata={"k": "v"}
    )
    assert done.id.startswith("resp_") and done.object == "response"
    assert done.status == "completed" and done.error is None and done.incomplete_details is None
    assert done.output_text == "Hello there."
    [item] = done.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    assert item.id.startswith("msg_")
    assert done.instructions == "Be brief." and done.metadata == {"k": "v"}
    usage = done.usage
    assert usage is not None
    expected = prompt_tokens([ChatMessage("system", "Be brief."), ChatMessage("user", "hi")])
    assert usage.input_tokens == expected
    assert usage.output_tokens == len("Hello there.") + 1  # and the end token
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_the_token_budget_ends_it_incomplete(server: ServerThread) -> None:
    say(server, "A long answer that will not fit.")
    client = sdk(server)
    done = client.responses.create(model="fake", input="hi", max_output_tokens=6)
    assert done.status == "incomplete"
    assert done.incomplete_details is not None
    assert done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == "A long" and done.output[0].status == "incomplete"  # type: ignore[union-attr]
    with client.responses.stream(model="fake", input="hi", max_output_tokens=6) as stream:
        kinds = [event.type for event in stream]
    assert kinds[-1] == "response.incomplete"
    assert "response.completed" not in kinds


def test_a_stream_is_the_typed_events_in_order_numbered_from_zero(server: ServerThread) -> None:
    say(server, "One two three.")
    reply = post(server, {"model": "fake", "input": "count", "stream": True})
    assert reply.headers["content-type"].startswith("text/event-stream")
    got = events(reply.content)
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    kinds = [kind for kind, _ in got]
    deltas = [k for k in kinds if k == "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert deltas
    by_kind = {kind: data for kind, data in got}
    text = "".join(d["delta"] for k, d in got if k == "response.output_text.delta")
    assert text == "One two three." == by_kind["response.output_text.done"]["text"]
    created = by_kind["response.created"]["response"]
    assert created["status"] == "in_progress" and created["output"] == [] and not created["usage"]
    final = by_kind["response.completed"]["response"]
    assert final["id"] == created["id"] and final["status"] == "completed"
    assert final["output"] == [by_kind["response.output_item.done"]["item"]]
    assert final["usage"]["output_tokens"] == len("One two three.") + 1
    item_id = by_kind["response.output_item.added"]["item"]["id"]
    assert all(d["item_id"] == item_id for k, d in got if "output_text" in k or "part" in k)


def test_the_sdk_stream_helper_gives_the_final_response(server: ServerThread) -> None:
    say(server, "Streamed words.")
    with sdk(server).responses.stream(model="fake", input="go") as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == "Streamed words."
    stored = sdk(server).responses.retrieve(final.id)
    assert stored.output_text == "Streamed words." and stored.status == "completed"


# --- tools ---


def test_a_call_then_its_output_then_the_final_text(server: ServerThread) -> None:
    client = sdk(server)
    say(server, CALL)
    first = client.responses.create(
        model="fake",
        input="weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
    )
    [call] = first.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
    assert first.output_text == "" and first.tools[0].name == "get_weather"  # type: ignore[union-attr]
    say(server, "It is sunny in Paris.")
    history: list[Any] = [
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"},
    ]  # fmt: skip
    second = client.responses.create(model="fake", input=history, tools=[WEATHER])  # type: ignore[list-item]
    assert second.output_text == "It is sunny in Paris."
    tool = Tool("get_weather", "The weather in a city", WEATHER["parameters"], True)  # type: ignore[arg-type]
    turns = [
        ChatMessage("user", "weather in Paris?"),
        ChatMessage("assistant", "", (ToolCall(call.call_id, call.name, call.arguments),)),
        ChatMessage("tool", "sunny, 21C", (), call.call_id),
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == prompt_tokens(turns, (tool,))
    # The same round trip, continued from the stored first response.
    third = client.responses.create(
        model="fake",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}],
        tools=[WEATHER],  # type: ignore[list-item]
    )
    assert third.output_text == "It is sunny in Paris."
    assert third.previous_response_id == first.id
    assert third.usage is not None and third.usage.input_tokens == second.usage.input_tokens


def test_a_streamed_call_has_argument_events_and_the_text_before_it(server: ServerThread) -> None:
    say(server, f"Checking. {CALL}")
    body = {"model": "fake", "input": "x", "tools": [WEATHER], "stream": True}
    got = events(post(server, body).content)
    kinds = [k for k, _ in got]
    assert [data["sequence_number"] for _, data in got] == list(range(len(got)))
    call_added = kinds.index("response.output_item.added", kinds.index("response.output_item.done"))
    assert kinds[call_added:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = got[-1][1]["response"]
    message, call = final["output"]
    assert message["content"][0]["text"] == "Checking. "
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert got[call_added + 2][1]["arguments"] == call["arguments"]
    assert all(d["output_index"] == 1 for _, d in got[call_added:-1])
    with sdk(server).responses.stream(model="fake", input="x", tools=[WEATHER]) as stream:  # type: ignore[list-item]
        final_sdk = stream.get_final_response()
    assert [item.type for item in final_sdk.output] == ["message", "function_call"]


def test_a_required_named_tool_choice_is_held_to_a_call(server: ServerThread) -> None:
    say(server, CALL)
    done = post(
        server,
        {"model": "fake", "input": "x", "tools": [WEATHER],
         "tool_choice": {"type": "function", "name": "get_weather"}},
    ).json()  # fmt: skip
    assert done["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert [item["type"] for item in done["output"]] == ["function_call"]
    say(server, "no call")
    none = post(server, {"model": "fake", "input": "x", "tools": [WEATHER], "tool_choice": "none"})
    assert none.json()["output"][0]["content"][0]["text"] == "no call"


def test_parallel_calls_off_reads_one_call_and_the_settings_are_echoed(
    server: ServerThread,
) -> None:
    second = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    say(server, CALL + second)
    body = {
        "model": "fake", "input": "x", "tools": [WEATHER], "temperature": 0.5, "top_p": 0.9,
        "user": "u-1", "truncation": "disabled", "max_output_tokens": 200,
    }  # fmt: skip
    both = post(server, body).json()
    assert [i["type"] for i in both["output"]] == ["function_call", "function_call"]
    one = post(server, body | {"parallel_tool_calls": False}).json()
    assert [i["type"] for i in one["output"]] == ["function_call", "message"]
    assert one["output"][1]["content"][0]["text"] == second  # the rest stays text
    assert one["parallel_tool_calls"] is False and both["parallel_tool_calls"] is True
    echoed = {
        k: one[k] for k in ("temperature", "top_p", "user", "truncation", "max_output_tokens")
    }
    assert echoed == {
        "temperature": 0.5, "top_p": 0.9, "user": "u-1", "truncation": "disabled",
        "max_output_tokens": 200,
    }  # fmt: skip
    assert one["tools"] == [WEATHER] and one["text"]["format"] == {"type": "text"}


# --- structured output ---


class Weather(pydantic.BaseModel):
    city: str
    degrees: int


def test_parse_with_a_pydantic_text_format_plain_and_streamed(server: ServerThread) -> None:
    say(server, '{"city": "Oslo", "degrees": 3}')
    client = sdk(server)
    parsed = client.responses.parse(model="fake", input="weather?", text_format=Weather)
    assert parsed.output_parsed == Weather(city="Oslo", degrees=3)
    assert parsed.text.format.type == "json_schema"  # type: ignore[union-attr]
    with client.responses.stream(model="fake", input="weather?", text_format=Weather) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == Weather(city="Oslo", degrees=3)


def test_a_schema_the_grammar_engine_refuses_names_text_format(server: ServerThread) -> None:
    form = {"type": "json_schema", "name": "x", "schema": {"type": "object", "uniqueItems": True}}
    reply = post(server, {"model": "fake", "input": "x", "text": {"format": form}})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "text.format"


# --- the store ---


def test_stored_responses_are_read_deleted_and_continued(server: ServerThread) -> None:
    client = sdk(server)
    say(server, "First answer.")
    first = client.responses.create(model="fake", input="one")
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"]  # type: ignore[union-attr]
    say(server, "Second answer.")
    second = client.responses.create(model="fake", input="two", previous_response_id=first.id)
    turns = [
        ChatMessage("user", "one"),
        ChatMessage("assistant", "First answer."),
        ChatMessage("user", "two"),
    ]
    assert second.usage is not None and second.usage.input_tokens == prompt_tokens(turns)
    listed = requests.get(
        f"{server.base_url}/v1/responses/{second.id}/input_items?order=asc", timeout=10
    ).json()
    texts = [i["content"][0]["text"] for i in listed["data"]]
    assert texts == ["one", "First answer.", "two"] and listed["has_more"] is False
    client.responses.delete(first.id)
    for method in (requests.get, requests.delete):
        gone = method(f"{server.base_url}/v1/responses/{first.id}", timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="fake", input="three", previous_response_id=first.id)
    assert refused.value.code == "previous_response_not_found"
    assert refused.value.param == "previous_response_id"  # type: ignore[attr-defined]


def test_store_false_keeps_nothing(server: ServerThread) -> None:
    say(server, "Ephemeral.")
    done = sdk(server).responses.create(model="fake", input="x", store=False)
    assert done.store is False
    assert requests.get(f"{server.base_url}/v1/responses/{done.id}", timeout=10).status_code == 404


def test_a_router_with_its_own_memory_store_does_not_know_the_response() -> None:
    with (
        ServerThread(ServeOptions(port=0, fake=True)) as one,
        ServerThread(ServeOptions(port=0, fake=True)) as two,
    ):
        first = sdk(one).responses.create(model="fake", input="x", max_output_tokens=4)
        with pytest.raises(openai.BadRequestError) as refused:
            sdk(two).responses.create(model="fake", input="y", previous_response_id=first.id)
        assert refused.value.code == "previous_response_not_found"


# --- logprobs, errors mid-stream, disconnects (the fake model) ---


def test_included_logprobs_are_the_models_records() -> None:
    with ServerThread(ServeOptions(port=0, fake=True)) as fake:
        body = {
            "model": "fake", "input": "tell me", "max_output_tokens": 20, "temperature": 0,
            "include": ["message.output_text.logprobs"], "top_logprobs": 3,
        }  # fmt: skip
        done = requests.post(f"{fake.base_url}/v1/responses", json=body, timeout=30).json()
        prompt = FAKE.tokenize_chat([ChatMessage("user", "tell me")])
        expected = chat_entries(reference(prompt, 20, 3))
        part = done["output"][0]["content"][0]
        assert part["logprobs"] == expected
        streamed = requests.post(
            f"{fake.base_url}/v1/responses", json=body | {"stream": True}, timeout=30
        )
        got = events(streamed.content)
        deltas = [d for k, d in got if k == "response.output_text.delta"]
        assert [e for d in deltas for e in d["logprobs"]] == expected
        assert all("".join(e["token"] for e in d["logprobs"]) == d["delta"] for d in deltas)
        plain = requests.post(
            f"{fake.base_url}/v1/responses", json=body | {"include": []}, timeout=30
        ).json()
        assert plain["output"][0]["content"][0]["logprobs"] == []


def test_an_error_after_the_stream_began_is_response_failed() -> None:
    with ServerThread(ServeOptions(port=0, fake=True), decoder=FailingDecoder(after=5)) as failing:
        reply = requests.post(
            f"{failing.base_url}/v1/responses",
            json={"model": "fake", "input": "x", "max_output_tokens": 100, "stream": True},
            timeout=30,
        )
        got = events(reply.content)
        kind, data = got[-1]
        assert kind == "response.failed"
        assert data["response"]["status"] == "failed"
        assert data["response"]["error"]["code"] == "failed"
        assert [d["sequence_number"] for _, d in got] == list(range(len(got)))
        wait_settled(failing)


def test_a_client_that_leaves_cancels_the_generation() -> None:
    with ServerThread(ServeOptions(port=0, fake=True, fake_step_ms=20)) as slow:
        # Unstored: nothing waits for the client to rejoin (test_stored_responses.py).
        body = {"model": "fake", "input": "x", "max_output_tokens": 2000, "stream": True,
                "store": False}  # fmt: skip
        with requests.post(
            f"{slow.base_url}/v1/responses", json=body, stream=True, timeout=30
        ) as reply:
            for line in reply.iter_lines():
                if line.startswith(b"event: response.output_text.delta"):
                    break
        wait_settled(slow)


# --- refusals ---


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
        ({"background": True, "store": False}, "background"),
        ({"background": "yes"}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "input[0].content[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),  # no turn after it
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c",
                     "output": [{"type": "input_image", "image_url": "x"}]}]},
         "input[1].output[0]"),
        ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "x"}]},
         "input[0].call_id"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}},
         "tool_choice.name"),
        ({"tools": [WEATHER | {"name": "bad name!"}]}, "tools[0].name"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"model": "nope"}, "model"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_the_field(
    server: ServerThread, extra: dict[str, Any], param: str
) -> None:
    reply = post(server, {"model": "fake", "input": "x"} | extra)
    assert reply.status_code in (400, 404), reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored(server: ServerThread) -> None:
    say(server, "ok")
    reply = post(server, {"model": "fake", "input": "x", "some_future_field": {"a": 1}})
    assert reply.status_code == 200 and reply.json()["status"] == "completed"
    assert reply.json()["output"][0]["content"][0]["text"] == "ok"
