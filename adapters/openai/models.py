"""What the HTTP boundary needs from a model: id, context, vocabulary, tokenizers, decoder.

tokenize_chat renders chat messages through the chat template (for
/v1/chat/completions); tokenize takes text as it is (for the legacy
/v1/completions, whose prompt is raw text).

ChatModel wraps a transformers tokenizer (the one the engine was loaded
with). FakeChatModel is the text side of core's fake model (core/fake_model.py,
which the runtime's FakeDecoder runs) for tests and load runs: a made-up
vocabulary of whole words and punctuation, a plain-text chat template, and no
model weights at all; the fake end-of-sequence token decodes to nothing, as a
real tokenizer skips its special tokens. Its vocabulary cannot spell JSON, so
it does not constrain: a response_format asking for JSON gets a 400 from it.

token_bytes is a token's own bytes, for log probability entries: a token may
hold part of a UTF-8 character, which decode cannot show.

Tools (the request's, and calls and results in the history) go through the
chat template when it renders them (a template that renders something else
when given `tools=`); otherwise, and always for the fake model, they are
rendered as text by tool_prompt.render_with_tools before the template.

call_syntax is how the model writes tool calls (callsyntax.py): detected from
the chat template's text unless the constructor is told (a family default),
Hermes for the fake model. Where the syntax's markers are special tokens of
the vocabulary (Mistral's `[TOOL_CALLS]`), decode drops them like every
special token, and decode_with_markers keeps them: the server decodes an
answer that is read for calls with it, so the reader sees the marker, and
every other answer with decode, so it looks as it always did. The text
between markers is decoded a segment at a time, so with the markers taken out
it is decode's text but for the space a SentencePiece tokenizer drops at the
start of a decode: the one just after a marker, where a reader skips
whitespace anyway.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Protocol

from adapters.engine.model import chat_token_ids
from adapters.openai.callsyntax import HERMES, CallSyntax, detect_syntax, syntax_named
from adapters.openai.logprobs import byte_level_decoder
from adapters.openai.normalize import ChatMessage
from adapters.openai.reasoning import Thinking, detect_thinking
from adapters.openai.tool_prompt import needs_tools_rendering, render_with_tools, tool_schema
from adapters.openai.tools import Tool
from core.fake_model import EOS_TOKEN, VOCAB


class ServedModel(Protocol):
    id: str
    max_context: int
    vocab_size: int  # token ids are 0..vocab_size-1
    constrains: bool  # its decoders enforce a request's grammar (response_format)
    call_syntax: CallSyntax  # how it writes tool calls
    thinking: Thinking | None  # its thinking convention (reasoning.py); None: it does not think

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def tokenize_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: tuple[Tool, ...] = (),
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def decode_with_markers(self, token_ids: list[int]) -> str:
        """decode, but the call syntax's markers that are special tokens are kept."""
        ...

    def token_bytes(self, token_id: int) -> bytes: ...


class ChatModel:
    def __init__(
        self, model_id: str, tokenizer: Any, max_context: int, call_syntax: str | None = None
    ) -> None:
        self.id = model_id
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.vocab_size = len(tokenizer)  # with added special tokens
        self._byte_of = byte_level_decoder()
        # Byte-level BPE writes a leading space as 'Ġ'; SentencePiece as '▁'.
        self._byte_level = any("\u0120" in piece for piece in tokenizer.get_vocab())
        self.token_bytes = lru_cache(maxsize=65536)(self._token_bytes)
        self.constrains = True  # the engine builds its grammar tokenizer from this one
        self.template_renders_tools = _template_renders_tools(tokenizer)
        template = getattr(tokenizer, "chat_template", None)
        syntax = (
            syntax_named(call_syntax)
            if call_syntax is not None
            else detect_syntax(template, self.template_renders_tools)
        )
        # Token id -> marker, for the syntax's markers that are special tokens here.
        self._markers = {
            i: t.content
            for i, t in tokenizer.added_tokens_decoder.items()
            if t.special and t.content in syntax.markers
        }
        self.call_syntax = syntax.with_special({m: i for i, m in self._markers.items()})
        self.thinking = detect_thinking(tokenizer)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The tokenizer's own special tokens (a BOS where the model wants one), as
        # other servers of the completions API do; without them for /tokenize's
        # add_special_tokens false.
        encoded = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return [int(t) for t in encoded]

    def tokenize_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: tuple[Tool, ...] = (),
        template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        def render(chat: list[dict[str, Any]], schemas: list[Any] | None = None) -> list[int]:
            return chat_token_ids(
                self.tokenizer, chat, schemas, template_kwargs, add_generation_prompt
            )

        if not needs_tools_rendering(messages, tools):
            return render(
                [_with_reasoning({"role": m.role, "content": m.content}, m) for m in messages]
            )
        if not self.template_renders_tools:
            return render(render_with_tools(messages, tools, self.call_syntax))
        schemas = [tool_schema(t) for t in tools] or None
        return render([_template_message(m) for m in messages], schemas)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def decode_with_markers(self, token_ids: list[int]) -> str:
        if not self._markers or not any(t in self._markers for t in token_ids):
            return self.decode(token_ids)
        parts, start = [], 0
        for i, token_id in enumerate(token_ids):
            if token_id in self._markers:
                parts += [self.decode(token_ids[start:i]), self._markers[token_id]]
                start = i + 1
        parts.append(self.decode(token_ids[start:]))
        return "".join(parts)

    def _token_bytes(self, token_id: int) -> bytes:
        """The vocabulary entry's bytes. Byte-level BPE: one character per byte.
        SentencePiece: '▁' is a space and `<0xNN>` a byte of its own. Anything else
        (an added token) is its text as UTF-8."""
        piece = str(self.tokenizer.convert_ids_to_tokens(token_id))
        if self._byte_level:
            if all(c in self._byte_of for c in piece):
                return bytes(self._byte_of[c] for c in piece)
            return piece.encode()
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()


FAKE_WORDS = (
    " the", " a", " fence", " post", " token", " stream", " worker", " router", " of", " and",
    " to", " in", ",", ".", " is", " was", " déjà", " vu", " naïve", " 🙂", "\n", " quick",
    " brown", " fox", " jumps", " over", " lazy", " dog", " 日本", " ok",
)  # fmt: skip


class FakeChatModel:
    """Token id t decodes to FAKE_WORDS[t % len]; the fake EOS to nothing."""

    def __init__(self, model_id: str = "fake", max_context: int = 4096) -> None:
        self.id = model_id
        self.max_context = max_context
        self.vocab_size = VOCAB
        # Its words hold no JSON punctuation, so it could not honour a grammar: a
        # response_format that needs one is refused (400) rather than ignored.
        self.constrains = False
        self.call_syntax: CallSyntax = HERMES
        self.thinking: Thinking | None = None  # its words hold no thinking tags

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # One per character, within VOCAB; it has no special tokens to add.
        return [1 + (ord(c) % 30_000) for c in text]

    def tokenize_chat(
        self,
        messages: Sequence[ChatMessage],
        tools: tuple[Tool, ...] = (),
        template_kwargs: dict[str, Any] | None = None,  # no template to read them
        add_generation_prompt: bool = True,
    ) -> list[int]:
        chat = render_with_tools(messages, tools, self.call_syntax)
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in chat)
        return self.tokenize(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, token_ids: list[int]) -> str:
        return "".join(FAKE_WORDS[t % len(FAKE_WORDS)] for t in token_ids if t != EOS_TOKEN)

    def decode_with_markers(self, token_ids: list[int]) -> str:
        return self.decode(token_ids)  # no special tokens but EOS

    def token_bytes(self, token_id: int) -> bytes:
        return self.decode([token_id]).encode()


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A message in the shape tool-aware chat templates read (arguments as a mapping
    where they parse, as transformers' templates expect)."""
    out: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": _arguments(c.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return _with_reasoning(out, message)


def _with_reasoning(out: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    """An assistant message's thinking under `reasoning_content`, the name thinking
    templates (Qwen3's, SmolLM3's) read; the template decides whether to show it."""
    if message.reasoning is not None:
        out["reasoning_content"] = message.reasoning
    return out


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows tools: it renders a probe differently with them."""
    probe = [{"role": "user", "content": "x"}]
    tool = {"type": "function", "function": {"name": "probe", "parameters": {"type": "object"}}}
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
    except Exception:  # a template that fails on tools does not render them
        return False
    return bool(plain != with_tools)
