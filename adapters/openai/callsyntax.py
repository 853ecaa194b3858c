"""Call syntaxes: how each model family writes a tool call, and which one a model uses.

A model is trained to call tools in one form, the one its chat template shows
it; with `tool_choice: auto` it writes that form, so the server must read that
form, and with `required` or a named function the grammar must force exactly
that form. A CallSyntax holds the three for one form:

- grammar(setup): the llguidance grammar of an answer that is only calls (one,
  or several when `required` and parallel calls are on), each call's JSON in
  tools.JSON_LAYOUT with the function's `parameters` schema embedded
  (tools.function_rules);
- reader: the ToolCallReader class that reads the form out of the stream
  (toolcalls.py);
- write_calls and instruction: an assistant message's calls from the history,
  and the sentence that teaches the form, for a template that does not render
  tools (tool_prompt.py).

The three, by name:

    hermes       <tool_call>{"name": "f", "arguments": {...}}</tool_call>   Qwen 2.5/3, Hermes
    llama3_json  {"name": "f", "parameters": {...}}; {...}                  Llama 3.1-3.3
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]       Mistral, Ministral

detect_syntax chooses from the chat template's text: a template that writes
`<tool_call>` is Hermes, one that writes `[TOOL_CALLS]` Mistral, one with
`<|python_tag|>`, or with Llama 3.1's ipython role and `"parameters"`, Llama
3 JSON. A template that does not render tools gets its tools from
tool_prompt.py, which teaches whichever syntax the model has, and detection
gives such a template Hermes, the form most instruction-tuned models have
seen; so does a template that renders tools in none of the three forms.

Markers. Some families' markers are special tokens (Mistral's `[TOOL_CALLS]`
and `[ARGS]`): a plain decode (skip_special_tokens) drops them, and a literal
string in a grammar would make the model spell them out in ordinary tokens it
was never trained to write. A syntax lists its `markers`; the model binds the
ones that are one special token of its vocabulary (with_special) so the
grammar names them by token id (`<[id]>`), and decodes a tool answer keeping
them for the reader (models.py, decode_with_markers), whose content never
shows them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

from llguidance import LLMatcher

from adapters.openai.toolcalls import (
    PYTHON_TAG,
    TOOL_CALLS,
    HermesReader,
    Llama3JsonReader,
    MistralReader,
    ToolCallReader,
)
from adapters.openai.tools import (
    CALL_END,
    CALL_START,
    ToolCall,
    ToolSetup,
    call_grammar,
    function_rules,
)

HOW_ARGUMENTS = "<arguments as JSON>"


@dataclass(frozen=True)
class CallSyntax:
    # (marker, token id) for each marker that is one special token of the model's
    # vocabulary; empty until a model binds them (with_special).
    special: tuple[tuple[str, int], ...] = ()

    name: ClassVar[str]
    reader: ClassVar[type[ToolCallReader]]
    markers: ClassVar[tuple[str, ...]] = ()  # strings the reader needs that may be special tokens

    def with_special(self, token_ids: Mapping[str, int]) -> CallSyntax:
        """This syntax for a model whose vocabulary has these markers as special tokens."""
        assert set(token_ids) <= set(self.markers), token_ids
        return replace(self, special=tuple(sorted(token_ids.items())))

    def grammar(self, setup: ToolSetup) -> str:
        raise NotImplementedError

    def write_calls(self, calls: Sequence[ToolCall]) -> str:
        """An assistant message's calls as the model would have written them (arguments
        as the client sent them)."""
        raise NotImplementedError

    def instruction(self) -> str:
        """The sentence of the tools section that says how to call a function."""
        raise NotImplementedError

    def _marker(self, marker: str) -> str:
        """The marker as a grammar term: its special token where the model has one."""
        ids = dict(self.special)
        return f"<[{ids[marker]}]>" if marker in ids else json.dumps(marker)


@dataclass(frozen=True)
class Hermes(CallSyntax):
    name: ClassVar[str] = "hermes"
    reader: ClassVar[type[ToolCallReader]] = HermesReader

    def grammar(self, setup: ToolSetup) -> str:
        return call_grammar(setup)

    def write_calls(self, calls: Sequence[ToolCall]) -> str:
        return "\n".join(
            CALL_START + _call_json(c.name, "arguments", c.arguments) + CALL_END for c in calls
        )

    def instruction(self) -> str:
        how = CALL_START + _call_json("<function name>", "arguments", HOW_ARGUMENTS) + CALL_END
        return f"To call one, answer with a line {how} for each call."


@dataclass(frozen=True)
class Llama3Json(CallSyntax):
    """Llama 3.1's JSON tool calling, as its template asks ("parameters", not
    "arguments"). Several calls in one answer are separated by "; "."""

    name: ClassVar[str] = "llama3_json"
    reader: ClassVar[type[ToolCallReader]] = Llama3JsonReader

    def grammar(self, setup: ToolSetup) -> str:
        several = setup.mode == "required" and setup.parallel
        lines = [
            'start: body ("; " body)*' if several else "start: body",
            *function_rules(setup, "parameters"),
        ]
        return LLMatcher.grammar_from_lark("\n".join(lines) + "\n")

    def write_calls(self, calls: Sequence[ToolCall]) -> str:
        return "; ".join(_call_json(c.name, "parameters", c.arguments) for c in calls)

    def instruction(self) -> str:
        how = _call_json("<function name>", "parameters", HOW_ARGUMENTS)
        return f'To call one, answer with only {how}; separate several calls with "; ".'


@dataclass(frozen=True)
class Mistral(CallSyntax):
    """The v3 tokenizers' form: the marker, then a JSON array of calls (the template
    writes a space between them, which the grammar allows)."""

    name: ClassVar[str] = "mistral"
    reader: ClassVar[type[ToolCallReader]] = MistralReader
    markers: ClassVar[tuple[str, ...]] = MistralReader.MARKERS

    def grammar(self, setup: ToolSetup) -> str:
        several = setup.mode == "required" and setup.parallel
        calls = 'body (", " body)*' if several else "body"
        lines = [
            f'start: {self._marker(TOOL_CALLS)} " "? "[" {calls} "]"',
            *function_rules(setup, "arguments"),
        ]
        return LLMatcher.grammar_from_lark("\n".join(lines) + "\n")

    def write_calls(self, calls: Sequence[ToolCall]) -> str:
        items = ", ".join(_call_json(c.name, "arguments", c.arguments) for c in calls)
        return f"{TOOL_CALLS}[{items}]"

    def instruction(self) -> str:
        how = f"{TOOL_CALLS}[{_call_json('<function name>', 'arguments', HOW_ARGUMENTS)}]"
        return f"To call one, answer with {how}, one object in the list for each call."


HERMES = Hermes()
LLAMA3_JSON = Llama3Json()
MISTRAL = Mistral()
SYNTAXES: dict[str, CallSyntax] = {s.name: s for s in (HERMES, LLAMA3_JSON, MISTRAL)}


def syntax_named(name: str) -> CallSyntax:
    syntax = SYNTAXES.get(name)
    if syntax is None:
        raise ValueError(f"no call syntax '{name}'; there are {', '.join(sorted(SYNTAXES))}")
    return syntax


def detect_syntax(template: object, renders_tools: bool) -> CallSyntax:
    """The syntax a chat template teaches (a string, or a dict of named templates)."""
    if not renders_tools:
        return HERMES  # the tools reach the model through tool_prompt.py, in Hermes
    text = _template_text(template)
    if CALL_START in text:
        return HERMES
    if TOOL_CALLS in text:
        return MISTRAL
    if PYTHON_TAG in text or ("ipython" in text and '"parameters"' in text):
        return LLAMA3_JSON
    return HERMES


def _template_text(template: object) -> str:
    if isinstance(template, str):
        return template
    if isinstance(template, Mapping):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    if isinstance(template, list):  # the list of {"name", "template"} some configs keep
        return "\n".join(_template_text(t.get("template")) for t in template if isinstance(t, dict))
    return ""


def _call_json(name: str, key: str, arguments: str) -> str:
    """One call's JSON object in the prompt's layout, the arguments written as given."""
    return f'{{"name": {json.dumps(name)}, "{key}": {arguments}}}'


__all__ = ["HERMES", "LLAMA3_JSON", "MISTRAL", "CallSyntax", "detect_syntax", "syntax_named"]
