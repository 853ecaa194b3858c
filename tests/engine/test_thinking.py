"""Thinking models on the engine (issue 55): tiny random Qwen3 and SmolLM3 checkpoints
with a tokenizer that holds `<think>` and `</think>` and chat templates of each
convention (tests/support/thinking.py).

The engine enforces a thinking budget and a schema that starts after the block as
it enforces any grammar (adapters/openai/reasoning.py writes it): so a budget closes
the block at exactly its count, the answer after it validates, a continuation from
a cut inside the block or right at its closing tag goes on as the undisturbed run,
and over HTTP the SDK's `parse` reads the answer while the thinking comes apart.
A random model never writes the closing tag itself (checked on an unconstrained
run), so a tag where the budget ends is the budget's doing.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pydantic
import pytest

from adapters.cli.serve import ServeOptions
from adapters.engine.engine import Engine
from adapters.engine.grammar import json_schema_grammar
from adapters.engine.model import LoadedModel, load_model
from adapters.openai.models import ChatModel
from adapters.openai.normalize import ChatMessage
from adapters.openai.reasoning import (
    AFTER,
    BEFORE,
    INSIDE,
    ThinkingStart,
    after_thinking,
    start_state,
)
from adapters.runtime.worker_host import EngineDecoder
from core.batching import BatchLimits
from core.protocol import Constraint, GenerationRequest, Sampling
from tests.engine.test_family_serving import run
from tests.support.http_helpers import ServerThread
from tests.support.thinking import thinking_checkpoint

CASES = ["qwen3", "smollm3"]
LIMITS = BatchLimits(max_seqs=4, max_context=512, max_step_tokens=64, max_prefill_tokens=16)
BUDGET = 12


class Fence(pydantic.BaseModel, extra="forbid"):
    posts: int = pydantic.Field(ge=0, le=99)
    painted: bool


SCHEMA = json_schema_grammar(Fence.model_json_schema())


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("thinking")


def served(case: str, convention: str, folder: Path) -> tuple[LoadedModel, ChatModel]:
    loaded = load_model(thinking_checkpoint(case, convention, folder), quiet=True)
    return loaded, ChatModel(case, loaded.tokenizer, 512)


def prompt_of(model: ChatModel, **template: object) -> tuple[int, ...]:
    messages = [ChatMessage("user", "Describe a fence as JSON.")]
    return tuple(model.tokenize_chat(messages, (), dict(template) or None))


@pytest.mark.parametrize("case", CASES)
def test_each_convention_is_detected_with_where_its_answers_start(case: str, folder: Path) -> None:
    for convention, on, off in [("qwen3", BEFORE, AFTER), ("smollm3", BEFORE, AFTER)]:
        _, model = served(case, convention, folder)
        assert model.thinking is not None and model.thinking.switchable
        assert start_state(model.thinking, prompt_of(model)) == on
        assert start_state(model.thinking, prompt_of(model, enable_thinking=False)) == off
    _, model = served(case, "r1", folder)
    assert model.thinking is not None and not model.thinking.switchable
    assert start_state(model.thinking, prompt_of(model)) == INSIDE


@pytest.mark.parametrize("case", CASES)
def test_a_budget_closes_the_block_and_the_schema_holds_after_it(case: str, folder: Path) -> None:
    loaded, model = served(case, "r1", folder)
    assert model.thinking is not None
    close = model.thinking.close_id
    prompt = prompt_of(model)
    start = ThinkingStart(model.thinking, start_state(model.thinking, prompt))
    grammar = after_thinking(start, BUDGET, SCHEMA)
    assert grammar is not None
    free = run(Engine(loaded, LIMITS), [GenerationRequest("f", prompt, 40)])["f"]
    assert close not in free  # the model would not close the block by itself
    greedy = GenerationRequest("g", prompt, 80, constraint=Constraint(grammar))
    sampled = GenerationRequest(
        "s", prompt, 80, Sampling(0.9, 1.0, 7), constraint=greedy.constraint
    )
    out = run(Engine(loaded, LIMITS), [greedy, sampled])
    for tokens in out.values():
        assert tokens.index(close) == BUDGET  # thinking of exactly the budget, then the tag
        answer = loaded.tokenizer.decode(tokens[BUDGET + 1 :], skip_special_tokens=True)
        Fence.model_validate_json(answer)
    # Batch invariance holds for the wrapped grammar as for any other.
    alone = run(Engine(loaded, LIMITS), [greedy])["g"]
    assert alone == out["g"]


@pytest.mark.parametrize("case", CASES)
def test_a_continuation_from_inside_or_at_the_close_goes_on_exactly(
    case: str, folder: Path
) -> None:
    loaded, model = served(case, "r1", folder)
    assert model.thinking is not None
    prompt = prompt_of(model)
    grammar = after_thinking(ThinkingStart(model.thinking, INSIDE), BUDGET, SCHEMA)
    assert grammar is not None
    request = GenerationRequest(
        "g", prompt, 80, Sampling(0.8, 1.0, 11), constraint=Constraint(grammar)
    )
    whole = run(Engine(loaded, LIMITS), [request])["g"]
    assert whole[BUDGET] == model.thinking.close_id
    # Inside the block, with the budget spent (the tag must come next), right after
    # the tag, and inside the answer.
    for cut in (5, BUDGET, BUDGET + 1, BUDGET + 4):
        resumed = GenerationRequest(
            "r", prompt, 80, request.sampling, constraint=request.constraint,
            output_prefix=tuple(whole[:cut]),
        )  # fmt: skip
        assert whole[:cut] + run(Engine(loaded, LIMITS), [resumed])["r"] == whole, cut


@pytest.mark.parametrize("case", CASES)
def test_a_budget_on_an_answer_that_does_not_think_changes_nothing(case: str, folder: Path) -> None:
    loaded, model = served(case, "qwen3", folder)
    assert model.thinking is not None
    prompt = prompt_of(model)
    grammar = after_thinking(ThinkingStart(model.thinking, BEFORE), 4, None)
    assert grammar is not None
    plain = GenerationRequest("p", prompt, 30)
    bounded = GenerationRequest("b", prompt, 30, constraint=Constraint(grammar))
    out = run(Engine(loaded, LIMITS), [plain, bounded])
    assert out["p"][0] != model.thinking.open_id and out["b"] == out["p"]


@pytest.fixture(scope="module", params=CASES)
def thinking_server(request: pytest.FixtureRequest, folder: Path) -> Iterator[ServerThread]:
    loaded, model = served(request.param, "r1", folder)
    engine = Engine(loaded, BatchLimits(max_seqs=4, max_context=512))
    with ServerThread(
        ServeOptions(port=0, max_context=512), EngineDecoder(engine), model
    ) as server:
        yield server


def test_the_sdk_parses_a_schema_answered_after_the_thinking(
    thinking_server: ServerThread,
) -> None:
    client = openai.OpenAI(base_url=f"{thinking_server.base_url}/v1", api_key="none")
    model = client.models.list().data[0].id
    messages: list[object] = [{"role": "user", "content": "Describe a fence as JSON."}]
    done = client.chat.completions.parse(
        model=model, messages=messages, response_format=Fence, temperature=0, max_tokens=100,  # type: ignore[arg-type]
        extra_body={"max_reasoning_tokens": 8},
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Fence)
    thought = (choice.message.model_extra or {})["reasoning_content"]
    assert thought and "</think>" not in thought
    assert done.usage is not None and done.usage.completion_tokens_details is not None
    assert done.usage.completion_tokens_details.reasoning_tokens == 9  # 8 and the tag
    thinking, content = "", ""
    schema = {"name": "fence", "schema": Fence.model_json_schema()}
    for chunk in client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=100, stream=True,  # type: ignore[arg-type]
        response_format={"type": "json_schema", "json_schema": schema},  # type: ignore[typeddict-item]
        extra_body={"max_reasoning_tokens": 8},
    ):  # fmt: skip
        delta = chunk.choices[0].delta
        thinking += (delta.model_extra or {}).get("reasoning_content", "")
        content += delta.content or ""
    assert (thinking, content) == (thought, choice.message.content)
