"""A /v1/responses request body in, a ResponsesJob (or an OpenAIError) out.

The Responses API asks for what chat asks for in other words: `input` items
instead of `messages`, `instructions` for the system message, flat function
tools, `text.format` for `response_format`, `max_output_tokens` for
`max_completion_tokens`, `include` for logprobs, `reasoning.effort` for
`reasoning_effort`. This file reads those words, refuses what fencepost does
not do (built-in tools, reasoning settings for a model that does not think,
images and files, automatic truncation) with a 400 whose
`param` names the field, and hands a chat-shaped body and the history to the
chat path's own checks (normalize.chat_job), whose errors come back with the
Responses API's field names. So the two APIs run one validation, one prompt
rendering and one set of GenerationRequests.

A conversation continued with `previous_response_id` is the stored one's
items (its input and its output, store.py) followed by the new input; the
earlier response's `instructions` are not carried over, as in OpenAI's API.
A `reasoning` item, stored or sent, is the thinking of the assistant turn
that follows it: that message's `reasoning`, which the chat template shows or
(most do, for turns before the last user message) drops.
`background: true` asks for a stored response (store true) that runs detached
from the connection (server.py, live.py). Pure: the store lookup (the server
reads the store first), the model and the tokenizer are injected.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec.structs import replace

from adapters.openai.errors import OpenAIError, invalid
from adapters.openai.normalize import (
    ChatJob,
    ChatMessage,
    ResolveModel,
    TokenizeChat,
    chat_job,
    read_storing,
    text_content,
)
from adapters.openai.tools import ToolCall, ToolSetup
from core.protocol import MAX_TOP_LOGPROBS

LOGPROBS = "message.output_text.logprobs"  # the one `include` value served
MESSAGE_ROLES = ("user", "system", "developer", "assistant")
# Content part types by who may send them; the input_* media types are refused by name.
TEXT_PARTS = {"input_text", "output_text", "refusal"}
MEDIA_PARTS = {"input_image", "input_file", "input_audio"}
OUTPUT_PARTS = frozenset({"input_text", "output_text"})  # a function call's output
SUMMARIES = ("auto", "concise", "detailed")  # reasoning.summary: accepted, none is written
# A reasoning item's text parts: (field, part type), in the order its text is read.
REASONING_PARTS = (("content", "reasoning_text"), ("summary", "summary_text"))

# response id -> its conversation; or why not (gone, in progress, the store down); None: unknown
Lookup = Callable[[str], "list[dict[str, Any]] | OpenAIError | None"]


class ResponsesJob(msgspec.Struct, frozen=True):
    """Everything /v1/responses needs: the chat job it runs and what the response
    object echoes back (tools, tool_choice and text as the request wrote them)."""

    chat: ChatJob
    items: tuple[dict[str, Any], ...]  # the conversation's input items, ids given
    instructions: str | None
    previous_response_id: str | None
    store: bool
    background: bool
    metadata: dict[str, str]
    user: str | None
    temperature: float
    top_p: float
    max_output_tokens: int | None
    top_logprobs: int
    tools: tuple[dict[str, Any], ...]
    tool_choice: Any
    text_format: dict[str, Any]
    reasoning: dict[str, Any]  # as echoed: {"effort", "summary"}, as asked

    @property
    def requests(self) -> Any:
        return self.chat.requests

    @property
    def shared(self) -> Any:
        return self.chat.shared

    @property
    def tool_setup(self) -> ToolSetup:
        return self.chat.tools


Refusal = tuple[str, Callable[[Any], bool], str]
_REFUSED: tuple[Refusal, ...] = (
    ("background", lambda v: not isinstance(v, bool), "must be a boolean"),
    ("conversation", lambda v: True, "conversations are not supported; use previous_response_id"),
    ("prompt", lambda v: True, "prompt templates are not supported"),
    ("max_tool_calls", lambda v: True, "max_tool_calls is not supported"),
    ("truncation", lambda v: v != "disabled", "only 'disabled' is supported"),
)

# Chat's field names in its errors, and what the Responses API calls them.
_RENAMES = (
    (re.compile(r"\bmax_completion_tokens\b"), "max_output_tokens"),
    (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
    (re.compile(r"\bresponse_format\b"), "text.format"),
    (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
    (re.compile(r"\btool_choice\.function\b"), "tool_choice"),
    (re.compile(r"\bmessages\b"), "input"),
    (re.compile(r"\breasoning_effort\b"), "reasoning.effort"),
)


def _renamed(error: OpenAIError) -> OpenAIError:
    message, param = error.message, error.param
    for pattern, name in _RENAMES:
        message = pattern.sub(name, message)
        param = pattern.sub(name, param) if param is not None else None
    return replace(error, message=message, param=param)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def normalize_responses_request(
    body: object,
    resolve_model: ResolveModel,
    tokenize_chat: TokenizeChat,
    request_id: str,
    lookup: Lookup,
) -> ResponsesJob | OpenAIError:
    if not isinstance(body, dict):
        return invalid("the request body must be a JSON object")
    for name, refused, why in _REFUSED:
        value = body.get(name)
        if value is not None and refused(value):
            return invalid(f"'{name}': {why}", name)
    scalars = _scalars(body)
    if isinstance(scalars, OpenAIError):
        return scalars
    instructions, store, metadata, user, logprobs, top = scalars
    background = body.get("background") is True
    if background and not store:
        return invalid("'background': a background response must be stored (store: true)",
                       "background")  # fmt: skip
    tools = _tools(body.get("tools"))
    if isinstance(tools, OpenAIError):
        return tools
    tool_choice = _tool_choice(body.get("tool_choice"))
    if isinstance(tool_choice, OpenAIError):
        return tool_choice
    text_format = _text_format(body.get("text"))
    if isinstance(text_format, OpenAIError):
        return text_format
    reasoning = _reasoning(body.get("reasoning"), body.get("model"), resolve_model)
    if isinstance(reasoning, OpenAIError):
        return reasoning
    new_items = _input(body.get("input"))
    if isinstance(new_items, OpenAIError):
        return new_items
    previous_id = body.get("previous_response_id")
    earlier: list[dict[str, Any]] = []
    if previous_id is not None:
        if not isinstance(previous_id, str) or not previous_id:
            return invalid("'previous_response_id' must be a string", "previous_response_id")
        found = lookup(previous_id)
        if isinstance(found, OpenAIError):
            return found
        if found is None:
            return invalid(
                f"the previous response '{previous_id}' is not stored (never stored, or "
                "stored with another state store)",
                "previous_response_id",
                "previous_response_not_found",
            )
        earlier = found
    items = earlier + new_items
    chat_body: dict[str, Any] = {"model": body.get("model"), "stream": body.get("stream")}
    for theirs, ours in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_output_tokens", "max_completion_tokens"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("max_reasoning_tokens", "max_reasoning_tokens"),  # fencepost's, as chat's
    ):
        if body.get(theirs) is not None:
            chat_body[ours] = body[theirs]
    chat_body["tools"] = [_chat_tool(t) for t in tools] or None
    chat_body["tool_choice"] = _chat_tool_choice(tool_choice)
    chat_body["response_format"] = _chat_format(text_format)
    if logprobs:
        chat_body |= {"logprobs": True, "top_logprobs": top}
    if reasoning["effort"] is not None:
        chat_body["reasoning_effort"] = reasoning["effort"]
    job = chat_job(
        chat_body,
        lambda: _messages(items, instructions, len(earlier)),
        resolve_model,
        tokenize_chat,
        request_id,
    )
    if isinstance(job, OpenAIError):
        return _renamed(job)
    sampling = job.shared.sampling
    return ResponsesJob(
        job,
        tuple(items),
        instructions,
        previous_id,
        store,
        background,
        metadata,
        user,
        sampling.temperature,
        sampling.top_p,
        job.shared.budget,
        top,
        tuple(tools),
        "auto" if tool_choice is None else tool_choice,
        text_format,
        reasoning,
    )


def _scalars(
    body: dict[str, Any],
) -> tuple[str | None, bool, dict[str, str], str | None, bool, int] | OpenAIError:
    """instructions, store, metadata, user, whether logprobs are included, top_logprobs."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        return invalid("'instructions' must be a string", "instructions")
    storing = read_storing(body)
    if isinstance(storing, OpenAIError):
        return storing
    store, metadata = storing
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        return invalid("'user' must be a string", "user")
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
        return invalid("'include' must be an array of strings", "include")
    for value in include:
        if value != LOGPROBS:
            return invalid(f"'include': '{value}' is not supported; only '{LOGPROBS}'", "include")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
        return invalid(
            f"'top_logprobs' must be an integer from 0 to {MAX_TOP_LOGPROBS}", "top_logprobs"
        )
    return instructions, store is not False, metadata, user, LOGPROBS in include, top or 0


def _reasoning(
    value: object, model_name: object, resolve_model: ResolveModel
) -> dict[str, Any] | OpenAIError:
    """`reasoning` as echoed: effort (chat's reasoning_effort checks its value) and
    summary (accepted; no summary is written). Any setting needs a model that thinks."""
    echo: dict[str, Any] = {"effort": None, "summary": None}
    if value is None:
        return echo
    if not isinstance(value, dict):
        return invalid("'reasoning' must be an object", "reasoning")
    for key, setting in value.items():
        if setting is not None and key not in ("effort", "summary", "generate_summary"):
            return invalid(f"'reasoning.{key}' is not supported", f"reasoning.{key}")
    summary = value.get("summary")
    if summary is None:
        summary = value.get("generate_summary")  # its older name
    echo = {"effort": value.get("effort"), "summary": summary}
    if echo == {"effort": None, "summary": None}:
        return echo
    model = resolve_model(model_name) if isinstance(model_name, str) else None
    if model is not None and model.thinking is None:
        return invalid(
            f"'reasoning': the model '{model.id}' does not think; "
            "reasoning settings are not supported",
            "reasoning",
        )
    if summary is not None and summary not in SUMMARIES:
        return invalid(
            f"'reasoning.summary' must be one of {', '.join(SUMMARIES)}", "reasoning.summary"
        )
    return echo


def _tools(value: object) -> list[dict[str, Any]] | OpenAIError:
    if value is None:
        return []
    if not isinstance(value, list):
        return invalid("'tools' must be an array", "tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            return invalid(f"'{where}' must be an object", where)
        kind = tool.get("type")
        if kind != "function":
            what = f"'{kind}' tools are" if isinstance(kind, str) else "this tool is"
            return invalid(
                f"'{where}.type': {what} not supported; only function tools", f"{where}.type"
            )
        echoed = {
            "type": "function",
            "name": tool.get("name"),
            "description": tool.get("description"),
            "parameters": tool.get("parameters"),
            "strict": tool.get("strict", True),  # the Responses API's default
        }
        tools.append(echoed)
    return tools


def _chat_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool[k] is not None}
    if tool["strict"] is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _tool_choice(value: object) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function":
        name = value.get("name")
        if not isinstance(name, str):
            return invalid("'tool_choice.name' must be a string", "tool_choice.name")
        return {"type": "function", "name": name}
    return invalid(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        '{"type": "function", "name": ...}; hosted and allowed-tools choices are not supported',
        "tool_choice",
    )


def _chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _text_format(value: object) -> dict[str, Any] | OpenAIError:
    if value is None:
        return {"type": "text"}
    if not isinstance(value, dict):
        return invalid("'text' must be an object", "text")
    verbosity = value.get("verbosity")
    if verbosity not in (None, "medium"):
        return invalid("'text.verbosity': only 'medium' is supported", "text.verbosity")
    form = value.get("format")
    if form is None:
        return {"type": "text"}
    if not isinstance(form, dict):
        return invalid("'text.format' must be an object", "text.format")
    return form


def _chat_format(form: dict[str, Any]) -> dict[str, Any]:
    if form.get("type") != "json_schema":
        return form  # text, json_object, or a type chat's check refuses
    spec = {k: form[k] for k in ("name", "schema", "strict", "description") if k in form}
    return {"type": "json_schema", "json_schema": spec}


def _input(value: object) -> list[dict[str, Any]] | OpenAIError:
    """The request's input as items, each checked and given an id."""
    if isinstance(value, str):
        return [_message_item("user", [{"type": "input_text", "text": value}])]
    if not isinstance(value, list) or not value:
        return invalid("'input' must be a string or a non-empty array of items", "input")
    items = []
    for i, item in enumerate(value):
        read = _item(item, f"input[{i}]")
        if isinstance(read, OpenAIError):
            return read
        items.append(read)
    return items


def _message_item(
    role: str, content: list[dict[str, Any]], item_id: str | None = None
) -> dict[str, Any]:
    return {
        "id": item_id or new_item_id("msg"),
        "type": "message",
        "role": role,
        "content": content,
        "status": "completed",
    }


def _item(item: object, where: str) -> dict[str, Any] | OpenAIError:
    if not isinstance(item, dict):
        return invalid(f"'{where}' must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        return _message(item, where)
    if kind == "function_call":
        fields = {}
        for name in ("call_id", "name", "arguments"):
            value = item.get(name)
            if not isinstance(value, str) or (name != "arguments" and not value):
                return invalid(f"'{where}.{name}' must be a non-empty string", f"{where}.{name}")
            fields[name] = value
        item_id = item.get("id")
        return {
            "id": item_id if isinstance(item_id, str) and item_id else new_item_id("fc"),
            "type": "function_call",
            "status": "completed",
            **fields,
        }
    if kind == "function_call_output":
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or not call_id:
            where_id = f"{where}.call_id"
            return invalid(f"'{where_id}' must be a non-empty string", where_id)
        output = text_content(item.get("output"), f"{where}.output", OUTPUT_PARTS)
        if isinstance(output, OpenAIError):
            return output
        item_id = item.get("id")
        return {
            "id": item_id if isinstance(item_id, str) and item_id else new_item_id("fco"),
            "type": "function_call_output",
            "call_id": call_id,
            "output": output,
            "status": "completed",
        }
    if kind == "reasoning":
        return _reasoning_item(item, where)
    what = f"'{kind}' items are" if isinstance(kind, str) else "this item is"
    return invalid(
        f"'{where}.type': {what} not supported; only message, function_call, "
        "function_call_output and reasoning",
        f"{where}.type",
    )


def _reasoning_item(item: dict[str, Any], where: str) -> dict[str, Any] | OpenAIError:
    """A reasoning item as sent back: its text parts (`encrypted_content`, another
    server's, cannot be read and is not kept)."""
    read: dict[str, list[dict[str, str]]] = {}
    for field, part_type in REASONING_PARTS:
        value = item.get(field)
        if value is None:
            value = []
        if not isinstance(value, list):
            return invalid(f"'{where}.{field}' must be an array", f"{where}.{field}")
        for j, part in enumerate(value):
            at = f"{where}.{field}[{j}]"
            if (
                not isinstance(part, dict)
                or part.get("type") != part_type
                or not isinstance(part.get("text"), str)
            ):
                return invalid(f"'{at}' must be a {part_type} part with a string text", at)
        read[field] = [{"type": part_type, "text": part["text"]} for part in value]
    item_id = item.get("id")
    return {
        "id": item_id if isinstance(item_id, str) and item_id else new_item_id("rs"),
        "type": "reasoning",
        "summary": read["summary"],
        "content": read["content"],
        "status": "completed",
    }


def reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's thinking: its reasoning text, else its summary's."""
    content = "".join(part["text"] for part in item.get("content") or [])
    return content or "\n\n".join(part["text"] for part in item.get("summary") or [])


def _message(item: dict[str, Any], where: str) -> dict[str, Any] | OpenAIError:
    role = item.get("role")
    if role not in MESSAGE_ROLES:
        return invalid(f"'{where}.role' must be one of {', '.join(MESSAGE_ROLES)}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        kind = "output_text" if role == "assistant" else "input_text"
        parts: list[dict[str, Any]] = [{"type": kind, "text": content}]
    elif isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            at = f"{where}.content[{j}]"
            if not isinstance(part, dict):
                return invalid(f"'{at}' must be an object", at)
            part_kind = part.get("type")
            if part_kind in MEDIA_PARTS:
                return invalid(f"'{at}': '{part_kind}' content is not supported; only text", at)
            if part_kind not in TEXT_PARTS:
                return invalid(f"'{at}.type' must be one of {', '.join(sorted(TEXT_PARTS))}", at)
            # A refusal the assistant made is resent as its text.
            text = part.get("refusal" if part_kind == "refusal" else "text")
            if not isinstance(text, str):
                return invalid(f"'{at}.text' must be a string", f"{at}.text")
            parts.append(
                {"type": "output_text" if part_kind == "refusal" else part_kind, "text": text}
            )
    else:
        return invalid(f"'{where}.content' must be a string or an array of parts", where)
    item_id = item.get("id")
    return _message_item(role, parts, item_id if isinstance(item_id, str) and item_id else None)


def _messages(
    items: list[dict[str, Any]], instructions: str | None, earlier: int
) -> list[ChatMessage] | OpenAIError:
    """The chat history the items mean: consecutive calls are one assistant turn (with
    the text before them), an output answers a call made before it, and reasoning
    is the thinking of the assistant message or call that comes next."""
    messages: list[ChatMessage] = []
    if instructions:
        messages.append(ChatMessage("system", instructions))
    calls: set[str] = set()
    thought: list[str] = []  # reasoning items' text, waiting for their turn
    thought_at: str | None = None  # where the first of them is
    for i, item in enumerate(items):
        where = f"input[{i - earlier}]"
        kind = item["type"]
        assistant = kind == "function_call" or (kind == "message" and item["role"] == "assistant")
        if thought_at is not None and not assistant and kind != "reasoning":
            return _unanswered(thought_at)
        if kind == "reasoning":
            thought.append(reasoning_text(item))
            thought_at = thought_at or where
        elif kind == "message":
            text = "".join(p["text"] for p in item["content"])
            messages.append(ChatMessage(item["role"], text))
        elif kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            calls.add(call.id)
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
            else:
                messages.append(ChatMessage("assistant", "", (call,)))
        else:
            if item["call_id"] not in calls:
                return invalid(
                    f"'{where}.call_id': no function_call before it has the call_id "
                    f"'{item['call_id']}'",
                    f"{where}.call_id",
                )
            messages.append(ChatMessage("tool", item["output"], (), item["call_id"]))
        if assistant and thought_at is not None:
            last = messages[-1]
            texts = [t for t in (last.reasoning, *thought) if t]
            messages[-1] = replace(last, reasoning="\n\n".join(texts) or None)
            thought, thought_at = [], None
    if thought_at is not None:
        return _unanswered(thought_at)
    if not any(m.role != "system" for m in messages):
        return invalid("'input' must hold at least one message or item", "input")
    return messages


def _unanswered(where: str) -> OpenAIError:
    return invalid(
        f"'{where}': a reasoning item must be followed by the assistant message or "
        "function_call it thought for",
        where,
    )
