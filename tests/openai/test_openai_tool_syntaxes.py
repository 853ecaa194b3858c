"""Tool calls in each family's own form: Hermes, Llama 3 JSON, Mistral (callsyntax.py).

The readers are fed answers written the way each family's models write them
(the conventions of their chat templates and tokenizers: Qwen's newlines
inside `<tool_call>`, Llama's `; `-separated objects and `<|python_tag|>`,
Mistral's `[TOOL_CALLS]` array and its v11 `name[ARGS]{...}` form), whole, at
every cut into two deltas, and in token-sized deltas, and must give the same
OpenAI-shaped result every way. The grammars are compiled by llguidance
against a byte-level tokenizer built here (with Mistral's markers added as
special tokens) and must admit the valid calls and refuse the rest. Detection
reads small hand-written templates; the Mistral marker is followed from token
ids through decode_with_markers to the reader, and over HTTP.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.callsyntax import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    CallSyntax,
    detect_syntax,
    syntax_named,
)
from adapters.openai.egress import IncrementalDetokenizer
from adapters.openai.models import ChatModel
from adapters.openai.normalize import ChatJob, ChatMessage, ModelInfo, normalize_chat_request
from adapters.openai.tool_prompt import render_with_tools
from adapters.openai.toolcalls import ARGS, TOOL_CALLS, Call, Content, Piece, read_answer
from adapters.openai.tools import Tool, ToolCall, ToolSetup
from core.fake_model import EOS_TOKEN
from tests.openai.test_openai_tools import ScriptedDecoder, ScriptModel
from tests.openai.test_tokenizer_families import byte_level
from tests.support.http_helpers import ServerThread, sse_events

NAMES = frozenset({"get_weather", "search"})
PARIS = '{"city": "Paris"}'
BERLIN = '{"city": "Berlin", "days": 2}'
RAIN = '{"q": "rain"}'

Result = tuple[str | None, list[tuple[str, str]]]  # content (None: only calls); (name, arguments)


def read(syntax: CallSyntax, chunks: Sequence[str], parallel: bool = True) -> Result:
    """The answer fed delta by delta, as the server reads a stream: content and calls."""
    counter = itertools.count()
    reader = syntax.reader(NAMES, lambda: f"call_{next(counter)}", parallel)
    pieces: list[Piece] = [p for chunk in chunks for p in reader.feed(chunk)]
    pieces += reader.finish()
    calls = [p for p in pieces if isinstance(p, Call)]
    assert [c.index for c in calls] == list(range(len(calls)))
    assert [c.call.id for c in calls] == [f"call_{i}" for i in range(len(calls))]
    content = "".join(p.text for p in pieces if isinstance(p, Content))
    return (None if calls and not content else content), [
        (c.call.name, c.call.arguments) for c in calls
    ]


def token_sized(text: str) -> list[str]:
    """Deltas of 1 to 4 characters, as a tokenizer cuts text (a fixed pattern)."""
    sizes = itertools.cycle([1, 3, 2, 4, 1, 1, 2])
    out, at = [], 0
    while at < len(text):
        size = next(sizes)
        out.append(text[at : at + size])
        at += size
    return out


def assert_reads(syntax: CallSyntax, text: str, expected: Result, parallel: bool = True) -> None:
    """Whole, at every cut into two deltas, character by character and token-sized, the
    answer reads as expected (the plain response's read_answer included)."""
    assert read(syntax, [text], parallel) == expected
    for cut in range(len(text) + 1):
        assert read(syntax, [text[:cut], text[cut:]], parallel) == expected, cut
    assert read(syntax, list(text), parallel) == expected
    assert read(syntax, token_sized(text), parallel) == expected
    content, calls = read_answer(text, NAMES, lambda: "id", parallel, syntax.reader)
    assert (content, [(c.name, c.arguments) for c in calls]) == expected


# --- recorded answers, per family: (text, content, calls) ---

HERMES_ANSWERS = {
    "plain": ("The capital of France is Paris.", "The capital of France is Paris.", []),
    "single": (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
        None,
        [("get_weather", PARIS)],
    ),
    "parallel": (
        f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "search", "arguments": {RAIN}}}\n</tool_call>',
        None,
        [("get_weather", PARIS), ("search", RAIN)],
    ),
    # Hermes sends whitespace before the first call as content, as it always has.
    "leading whitespace": (
        f'\n\n<tool_call>{{"name": "get_weather", "arguments": {PARIS}}}</tool_call>',
        "\n\n",
        [("get_weather", PARIS)],
    ),
    "malformed": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
        [],
    ),
    "unknown function": (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        [],
    ),
    "text then a call": (
        f'Let me check.\n<tool_call>{{"name": "search", "arguments": {RAIN}}}</tool_call>',
        "Let me check.\n",
        [("search", RAIN)],
    ),
}

LLAMA_ANSWERS = {
    "plain": (
        "I don't have real-time data, but Paris is usually mild in May.",
        "I don't have real-time data, but Paris is usually mild in May.",
        [],
    ),
    "single": (f'{{"name": "get_weather", "parameters": {PARIS}}}', None, [("get_weather", PARIS)]),
    "python tag": (  # the tag is a special token; kept as text, it is no content either
        f'<|python_tag|>{{"name": "get_weather", "parameters": {PARIS}}}',
        None,
        [("get_weather", PARIS)],
    ),
    "parallel": (  # Llama 3.2 / 3.3
        f'{{"name": "get_weather", "parameters": {PARIS}}}; '
        f'{{"name": "get_weather", "parameters": {BERLIN}}}',
        None,
        [("get_weather", PARIS), ("get_weather", BERLIN)],
    ),
    "parallel on lines, arguments and type": (
        f'{{"type": "function", "name": "get_weather", "parameters": {PARIS}}}\n'
        f'{{"name": "search", "arguments": {RAIN}}}\n',
        None,
        [("get_weather", PARIS), ("search", RAIN)],
    ),
    "leading whitespace": (
        f'\n\n  {{"name": "search", "parameters": {RAIN}}}',
        None,
        [("search", RAIN)],
    ),
    "json content": (  # starts with { but names no function: an answer in JSON
        '{"city": "Paris", "temperature_c": 21, "sky": "clear"}',
        '{"city": "Paris", "temperature_c": 21, "sky": "clear"}',
        [],
    ),
    "braces in prose": (
        "{city} is a placeholder; write the city there.",
        "{city} is a placeholder; write the city there.",
        [],
    ),
    "malformed": (  # a bare word for a string: the object closes but does not parse
        '{"name": "get_weather", "parameters": {"city": Paris}}',
        '{"name": "get_weather", "parameters": {"city": Paris}}',
        [],
    ),
    "unclosed": (
        '{"name": "get_weather", "parameters": {"city": "Par',
        '{"name": "get_weather", "parameters": {"city": "Par',
        [],
    ),
    "unknown function": (
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        [],
    ),
    "text first": (  # a call only from the first character on
        f'Sure: {{"name": "search", "parameters": {RAIN}}}',
        f'Sure: {{"name": "search", "parameters": {RAIN}}}',
        [],
    ),
    "text after the calls": (
        f'{{"name": "search", "parameters": {RAIN}}} I will look that up.',
        " I will look that up.",
        [("search", RAIN)],
    ),
    "a string holding braces": (
        '{"name": "search", "parameters": {"q": "} and { and \\" and ]"}}',
        None,
        [("search", '{"q": "} and { and \\" and ]"}')],
    ),
}

MISTRAL_ANSWERS = {
    "plain": ("Paris is the capital of France.", "Paris is the capital of France.", []),
    "single": (
        f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {PARIS}}}]',
        None,
        [("get_weather", PARIS)],
    ),
    "parallel, with the ids v3 models write": (
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}, "id": "a1b2c3d4e"}}, '
        f'{{"name": "search", "arguments": {RAIN}, "id": "f5g6h7i8j"}}]',
        None,
        [("get_weather", PARIS), ("search", RAIN)],
    ),
    "v11 form": (
        f"[TOOL_CALLS]get_weather[ARGS]{PARIS}[TOOL_CALLS]search[ARGS]{RAIN}",
        None,
        [("get_weather", PARIS), ("search", RAIN)],
    ),
    "leading whitespace": (
        f'\n [TOOL_CALLS]\n[{{"name": "search", "arguments": {RAIN}}}]\n',
        None,
        [("search", RAIN)],
    ),
    "text then the marker": (
        f'Let me check. [TOOL_CALLS][{{"name": "search", "arguments": {RAIN}}}]',
        "Let me check. ",
        [("search", RAIN)],
    ),
    "marker absent": (  # the array alone is no call: the marker says it is one
        f'[{{"name": "get_weather", "arguments": {PARIS}}}]',
        f'[{{"name": "get_weather", "arguments": {PARIS}}}]',
        [],
    ),
    "malformed": (  # content, without the marker a plain decode would have dropped
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}]',
        ' [{"name": "get_weather", "arguments": {"city": "Paris"}]',
        [],
    ),
    "unknown function": (
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]',
        '[{"name": "get_time", "arguments": {}}]',
        [],
    ),
    "one bad call spoils the array": (
        f'[TOOL_CALLS][{{"name": "search", "arguments": {RAIN}}}, {{"name": "search"}}]',
        f'[{{"name": "search", "arguments": {RAIN}}}, {{"name": "search"}}]',
        [],
    ),
    "unclosed": (
        '[TOOL_CALLS][{"name": "search", "arguments": {"q": "ra',
        '[{"name": "search", "arguments": {"q": "ra',
        [],
    ),
    "v11 malformed": (  # [ARGS] is a marker too: not in the content
        '[TOOL_CALLS]get_weather[ARGS]{"city": Paris}',
        'get_weather{"city": Paris}',
        [],
    ),
    "marker then prose": ("[TOOL_CALLS]Hello there", "Hello there", []),
    "brackets in prose": (
        "See [1] and [2], and the list [a, b].",
        "See [1] and [2], and the list [a, b].",
        [],
    ),
}

ALL_ANSWERS = [
    (syntax, case, *answer)
    for syntax, answers in ((HERMES, HERMES_ANSWERS), (LLAMA3_JSON, LLAMA_ANSWERS),
                            (MISTRAL, MISTRAL_ANSWERS))
    for case, answer in answers.items()
]  # fmt: skip


@pytest.mark.parametrize(
    ("syntax", "case", "text", "content", "calls"),
    ALL_ANSWERS,
    ids=[f"{a[0].name}-{a[1]}" for a in ALL_ANSWERS],
)
def test_a_recorded_answer_reads_the_same_whole_and_in_any_deltas(
    syntax: CallSyntax, case: str, text: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    assert_reads(syntax, text, (content, calls))


@pytest.mark.parametrize("syntax", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda s: s.name)
def test_with_parallel_calls_off_only_the_first_call_is_one(syntax: CallSyntax) -> None:
    text = {
        "hermes": HERMES_ANSWERS["parallel"][0],
        "llama3_json": LLAMA_ANSWERS["parallel"][0],
        "mistral": MISTRAL_ANSWERS["parallel, with the ids v3 models write"][0],
    }[syntax.name]
    content, calls = read(syntax, [text], parallel=False)
    assert len(calls) == 1 and content
    rest = {
        "hermes": f'\n<tool_call>\n{{"name": "search", "arguments": {RAIN}}}\n</tool_call>',
        "llama3_json": f'; {{"name": "get_weather", "parameters": {BERLIN}}}',
        "mistral": f'[{{"name": "search", "arguments": {RAIN}}}]',  # the array's other calls
    }[syntax.name]
    assert_reads(syntax, text, (rest, calls), parallel=False)


def test_content_goes_out_as_it_comes_and_only_what_could_be_a_call_waits() -> None:
    words = ["Paris", " is", " sunny", " today", "."]
    for syntax in (HERMES, LLAMA3_JSON, MISTRAL):
        reader = syntax.reader(NAMES, lambda: "id")
        assert [reader.feed(w) for w in words] == [[Content(w)] for w in words], syntax.name
    llama = LLAMA3_JSON.reader(NAMES, lambda: "id")
    assert llama.feed("\n") == []  # the answer's first character is still to come
    assert llama.feed('{"city": "Paris"') == []  # it could be a call until it closes
    assert llama.feed("}") == [Content('\n{"city": "Paris"}')]
    assert llama.feed(" and {") == [Content(" and {")]  # content now: nothing waits
    prose = LLAMA3_JSON.reader(NAMES, lambda: "id")
    assert prose.feed('Sure: {"name": "search"') == [Content('Sure: {"name": "search"')]
    mistral = MISTRAL.reader(NAMES, lambda: "id")
    assert mistral.feed("See [") == [Content("See ")]  # "[" could open [TOOL_CALLS]
    assert mistral.feed("1]") == [Content("[1]")]
    assert mistral.feed(" [TOOL_CA") == [Content(" ")]
    assert mistral.finish() == [Content("[TOOL_CA")]  # never completed: it was text


# --- the grammars of required and named calls ---

WEATHER = Tool(
    "get_weather",
    None,
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
    None,
)
SEARCH = Tool("search", None, {"type": "object", "properties": {"q": {"type": "string"}}}, None)
REQUIRED = ToolSetup((WEATHER, SEARCH), "required")
SINGLE = ToolSetup((WEATHER, SEARCH), "required", parallel=False)
NAMED = ToolSetup((WEATHER, SEARCH), "function", "search")


@pytest.fixture(scope="module")
def mistral_vocabulary() -> Any:
    """A byte-level tokenizer with Mistral's markers as special tokens, and its llguidance view."""
    import llguidance.hf

    hf = byte_level()
    hf.add_special_tokens({"additional_special_tokens": [TOOL_CALLS, ARGS]})
    return hf, llguidance.hf.from_tokenizer(hf)


def admits(vocabulary: Any, grammar: str, text: str | list[int]) -> bool:
    """Whether the grammar takes the text (special tokens as the tokenizer encodes them)
    or the token ids whole, and is then complete."""
    from llguidance import LLMatcher

    hf, tokenizer = vocabulary
    ids = hf.encode(text, add_special_tokens=False) if isinstance(text, str) else text
    matcher = LLMatcher(tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return bool(matcher.consume_tokens(ids)) and bool(matcher.is_accepting())


def test_the_llama_grammar_admits_exactly_its_calls(mistral_vocabulary: Any) -> None:
    from llguidance import LLMatcher

    grammar = LLAMA3_JSON.grammar(REQUIRED)
    assert not LLMatcher.validate_grammar(grammar)
    weather = f'{{"name": "get_weather", "parameters": {PARIS}}}'
    search = f'{{"name": "search", "parameters": {RAIN}}}'
    for text, ok in [
        (weather, True),
        (f"{weather}; {search}", True),  # required, parallel: several, "; " between
        (f'{{"name": "get_weather", "parameters": {BERLIN}}}', True),
        (f'{{"name": "get_weather", "arguments": {PARIS}}}', False),  # Llama's key only
        ('{"name": "get_weather", "parameters": {"days": 2}}', False),  # city is required
        ('{"name": "get_time", "parameters": {}}', False),
        (f"{weather};{search}", False),  # the layout is the prompt's
        (f"<|python_tag|>{weather}", False),
        (f"Sure. {weather}", False),
        (weather[:-1], False),  # not complete
    ]:
        assert admits(mistral_vocabulary, grammar, text) == ok, text
    assert not admits(mistral_vocabulary, LLAMA3_JSON.grammar(SINGLE), f"{weather}; {search}")
    assert admits(mistral_vocabulary, LLAMA3_JSON.grammar(NAMED), search)
    assert not admits(mistral_vocabulary, LLAMA3_JSON.grammar(NAMED), weather)


def test_the_mistral_grammar_admits_exactly_its_calls(mistral_vocabulary: Any) -> None:
    from llguidance import LLMatcher

    hf, _ = mistral_vocabulary
    marker_id = hf.convert_tokens_to_ids(TOOL_CALLS)
    bound = MISTRAL.with_special({TOOL_CALLS: marker_id})
    grammar = bound.grammar(REQUIRED)
    assert f"<[{marker_id}]>" in grammar and not LLMatcher.validate_grammar(grammar)
    weather = f'{{"name": "get_weather", "arguments": {PARIS}}}'
    search = f'{{"name": "search", "arguments": {RAIN}}}'
    for text, ok in [
        (f"[TOOL_CALLS][{weather}]", True),
        (f"[TOOL_CALLS] [{weather}]", True),  # the v3 template's space
        (f"[TOOL_CALLS][{weather}, {search}]", True),
        (f"[{weather}]", False),  # the marker is required
        (f"[TOOL_CALLS]{weather}", False),  # and the array
        (f'[TOOL_CALLS][{{"name": "get_weather", "parameters": {PARIS}}}]', False),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": 5}}]', False),
        (f"[TOOL_CALLS][{weather}", False),
    ]:
        assert admits(mistral_vocabulary, grammar, text) == ok, text
    assert not admits(
        mistral_vocabulary, bound.grammar(SINGLE), f"[TOOL_CALLS][{weather}, {search}]"
    )
    assert admits(mistral_vocabulary, bound.grammar(NAMED), f"[TOOL_CALLS][{search}]")
    assert not admits(mistral_vocabulary, bound.grammar(NAMED), f"[TOOL_CALLS][{weather}]")
    # Bound to the vocabulary, the grammar wants the special token, not the marker spelled
    # in ordinary tokens; unbound (the literal string) it is the other way round.
    spelled = (
        hf.encode("[TOOL", add_special_tokens=False)
        + hf.encode("_CALLS]", add_special_tokens=False)
        + hf.encode(f"[{weather}]", add_special_tokens=False)
    )
    assert marker_id not in spelled
    assert not admits(mistral_vocabulary, grammar, spelled)
    assert admits(mistral_vocabulary, MISTRAL.grammar(REQUIRED), spelled)
    assert not admits(mistral_vocabulary, MISTRAL.grammar(REQUIRED), f"[TOOL_CALLS][{weather}]")


def test_the_hermes_grammar_is_the_one_it_always_was(mistral_vocabulary: Any) -> None:
    from adapters.openai.tools import call_grammar

    assert HERMES.grammar(REQUIRED) == call_grammar(REQUIRED)
    call = f'<tool_call>{{"name": "get_weather", "arguments": {PARIS}}}</tool_call>'
    assert admits(mistral_vocabulary, HERMES.grammar(REQUIRED), call)
    assert not admits(mistral_vocabulary, HERMES.grammar(REQUIRED), f'{{"name": "x"}}{call}')


def test_a_required_call_is_held_to_the_grammar_of_the_models_syntax() -> None:
    def tokenize(
        model_id: str,
        messages: Sequence[ChatMessage],
        tools: tuple[Tool, ...],
        template_kwargs: object = None,
    ) -> list[int]:
        return [1, 2, 3]

    tools = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools}
    for syntax in (HERMES, LLAMA3_JSON, MISTRAL):
        model = ModelInfo("m", 4000, 1000, call_syntax=syntax)
        job = normalize_chat_request(
            body | {"tool_choice": "required"}, {"m": model}.get, tokenize, "r"
        )
        assert isinstance(job, ChatJob), job
        constraint = job.requests[0].constraint
        assert constraint is not None and constraint.grammar == syntax.grammar(job.tools)
        auto = normalize_chat_request(body, {"m": model}.get, tokenize, "r")
        assert isinstance(auto, ChatJob) and auto.requests[0].constraint is None


# --- choosing the syntax from the chat template ---

PLAIN_TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
LLAMA31_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, "
    "please respond with a JSON for a function call.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}.'
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>{% endif %}"
    "\n\n{{ m.content }}<|eot_id|>{% endfor %}"
)
LLAMA_TAG_TEMPLATE = (
    "{%- if tools %}Tools: {{ tools | tojson }}{% endif %}{% for m in messages %}"
    "{% if m.tool_calls %}<|python_tag|>{{ m.tool_calls[0].function | tojson }}{% endif %}"
    "{{ m.content }}{% endfor %}"
)
MISTRAL_TEMPLATE = (
    "{%- for m in messages %}{% if m.role == 'user' %}{% if tools and loop.last %}"
    "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}[TOOL_CALLS] ["
    "{% for c in m.tool_calls %}{{ c.function | tojson }}{% endfor %}]</s>"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
OTHER_TOOL_TEMPLATE = (
    "{% if tools %}Functions: {{ tools | tojson }}. Call as <function=name>{...}</function>."
    "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)


def chat_model(template: Any, call_syntax: str | None = None, markers: bool = False) -> ChatModel:
    tokenizer = byte_level()
    if markers:
        tokenizer.add_special_tokens({"additional_special_tokens": [TOOL_CALLS, ARGS]})
    tokenizer.chat_template = template
    return ChatModel("m", tokenizer, 512, call_syntax)


@pytest.mark.parametrize(
    ("template", "syntax"),
    [
        (QWEN_TEMPLATE, "hermes"),
        (LLAMA31_TEMPLATE, "llama3_json"),
        (LLAMA_TAG_TEMPLATE, "llama3_json"),
        (MISTRAL_TEMPLATE, "mistral"),
        (OTHER_TOOL_TEMPLATE, "hermes"),  # renders tools, in none of the three forms
        (PLAIN_TEMPLATE, "hermes"),  # renders no tools: tool_prompt.py teaches Hermes
        (PLAIN_TEMPLATE + "{# [TOOL_CALLS] #}", "hermes"),  # names a marker, shows no tools
    ],
)
def test_the_chat_template_decides_the_syntax(template: str, syntax: str) -> None:
    assert chat_model(template).call_syntax.name == syntax


def test_named_templates_an_override_and_unknown_names() -> None:
    assert detect_syntax({"default": PLAIN_TEMPLATE, "tool_use": MISTRAL_TEMPLATE}, True) is MISTRAL
    assert detect_syntax(MISTRAL_TEMPLATE, False) is HERMES
    assert chat_model(QWEN_TEMPLATE, "llama3_json").call_syntax == LLAMA3_JSON
    assert syntax_named("mistral") is MISTRAL
    with pytest.raises(ValueError, match="no call syntax 'pythonic'"):
        chat_model(QWEN_TEMPLATE, "pythonic")


# --- Mistral's marker: a special token, kept for the reader, never shown ---


def test_the_mistral_marker_survives_decoding_for_the_reader_only() -> None:
    model = chat_model(MISTRAL_TEMPLATE, markers=True)
    tokenizer = model.tokenizer
    marker_id = tokenizer.convert_tokens_to_ids(TOOL_CALLS)
    args_id = tokenizer.convert_tokens_to_ids(ARGS)
    assert model.call_syntax.special == ((ARGS, args_id), (TOOL_CALLS, marker_id))
    answer = f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {PARIS}}}]'
    ids = [int(t) for t in tokenizer.encode(answer, add_special_tokens=False)]
    assert marker_id in ids
    assert TOOL_CALLS not in model.decode(ids)  # a plain decode drops it, as before
    assert model.decode_with_markers(ids) == answer
    detokenizer = IncrementalDetokenizer(model.decode_with_markers)
    deltas = [detokenizer.push(t) for t in ids] + [detokenizer.flush()]
    assert "".join(deltas) == answer
    assert read(model.call_syntax, deltas) == (None, [("get_weather", PARIS)])
    prose = "Hello world, the quick brown fox."
    plain = [int(t) for t in tokenizer.encode(prose, add_special_tokens=False)]
    assert model.decode_with_markers(plain) == model.decode(plain) == prose
    hermes = chat_model(QWEN_TEMPLATE, markers=True)  # the same vocabulary, another syntax
    assert hermes.call_syntax.special == () and TOOL_CALLS not in hermes.decode_with_markers(ids)


# --- the history and the tools section for a template that renders no tools ---


def test_a_template_without_tools_is_taught_and_shown_the_models_syntax() -> None:
    messages = [
        ChatMessage("user", "weather?"),
        ChatMessage(
            "assistant",
            "",
            (ToolCall("c1", "get_weather", PARIS), ToolCall("c2", "search", RAIN)),
        ),
        ChatMessage("tool", "sunny", (), "c1"),
        ChatMessage("tool", "wet", (), "c2"),
    ]
    written = {
        HERMES: f'<tool_call>{{"name": "get_weather", "arguments": {PARIS}}}</tool_call>\n'
        f'<tool_call>{{"name": "search", "arguments": {RAIN}}}</tool_call>',
        LLAMA3_JSON: f'{{"name": "get_weather", "parameters": {PARIS}}}; '
        f'{{"name": "search", "parameters": {RAIN}}}',
        MISTRAL: f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {PARIS}}}, '
        f'{{"name": "search", "arguments": {RAIN}}}]',
    }
    taught = {
        HERMES: 'answer with a line <tool_call>{"name": "<function name>", "arguments": '
        "<arguments as JSON>}</tool_call> for each call.",
        LLAMA3_JSON: 'answer with only {"name": "<function name>", "parameters": '
        '<arguments as JSON>}; separate several calls with "; ".',
        MISTRAL: 'answer with [TOOL_CALLS][{"name": "<function name>", "arguments": '
        "<arguments as JSON>}], one object in the list for each call.",
    }
    for syntax, calls in written.items():
        rendered = render_with_tools(messages, (WEATHER,), syntax)
        assert rendered[2] == {"role": "assistant", "content": calls}, syntax.name
        assert taught[syntax] in rendered[0]["content"], syntax.name
        # what the model is shown in the history reads back as the same calls
        assert read(syntax, [calls]) == (None, [("get_weather", PARIS), ("search", RAIN)])
    llama = chat_model(PLAIN_TEMPLATE, "llama3_json")
    prompt = llama.tokenizer.decode(llama.tokenize_chat(messages, (WEATHER,)))
    assert written[LLAMA3_JSON] in prompt and taught[LLAMA3_JSON] in prompt


# --- over HTTP: a scripted model whose token 1 is Mistral's special marker ---

MARKER_TOKEN = "\x01"  # in a script: the [TOOL_CALLS] token


class MistralScriptModel(ScriptModel):
    """The script model, in the Mistral syntax: token 1 is [TOOL_CALLS], a special
    token that decode drops and decode_with_markers writes."""

    def __init__(self) -> None:
        super().__init__()
        self.call_syntax = MISTRAL

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids if t not in (EOS_TOKEN, ord(MARKER_TOKEN)))

    def decode_with_markers(self, token_ids: list[int]) -> str:
        return "".join(
            TOOL_CALLS if t == ord(MARKER_TOKEN) else chr(t) for t in token_ids if t != EOS_TOKEN
        )


@pytest.fixture(scope="module")
def mistral_server() -> Iterator[ServerThread]:
    options = ServeOptions(port=0, fake=True)
    with ServerThread(options, ScriptedDecoder(), MistralScriptModel()) as running:
        yield running


def ask(server: ServerThread, script: str, **fields: Any) -> tuple[dict[str, Any], list[Any]]:
    """The plain response's choice and the streamed chunks' choices for one script."""
    decoder = server.decoder
    assert isinstance(decoder, ScriptedDecoder)
    decoder.script = script
    url = f"{server.base_url}/v1/chat/completions"
    body = {"model": "fake", "messages": [{"role": "user", "content": "x"}]} | fields
    plain = requests.post(url, json=body, timeout=30).json()["choices"][0]
    raw = requests.post(url, json=body | {"stream": True}, timeout=30).content
    streamed = [e["choices"][0] for e in sse_events(raw) if e != "[DONE]" and e["choices"]]
    return plain, streamed


def test_mistral_calls_over_http_streamed_and_plain(mistral_server: ServerThread) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    call = f'[{{"name": "get_weather", "arguments": {PARIS}}}]'
    plain, streamed = ask(mistral_server, MARKER_TOKEN + call, tools=tools)
    assert plain["message"]["content"] is None and plain["finish_reason"] == "tool_calls"
    assert [c["function"] for c in plain["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": PARIS}
    ]
    deltas = [c for s in streamed for c in s["delta"].get("tool_calls", [])]
    assert "".join(d["function"]["arguments"] for d in deltas) == PARIS
    assert "".join(s["delta"].get("content") or "" for s in streamed) == ""
    # Without tools the answer is decoded as always: the special marker is not in it.
    plain, streamed = ask(mistral_server, MARKER_TOKEN + call)
    assert plain["message"]["content"] == call and "tool_calls" not in plain["message"]
    # A call that does not parse falls back to content, and the marker stays out of it.
    broken = '[{"name": "get_weather", "arguments": {"city": }]'
    plain, streamed = ask(mistral_server, "Hm. " + MARKER_TOKEN + broken, tools=tools)
    text = "".join(s["delta"].get("content") or "" for s in streamed)
    assert plain["message"]["content"] == text == "Hm. " + broken
    assert plain["finish_reason"] == "stop" and "tool_calls" not in plain["message"]
