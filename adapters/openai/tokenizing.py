"""POST /tokenize and /detokenize: text or a conversation in tokens, and tokens in text.

The shapes vLLM's and llama.cpp's servers share, which clients use to count
what a request will take of the context before they send it. A conversation
is read by chat completions' own reader (normalize._messages) and rendered by
the same tokenize_chat with the same tools, so its count is the
usage.prompt_tokens a chat completion of it reports, and a bad message gets
the same 400 (`messages[1].content`). Text is tokenized as /v1/completions
tokenizes a prompt, with the tokenizer's special tokens unless
add_special_tokens is false. Every other refusal is a 400 naming its field.

Options that only a conversation has (add_generation_prompt,
chat_template_kwargs, tools) are refused beside a text prompt rather than
ignored. add_special_tokens true is refused with messages: the chat template
writes a conversation's special tokens, and adding the tokenizer's again
(vLLM does) would count a BOS that chat completions never sends.

Pure but for the model's tokenizer; the server picks the model (server.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
from jinja2.exceptions import TemplateError

from adapters.openai.errors import OpenAIError, invalid
from adapters.openai.models import ServedModel
from adapters.openai.normalize import ChatMessage, _is_int, _messages, template_kwargs
from adapters.openai.tools import Tool, read_tools

Names = tuple[str, ...]  # a field's names: the first vLLM's, then aliases
TEXT_NAMES = ("prompt", "content")  # vLLM's name, llama.cpp's
SPECIAL_NAMES = ("add_special_tokens", "add_special")  # vLLM's name, llama.cpp's
CHAT_ONLY = ("add_generation_prompt", "chat_template_kwargs", "tools", "tool_choice",
             "parallel_tool_calls")  # fmt: skip


class TextPrompt(msgspec.Struct, frozen=True):
    text: str
    add_special_tokens: bool


class ChatPrompt(msgspec.Struct, frozen=True):
    messages: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...]  # those the prompt lists (none with tool_choice none)
    template_kwargs: dict[str, Any] | None
    add_generation_prompt: bool


class Counting(msgspec.Struct, frozen=True):
    """What one /tokenize request asks for."""

    prompt: TextPrompt | ChatPrompt
    with_pieces: bool  # llama.cpp's: each token as {"id", "piece"}


def tokenize(body: dict[str, Any], model: ServedModel) -> dict[str, Any] | OpenAIError:
    """The answer to a /tokenize body: count, max_model_len and the tokens."""
    counting = read_tokenize(body)
    if isinstance(counting, OpenAIError):
        return counting
    ids = token_ids(model, counting.prompt)
    if isinstance(ids, OpenAIError):
        return ids
    tokens: list[Any] = [_piece(model, i) for i in ids] if counting.with_pieces else ids
    return {"count": len(ids), "max_model_len": model.max_context, "tokens": tokens}


def detokenize(body: dict[str, Any], model: ServedModel) -> dict[str, Any] | OpenAIError:
    """The answer to a /detokenize body: the text under vLLM's key and llama.cpp's."""
    tokens = read_detokenize(body, model.vocab_size)
    if isinstance(tokens, OpenAIError):
        return tokens
    text = model.decode(tokens)
    return {"prompt": text, "content": text}


def read_tokenize(body: dict[str, Any]) -> Counting | OpenAIError:
    with_pieces = _flag(body, ("with_pieces",), False)
    if isinstance(with_pieces, OpenAIError):
        return with_pieces
    text = _one_of(body, TEXT_NAMES)
    if isinstance(text, OpenAIError):
        return text
    has_messages = body.get("messages") is not None
    if text is None and not has_messages:
        return invalid("one of 'prompt' (or 'content') and 'messages' is required", "prompt")
    if text is not None and has_messages:
        return invalid(f"give '{text[0]}' or 'messages', not both", "messages")
    prompt = _text_prompt(body, *text) if text is not None else _chat_prompt(body)
    if isinstance(prompt, OpenAIError):
        return prompt
    return Counting(prompt, with_pieces[1])


def read_detokenize(body: dict[str, Any], vocab_size: int) -> list[int] | OpenAIError:
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        return invalid("'tokens' must be an array of token ids", "tokens")
    for i, token in enumerate(tokens):
        if not _is_int(token) or not 0 <= token < vocab_size:
            where = f"tokens[{i}]"
            return invalid(f"'{where}' must be a token id from 0 to {vocab_size - 1}", where)
    return [int(t) for t in tokens]


def token_ids(model: ServedModel, prompt: TextPrompt | ChatPrompt) -> list[int] | OpenAIError:
    match prompt:
        case TextPrompt(text, add_special_tokens):
            return model.tokenize(text, add_special_tokens=add_special_tokens)
        case ChatPrompt(messages, tools, template_kwargs, add_generation_prompt):
            try:
                return model.tokenize_chat(messages, tools, template_kwargs, add_generation_prompt)
            except TemplateError as error:  # the template's own refusal (raise_exception)
                return invalid(f"the chat template refused the messages: {error}", "messages")


def _text_prompt(body: dict[str, Any], name: str, text: object) -> TextPrompt | OpenAIError:
    if not isinstance(text, str):
        return invalid(f"'{name}' must be a string", name)
    for option in CHAT_ONLY:
        if body.get(option) is not None:
            return invalid(f"'{option}' applies only to 'messages'", option)
    special = _flag(body, SPECIAL_NAMES, True)
    if isinstance(special, OpenAIError):
        return special
    return TextPrompt(text, special[1])


def _chat_prompt(body: dict[str, Any]) -> ChatPrompt | OpenAIError:
    special = _flag(body, SPECIAL_NAMES, False)
    if isinstance(special, OpenAIError):
        return special
    if special[1]:
        message = f"'{special[0]}': the chat template writes the special tokens of 'messages'"
        return invalid(f"{message}; only false is supported with them", special[0])
    generation = _flag(body, ("add_generation_prompt",), True)
    if isinstance(generation, OpenAIError):
        return generation
    variables = template_kwargs(body.get("chat_template_kwargs"))
    if isinstance(variables, OpenAIError):
        return variables
    tools = read_tools(body)
    if isinstance(tools, OpenAIError):
        return tools
    messages = _messages(body.get("messages"))
    if isinstance(messages, OpenAIError):
        return messages
    return ChatPrompt(tuple(messages), tools.prompted, variables, generation[1])


def _one_of(body: dict[str, Any], names: Names) -> tuple[str, object] | OpenAIError | None:
    """(name, value) of the one of these alias names given (not null), None for none."""
    given = [(name, body[name]) for name in names if body.get(name) is not None]
    if len(given) > 1:
        return invalid(f"'{given[0][0]}' and '{given[1][0]}' are one field: give one", given[1][0])
    return given[0] if given else None


def _flag(body: dict[str, Any], names: Names, default: bool) -> tuple[str, bool] | OpenAIError:
    """(the name it was given as, its value) of a boolean option; absent: the default."""
    given = _one_of(body, names)
    if given is None:
        return names[0], default
    if isinstance(given, OpenAIError):
        return given
    name, value = given
    if not isinstance(value, bool):
        return invalid(f"'{name}' must be a boolean", name)
    return name, value


def _piece(model: ServedModel, token_id: int) -> dict[str, Any]:
    # A token may hold part of a UTF-8 character: its piece shows U+FFFD there.
    return {"id": token_id, "piece": model.token_bytes(token_id).decode(errors="replace")}
