"""response_format: what the boundary accepts and refuses, and JSON answers from the real model.

The fake model cannot spell JSON, so it refuses a response_format that needs a
grammar (400); answers whose content matters come from the default model on
the real engine, through the official SDK and raw HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import openai
import pydantic
import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.engine.model import LoadedModel, load_model
from adapters.openai.errors import OpenAIError
from adapters.openai.normalize import (
    ChatJob,
    CompletionJob,
    ModelInfo,
    normalize_chat_request,
    normalize_completion_request,
)
from tests.support.http_helpers import ServerThread, chat_body, sse_events

# One worker of a parallel run holds this module's loaded model (pytest-xdist).
pytestmark = pytest.mark.xdist_group("openai_structured")

MODEL = ModelInfo("m", max_context=100, vocab_size=1000)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "pets": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 2},
        "home": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "colour", "pets", "home"],
    "additionalProperties": False,
}


def json_schema(schema: Any = SCHEMA, **spec: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema} | spec}


def chat(fields: dict[str, Any], model: ModelInfo = MODEL) -> ChatJob | OpenAIError:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]} | fields
    return normalize_chat_request(
        body, {"m": model}.get, lambda m, msgs, tools, kwargs=None: [1, 2, 3], "r"
    )


@pytest.mark.parametrize(
    "value",
    [
        {"type": "json_object"},
        json_schema(),
        json_schema(strict=True, description="a person"),
        json_schema(strict=False),
        json_schema({}),  # any JSON value
        json_schema({"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "^a+$"}]}),
    ],
)
def test_json_response_formats_give_every_choice_the_grammar(value: dict[str, Any]) -> None:
    job = chat({"response_format": value, "n": 3})
    assert isinstance(job, ChatJob), job
    grammars = {r.constraint.grammar for r in job.requests if r.constraint is not None}
    assert len(grammars) == 1 and len(job.requests) == 3


def test_text_and_absent_response_formats_do_not_constrain() -> None:
    for fields in ({}, {"response_format": {"type": "text"}}, {"response_format": None}):
        job = chat(fields)
        assert isinstance(job, ChatJob) and job.requests[0].constraint is None


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("json", "must be an object"),
        ({"type": "json"}, "must be one of"),
        ({"type": "json_schema"}, "json_schema' must be an object"),
        (json_schema(name="has space"), "name"),
        (json_schema(name="x" * 65), "name"),
        (json_schema(name=None), "name"),
        (json_schema(strict="yes"), "strict"),
        (json_schema(description=5), "description"),
        (json_schema(schema=None), "schema"),
        (json_schema(schema=[1]), "schema"),
        (json_schema({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (json_schema({"not": {"type": "string"}}), "not"),
        (json_schema({"type": "strange"}), "strange"),
        (json_schema({"$ref": "#/$defs/missing"}), "missing"),
        (json_schema({"type": "string", "pattern": "("}), "regex"),
        (json_schema({"type": "string", "format": "shoe-size"}), "shoe-size"),
    ],
)
def test_bad_or_unsupported_response_formats_are_400_naming_the_problem(
    value: Any, says: str
) -> None:
    error = chat({"response_format": value})
    assert isinstance(error, OpenAIError), error
    assert (error.status, error.param) == (400, "response_format")
    assert says in error.message


def test_a_model_that_cannot_constrain_refuses_json_but_not_text() -> None:
    fake = ModelInfo("m", 100, 1000, constrains=False)
    error = chat({"response_format": {"type": "json_object"}}, fake)
    assert isinstance(error, OpenAIError) and error.param == "response_format"
    assert "cannot constrain" in error.message
    assert isinstance(chat({"response_format": {"type": "text"}}, fake), ChatJob)


def test_legacy_completions_take_response_format_too() -> None:
    body = {"model": "m", "prompt": ["a", "b"], "response_format": json_schema()}
    job = normalize_completion_request(body, {"m": MODEL}.get, lambda m, t: [1, 2], "r")
    assert isinstance(job, CompletionJob)
    assert all(r.constraint is not None for r in job.requests)


# --- over HTTP, the fake model: refusals with param ---


@pytest.fixture(scope="module")
def fake_server() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True)) as running:
        yield running


@pytest.mark.parametrize(
    "value",
    [{"type": "json_object"}, json_schema(), json_schema({"type": "array", "uniqueItems": True})],
)
def test_the_fake_server_refuses_json_formats_with_param(
    fake_server: ServerThread, value: dict[str, Any]
) -> None:
    reply = requests.post(
        f"{fake_server.base_url}/v1/chat/completions",
        json=chat_body(response_format=value),
        timeout=30,
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "response_format"
    client = openai.OpenAI(base_url=f"{fake_server.base_url}/v1", api_key="unused")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model="fake",
            messages=[{"role": "user", "content": "hi"}],
            response_format=value,  # type: ignore[arg-type]
        )
    assert refused.value.body["param"] == "response_format"  # type: ignore[index]


# --- the default model on the real engine: answers that parse and validate ---


class Home(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=20)


class Person(pydantic.BaseModel):
    """The pydantic twin of SCHEMA: validating with it is validating against SCHEMA."""

    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=24)
    age: int = pydantic.Field(ge=0, le=120)
    colour: Literal["red", "green", "blue"]
    pets: list[str] = pydantic.Field(max_length=2)
    home: Home


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model(quiet=True)


@pytest.fixture(scope="module")
def real_server(loaded: LoadedModel) -> Iterator[ServerThread]:
    from adapters.engine.engine import Engine
    from adapters.openai.models import ChatModel
    from adapters.runtime.worker_host import EngineDecoder
    from core.batching import BatchLimits

    model = ChatModel(loaded.name, loaded.tokenizer, 512)
    engine = Engine(loaded, BatchLimits(max_seqs=4, max_context=512))
    with ServerThread(ServeOptions(port=0, max_context=512), EngineDecoder(engine), model) as s:
        yield s


ASK = [{"role": "user", "content": "Invent a person and describe them as JSON."}]


def test_the_sdk_parses_a_json_schema_answer_into_a_pydantic_model(
    real_server: ServerThread, loaded: LoadedModel
) -> None:
    client = openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key="unused")
    done = client.chat.completions.parse(
        model=loaded.name, messages=ASK, response_format=Person, temperature=0, max_tokens=100
    )  # type: ignore[call-overload]
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert choice.message.content == choice.message.parsed.model_dump_json()


def test_a_streamed_json_schema_answer_equals_the_whole_one_and_validates(
    real_server: ServerThread, loaded: LoadedModel
) -> None:
    url = f"{real_server.base_url}/v1/chat/completions"
    body = {"model": loaded.name, "messages": ASK, "temperature": 0, "max_tokens": 100,
            "response_format": json_schema(strict=True)}  # fmt: skip
    whole = requests.post(url, json=body, timeout=120).json()["choices"][0]
    streamed = sse_events(requests.post(url, json=body | {"stream": True}, timeout=120).content)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in streamed[:-1])
    assert text == whole["message"]["content"] and whole["finish_reason"] == "stop"
    Person.model_validate_json(text)


def test_json_object_answers_are_json_objects_on_both_endpoints(
    real_server: ServerThread, loaded: LoadedModel
) -> None:
    client = openai.OpenAI(base_url=f"{real_server.base_url}/v1", api_key="unused")
    done = client.chat.completions.create(
        model=loaded.name,
        messages=[{"role": "user", "content": "Give me a JSON object with a colour in it."}],
        response_format={"type": "json_object"},
        temperature=0,
        max_tokens=200,
    )
    if done.choices[0].finish_reason == "stop":  # a cut answer (length) is a prefix only
        assert isinstance(json.loads(done.choices[0].message.content or ""), dict)
    else:
        assert (done.choices[0].message.content or "").startswith("{")
    legacy = client.completions.create(
        model=loaded.name,
        prompt="A person as JSON:",
        extra_body={"response_format": json_schema()},
        temperature=0,
        max_tokens=100,
    )
    assert legacy.choices[0].finish_reason == "stop"
    Person.model_validate_json(legacy.choices[0].text)
