"""Tools in the prompt, for chat templates that do not render them.

A template that knows tools (it renders something different when given
`tools=`) gets the tools and the history in the shape transformers documents
(models.py decides). Every other template gets plain messages from
render_with_tools, a model-agnostic rendering in the call syntax of tools.py:

- The tools are a section of the system prompt: each function's schema as one
  line of JSON inside <tools></tools>, and how to call one. It is added to the
  first message when that is a system (or developer) message, else it is a
  system message of its own.
- An assistant message with tool_calls is its content followed by one
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` line per call, the
  arguments written as the client sent them.
- Tool messages become a user turn of `<tool_response>...</tool_response>`
  blocks, consecutive tool messages in one turn, so an agent loop reads as a
  conversation the model can follow.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from adapters.openai.normalize import ChatMessage
from adapters.openai.tools import CALL_END, CALL_START, Tool


def tools_section(schemas: str) -> str:
    how = f'{CALL_START}{{"name": "<function name>", "arguments": <arguments as JSON>}}{CALL_END}'
    return (
        f"You can call functions. Their JSON schemas, one per line:\n<tools>\n{schemas}\n</tools>\n"
        f"To call one, answer with a line {how} for each call. "
        "Results come back to you in <tool_response></tool_response>."
    )


def tool_schema(tool: Tool) -> dict[str, object]:
    """The function as the OpenAI request gave it (also what a tool-aware template gets)."""
    function: dict[str, object] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def call_text(name: str, arguments: str) -> str:
    return f'{CALL_START}{{"name": {json.dumps(name)}, "arguments": {arguments}}}{CALL_END}'


def render_with_tools(
    messages: Sequence[ChatMessage], tools: tuple[Tool, ...]
) -> list[dict[str, str]]:
    """Plain {"role", "content"} messages carrying the tools, calls and results as text."""
    out: list[dict[str, str]] = []
    previous = ""  # the role of the message before
    for message in messages:
        if message.role == "tool":
            block = f"<tool_response>\n{message.content}\n</tool_response>"
            if previous == "tool":
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
        else:
            content = message.content
            if message.tool_calls:
                calls = "\n".join(call_text(c.name, c.arguments) for c in message.tool_calls)
                content = f"{content}\n{calls}" if content else calls
            out.append({"role": message.role, "content": content})
        previous = message.role
    if tools:
        schemas = "\n".join(json.dumps(tool_schema(t)) for t in tools)
        section = tools_section(schemas)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{section}"
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def needs_tools_rendering(messages: Sequence[ChatMessage], tools: tuple[Tool, ...]) -> bool:
    return bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
