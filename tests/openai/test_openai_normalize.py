"""normalize_chat_request: what the server accepts, and the error for everything else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from adapters.openai.errors import OpenAIError
from adapters.openai.normalize import (
    MAX_CHOICES,
    MAX_PROMPTS,
    ChatJob,
    ChatMessage,
    CompletionJob,
    ModelInfo,
    Prompt,
    choice_seed,
    normalize_chat_request,
    normalize_completion_request,
)
from adapters.openai.tools import Tool
from core.protocol import Sampling

MODEL = ModelInfo("m", max_context=100, vocab_size=1000)


def tokenize(
    model_id: str,
    messages: Sequence[ChatMessage],
    tools: tuple[Tool, ...],
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    # one token per character, so tests can size prompts exactly
    return [1] * sum(len(m.content) + 2 for m in messages)


def run(body: Any) -> ChatJob | OpenAIError:
    return normalize_chat_request(body, {"m": MODEL}.get, tokenize, "req-1")


def ok(**fields: Any) -> ChatJob:
    job = run({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields)
    assert isinstance(job, ChatJob), job
    return job


def refused(**fields: Any) -> OpenAIError:
    error = run({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields)
    assert isinstance(error, OpenAIError), error
    return error


def test_a_minimal_request_gets_openai_defaults() -> None:
    job = ok()
    assert job.requests[0].prompt_token_ids == (1, 1, 1, 1)
    assert job.requests[0].max_new_tokens == 96  # the rest of the context
    assert job.requests[0].sampling == Sampling(temperature=1.0, top_p=1.0, seed=None)
    shared = job.shared
    assert (shared.stream, shared.include_usage, shared.stop, shared.model.id) == (
        False,
        False,
        (),
        "m",
    )


def test_accepted_fields_reach_the_generation_request() -> None:
    job = ok(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "developer", "content": [{"type": "text", "text": t} for t in "ab"]},
            {"role": "assistant", "content": "ok", "name": "bot"},
            {"role": "user", "content": "go"},
        ],
        max_tokens=7, max_completion_tokens=5, temperature=0, top_p=0.5, seed=-3,
        stop=["x", "yz", "x"], stream=True, stream_options={"include_usage": True},
        user="someone", metadata={"a": "b"}, unknown_field=[1, 2],
    )  # fmt: skip
    assert job.requests[0].max_new_tokens == 5  # max_completion_tokens wins
    assert job.requests[0].sampling == Sampling(0.0, 0.5, -3)
    assert job.shared.stop == ("x", "yz")
    assert job.shared.stream and job.shared.include_usage


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("n", 17), ("n", 0), ("n", True), ("n", 1.0), ("tools", {"type": "function"}),
        ("tool_choice", "required"), ("parallel_tool_calls", 1),
        ("functions", [{"name": "f"}]), ("function_call", "auto"), ("logprobs", 1),
        ("top_logprobs", 2), ("top_logprobs", 21), ("logit_bias", {"5": 1}),
        ("presence_penalty", 0.5),
        ("frequency_penalty", -1), ("audio", {"voice": "x"}), ("modalities", ["audio"]),
        ("response_format", {"type": "json"}), ("response_format", "text"),
        ("temperature", 2.5), ("temperature", -0.1), ("temperature", "hot"), ("temperature", True),
        ("top_p", 0), ("top_p", 1.5), ("seed", 1.5), ("seed", 2**63), ("seed", "7"),
        ("stop", ""), ("stop", ["a", "b", "c", "d", "e"]), ("stop", [1]), ("stop", {"a": 1}),
        ("stream", "yes"), ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 1.5),
        ("max_completion_tokens", -1), ("model", ""), ("model", 5), ("messages", []),
        ("messages", "hi"),
    ],
)  # fmt: skip
def test_unsupported_or_malformed_fields_are_400_naming_the_field(field: str, value: Any) -> None:
    error = refused(**{field: value})
    assert (error.status, error.type, error.param) == (400, "invalid_request_error", field)


def test_harmless_values_of_refusable_fields_are_accepted() -> None:
    ok(n=1, tools=[], tool_choice="none", logprobs=False, presence_penalty=0,
       response_format={"type": "text"}, modalities=["text"], parallel_tool_calls=True)  # fmt: skip


@pytest.mark.parametrize(
    ("message", "param"),
    [
        ({"role": "tool", "content": "x", "tool_call_id": "1"}, "messages[0].tool_call_id"),
        ({"role": "function", "content": "x", "name": "f"}, "messages[0].role"),
        ({"role": "robot", "content": "x"}, "messages[0].role"),
        ({"content": "x"}, "messages[0].role"),
        ({"role": "user"}, "messages[0].content"),
        ({"role": "user", "content": 5}, "messages[0].content"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
         "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "input_audio"}]}, "messages[0].content[0]"),
        ({"role": "user", "content": [{"type": "text"}]}, "messages[0].content[0].text"),
        ({"role": "assistant", "content": "x", "tool_calls": [{}]}, "messages[0].tool_calls[0].id"),
        ("hello", "messages[0]"),
    ],
)  # fmt: skip
def test_bad_messages_are_400_naming_the_message(message: Any, param: str) -> None:
    error = refused(messages=[message])
    assert (error.status, error.param) == (400, param)


def test_stream_options_need_stream() -> None:
    assert refused(stream_options={"include_usage": True}).param == "stream_options"
    assert refused(stream=True, stream_options={"include_usage": "y"}).param == "stream_options"
    assert not ok(stream=False, stream_options=None).shared.include_usage


def test_unknown_model_is_404_model_not_found() -> None:
    error = refused(model="gpt-9")
    assert (error.status, error.code, error.param) == (404, "model_not_found", "model")


def test_prompt_plus_budget_beyond_the_context_is_context_length_exceeded() -> None:
    assert ok(max_tokens=96).requests[0].max_new_tokens == 96  # exactly fills the context
    error = refused(max_tokens=97)
    assert (error.status, error.code, error.param) == (400, "context_length_exceeded", "messages")
    long = refused(messages=[{"role": "user", "content": "x" * 98}])  # no room for one token
    assert long.code == "context_length_exceeded"


@pytest.mark.parametrize("body", [None, [], "text", 5, True])
def test_a_body_that_is_not_an_object_is_400(body: Any) -> None:
    error = run(body)
    assert isinstance(error, OpenAIError) and error.status == 400


# Every documented limit, probed on both sides of its edge (an inclusive edge is accepted).
EDGES_ACCEPTED: list[dict[str, Any]] = [
    {"temperature": 0},
    {"temperature": 2},
    {"temperature": 2.0},
    {"top_p": 1},
    {"top_p": 1e-9},
    {"stop": ["a", "b", "c", "d"]},  # exactly MAX_STOPS
    {"stop": "x" * 256},  # exactly MAX_STOP_CHARS
    {"seed": -(2**63)},
    {"seed": 2**63 - 1},
    {"max_tokens": 1},
    {"max_completion_tokens": 1},
    {"logprobs": False},
    {"logprobs": True},
    {"logprobs": True, "top_logprobs": 0},
    {"logprobs": True, "top_logprobs": 20},  # exactly MAX_TOP_LOGPROBS
    {"n": 1},
    {"n": 16},  # exactly MAX_CHOICES
    {"response_format": {"type": "text"}},
    {"presence_penalty": 0},
    {"frequency_penalty": 0.0},
]
EDGES_REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"temperature": -1e-9}, "temperature"),
    ({"temperature": 2.000001}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.000001}, "top_p"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),  # one past MAX_STOPS
    ({"stop": "x" * 257}, "stop"),
    ({"stop": ""}, "stop"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**63}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    # refused fields given falsy values are still refused
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),  # one past MAX_CHOICES
    ({"n": False}, "n"),
    ({"response_format": {}}, "response_format"),
    ({"logprobs": 0}, "logprobs"),  # chat's logprobs is a boolean
    ({"top_logprobs": 0}, "top_logprobs"),  # only with logprobs true
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"tools": [{}]}, "tools[0].type"),
    ({"presence_penalty": 0.1}, "presence_penalty"),
]


@pytest.mark.parametrize("fields", EDGES_ACCEPTED, ids=lambda f: repr(f)[:40])
def test_values_exactly_at_an_inclusive_limit_are_accepted(fields: dict[str, Any]) -> None:
    job = ok(**fields)
    if "temperature" in fields:
        assert job.requests[0].sampling.temperature == fields["temperature"]
    if "stop" in fields:
        stops = fields["stop"]
        assert job.shared.stop == ((stops,) if isinstance(stops, str) else tuple(stops))
    if "seed" in fields:
        assert job.requests[0].sampling.seed == fields["seed"]


@pytest.mark.parametrize(("fields", "param"), EDGES_REFUSED, ids=lambda f: repr(f)[:40])
def test_values_just_past_a_limit_or_falsy_refusals_are_400_naming_the_field(
    fields: dict[str, Any], param: str
) -> None:
    error = refused(**fields)
    assert (error.status, error.param) == (400, param)


# --- the legacy /v1/completions ---


def complete(**fields: Any) -> CompletionJob | OpenAIError:
    def tokenize(model_id: str, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text]  # one token per character, within the vocabulary

    body = {"model": "m", "prompt": "hi"} | fields
    return normalize_completion_request(body, {"m": MODEL}.get, tokenize, "cmpl-1")


def completion_ok(**fields: Any) -> CompletionJob:
    job = complete(**fields)
    assert isinstance(job, CompletionJob), job
    return job


def completion_refused(**fields: Any) -> OpenAIError:
    error = complete(**fields)
    assert isinstance(error, OpenAIError), error
    return error


def test_every_prompt_shape_becomes_one_request_each_in_order() -> None:
    hi = (ord("h"), ord("i"))
    assert completion_ok().prompts == (Prompt(hi, "hi"),)
    assert completion_ok(prompt=["hi", "a"]).prompts == (Prompt(hi, "hi"), Prompt((97,), "a"))
    assert completion_ok(prompt=[0, 999]).prompts == (Prompt((0, 999), None),)
    job = completion_ok(prompt=[[5], [6, 7]], temperature=0.5, seed=3, stop="x", echo=True)
    assert job.prompts == (Prompt((5,), None), Prompt((6, 7), None))
    assert [r.request_id for r in job.requests] == ["cmpl-1-0", "cmpl-1-1"]
    assert [r.prompt_token_ids for r in job.requests] == [(5,), (6, 7)]
    assert all(r.sampling == Sampling(0.5, 1.0, 3) for r in job.requests)
    assert (job.shared.stop, job.echo, job.shared.model.id) == (("x",), True, "m")


def test_a_completion_gets_16_tokens_by_default_at_most_the_rest_of_the_context() -> None:
    assert completion_ok().requests[0].max_new_tokens == 16
    assert completion_ok(prompt="x" * 90).requests[0].max_new_tokens == 10
    assert completion_ok(prompt="x" * 90, max_tokens=10).requests[0].max_new_tokens == 10
    error = completion_refused(prompt=["hi", "x" * 90], max_tokens=11)
    assert (error.code, error.param) == ("context_length_exceeded", "prompt")
    assert "prompt 1" in error.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"suffix": "x"}, "suffix"), ({"logprobs": 21}, "logprobs"), ({"best_of": 2}, "best_of"),
        ({"logprobs": True}, "logprobs"), ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 2, "echo": True}, "echo"),
        ({"best_of": 0}, "best_of"), ({"n": 17}, "n"), ({"echo": 1}, "echo"),
        ({"frequency_penalty": 1}, "frequency_penalty"), ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"prompt": ["a"] * (MAX_PROMPTS + 1)}, "prompt"), ({"prompt": [1000]}, "prompt"),
        ({"prompt": [-1]}, "prompt"), ({"prompt": [[1], [1000]]}, "prompt"),
        ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a", [1]]}, "prompt"), ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [1.0]}, "prompt"), ({"prompt": [False]}, "prompt"),
        ({"prompt": None}, "prompt"), ({"prompt": [[1], "a"]}, "prompt"),
        ({"prompt": {"text": "a"}}, "prompt"), ({"temperature": 3}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"), ({"model": ""}, "model"),
    ],
)  # fmt: skip
def test_completion_refusals_name_the_field(fields: dict[str, Any], param: str) -> None:
    error = completion_refused(**fields)
    assert (error.status, error.param) == (400, param)


def test_completion_edges_that_are_accepted() -> None:
    completion_ok(prompt=["a"] * MAX_PROMPTS, suffix="", logprobs=None, best_of=1, n=1, echo=False)
    completion_ok(prompt=[0, 999], presence_penalty=0, user="u", unknown=[1])
    assert completion_refused(model="gpt-9").status == 404


def test_n_choices_are_n_requests_with_their_own_ids_and_seeds() -> None:
    job = ok(n=3, seed=42)
    assert [r.request_id for r in job.requests] == ["req-1-0", "req-1-1", "req-1-2"]
    seeds = [r.sampling.seed for r in job.requests]
    assert seeds[0] == 42 and len(set(seeds)) == 3  # choice 0 keeps the seed; all differ
    assert seeds == [r.sampling.seed for r in ok(n=3, seed=42).requests]  # deterministic
    assert ok(seed=42).requests[0].request_id == "req-1"  # n=1 as before
    assert [r.sampling.seed for r in ok(n=3).requests] == [None] * 3  # the controller draws


def test_completion_choices_are_ordered_prompt_by_prompt() -> None:
    job = completion_ok(prompt=["a", "bb"], n=2, seed=7)
    assert [r.request_id for r in job.requests] == [f"cmpl-1-{i}" for i in range(4)]
    assert [len(r.prompt_token_ids) for r in job.requests] == [1, 1, 2, 2]
    assert [r.sampling.seed for r in job.requests] == [choice_seed(7, i) for i in (0, 1, 0, 1)]


@given(st.integers(-(2**63), 2**63 - 1), st.integers(0, MAX_CHOICES - 1))
def test_choice_seeds_stay_in_the_int64_range(seed: int, choice: int) -> None:
    derived = choice_seed(seed, choice)
    assert -(2**63) <= derived < 2**63
    assert derived == seed if choice == 0 else derived != choice_seed(seed, choice + 1)


def test_logprobs_reach_every_choice_as_the_top_count() -> None:
    assert [r.logprobs for r in ok(n=2).requests] == [None, None]
    assert [r.logprobs for r in ok(n=2, logprobs=True).requests] == [0, 0]
    assert [r.logprobs for r in ok(logprobs=True, top_logprobs=7).requests] == [7]
    assert [r.logprobs for r in ok(logprobs=False).requests] == [None]
    job = completion_ok(prompt=["a", "b"], n=2, logprobs=5)
    assert [r.logprobs for r in job.requests] == [5, 5, 5, 5]
    assert completion_ok(logprobs=0, echo=False).requests[0].logprobs == 0
    error = refused(top_logprobs=2)
    assert error.param == "top_logprobs" and "logprobs" in error.message
