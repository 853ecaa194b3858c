"""POST /tokenize and /detokenize: counts a client can trust before it sends a request.

Over HTTP against the fake model (whose chat completions report the usage a
count must match) and the default model's real tokenizer (round trips,
pieces, the chat template); a tokenizer that adds a BOS and a template with
variables of its own are served beside them through the app's test client.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests
import trio
from tokenizers.processors import TemplateProcessing

from adapters.cli.serve import ServeOptions
from adapters.openai.models import ChatModel, FakeChatModel, ServedModel
from adapters.openai.normalize import ChatMessage
from adapters.openai.server import FencepostApp
from adapters.runtime.controller import Controller
from core.fake_model import VOCAB
from tests.support.http_helpers import ServerThread, chat_body, post_json
from tests.support.tiny_models import default_tokenizer

KEY = "sk-fencepost-tokenize-0123456789"
HELLO = [{"role": "user", "content": "hello"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
# A template that reads variables of its own (chat_template_kwargs) and can refuse.
KWARGS_TEMPLATE = (
    "{% if refuse %}{{ raise_exception('refused: ' + refuse) }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{% if greeting %}{{ greeting }}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return default_tokenizer()


@pytest.fixture(scope="module")
def fake() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True)) as running:
        yield running


@pytest.fixture(scope="module")
def real(tokenizer: Any) -> Iterator[ServerThread]:
    model = ChatModel("m", tokenizer, 2048)
    with ServerThread(ServeOptions(port=0, fake=True), model=model) as running:
        yield running


def tokenize(server: ServerThread, **body: Any) -> dict[str, Any]:
    reply = post_json(server, "/tokenize", body)
    assert reply.status_code == 200, reply.text
    answer: dict[str, Any] = reply.json()
    assert answer["count"] == len(answer["tokens"])
    return answer


def detokenize(server: ServerThread, tokens: list[int]) -> str:
    reply = post_json(server, "/detokenize", {"tokens": tokens})
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["prompt"] == answer["content"]  # vLLM's key and llama.cpp's
    return str(answer["prompt"])


# --- the real tokenizer ---

TEXTS = ["Hello world", "The capital of France is Paris.", "déjà vu 🙂 日本語", ""]


@pytest.mark.parametrize("text", TEXTS)
def test_a_prompt_tokenized_then_detokenized_gives_the_text_back(
    real: ServerThread, tokenizer: Any, text: str
) -> None:
    answer = tokenize(real, model="m", prompt=text)
    assert answer["tokens"] == tokenizer.encode(text)
    assert answer["max_model_len"] == 2048
    assert detokenize(real, answer["tokens"]) == text


def test_llama_cpp_names_mean_the_same_as_vllm_names(real: ServerThread) -> None:
    vllm = tokenize(real, prompt="Hello world", add_special_tokens=False)
    assert tokenize(real, content="Hello world", add_special=False) == vllm


def test_messages_count_what_the_chat_template_renders(real: ServerThread, tokenizer: Any) -> None:
    answer = tokenize(real, messages=HELLO)
    rendered = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True)
    assert answer["tokens"] == rendered["input_ids"]
    text = detokenize(real, answer["tokens"])  # special tokens skipped, as chat decodes
    assert "hello" in text and "<|im_start|>" not in text


def test_without_the_generation_prompt_a_conversation_is_fewer_tokens(
    real: ServerThread,
) -> None:
    ready = tokenize(real, messages=HELLO)["tokens"]
    plain = tokenize(real, messages=HELLO, add_generation_prompt=False)["tokens"]
    assert len(plain) < len(ready) and ready[: len(plain)] == plain
    assert tokenize(real, messages=HELLO, add_generation_prompt=True)["tokens"] == ready


def test_with_pieces_each_token_comes_with_its_text(real: ServerThread) -> None:
    ids = tokenize(real, prompt="Hello brave new world")["tokens"]
    pieces = tokenize(real, prompt="Hello brave new world", with_pieces=True)["tokens"]
    assert [p["id"] for p in pieces] == ids and len(ids) > 1
    assert "".join(p["piece"] for p in pieces) == "Hello brave new world"
    # A character spread over tokens: each holds bytes of it, shown as U+FFFD.
    split = tokenize(real, prompt="鬱", with_pieces=True)["tokens"]
    assert len(split) > 1 and all(p["piece"] == "\ufffd" for p in split)


def test_unknown_or_out_of_range_token_ids_are_refused(real: ServerThread) -> None:
    reply = post_json(real, "/detokenize", {"tokens": [1, 49152]})  # the vocabulary is 49152
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens[1]"
    detokenize(real, [49151])  # the last id is one: a 200 (the helper asserts it)


# --- counts against what chat completions report (the fake model) ---


@pytest.mark.parametrize(
    "fields",
    [
        {"messages": HELLO},
        {"messages": [{"role": "system", "content": "be brief"}, *HELLO]},
        {"messages": HELLO, "tools": [WEATHER]},  # the fake model's prompt lists the tools
        {"messages": HELLO, "tools": [WEATHER], "tool_choice": "none"},  # and here does not
    ],
)
def test_a_conversations_count_is_what_a_chat_completion_reports(
    fake: ServerThread, fields: dict[str, Any]
) -> None:
    counted = tokenize(fake, model="fake", **fields)["count"]
    chat = post_json(fake, "/v1/chat/completions", chat_body(max_tokens=1, **fields))
    assert chat.status_code == 200, chat.text
    assert counted == chat.json()["usage"]["prompt_tokens"]


def test_tools_add_to_the_count(fake: ServerThread) -> None:
    plain = tokenize(fake, messages=HELLO)["count"]
    assert tokenize(fake, messages=HELLO, tools=[WEATHER])["count"] > plain


def test_a_prompts_count_is_what_a_completion_reports(fake: ServerThread) -> None:
    counted = tokenize(fake, prompt="count me")["count"]
    body = {"model": "fake", "prompt": "count me", "max_tokens": 1, "temperature": 0}
    completion = post_json(fake, "/v1/completions", body)
    assert counted == completion.json()["usage"]["prompt_tokens"] == len("count me")


def test_counting_submits_nothing(fake: ServerThread) -> None:
    def reached() -> int:
        router = fake.statistics().router
        return sum(router.outcomes.values()) + sum(router.requests_by_phase.values())

    before = reached()
    tokenize(fake, messages=HELLO)
    detokenize(fake, [1, 2, 3])
    assert reached() == before


# --- refusals ---

MESSAGES_OK = {"messages": HELLO}
TOKENIZE_REFUSALS: list[tuple[object, str | None]] = [
    ([1, 2], None),  # not an object
    ("prompt", None),
    ({}, "prompt"),  # neither
    ({"model": "fake"}, "prompt"),
    ({"prompt": "a", "messages": HELLO}, "messages"),  # both
    ({"content": "a", "messages": HELLO}, "messages"),
    ({"prompt": "a", "content": "b"}, "content"),
    ({"prompt": 5}, "prompt"),
    ({"content": ["a"]}, "content"),
    ({"prompt": "a", "model": 5}, "model"),
    ({"prompt": "a", "model": ""}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": [*HELLO, {"role": "user", "content": 5}]}, "messages[1].content"),
    ({"messages": [{"role": "wizard", "content": "a"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "a", "tool_call_id": "c"}]},
     "messages[0].tool_call_id"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"prompt": "a", "add_special": 1}, "add_special"),
    ({"prompt": "a", "add_special_tokens": True, "add_special": True}, "add_special"),
    ({"prompt": "a", "with_pieces": "true"}, "with_pieces"),
    ({**MESSAGES_OK, "with_pieces": 0}, "with_pieces"),
    ({"prompt": "a", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs"),
    ({"prompt": "a", "tools": [WEATHER]}, "tools"),
    ({"prompt": "a", "tool_choice": "none"}, "tool_choice"),
    ({**MESSAGES_OK, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ({**MESSAGES_OK, "add_special_tokens": True}, "add_special_tokens"),
    ({**MESSAGES_OK, "add_special": "no"}, "add_special"),
    ({**MESSAGES_OK, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ({**MESSAGES_OK, "chat_template_kwargs": "enable_thinking"}, "chat_template_kwargs"),
    ({**MESSAGES_OK, "chat_template_kwargs": {"tokenize": False}},
     "chat_template_kwargs.tokenize"),
    ({**MESSAGES_OK, "tools": {"type": "function"}}, "tools"),
    ({**MESSAGES_OK, "tools": [{"type": "function"}]}, "tools[0].function"),
    ({**MESSAGES_OK, "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), TOKENIZE_REFUSALS)
def test_every_bad_tokenize_body_is_a_400_naming_its_field(
    fake: ServerThread, body: object, param: str | None
) -> None:
    reply = post_json(fake, "/tokenize", body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


DETOKENIZE_REFUSALS: list[tuple[object, str | None]] = [
    ([1], None),  # a list, not an object
    ({}, "tokens"),
    ({"tokens": "1 2"}, "tokens"),
    ({"tokens": {"0": 1}}, "tokens"),
    ({"tokens": [1, -1]}, "tokens[1]"),
    ({"tokens": [1, 2, VOCAB]}, "tokens[2]"),
    ({"tokens": [True]}, "tokens[0]"),
    ({"tokens": [1.0]}, "tokens[0]"),
    ({"tokens": ["1"]}, "tokens[0]"),
    ({"tokens": [1], "model": 7}, "model"),
]


@pytest.mark.parametrize(("body", "param"), DETOKENIZE_REFUSALS)
def test_every_bad_detokenize_body_is_a_400_naming_its_field(
    fake: ServerThread, body: object, param: str | None
) -> None:
    reply = post_json(fake, "/detokenize", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_body_that_is_not_json_is_refused(fake: ServerThread) -> None:
    for path in ("/tokenize", "/detokenize"):
        for kind, raw, said in (("application/json", b"{", "not valid JSON"),
                                ("text/plain", b"{}", "Content-Type")):  # fmt: skip
            headers = {"Content-Type": kind}
            reply = requests.post(f"{fake.base_url}{path}", data=raw, headers=headers, timeout=10)
            assert reply.status_code == 400 and said in reply.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"), [("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})]
)
def test_an_unknown_model_is_404_as_for_chat(fake: ServerThread, path: str, body: Any) -> None:
    reply = post_json(fake, path, {"model": "nope", **body})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")
    chat = post_json(fake, "/v1/chat/completions", chat_body(model="nope"))
    assert (chat.status_code, chat.json()["error"]["code"]) == (404, "model_not_found")


def test_only_post_is_served(fake: ServerThread) -> None:
    reply = requests.get(f"{fake.base_url}/tokenize", timeout=10)
    assert reply.status_code == 405 and "error" in reply.json()


# --- behind the API keys ---


def test_without_a_key_both_routes_are_401_when_keys_are_configured() -> None:
    keyed = {"Authorization": f"Bearer {KEY}"}
    with ServerThread(ServeOptions(port=0, fake=True, api_keys=(KEY,))) as guarded:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            for headers in ({}, {"Authorization": "Bearer sk-wrong"}):
                reply = requests.post(
                    guarded.base_url + path, json=body, headers=headers, timeout=10
                )
                assert reply.status_code == 401, (path, headers)
                assert reply.json()["error"]["code"] == "invalid_api_key"
            reply = requests.post(guarded.base_url + path, json=body, headers=keyed, timeout=10)
            assert reply.status_code == 200, reply.text
        page = requests.get(f"{guarded.base_url}/metrics", headers=keyed, timeout=10).text
        counted = re.search(r"^fencepost_unauthorized_requests_total (\S+)$", page, re.M)
        assert counted is not None and float(counted[1]) == 4


# --- several models: a BOS-adding tokenizer, a template with variables ---


def with_bos(tokenizer: Any) -> Any:
    """The default tokenizer, made to start every encoding with its BOS."""
    changed = copy.deepcopy(tokenizer)
    bos = changed.bos_token
    processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, changed.bos_token_id)])
    changed.backend_tokenizer.post_processor = processor
    return changed


def with_template(tokenizer: Any, template: str) -> Any:
    changed = copy.deepcopy(tokenizer)
    changed.chat_template = template
    return changed


@pytest.fixture(scope="module")
def several(tokenizer: Any) -> FencepostApp:
    models: list[ServedModel] = [
        ChatModel("bos", with_bos(tokenizer), 1024),
        ChatModel("kwargs", with_template(tokenizer, KWARGS_TEMPLATE), 1024),
        FakeChatModel("fake", 4096),
    ]
    return FencepostApp(Controller(), models)


def ask(app: FencepostApp, path: str, body: Any) -> tuple[int, Any]:
    async def post() -> tuple[int, Any]:
        reply = await app.quart.test_client().post(path, json=body)
        return reply.status_code, await reply.get_json()

    return trio.run(post)


def test_with_several_models_the_model_must_be_named(several: FencepostApp) -> None:
    status, answer = ask(several, "/tokenize", {"prompt": "hi"})
    assert (status, answer["error"]["param"]) == (400, "model")
    status, answer = ask(several, "/detokenize", {"tokens": [1]})
    assert (status, answer["error"]["param"]) == (400, "model")
    status, answer = ask(several, "/tokenize", {"model": "fake", "prompt": "hi"})
    assert (status, answer["max_model_len"]) == (200, 4096)


def test_add_special_tokens_decides_whether_the_tokenizers_bos_is_counted(
    several: FencepostApp,
) -> None:
    model = several.models["bos"]
    assert isinstance(model, ChatModel)
    bos = model.tokenizer.bos_token_id
    _, plain = ask(several, "/tokenize", {"model": "bos", "prompt": "hi there"})
    _, bare = ask(several, "/tokenize", {"model": "bos", "prompt": "hi there",
                                         "add_special_tokens": False})  # fmt: skip
    assert plain["tokens"] == [bos, *bare["tokens"]] == model.tokenize("hi there")
    _, llama = ask(several, "/tokenize", {"model": "bos", "content": "hi there",
                                          "add_special": False})  # fmt: skip
    assert llama == bare
    # what /v1/completions sends for the same text: the BOS included
    assert plain["count"] == len(model.tokenize("hi there")) == bare["count"] + 1


def test_chat_template_kwargs_reach_the_template_and_its_refusal_is_a_400(
    several: FencepostApp,
) -> None:
    model = several.models["kwargs"]
    base = {"model": "kwargs", "messages": HELLO}
    _, plain = ask(several, "/tokenize", base)
    assert plain["tokens"] == model.tokenize_chat([ChatMessage("user", "hello")])
    _, greeted = ask(several, "/tokenize", {**base, "chat_template_kwargs": {"greeting": "Hi!"}})
    assert greeted["tokens"][: plain["count"]] == plain["tokens"]
    assert greeted["count"] > plain["count"]
    status, refused = ask(several, "/tokenize", {**base, "chat_template_kwargs": {"refuse": "no"}})
    assert (status, refused["error"]["param"]) == (400, "messages")
    assert "refused: no" in refused["error"]["message"]
