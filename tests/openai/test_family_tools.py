"""Tool calls in each family's own form, end to end: the official SDK against tiny models.

Three tiny checkpoints (Qwen3, Llama, Mistral), each with the default model's
tokenizer and a chat template written here in its family's convention (Qwen's
Hermes `<tool_call>` blocks, Llama 3.1's JSON with "parameters", Mistral's
`[TOOL_CALLS]` array, the marker a special token of its own). The server reads
the template, picks the call syntax, holds a required or named call to that
syntax with the grammar, and reads it back into OpenAI `tool_calls`. The
models are random, so only a constrained call is a call; reading unforced
calls is tested on recorded outputs (tests/openai/test_openai_tool_syntaxes.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
import transformers

from adapters.cli.serve import ServeOptions
from adapters.engine.engine import Engine
from adapters.engine.model import load_model
from core.batching import BatchLimits
from tests.support import tiny_models
from tests.support.http_helpers import ServerThread

TURNS = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
PROMPT = "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
TEMPLATES = {
    # Qwen's convention: the tools in the system turn, calls as <tool_call> JSON blocks.
    "qwen3": (
        "{%- if tools %}<|im_start|>system\nYou may call these, one <tool_call>"
        '{"name": ..., "arguments": ...}</tool_call> each:\n<tools>'
        "{%- for t in tools %}{{ t | tojson }}{%- endfor %}</tools><|im_end|>\n{%- endif %}"
        + TURNS
        + PROMPT
    ),
    # Llama 3.1's: ipython results, calls as JSON objects with "parameters".
    "llama": (
        "{%- if tools %}<|im_start|>system\nAnswer a call as "
        '{"name": function name, "parameters": its arguments} (results come back as '
        "ipython turns):{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|im_end|>\n"
        "{%- endif %}" + TURNS + PROMPT
    ),
    # Mistral's: [AVAILABLE_TOOLS] before the last user turn, calls after [TOOL_CALLS].
    "mistral": (
        "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}"
        + TURNS
        + PROMPT
        + "{#- calls: [TOOL_CALLS][{...}] #}"
    ),
}
SYNTAX = {"qwen3": "hermes", "llama": "llama3_json", "mistral": "mistral"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def checkpoint(case: str, folder: Path) -> Path:
    """A tiny `case` model with the default tokenizer, this family's template and (for
    Mistral) its [TOOL_CALLS] marker as a special token, the vocabulary grown to fit."""
    target = folder / f"tools-{case}"
    if (target / "config.json").is_file():
        return target
    tokenizer = transformers.AutoTokenizer.from_pretrained(_default_tokenizer_folder(folder))
    if case == "mistral":
        tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tokenizer.chat_template = TEMPLATES[case]
    config = tiny_models.config(case)
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def _default_tokenizer_folder(folder: Path) -> Path:
    saved = folder / "default-tokenizer"
    if not (saved / "tokenizer_config.json").is_file():
        tiny_models.default_tokenizer().save_pretrained(saved)
    return saved


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("family-tools")


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def server(request: pytest.FixtureRequest, folder: Path) -> Iterator[tuple[str, ServerThread]]:
    from adapters.openai.models import ChatModel
    from adapters.runtime.worker_host import EngineDecoder

    loaded = load_model(checkpoint(request.param, folder), quiet=True)
    model = ChatModel(request.param, loaded.tokenizer, 512)
    assert model.call_syntax.name == SYNTAX[request.param]
    engine = Engine(loaded, BatchLimits(max_seqs=2, max_context=512))
    with ServerThread(ServeOptions(port=0, max_context=512), EngineDecoder(engine), model) as s:
        yield request.param, s


@pytest.mark.parametrize("choice", ["required", "named"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_comes_back_as_tool_calls_in_every_syntax(
    server: tuple[str, ServerThread], choice: str, stream: bool
) -> None:
    case, thread = server
    client = openai.OpenAI(base_url=f"{thread.base_url}/v1", api_key="unused")
    tool_choice = (
        "required" if choice == "required"
        else {"type": "function", "function": {"name": "get_weather"}}
    )  # fmt: skip
    arguments = dict(
        model=case, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER], tool_choice=tool_choice, temperature=0, max_tokens=60,
        parallel_tool_calls=False,
    )  # fmt: skip
    if stream:
        names, args, finish = [], "", None
        for chunk in client.chat.completions.create(**arguments, stream=True):  # type: ignore[call-overload]
            delta = chunk.choices[0].delta if chunk.choices else None
            for call in (delta.tool_calls or []) if delta else []:
                names += [call.function.name] if call.function.name else []
                args += call.function.arguments or ""
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        assert names == ["get_weather"] and finish == "tool_calls", (names, finish)
    else:
        done = client.chat.completions.create(**arguments)  # type: ignore[call-overload]
        message = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls", message
        [call] = message.tool_calls
        assert call.function.name == "get_weather" and not message.content
        args = call.function.arguments
    parsed = json.loads(args)
    assert set(parsed) == {"city"} and isinstance(parsed["city"], str)
