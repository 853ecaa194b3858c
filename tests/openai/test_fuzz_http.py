"""Fuzzing the served endpoints over TCP: whatever the body, no 5xx, always the envelope.

hypothesis builds request bodies around the real schema (so many get far into
validation, and some are valid and generate) and around it: wrong types, huge
and negative numbers, deep nesting, odd unicode, missing and duplicated
fields, bytes that are not JSON. Each goes to a real server on 127.0.0.1
(fake model): /v1/chat/completions, and /v1/completions with its own fields
(prompts as text, token ids in and out of the vocabulary, lists of them past
the batch limit; echo, suffix, best_of; n, up to 16 choices for each of up to
16 prompts; response_format on both, with drawn JSON Schemas that reach the
grammar engine's validation). Tool requests get their own run (a server with
a context that holds the tools section): valid tools and choices over valid
histories, and malformed tools, choices, calls and tool messages. The default
run sends
FENCEPOST_FUZZ_EXAMPLES (1,000) cases to chat and half as many to completions;
set it higher for a longer run (README).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.cli.serve import ServeOptions
from adapters.openai.models import FakeChatModel
from core.fake_model import VOCAB
from tests.support.http_helpers import ServerThread, sse_events

EXAMPLES = int(os.environ.get("FENCEPOST_FUZZ_EXAMPLES", "1000"))
CONTEXT = 256  # small, so valid requests without max_tokens stay quick
TOOL_CONTEXT = 2048

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
odd_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=120)  # controls, RTL, emoji
numbers = st.integers(-5, 30) | st.sampled_from([0, -1, 2**31, 2**63, 2**64, 10**30]) | json_values
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": odd_text})
other_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["image_url", "input_audio", "file", "", "TEXT"]) | json_values},
    optional={"image_url": json_values, "text": json_values},
)
content = odd_text | st.lists(text_part | other_part, max_size=3) | json_values
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "bot"])
# Tools: names on both sides of the pattern, schemas llguidance takes and ones it refuses.
tool_names = st.sampled_from(["get_weather", "f", "x" * 64, "x" * 65, "", "a b", "é"]) | json_values
parameter_schemas = st.sampled_from([
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    {"type": "object"}, {}, {"type": "string"}, {"properties": {"a": {"type": "strng"}}},
    {"properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}, {"$ref": "#/nowhere"},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 3}}},
]) | json_values  # fmt: skip
function = st.fixed_dictionaries(
    {"name": tool_names},
    optional={"description": odd_text | json_values, "parameters": parameter_schemas,
              "strict": st.booleans() | json_values},
)  # fmt: skip
tool = st.fixed_dictionaries({"type": st.just("function") | json_values, "function": function})
tool_choices = (
    st.sampled_from(["none", "auto", "required", "any"])
    | st.fixed_dictionaries(
        {"type": st.just("function") | json_values, "function": st.fixed_dictionaries(
            {"name": tool_names})}
    )
    | json_values
)  # fmt: skip
call_ids = st.sampled_from(["call_1", "call_2", ""]) | json_values
tool_call = st.fixed_dictionaries(
    {"id": call_ids, "function": st.fixed_dictionaries(
        {"name": tool_names, "arguments": st.sampled_from(['{"city": "Paris"}', "{", ""])
         | json_values})},
    optional={"type": st.just("function") | json_values},
)  # fmt: skip
message = st.fixed_dictionaries(
    {},
    optional={"role": roles | json_values, "content": content | st.none(), "name": json_values,
              "tool_calls": st.lists(tool_call, max_size=2) | json_values,
              "tool_call_id": call_ids},
)  # fmt: skip
# JSON Schemas: mostly real keywords, with sensible and nonsense values, nested.
schema_keywords = st.sampled_from(
    ["type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf", "allOf",
     "not", "$ref", "$defs", "pattern", "format", "minimum", "maxLength", "minItems",
     "additionalProperties", "uniqueItems", "prefixItems", "if", "x-guidance"]
)  # fmt: skip
schema_values = st.sampled_from(
    ["object", "string", "integer", "array", "null", "nope", "#/$defs/a", "#", "(", "^a+$",
     "date-time", -1, 0, 3, True, False, None, [], ["a"]]
)  # fmt: skip
schemas = st.recursive(
    st.dictionaries(schema_keywords, schema_values | json_values, max_size=3),
    lambda inner: st.dictionaries(
        schema_keywords, inner | st.lists(inner, max_size=3) | schema_values, max_size=4
    )
    | st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
        st.text(max_size=5), inner, max_size=3)}),
    max_leaves=12,
)  # fmt: skip
spec_fields = {
    "name": st.sampled_from(["person", "a-b_1", "", "has space", "x" * 65]) | json_values,
    "schema": schemas | json_values,
    "strict": st.booleans() | json_values,
    "description": odd_text | json_values,
}
json_schema_specs = st.fixed_dictionaries(  # mostly well-formed, so schemas reach validation
    {"name": st.just("person"), "schema": schemas},
    optional={"strict": st.booleans(), "description": st.text(max_size=20)},
) | st.fixed_dictionaries({}, optional=spec_fields)
# Values on both sides of every documented limit (inclusive edges are accepted).
EDGES: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.sampled_from([0, 0.0, -0.0, 2, 2.0, 2.000001, -1e-9, 1e-300]),
    "top_p": st.sampled_from([0, 0.0, 1e-9, 1, 1.0, 1.000001, -0.0]),
    "stop": st.sampled_from(
        [["a", "b", "c", "d"], ["a", "b", "c", "d", "e"], "x" * 256, "x" * 257, "", [], [""]]
    ),
    "seed": st.sampled_from([-(2**63), -(2**63) - 1, 2**63 - 1, 2**63, 0]),
    "response_format": st.sampled_from([{}, {"type": "text"}, {"type": "json_object"}, None])
    | st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": json_schema_specs}),
    # around the context: the prompt takes a few dozen tokens of CONTEXT
    "max_tokens": st.integers(CONTEXT - 60, CONTEXT + 1) | st.sampled_from([0, 1, CONTEXT]),
}
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("fake") | st.sampled_from(["", "gpt-4o", "FAKE"]) | json_values,
    "messages": st.lists(message, min_size=1, max_size=4) | json_values,
    "max_tokens": numbers | EDGES["max_tokens"],
    "max_completion_tokens": numbers | EDGES["max_tokens"],
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values})
    | json_values,
    "temperature": st.floats(-1, 3) | EDGES["temperature"] | json_values,
    "top_p": st.floats(-0.5, 1.5) | EDGES["top_p"] | json_values,
    "stop": odd_text | st.lists(odd_text, max_size=6) | EDGES["stop"] | json_values,
    "seed": numbers | EDGES["seed"],
    "n": st.sampled_from([1, 2, 3, 16, 17, 0, False, True, -1, 2.0]) | json_values,
    "tools": st.lists(tool, max_size=3) | json_values,
    "tool_choice": tool_choices,
    "parallel_tool_calls": st.booleans() | json_values,
    "logprobs": st.sampled_from([True, False, 0, 1, None]) | json_values,
    "top_logprobs": st.sampled_from([0, 1, 20, 21, -1, True, 2.0]) | json_values,
    "response_format": EDGES["response_format"] | json_values,
    "logit_bias": json_values,
    "presence_penalty": json_values,
    "user": json_values,
    "metadata": json_values,
    "x-unknown": json_values,
}
# Tool requests that get past the other fields: valid histories (a call and its
# result) and valid tools beside malformed ones, so the tool paths run deep.
HISTORY = [
    {"role": "user", "content": "weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip
good_histories = st.sampled_from([HISTORY[:1], HISTORY, [*HISTORY, HISTORY[0]]])
histories = good_histories | st.lists(st.sampled_from(HISTORY) | message, min_size=1, max_size=4)
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
SEARCH_TOOL = {"type": "function", "function": {"name": "search"}}
GOOD_CHOICES = ["none", "auto", "required", {"type": "function", "function": {"name": "search"}}]
tool_bodies = st.fixed_dictionaries(  # valid tools and choices, histories mostly valid ...
    {"model": st.just("fake"), "messages": good_histories,
     "tools": st.just([WEATHER_TOOL, SEARCH_TOOL])},
    optional={"tool_choice": st.sampled_from(GOOD_CHOICES), "parallel_tool_calls": st.booleans(),
              "stream": st.booleans(), "max_tokens": st.integers(1, 40), "n": st.just(2)},
) | st.fixed_dictionaries(  # ... or anything in the tool fields
    {"model": st.just("fake"), "messages": histories},
    optional={"tools": st.lists(st.just(WEATHER_TOOL) | tool, max_size=3) | json_values,
              "tool_choice": tool_choices, "parallel_tool_calls": st.booleans() | json_values,
              "stream": st.booleans()},
)  # fmt: skip
token_ids = st.integers(-2, 60) | st.sampled_from([VOCAB - 1, VOCAB, 2**63, True]) | json_values
COMPLETION_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    k: v
    for k, v in FIELDS.items()
    if k not in ("messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls")
} | {
    "prompt": odd_text
    | st.lists(odd_text, max_size=18)
    | st.lists(token_ids, max_size=20)
    | st.lists(st.lists(token_ids, max_size=6), max_size=18)
    | json_values,
    "echo": st.booleans() | json_values,
    "suffix": st.sampled_from(["", "x"]) | json_values,
    "best_of": st.sampled_from([1, 2, 0, True]) | json_values,
    "logprobs": st.sampled_from([0, 1, 5, 20, 21, -1, False, True, None, 2.0]) | json_values,
}


class Endpoint(NamedTuple):
    path: str
    fields: dict[str, st.SearchStrategy[Any]]
    required: dict[str, Any]  # the required fields with valid values
    objects: tuple[str, str]  # the object of a streamed chunk, of a plain response

    def bodies(self) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries(  # the required fields valid, the rest drawn ...
            {k: st.just(v) for k, v in self.required.items()},
            optional={k: v for k, v in self.fields.items() if k not in self.required},
        ) | st.fixed_dictionaries({}, optional=self.fields)  # ... or all drawn, any missing


CHAT = Endpoint(
    "/v1/chat/completions",
    FIELDS,
    {"model": "fake", "messages": [{"role": "user", "content": "hi"}]},
    ("chat.completion.chunk", "chat.completion"),
)
COMPLETIONS = Endpoint(
    "/v1/completions",
    COMPLETION_FIELDS,
    {"model": "fake", "prompt": "hi"},
    ("text_completion", "text_completion"),
)


@st.composite
def payloads(draw: st.DrawFn, endpoint: Endpoint) -> tuple[str, bytes]:
    """(content type, raw body)."""
    bodies = endpoint.bodies()
    kind = draw(st.sampled_from(["json"] * 6 + ["duplicate", "nested", "garbage", "any", "type"]))
    if kind == "json":
        return "application/json", json.dumps(draw(bodies)).encode()
    if kind == "duplicate":  # the same key twice: the last one counts, as in most parsers
        body = draw(bodies)
        extra = draw(st.sampled_from(sorted(endpoint.fields)))
        text = json.dumps(body)[:-1] if body else "{"
        sep = ", " if body else ""
        return (
            "application/json",
            f'{text}{sep}"{extra}": {json.dumps(draw(endpoint.fields[extra]))}}}'.encode(),
        )
    if kind == "nested":
        depth = draw(st.integers(1, 5000))
        nested = "[" * depth + "]" * depth
        field = "messages" if endpoint is CHAT else "prompt"
        return "application/json", f'{{"model": "fake", "{field}": {nested}}}'.encode()
    if kind == "garbage":
        return "application/json", draw(st.binary(max_size=200))
    if kind == "any":
        return "application/json", json.dumps(draw(json_values)).encode()
    ctype = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", "", "json"]))
    return ctype, json.dumps(draw(bodies)).encode()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    options = ServeOptions(port=0, fake=True, max_context=CONTEXT)
    with ServerThread(options, model=FakeChatModel("fake", CONTEXT)) as running:
        yield running


@pytest.fixture(scope="module")
def tool_server() -> Iterator[ServerThread]:
    # The tools section alone takes hundreds of the fake model's one-character tokens.
    options = ServeOptions(port=0, fake=True, max_context=TOOL_CONTEXT)
    with ServerThread(options, model=FakeChatModel("fake", TOOL_CONTEXT)) as running:
        yield running


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def check_reply(reply: requests.Response, streamed: bool, endpoint: Endpoint) -> None:
    assert reply.status_code < 500, reply.text
    if reply.status_code != 200:
        assert reply.headers["content-type"] == "application/json"
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]
        return
    if streamed:
        events = sse_events(reply.content)
        assert events[-1] == "[DONE]"
        chunk, _ = endpoint.objects
        assert all(e["object"] == chunk for e in events[:-1] if "choices" in e)
        choices = [c for e in events[:-1] for c in e.get("choices", [])]
    else:
        body = reply.json()
        assert body["object"] == endpoint.objects[1]
        assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
        assert all(c["finish_reason"] in ("stop", "length", "tool_calls") for c in body["choices"])
        choices = body["choices"]
    for choice in choices:
        check_logprobs(choice["logprobs"], endpoint)


def check_logprobs(logprobs: Any, endpoint: Endpoint) -> None:
    """None, or the endpoint's OpenAI shape with log probabilities that are finite, <= 0."""
    if logprobs is None:
        return
    if endpoint is CHAT:
        assert set(logprobs) == {"content", "refusal"}
        for entry in logprobs["content"]:
            assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
            values = [entry["logprob"], *(c["logprob"] for c in entry["top_logprobs"])]
            assert all(set(c) == {"token", "logprob", "bytes"} for c in entry["top_logprobs"])
            assert all(math.isfinite(v) and v <= 0 for v in values)
    else:
        assert set(logprobs) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        assert len({len(v) for v in logprobs.values()}) == 1
        assert all(math.isfinite(v) and v <= 0 for v in logprobs["token_logprobs"])


def fuzz(endpoint: Endpoint, examples: int) -> Any:
    """A hypothesis test that posts `examples` drawn payloads to the endpoint."""

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,  # the same cases every run: the suite stays deterministic
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.function_scoped_fixture],
    )  # fmt: skip
    @given(payload=payloads(endpoint))
    def test(server: ServerThread, session: requests.Session, payload: tuple[str, bytes]) -> None:
        ctype, raw = payload
        headers = {"Content-Type": ctype} if ctype else {}
        reply = session.post(
            f"{server.base_url}{endpoint.path}", data=raw, headers=headers, timeout=30
        )
        streamed = reply.headers.get("content-type", "").startswith("text/event-stream")
        check_reply(reply, streamed, endpoint)

    return test


test_no_body_breaks_the_server = fuzz(CHAT, EXAMPLES)


@settings(
    max_examples=max(1, EXAMPLES // 2),
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(body=tool_bodies)
def test_no_tool_request_breaks_the_server(
    tool_server: ServerThread, session: requests.Session, body: dict[str, Any]
) -> None:
    reply = session.post(f"{tool_server.base_url}{CHAT.path}", json=body, timeout=30)
    streamed = reply.headers.get("content-type", "").startswith("text/event-stream")
    check_reply(reply, streamed, CHAT)


test_no_completions_body_breaks_the_server = fuzz(COMPLETIONS, max(1, EXAMPLES // 2))


def test_the_server_is_healthy_and_holds_nothing_after_the_fuzzing(server: ServerThread) -> None:
    # In file order this runs after the fuzzing (the module's server is shared): every
    # request has ended, nothing is held. In any order, the server still refuses bad
    # input with a 400 and counts it.
    bad = requests.post(f"{server.base_url}{CHAT.path}", data=b"{nope", timeout=30,
                        headers={"Content-Type": "application/json"})  # fmt: skip
    assert bad.status_code == 400
    assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 200

    def settled() -> bool:
        stats = server.statistics()
        idle = stats.open_streams == 0 and not stats.router.requests_by_phase
        return idle and all(w.held == 0 for w in stats.router.workers)

    deadline = time.monotonic() + 30
    while not settled():
        assert time.monotonic() < deadline, f"still held: {server.statistics()}"
        time.sleep(0.05)
    metrics = requests.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'outcome="rejected_400"' in metrics
