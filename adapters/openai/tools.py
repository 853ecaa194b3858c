"""Tool calls, request side: what `tools`, `tool_choice` and `parallel_tool_calls` ask for.

read_tools validates the three fields (every refusal names its exact param,
e.g. `tools[2].function.parameters`) and yields a ToolSetup: the functions,
the choice (none, auto, required, or one named function) and whether several
calls may come at once. Each function's `parameters` schema is compiled by
llguidance at request time, so a schema the constrained decoder cannot
enforce is a 400 here, never a failure inside a worker.

How a call is written depends on the model family (callsyntax.py chooses one
of three syntaxes per model). What they share lives here: function_rules, the
llguidance rules (Lark embedding each function's schema with %json) of one
call's JSON object, `{"name": <the function>, <key>: <its arguments>}` in
JSON_LAYOUT, so a required call can only be a call that parses and whose
arguments match the schema; and call_grammar, the whole grammar of the
default syntax, the Hermes/Qwen convention, one call per block:

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

read_tool_calls reads the `tool_calls` of an assistant message in the
history. Pure: no IO, no randomness.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import msgspec
from llguidance import LLMatcher

from adapters.engine.grammar import validate
from adapters.openai.errors import OpenAIError, invalid

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
MAX_TOOLS = 128  # as OpenAI
NAME_PATTERN = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# The JSON the decoder is held to: the same compact-with-spaces layout as the
# prompt shows (json.dumps' separators), so the model sees what it must write.
JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}

ChoiceMode = Literal["none", "auto", "required", "function"]


class Tool(msgspec.Struct, frozen=True):
    name: str
    description: str | None
    parameters: dict[str, Any]  # a JSON schema of an object (type object added where absent)
    strict: bool | None


class ToolCall(msgspec.Struct, frozen=True):
    id: str
    name: str
    arguments: str  # the arguments as JSON text, as the API carries them


class ToolSetup(msgspec.Struct, frozen=True):
    """The tools of one chat request and what the model may or must do with them."""

    tools: tuple[Tool, ...]
    mode: ChoiceMode
    function: str | None = None  # mode "function": the one it must call
    parallel: bool = True  # several calls in one answer

    @property
    def prompted(self) -> tuple[Tool, ...]:
        """The tools the prompt lists: none when the model may not call any."""
        return () if self.mode == "none" else self.tools

    @property
    def parses(self) -> bool:
        """Whether the answer is read for calls."""
        return self.mode != "none" and bool(self.tools)

    @property
    def callable(self) -> tuple[Tool, ...]:
        if self.mode == "function":
            return tuple(t for t in self.tools if t.name == self.function)
        return self.tools


NO_TOOLS = ToolSetup((), "none")


def read_tools(body: dict[str, Any]) -> ToolSetup | OpenAIError:
    tools = _tools(body.get("tools"))
    if isinstance(tools, OpenAIError):
        return tools
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        return invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        mode: ChoiceMode = "auto" if tools else "none"
        return ToolSetup(tools, mode, None, parallel is not False)
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            return invalid(
                "'tool_choice' 'required' needs at least one tool in 'tools'", "tool_choice"
            )
        return ToolSetup(tools, choice, None, parallel is not False)
    if not isinstance(choice, dict):
        return invalid(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if choice.get("type") != "function":
        return invalid("'tool_choice.type' must be 'function'", "tool_choice.type")
    function = choice.get("function")
    if not isinstance(function, dict):
        return invalid("'tool_choice.function' must be an object", "tool_choice.function")
    name = function.get("name")
    if not isinstance(name, str):
        return invalid("'tool_choice.function.name' must be a string", "tool_choice.function.name")
    if name not in {t.name for t in tools}:
        return invalid(
            f"'tool_choice.function.name': no function '{name}' in 'tools'",
            "tool_choice.function.name",
        )
    return ToolSetup(tools, "function", name, parallel is not False)


def _tools(value: object) -> tuple[Tool, ...] | OpenAIError:
    if value is None:
        return ()
    if not isinstance(value, list):
        return invalid("'tools' must be an array of function tools", "tools")
    if len(value) > MAX_TOOLS:
        return invalid(f"'tools': at most {MAX_TOOLS} tools", "tools")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        tool = _tool(item, f"tools[{i}]")
        if isinstance(tool, OpenAIError):
            return tool
        if any(t.name == tool.name for t in tools):
            where = f"tools[{i}].function.name"
            return invalid(f"'{where}': the function '{tool.name}' is listed twice", where)
        tools.append(tool)
    return tuple(tools)


def _tool(item: object, where: str) -> Tool | OpenAIError:
    if not isinstance(item, dict):
        return invalid(f"'{where}' must be an object", where)
    if item.get("type") != "function":
        return invalid(f"'{where}.type' must be 'function'", f"{where}.type")
    function = item.get("function")
    if not isinstance(function, dict):
        return invalid(f"'{where}.function' must be an object", f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        return invalid(
            f"'{where}.function.name' must be 1 to 64 letters, digits, '_' or '-'",
            f"{where}.function.name",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        return invalid(
            f"'{where}.function.description' must be a string", f"{where}.function.description"
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        return invalid(f"'{where}.function.strict' must be a boolean", f"{where}.function.strict")
    parameters = _parameters(function.get("parameters"), f"{where}.function.parameters")
    if isinstance(parameters, OpenAIError):
        return parameters
    return Tool(name, description, parameters, strict)


def _parameters(value: object, where: str) -> dict[str, Any] | OpenAIError:
    """The schema, with type object made explicit; refused when llguidance cannot compile it."""
    if value is None:
        return {"type": "object", "properties": {}}
    if not isinstance(value, dict):
        return invalid(f"'{where}' must be a JSON schema object", where)
    kind = value.get("type", "object")
    if kind != "object":
        return invalid(f"'{where}': the arguments must be an object (type 'object')", where)
    schema = {"type": "object", **value}
    error = _schema_error(schema)
    if error:
        return invalid(f"'{where}': {error}", where)
    return schema


def _schema_error(schema: dict[str, Any]) -> str:
    """Why llguidance cannot enforce this schema ("" when it can)."""
    try:
        text = json.dumps(schema)
    except RecursionError:  # the body decoded, but a deep stack leaves less room here
        return "the schema is nested too deeply"
    error = validate(LLMatcher.grammar_from_lark(f"start: %json {text}"))
    if not error:
        return ""
    detail = error.split("\n")[0]
    return detail.split("failed to compile JSON schema: ", 1)[-1]


def call_grammar(setup: ToolSetup) -> str:
    """The llguidance grammar of the answer when a call is required, in the Hermes
    syntax: one call of a callable function (one or more when the choice is `required`
    and parallel calls are allowed). Calls follow each other with nothing between them:
    with a newline allowed there, the default model at temperature 0 wrote the same
    call again and again until max_tokens; without it, end-of-sequence wins after the
    call."""
    several = setup.mode == "required" and setup.parallel
    lines = [
        "start: call+" if several else "start: call",
        f'call: "{CALL_START}" body "{CALL_END}"',
        *function_rules(setup),
    ]
    return LLMatcher.grammar_from_lark("\n".join(lines) + "\n")


def function_rules(setup: ToolSetup, arguments_key: str = "arguments") -> list[str]:
    """The Lark rules of `body`: the JSON object of one call of a callable function,
    `{"name": <const>, <arguments_key>: <the function's parameters schema>}`."""
    functions = setup.callable
    assert functions, "a grammar needs at least one function"
    return [
        "body: " + " | ".join(f"f{i}" for i in range(len(functions))),
        *(
            f"f{i}: %json {json.dumps(_call_schema(t, arguments_key))}"
            for i, t in enumerate(functions)
        ),
    ]


def _call_schema(tool: Tool, arguments_key: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: tool.parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        "x-guidance": JSON_LAYOUT,
    }


def read_tool_calls(value: object, where: str) -> tuple[ToolCall, ...] | OpenAIError:
    """The `tool_calls` of an assistant message in the history."""
    if not isinstance(value, list) or not value:
        return invalid(f"'{where}' must be a non-empty array", where)
    calls: list[ToolCall] = []
    for i, item in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(item, dict):
            return invalid(f"'{at}' must be an object", at)
        call_id = item.get("id")
        if not isinstance(call_id, str) or not call_id:
            return invalid(f"'{at}.id' must be a non-empty string", f"{at}.id")
        if item.get("type", "function") != "function":
            return invalid(f"'{at}.type' must be 'function'", f"{at}.type")
        function = item.get("function")
        if not isinstance(function, dict):
            return invalid(f"'{at}.function' must be an object", f"{at}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            return invalid(
                f"'{at}.function.name' must be a non-empty string", f"{at}.function.name"
            )
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            return invalid(
                f"'{at}.function.arguments' must be a string", f"{at}.function.arguments"
            )
        calls.append(ToolCall(call_id, name, arguments))
    return tuple(calls)
