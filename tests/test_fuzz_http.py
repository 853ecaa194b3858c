"""Fuzzing the served endpoint over TCP: whatever the body, no 5xx, always the envelope.

hypothesis builds request bodies around the real schema (so many get far into
validation, and some are valid and generate) and around it: wrong types, huge
and negative numbers, deep nesting, odd unicode, missing and duplicated
fields, bytes that are not JSON. Each goes to a real server on 127.0.0.1
(fake model). The default run sends FENCEPOST_FUZZ_EXAMPLES (2,000) cases;
set it higher for a longer run (README).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.cli.serve import ServeOptions
from adapters.openai.models import FakeChatModel
from tests.http_helpers import ServerThread, sse_events

EXAMPLES = int(os.environ.get("FENCEPOST_FUZZ_EXAMPLES", "2000"))
CONTEXT = 256  # small, so valid requests without max_tokens stay quick

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
message = st.fixed_dictionaries(
    {},
    optional={"role": roles | json_values, "content": content, "name": json_values,
              "tool_calls": json_values},
)  # fmt: skip
# Values on both sides of every documented limit (inclusive edges are accepted).
EDGES: dict[str, st.SearchStrategy[Any]] = {
    "temperature": st.sampled_from([0, 0.0, -0.0, 2, 2.0, 2.000001, -1e-9, 1e-300]),
    "top_p": st.sampled_from([0, 0.0, 1e-9, 1, 1.0, 1.000001, -0.0]),
    "stop": st.sampled_from(
        [["a", "b", "c", "d"], ["a", "b", "c", "d", "e"], "x" * 256, "x" * 257, "", [], [""]]
    ),
    "seed": st.sampled_from([-(2**63), -(2**63) - 1, 2**63 - 1, 2**63, 0]),
    "response_format": st.sampled_from([{}, {"type": "text"}, {"type": "json_object"}, None]),
    # around the context: the prompt takes a few dozen tokens of CONTEXT
    "max_tokens": st.integers(CONTEXT - 60, CONTEXT + 1) | st.sampled_from([0, 1, CONTEXT]),
}
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just("fake") | st.sampled_from(["", "gpt-4o", "FAKE"]) | json_values,
    "messages": st.lists(message, min_size=1, max_size=3) | json_values,
    "max_tokens": numbers | EDGES["max_tokens"],
    "max_completion_tokens": numbers | EDGES["max_tokens"],
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | json_values})
    | json_values,
    "temperature": st.floats(-1, 3) | EDGES["temperature"] | json_values,
    "top_p": st.floats(-0.5, 1.5) | EDGES["top_p"] | json_values,
    "stop": odd_text | st.lists(odd_text, max_size=6) | EDGES["stop"] | json_values,
    "seed": numbers | EDGES["seed"],
    "n": st.sampled_from([1, 2, 0, False, True, -1]) | json_values,
    "tools": json_values,
    "tool_choice": json_values,
    "logprobs": st.sampled_from([True, False, 0, 1, None]) | json_values,
    "top_logprobs": st.sampled_from([0, 1, 20, 21]) | json_values,
    "response_format": EDGES["response_format"] | json_values,
    "logit_bias": json_values,
    "presence_penalty": json_values,
    "user": json_values,
    "metadata": json_values,
    "x-unknown": json_values,
}
BASE_KEYS = ("model", "messages")
bodies = st.fixed_dictionaries(  # the two required fields valid, the rest drawn ...
    {"model": st.just("fake"), "messages": st.just([{"role": "user", "content": "hi"}])},
    optional={k: v for k, v in FIELDS.items() if k not in BASE_KEYS},
) | st.fixed_dictionaries({}, optional=FIELDS)  # ... or everything drawn, any of it missing


@st.composite
def payloads(draw: st.DrawFn) -> tuple[str, bytes]:
    """(content type, raw body)."""
    kind = draw(st.sampled_from(["json"] * 6 + ["duplicate", "nested", "garbage", "any", "type"]))
    if kind == "json":
        return "application/json", json.dumps(draw(bodies)).encode()
    if kind == "duplicate":  # the same key twice: the last one counts, as in most parsers
        body = draw(bodies)
        extra = draw(st.sampled_from(sorted(FIELDS)))
        text = json.dumps(body)[:-1] if body else "{"
        sep = ", " if body else ""
        return (
            "application/json",
            f'{text}{sep}"{extra}": {json.dumps(draw(FIELDS[extra]))}}}'.encode(),
        )
    if kind == "nested":
        depth = draw(st.integers(1, 5000))
        nested = "[" * depth + "]" * depth
        return "application/json", f'{{"model": "fake", "messages": {nested}}}'.encode()
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
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def check_reply(reply: requests.Response, streamed: bool) -> None:
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
        assert all(e["object"] == "chat.completion.chunk" for e in events[:-1] if "choices" in e)
    else:
        body = reply.json()
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["finish_reason"] in ("stop", "length")


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same cases every run: the suite stays deterministic
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture],
)  # fmt: skip
@given(payload=payloads())
def test_no_body_breaks_the_server(
    server: ServerThread, session: requests.Session, payload: tuple[str, bytes]
) -> None:
    ctype, raw = payload
    headers = {"Content-Type": ctype} if ctype else {}
    reply = session.post(
        f"{server.base_url}/v1/chat/completions", data=raw, headers=headers, timeout=30
    )
    streamed = reply.headers.get("content-type", "").startswith("text/event-stream")
    check_reply(reply, streamed)


def test_the_server_is_healthy_and_holds_nothing_after_the_fuzzing(server: ServerThread) -> None:
    # runs after the fuzz test (file order): every request ended, nothing is held
    assert requests.get(f"{server.base_url}/health", timeout=10).status_code == 200
    stats = server.statistics()
    assert stats.open_streams == 0 and not stats.router.requests_by_phase
    assert all(w.held == 0 for w in stats.router.workers)
    metrics = requests.get(f"{server.base_url}/metrics", timeout=10).text
    assert 'outcome="rejected_400"' in metrics
