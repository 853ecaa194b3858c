"""What serving relies on, for families beside Llama: Qwen3, Gemma 3, Qwen3-MoE (tiny checkpoints).

On the engine: a request's tokens are the same alone and in a batch with
neighbours (greedy and seeded), a continuation from any prefix goes on exactly
as the uninterrupted run, a prompt found in the prefix cache gives the tokens
of one computed whole, and a json_schema answer validates; on w4a16 too where
the fused pass runs the family. Over HTTP with the official SDK: structured
output parses. As real processes: kill -9 of the worker streaming an answer
resumes it on the other worker with exactly the undisturbed text.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import openai
import pydantic
import pytest

from adapters.cli.serve import ServeOptions
from adapters.engine.engine import Engine
from adapters.engine.grammar import json_schema_grammar
from adapters.engine.model import LoadedModel, chat_token_ids, load_model
from adapters.engine.native import model_problem
from adapters.engine.native_build import NativeUnavailable, load
from core.batching import BatchLimits
from core.protocol import Assignment, Constraint, Decoded, GenerationRequest, Sampling
from tests.support import tiny_models
from tests.support.http_helpers import ServerThread
from tests.support.process_helpers import (
    kill_the_serving_worker_after_a_token,
    metric,
    router_with_workers,
)
from tests.support.runtime_helpers import kill_all

FAMILIES = ["llama", "qwen3", "gemma3", "qwen3-moe"]
LIMITS = BatchLimits(max_seqs=6, max_context=512, max_step_tokens=64, max_prefill_tokens=16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("family-serving")


def chat(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    return tuple(chat_token_ids(loaded.tokenizer, [{"role": "user", "content": text}]))


def run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    for request in requests:
        engine.start(Assignment(request.request_id, 1), request)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    for _ in range(10_000):
        if not engine.has_work():
            return out
        for event in engine.step():
            if isinstance(event, Decoded):
                out[event.assignment.request_id].append(event.token_id)
    raise AssertionError("the engine never finished")


def formats(loaded: LoadedModel) -> list[str]:
    """fp32, and w4a16 where the fused pass runs this family here."""
    try:
        load()
    except NativeUnavailable:
        return ["fp32"]
    return ["fp32"] if model_problem(loaded.spec) else ["fp32", "w4a16"]


@pytest.mark.parametrize("case", FAMILIES)
def test_batching_resumes_and_the_prefix_cache_change_no_token(case: str, folder: Path) -> None:
    loaded = load_model(tiny_models.saved(case, folder), quiet=True)
    prompt = chat(loaded, "Tell me about fences, posts and the errors between them.")
    for fmt in formats(loaded):
        greedy = GenerationRequest("g", prompt, 40)
        # A random checkpoint's logits are nearly flat (std ~0.16 over 49,152 tokens):
        # at temperature 0.8 a draw would hang on the last-bit noise that batch
        # shapes bring (engine.md, float numerics). At 0.02 its top_p 0.9 nucleus
        # is ~10 tokens, as a trained model's is at 0.8.
        seeded = GenerationRequest("s", prompt, 40, Sampling(0.02, 0.9, 7))
        alone = {r.request_id: run(Engine(loaded, LIMITS, fmt), [r])[r.request_id]
                 for r in (greedy, seeded)}  # fmt: skip
        assert alone["s"] != alone["g"], "the seeded draw never left the greedy path"
        neighbours = [
            GenerationRequest(
                f"n{i}", chat(loaded, f"Count to {i + 3}."), 30, Sampling(0.7, 1.0, i)
            )
            for i in range(4)
        ]
        together = run(Engine(loaded, LIMITS, fmt), [*neighbours, greedy, seeded])
        assert (together["g"], together["s"]) == (alone["g"], alone["s"]), fmt
        for k in (1, 13, 39):  # continuations, as a resume sends them
            for request in (greedy, seeded):
                rest = GenerationRequest(
                    "c", prompt, 40, request.sampling,
                    output_prefix=tuple(alone[request.request_id][:k]),
                )  # fmt: skip
                got = run(Engine(loaded, LIMITS, fmt), [rest])["c"]
                assert alone[request.request_id][:k] + got == alone[request.request_id], (fmt, k)
        # the same prompt again on one engine: the second finds it cached, same tokens
        engine = Engine(loaded, LIMITS, fmt)
        first = run(engine, [greedy])["g"]
        second = run(engine, [GenerationRequest("again", prompt, 40)])["again"]
        report = engine.cache_report()
        assert 0 < report.computed_tokens <= report.prompt_tokens - len(prompt) + 16
        assert first == second == alone["g"], fmt


class Fence(pydantic.BaseModel, extra="forbid"):
    name: str = pydantic.Field(max_length=20)
    posts: int = pydantic.Field(ge=0, le=99)
    painted: bool


@pytest.mark.parametrize("case", FAMILIES)
def test_json_schema_answers_validate_alone_in_a_batch_and_resumed(case: str, folder: Path) -> None:
    loaded = load_model(tiny_models.saved(case, folder), quiet=True)
    schema = Constraint(json_schema_grammar(Fence.model_json_schema()))
    prompt = chat(loaded, "Describe a fence as JSON.")
    whole = GenerationRequest("w", prompt, 60, constraint=schema)
    alone = run(Engine(loaded, LIMITS), [whole])["w"]
    Fence.model_validate_json(loaded.tokenizer.decode(alone, skip_special_tokens=True))
    other = GenerationRequest("o", prompt, 60, Sampling(1.0, 1.0, 3), constraint=schema)
    together = run(Engine(loaded, LIMITS), [other, whole])
    assert together["w"] == alone
    Fence.model_validate_json(loaded.tokenizer.decode(together["o"], skip_special_tokens=True))
    resumed = GenerationRequest("r", prompt, 60, constraint=schema, output_prefix=tuple(alone[:9]))
    assert alone[:9] + run(Engine(loaded, LIMITS), [resumed])["r"] == alone


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family_server(request: pytest.FixtureRequest, folder: Path) -> Iterator[ServerThread]:
    from adapters.openai.models import ChatModel
    from adapters.runtime.worker_host import EngineDecoder

    loaded = load_model(tiny_models.saved(request.param, folder), quiet=True)
    model = ChatModel(request.param, loaded.tokenizer, 512)
    engine = Engine(loaded, BatchLimits(max_seqs=4, max_context=512))
    options = ServeOptions(port=0, max_context=512)
    with ServerThread(options, EngineDecoder(engine), model) as server:
        yield server


def test_the_sdk_parses_structured_output_from_other_families(family_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{family_server.base_url}/v1", api_key="unused")
    model = client.models.list().data[0].id
    done = client.chat.completions.parse(
        model=model, messages=[{"role": "user", "content": "A fence, as JSON."}],
        response_format=Fence, temperature=0, max_tokens=80,
    )  # fmt: skip
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Fence)


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_kill_9_of_the_streaming_worker_resumes_to_the_undisturbed_text(
    case: str, folder: Path
) -> None:
    checkpoint = str(tiny_models.saved(case, folder))
    processes: list[subprocess.Popen[str]] = []
    try:
        base, health = router_with_workers(
            processes,
            ["--model", checkpoint, "--heartbeat-timeout", "10"],
            ["--model", checkpoint, "--weights", "fp32", "--slots", "2", "--max-context", "1024"],
        )
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id

        def stream() -> openai.Stream:  # type: ignore[type-arg]
            return client.chat.completions.create(
                model=model, temperature=0, max_tokens=900, stream=True,
                messages=[{"role": "user", "content": "Go on about fences for a while."}],
            )  # fmt: skip

        undisturbed = "".join(c.choices[0].delta.content or "" for c in stream() if c.choices)
        chunks = iter(stream())
        text = kill_the_serving_worker_after_a_token(chunks, processes, health)
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
        assert metric(base, "fencepost_stream_resumes") == 1
        assert text == undisturbed
    finally:
        kill_all(processes)


def test_a_config_no_family_serves_is_refused_in_one_line_before_any_weight(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "vocab_size": 10}))
    done = subprocess.run(
        [*fencepost_command(), "serve", "--model", str(tmp_path), "--port", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("fencepost serve: model_type 'mamba' is not supported (supported: ")
    assert "qwen3" in last and "Traceback" not in done.stderr


def fencepost_command() -> list[str]:
    import sys

    return [sys.executable, "-m", "adapters.cli"]
