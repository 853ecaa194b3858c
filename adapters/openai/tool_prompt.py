"""Tools in the prompt, for chat templates that do not render them.

A template that knows tools (it renders something different when given
`tools=`) gets the tools and the history in the shape transformers documents
(models.py decides). Every other template gets plain messages from
render_with_tools, a model-agnostic rendering in the model's call syntax
(callsyntax.py; Hermes unless the model was told otherwise):

- The tools are a section of the system prompt: each function's schema as one
  line of JSON inside <tools></tools>, and how to call one. It is added to the
  first message when that is a system (or developer) message, else it is a
  system message of its own.
- An assistant message with tool_calls is its content followed by its calls
  as the syntax writes them (Hermes: one
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` line per call), the
  arguments written as the client sent them.
- Tool messages become a user turn of `<tool_response>...</tool_response>`
  blocks, consecutive tool messages in one turn, so an agent loop reads as a
  conversation the model can follow.

Why the syntax and not always Hermes: the prompt is the model's only lesson in
how to call, and the reader and the grammar hold it to the syntax of its
model. Detection gives every template that does not render tools Hermes, so
this is Hermes unless a model is told its syntax (ChatModel's call_syntax, a
family default): a model told it writes Llama 3 JSON, whose template shows no
tools, must be taught and shown Llama 3 JSON, or its calls would be read in a
form it was never shown.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from adapters.openai.callsyntax import HERMES, CallSyntax
from adapters.openai.normalize import ChatMessage
from adapters.openai.tools import Tool


def tools_section(schemas: str, syntax: CallSyntax = HERMES) -> str:
    return (
        f"You can call functions. Their JSON schemas, one per line:\n<tools>\n{schemas}\n</tools>\n"
        f"{syntax.instruction()} Results come back to you in <tool_response></tool_response>."
    )


def tool_schema(tool: Tool) -> dict[str, object]:
    """The function as the OpenAI request gave it (also what a tool-aware template gets)."""
    function: dict[str, object] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters
    return {"type": "function", "function": function}


def render_with_tools(
    messages: Sequence[ChatMessage], tools: tuple[Tool, ...], syntax: CallSyntax = HERMES
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
                calls = syntax.write_calls(message.tool_calls)
                content = f"{content}\n{calls}" if content else calls
            out.append({"role": message.role, "content": content})
        previous = message.role
    if tools:
        schemas = "\n".join(json.dumps(tool_schema(t)) for t in tools)
        section = tools_section(schemas, syntax)
        if out and out[0]["role"] in ("system", "developer"):
            out[0]["content"] = f"{out[0]['content']}\n\n{section}"
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def needs_tools_rendering(messages: Sequence[ChatMessage], tools: tuple[Tool, ...]) -> bool:
    return bool(tools) or any(m.role == "tool" or m.tool_calls for m in messages)
