"""Tool calls: the request fields, the prompt, the grammar, reading calls out of text,
and the whole path over 127.0.0.1 (official SDK and raw HTTP, a scripted fake model)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator, Sequence
from typing import Any

import openai
import pydantic
import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.errors import OpenAIError
from adapters.openai.models import FakeChatModel
from adapters.openai.normalize import ChatJob, ChatMessage, ModelInfo, normalize_chat_request
from adapters.openai.tool_prompt import render_with_tools
from adapters.openai.toolcalls import Call, Content, HermesReader, Piece, read_answer
from adapters.openai.tools import Tool, ToolCall, ToolSetup, call_grammar
from adapters.runtime.worker_host import FakeDecoder
from core.fake_model import EOS_TOKEN
from core.protocol import Assignment, GenerationRequest
from tests.support.http_helpers import ServerThread, sse_events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
NAMES = frozenset({"get_weather", "search"})


def ids() -> Iterator[str]:
    return (f"call_{i}" for i in itertools.count())


# --- reading calls out of the model's text ---


def read_in_pieces(chunks: Sequence[str], parallel: bool = True) -> tuple[str, list[Piece]]:
    counter = ids()
    reader = HermesReader(NAMES, lambda: next(counter), parallel)
    pieces = [p for chunk in chunks for p in reader.feed(chunk)] + reader.finish()
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    return content, [p for p in pieces if isinstance(p, Call)]


def test_a_call_split_at_every_position_reads_the_same() -> None:
    text = "Let me look. " + CALL
    for cut in range(len(text) + 1):
        content, calls = read_in_pieces([text[:cut], text[cut:]])
        assert content == "Let me look. ", cut
        assert [(c.index, c.call.name, json.loads(c.call.arguments)) for c in calls] == [
            (0, "get_weather", {"city": "Paris"})
        ]
    content, calls = read_in_pieces(list(text))  # a character at a time
    assert content == "Let me look. " and len(calls) == 1


def test_a_partial_marker_is_held_back_then_released_as_text() -> None:
    counter = ids()
    reader = HermesReader(NAMES, lambda: next(counter))
    assert reader.feed("a <tool_") == [Content("a ")]  # "<tool_" might start a call
    assert reader.feed("box> b") == [Content("<tool_box> b")]  # it did not
    assert reader.feed("<") == []
    assert reader.finish() == [Content("<")]  # the end: what was held is text


@pytest.mark.parametrize(
    "text",
    [
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>',  # not a tool
        '<tool_call>{"name": "search", "arguments": "q"}</tool_call>',  # not an object
        '<tool_call>{"name": "search", "arguments": {}, "extra": 1}</tool_call>',
        '<tool_call>["search", {}]</tool_call>',
        '<tool_call>{"name": "search", "arguments": {"q": "unfinished',  # never closed
    ],
)
def test_a_malformed_call_stays_content(text: str) -> None:
    for chunks in ([text], list(text)):
        content, calls = read_in_pieces(["Hi ", *chunks])
        assert (content, calls) == ("Hi " + text, [])


def test_two_calls_are_two_tool_calls_and_the_whitespace_between_is_dropped() -> None:
    second = '<tool_call>{"name": "search", "arguments": {"q": "rain"}}</tool_call>'
    text = f"{CALL}\n \n{second}\n"
    content, calls = read_in_pieces(list(text))
    assert content == ""
    assert [(c.index, c.call.id, c.call.name) for c in calls] == [
        (0, "call_0", "get_weather"),
        (1, "call_1", "search"),
    ]
    assert read_answer(text, NAMES, lambda: "x")[0] is None  # only calls: content null


def test_without_parallel_calls_only_the_first_call_is_one() -> None:
    second = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    content, calls = read_in_pieces([CALL, "\n", second], parallel=False)
    assert [c.call.name for c in calls] == ["get_weather"]
    assert content == "\n" + second
    content, calls = read_in_pieces([CALL, "\n"], parallel=False)
    assert (content, len(calls)) == ("", 1)  # trailing whitespace is not content


def test_text_after_a_call_is_content() -> None:
    content, calls = read_in_pieces([CALL, " and done."])
    assert content == " and done." and len(calls) == 1


# --- the request fields ---

MODEL = ModelInfo("m", max_context=4000, vocab_size=1000)
seen_tools: list[tuple[Tool, ...]] = []


def tokenize(
    model_id: str,
    messages: Sequence[ChatMessage],
    tools: tuple[Tool, ...],
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    seen_tools.append(tools)
    return FakeChatModel().tokenize_chat(messages, tools)


def run(**fields: Any) -> ChatJob | OpenAIError:
    body = {"model": "m", "messages": [{"role": "user", "content": "weather?"}]} | fields
    return normalize_chat_request(body, {"m": MODEL}.get, tokenize, "req-1")


def refused_param(**fields: Any) -> str | None:
    error = run(**fields)
    assert isinstance(error, OpenAIError) and error.status == 400, error
    return error.param


def fn(**function: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f"} | function}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": "f"}, "tools"),
        ({"tools": [WEATHER] * 129}, "tools"),
        ({"tools": [5]}, "tools[0]"),
        ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [WEATHER, fn(name="bad name")]}, "tools[1].function.name"),
        ({"tools": [fn(name="x" * 65)]}, "tools[0].function.name"),
        ({"tools": [fn(name="")]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tools": [fn(description=5)]}, "tools[0].function.description"),
        ({"tools": [fn(strict="yes")]}, "tools[0].function.strict"),
        ({"tools": [fn(parameters="{}")]}, "tools[0].function.parameters"),
        ({"tools": [fn(parameters={"type": "string"})]}, "tools[0].function.parameters"),
        (
            {"tools": [fn(parameters={"properties": {"a": {"type": "strng"}}})]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [fn(parameters={"properties": {"a": {"pattern": "(?<=x)a"}}})]},
            "tools[0].function.parameters",
        ),
        ({"tools": [fn(parameters={"$ref": "#/nowhere"})]}, "tools[0].function.parameters"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "always", "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.type"),
        ({"tool_choice": {"type": "function"}, "tools": [WEATHER]}, "tool_choice.function"),
        (
            {"tool_choice": {"type": "function", "function": {}}, "tools": [WEATHER]},
            "tool_choice.function.name",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]},
            "tool_choice.function.name",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tool_choice.function.name"),
        ({"parallel_tool_calls": "no", "tools": [WEATHER]}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_400_naming_the_exact_param(fields: dict[str, Any], param: str) -> None:
    assert refused_param(**fields) == param


def history(*extra: dict[str, Any]) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    return [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        *extra,
    ]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([*history()[:1], {"role": "tool", "tool_call_id": "call_1", "content": "x"}],
         "messages[1].tool_call_id"),
        ([*history()[:2], {"role": "tool", "content": "x"}], "messages[2].tool_call_id"),
        ([*history()[:2], {"role": "tool", "tool_call_id": "call_9", "content": "x"}],
         "messages[2].tool_call_id"),
        ([*history()[:2], {"role": "tool", "tool_call_id": "call_1"}], "messages[2].content"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}],
         "messages[0].tool_calls[0].function.arguments"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "x", "function": {}}]}],
         "messages[0].tool_calls[0].type"),
        ([{"role": "assistant", "tool_calls": [{"id": "", "function": {}}]}],
         "messages[0].tool_calls[0].id"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}],
         "messages[0].tool_calls[0].function.name"),
        ([{"role": "assistant", "content": None}], "messages[0].content"),
    ],
)  # fmt: skip
def test_bad_tool_history_is_400_naming_the_message(messages: Any, param: str) -> None:
    assert refused_param(messages=messages) == param


def test_the_choice_decides_the_prompt_and_the_constraint() -> None:
    for choice, constrained, prompted in [
        (None, False, 2),
        ("auto", False, 2),
        ("none", False, 0),
        ("required", True, 2),
        ({"type": "function", "function": {"name": "search"}}, True, 2),
    ]:
        job = run(tools=[WEATHER, SEARCH], tool_choice=choice, n=2)
        assert isinstance(job, ChatJob), job
        assert all((r.constraint is not None) == constrained for r in job.requests)
        assert len(seen_tools[-1]) == prompted
        assert job.tools.parses == (choice != "none")
    named = run(
        tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {"name": "search"}}
    )
    assert isinstance(named, ChatJob) and [t.name for t in named.tools.callable] == ["search"]


def test_a_history_with_calls_and_results_is_accepted_and_rendered() -> None:
    job = run(messages=history({"role": "user", "content": "and tomorrow?"}), tools=[WEATHER])
    assert isinstance(job, ChatJob), job
    messages = [
        ChatMessage("user", "weather in Paris?"),
        ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "sunny, 21C", (), "call_1"),
        ChatMessage("tool", "windy", (), "call_1"),
    ]
    tool = Tool("get_weather", "The weather in a city", {"type": "object"}, None)
    rendered = render_with_tools(messages, (tool,))
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert '{"type": "function", "function": {"name": "get_weather"' in rendered[0]["content"]
    assert rendered[2]["content"] == CALL
    assert rendered[3]["content"] == (
        "<tool_response>\nsunny, 21C\n</tool_response>\n<tool_response>\nwindy\n</tool_response>"
    )
    with_system = render_with_tools([ChatMessage("system", "Be brief."), *messages[:1]], (tool,))
    assert with_system[0]["content"].startswith("Be brief.\n\n") and len(with_system) == 2


# --- over HTTP: a fake model that says what the test scripts ---


class ScriptContext:
    """Stands in for the fake model's context: the script's characters, then EOS."""

    def __init__(self, script: str) -> None:
        self.tokens = [ord(c) for c in script]
        self.index = 0

    def next_token(self) -> int:
        return self.tokens[self.index] if self.index < len(self.tokens) else EOS_TOKEN

    def feed(self, token: int) -> None:
        self.index += 1


class ScriptedDecoder(FakeDecoder):
    def __init__(self) -> None:
        super().__init__()
        self.script = ""

    def start(self, assignment: Assignment, request: GenerationRequest) -> None:
        super().start(assignment, request)
        self._running[assignment].decode.context = ScriptContext(self.script)  # type: ignore[assignment]


class ScriptModel(FakeChatModel):
    """Token t is the character chr(t) (the script decoder's output reads as its script).

    It says it constrains: its decoder writes whatever the test scripts, so a test
    stands in for the grammar by scripting a valid call (the real model is held to
    one in test_default_model.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.constrains = True

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t != EOS_TOKEN)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True), ScriptedDecoder(), ScriptModel()) as running:
        yield running


def say(server: ServerThread, script: str) -> None:
    decoder = server.decoder
    assert isinstance(decoder, ScriptedDecoder)
    decoder.script = script


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


class Weather(pydantic.BaseModel):
    city: str
    days: int = 1


def test_the_sdk_gets_a_required_call_with_a_pydantic_tool(server: ServerThread) -> None:
    say(
        server,
        '<tool_call>{"name": "Weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>',
    )
    client = sdk(server)
    done = client.chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "weather in Oslo?"}],
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice="required",
    )
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].id.startswith("call_")
    assert calls[0].function.name == "Weather"
    assert Weather.model_validate_json(calls[0].function.arguments) == Weather(city="Oslo", days=2)
    assert done.usage is not None and done.usage.completion_tokens == len(server.decoder.script) + 1
    parsed = client.chat.completions.parse(
        model="fake",
        messages=[{"role": "user", "content": "weather in Oslo?"}],
        tools=[openai.pydantic_function_tool(Weather)],
        tool_choice={"type": "function", "function": {"name": "Weather"}},
    )
    tool_calls = parsed.choices[0].message.tool_calls or []
    assert tool_calls[0].function.parsed_arguments == Weather(city="Oslo", days=2)


def test_the_sdk_streams_content_then_tool_call_deltas(server: ServerThread) -> None:
    second = '<tool_call>{"name": "search", "arguments": {"q": "umbrella"}}</tool_call>'
    say(server, f"Checking. {CALL}\n{second}")
    stream = sdk(server).chat.completions.create(
        model="fake",
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER, SEARCH],  # type: ignore[list-item]
        stream=True,
        stream_options={"include_usage": True},
    )
    content, calls, finish, usage = "", {}, None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and delta.function and delta.function.name
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += (delta.function and delta.function.arguments) or ""
    assert content == "Checking. "
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("search", {"q": "umbrella"}),
    ]
    assert len({c["id"] for c in calls.values()}) == 2
    assert usage is not None and usage.completion_tokens == len(f"Checking. {CALL}\n{second}") + 1


def test_raw_sse_tool_call_chunks_have_the_openai_shape(server: ServerThread) -> None:
    say(server, CALL)
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    response = requests.post(
        f"{server.base_url}/v1/chat/completions", json=body | {"stream": True}, timeout=30
    )
    events = sse_events(response.content)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["index"] == 0 and calls[0]["type"] == "function"
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Paris"}'}}
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert "".join(d.get("content") or "" for d in deltas) == ""


def test_a_malformed_call_comes_back_as_content(server: ServerThread) -> None:
    script = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    say(server, script)
    for stream in (False, True):
        body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
        response = requests.post(
            f"{server.base_url}/v1/chat/completions", json=body | {"stream": stream}, timeout=30
        )
        if stream:
            events = sse_events(response.content)[:-1]
            text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
            assert events[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            choice = response.json()["choices"][0]
            text = choice["message"]["content"]
            assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert text == script


def test_tool_choice_none_reads_no_calls_and_leaves_tools_out_of_the_prompt(
    server: ServerThread,
) -> None:
    say(server, CALL)
    model = ScriptModel()
    messages = [{"role": "user", "content": "x"}]
    body = {"model": "fake", "messages": messages, "tools": [WEATHER]}
    none = requests.post(
        f"{server.base_url}/v1/chat/completions", json=body | {"tool_choice": "none"}, timeout=30
    ).json()
    assert none["choices"][0]["message"]["content"] == CALL
    assert none["usage"]["prompt_tokens"] == len(model.tokenize_chat([ChatMessage("user", "x")]))
    auto = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30).json()
    assert auto["usage"]["prompt_tokens"] > none["usage"]["prompt_tokens"]  # the tools section


def test_a_multi_turn_history_through_the_sdk_counts_its_rendered_prompt(
    server: ServerThread,
) -> None:
    say(server, "It is sunny in Paris.")
    messages = history({"role": "user", "content": "thanks, and tomorrow?"})
    done = sdk(server).chat.completions.create(
        model="fake",
        messages=messages,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
    )
    assert done.choices[0].message.content == "It is sunny in Paris."
    assert done.choices[0].finish_reason == "stop" and not done.choices[0].message.tool_calls
    tool = Tool("get_weather", "The weather in a city", WEATHER["function"]["parameters"], None)  # type: ignore[index]
    expected = ScriptModel().tokenize_chat(
        [
            ChatMessage("user", "weather in Paris?"),
            ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
            ChatMessage("tool", "sunny, 21C", (), "call_1"),
            ChatMessage("user", "thanks, and tomorrow?"),
        ],
        (tool,),
    )
    assert done.usage is not None and done.usage.prompt_tokens == len(expected)


def test_a_model_that_cannot_constrain_refuses_required_calls() -> None:
    with ServerThread(ServeOptions(port=0, fake=True)) as plain:  # the fake model
        body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            reply = requests.post(
                f"{plain.base_url}/v1/chat/completions",
                json=body | {"tool_choice": choice},
                timeout=30,
            )
            assert reply.status_code == 400 and reply.json()["error"]["param"] == "tool_choice"
        auto = requests.post(f"{plain.base_url}/v1/chat/completions", json=body, timeout=30)
        assert auto.status_code == 200  # auto needs no grammar: the answer is read for calls


def test_bad_tool_input_over_http_is_an_openai_400(server: ServerThread) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]}
    response = requests.post(
        f"{server.base_url}/v1/chat/completions",
        json=body | {"tools": [WEATHER, fn(name="no spaces allowed")], "stream": True},
        timeout=30,
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "tools[1].function.name"
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(server).chat.completions.create(
            model="fake",
            messages=[*history()[:2], {"role": "tool", "tool_call_id": "call_2", "content": "x"}],  # type: ignore[arg-type]
        )
    assert caught.value.body["param"] == "messages[2].tool_call_id"  # type: ignore[index]


# --- the grammar of a required call (llguidance, a byte-level BPE tokenizer built here) ---


@pytest.fixture(scope="module")
def grammar_tokenizer() -> Any:
    import llguidance.hf

    from tests.openai.test_tokenizer_families import byte_level

    return llguidance.hf.from_tokenizer(byte_level())


def admits(tokenizer: Any, setup: ToolSetup, text: str) -> bool:
    """Whether the grammar takes `text` whole and is then complete."""
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer, call_grammar(setup))
    encoded = tokenizer.tokenize_str(text)
    return matcher.consume_tokens(encoded) and matcher.is_accepting()


def test_the_required_grammar_admits_exactly_calls_of_the_tools(grammar_tokenizer: Any) -> None:
    job = run(tools=[WEATHER, SEARCH], tool_choice="required")
    assert isinstance(job, ChatJob)
    second = '<tool_call>{"name": "search", "arguments": {"q": "rain"}}</tool_call>'
    for text, ok in [
        (CALL, True),
        (CALL + second, True),  # parallel calls allowed: one after the other
        (CALL.replace('"Paris"', '"Paris", "days": 2'), True),
        ('<tool_call>{"name": "get_weather", "arguments": {"days": 2}}</tool_call>', False),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": 5}}</tool_call>', False),
        ('<tool_call>{"name": "delete_all", "arguments": {}}</tool_call>', False),
        ('<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>', False),
        ("Sure! " + CALL, False),
        (CALL[:-1], False),  # not complete
    ]:  # fmt: skip
        assert admits(grammar_tokenizer, job.tools, text) == ok, text
    single = run(tools=[WEATHER, SEARCH], tool_choice="required", parallel_tool_calls=False)
    named = run(
        tools=[WEATHER, SEARCH], tool_choice={"type": "function", "function": {"name": "search"}}
    )
    assert isinstance(single, ChatJob) and isinstance(named, ChatJob)
    assert not admits(grammar_tokenizer, single.tools, CALL + second)
    assert admits(grammar_tokenizer, named.tools, second)
    assert not admits(grammar_tokenizer, named.tools, CALL)  # not the named function


def test_a_required_call_replaces_the_response_format_grammar() -> None:
    json_object = {"type": "json_object"}
    required = run(tools=[WEATHER], tool_choice="required", response_format=json_object)
    auto = run(tools=[WEATHER], response_format=json_object)
    plain = run(tools=[WEATHER], tool_choice="required")
    assert isinstance(required, ChatJob) and isinstance(auto, ChatJob)
    assert isinstance(plain, ChatJob)
    assert required.requests[0].constraint == plain.requests[0].constraint  # the call's
    assert auto.requests[0].constraint == auto.shared.constraint is not None  # the format's


# --- a chat template that renders tools itself gets them (and the history) as data ---

TOOL_TEMPLATE = (
    "{% if tools %}[tools:{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "(call {{ c.function.name }} {{ c.function.arguments.city }}){% endfor %}{% endif %}"
    "{% if m.tool_call_id %}(result of {{ m.tool_call_id }}){% endif %}"
    "{{ m.content or '' }}{% endfor %}<assistant>"
)


def test_a_template_that_renders_tools_gets_them_and_the_history_as_data() -> None:
    from adapters.openai.models import ChatModel
    from tests.openai.test_tokenizer_families import byte_level

    plain = byte_level()
    plain.chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    assert not ChatModel("plain", plain, 512).template_renders_tools
    tokenizer = byte_level()
    tokenizer.chat_template = TOOL_TEMPLATE
    model = ChatModel("aware", tokenizer, 512)
    assert model.template_renders_tools
    tool = Tool("get_weather", None, {"type": "object"}, None)
    messages = [
        ChatMessage("user", "weather?"),
        ChatMessage("assistant", "", (ToolCall("call_1", "get_weather", '{"city": "Paris"}'),)),
        ChatMessage("tool", "sunny", (), "call_1"),
    ]
    text = tokenizer.decode(model.tokenize_chat(messages, (tool,)))
    assert text == (
        "[tools:get_weather;]<user>weather?<assistant>(call get_weather Paris)"
        "<tool>(result of call_1)sunny<assistant>"
    )


def test_a_schema_nested_past_what_the_grammar_engine_takes_is_a_400() -> None:
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(300):
        deep = {"type": "object", "properties": {"a": deep}}
    assert refused_param(tools=[fn(parameters=deep)]) == "tools[0].function.parameters"


def test_stop_strings_apply_before_calls_are_read_streamed_and_not(server: ServerThread) -> None:
    say(server, f"Looking. {CALL} END and more text")
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER]}
    url = f"{server.base_url}/v1/chat/completions"
    for stop, content, finish in [("END", "Looking. ", "tool_calls"), ("Paris", "", "stop")]:
        plain = requests.post(url, json=body | {"stop": stop}, timeout=30).json()
        choice = plain["choices"][0]
        streamed = sse_events(
            requests.post(
                url,
                json=body
                | {"stop": stop, "stream": True, "stream_options": {"include_usage": True}},
                timeout=30,
            ).content
        )
        deltas = [e["choices"][0] for e in streamed[:-1] if e["choices"]]
        text = "".join(d["delta"].get("content") or "" for d in deltas)
        calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
        if finish == "tool_calls":  # the stop string ends the text after the call
            assert choice["message"]["content"] == text == content
            assert len(choice["message"]["tool_calls"]) == 1 and len(calls) == 2
        else:  # the stop string cut the call: what is left of it is content
            cut = CALL[: CALL.index("Paris")]
            assert choice["message"]["content"] == text == "Looking. " + cut
            assert "tool_calls" not in choice["message"] and calls == []
        assert choice["finish_reason"] == deltas[-1]["finish_reason"] == finish
        usage = streamed[-2]["usage"]
        assert usage == plain["usage"]
        script = f"Looking. {CALL} END"
        assert usage["completion_tokens"] == script.index(stop) + len(stop)  # up to the stop
