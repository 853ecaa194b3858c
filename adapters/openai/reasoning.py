"""Thinking models: where an answer's thinking block is, and which tokens are in it.

A model thinks when its chat template writes a `<think>` ... `</think>` block and
its tokenizer holds both tags as single tokens (Qwen3, SmolLM3, QwQ, the
DeepSeek-R1 distills): `detect_thinking` finds that convention once per model.
Whether a given answer starts inside the block is read from the end of its
prompt (`start_state`), which is where every template of this kind says it: a
generation prompt that ends in an open tag (R1's templates) starts inside; one
that ends in a closed block (Qwen3's and SmolLM3's `enable_thinking: false`)
has no thinking to come; any other (thinking on, the model opens the block
itself) starts before it.

`ThinkingSplit` routes an answer's tokens, one by one, to the thinking or to
the content, by token id, so a partial UTF-8 character never straddles the
boundary (each side has its own detokenizer, egress.py). `after_thinking`
wraps a request's grammar (a response_format or a required tool call) so that
it holds only after the block, and writes a thinking budget as a bounded run of
tokens that are not the closing tag, after which the closing tag is the only
token allowed: the engine enforces both as it enforces any grammar, and a
continuation replays them from its output prefix.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import msgspec

OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"
BEFORE, INSIDE, AFTER = "before", "inside", "after"
REASONING, CONTENT, TAG = "reasoning", "content", "tag"
# At most this many whitespace tokens between a tag and the prompt's end (R1: "<think>\n").
TAIL_TOKENS = 8
# What may separate the closing tag from a constrained answer (Qwen3 writes "\n\n").
GAP = r"/[ \t\r\n]{0,8}/"


class Thinking(msgspec.Struct, frozen=True):
    """A model's thinking convention: its tags' token ids, whether its template reads
    `enable_thinking`, and the whitespace-only tokens (to read a prompt's tail)."""

    open_id: int
    close_id: int
    switchable: bool
    blank_ids: frozenset[int] = frozenset()


class ThinkingStart(msgspec.Struct, frozen=True):
    """One answer's thinking: the model's convention and where its output begins."""

    thinking: Thinking
    state: str  # BEFORE, INSIDE or AFTER


def template_texts(tokenizer: Any) -> list[str]:
    """The chat template's text (every one of a dict of named templates)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return [str(t) for t in template.values()]
    return [str(template)] if template else []


def detect_thinking(tokenizer: Any) -> Thinking | None:
    """The convention of a tokenizer's chat template, or None for a model that does not
    think (no template writing both tags, or a tag that is not one token)."""
    texts = template_texts(tokenizer)
    if not any(OPEN_TAG in t and CLOSE_TAG in t for t in texts):
        return None
    vocab = tokenizer.get_vocab()
    open_id, close_id = vocab.get(OPEN_TAG), vocab.get(CLOSE_TAG)
    if open_id is None or close_id is None:
        return None
    switchable = any("enable_thinking" in t for t in texts)
    return Thinking(int(open_id), int(close_id), switchable, _blank_ids(tokenizer, vocab))


def _blank_ids(tokenizer: Any, vocab: dict[str, int]) -> frozenset[int]:
    """Tokens that decode to whitespace alone: candidates by their pieces (byte-level
    BPE's Ġ Ċ ĉ č, SentencePiece's ▁ and byte tokens), confirmed by decoding."""
    marks = set(" \t\n\r\u0120\u010a\u0109\u010d\u2581")
    candidates = [
        i
        for piece, i in vocab.items()
        if (piece and len(piece) <= 16 and set(piece) <= marks)
        or piece in ("<0x0A>", "<0x20>", "<0x09>", "<0x0D>")
    ]
    return frozenset(
        i for i in candidates if not tokenizer.decode([i], skip_special_tokens=False).strip()
    )


def start_state(thinking: Thinking, prompt: Iterable[int]) -> str:
    """Where an answer to this prompt begins: INSIDE a block its prompt opened, AFTER
    one its prompt closed, else BEFORE (the model may open one)."""
    tail = list(prompt)[-TAIL_TOKENS - 1 :]
    for token in reversed(tail):
        if token == thinking.open_id:
            return INSIDE
        if token == thinking.close_id:
            return AFTER
        if token not in thinking.blank_ids:
            return BEFORE
    return BEFORE


class ThinkingSplit:
    """An answer's tokens to the thinking or the content, one at a time.

    BEFORE: an opening tag as the first token opens the block; any other token is
    content, and so is everything after it. INSIDE: the closing tag ends the block;
    every other token is thinking. AFTER: everything is content. The tags
    themselves are neither (TAG)."""

    def __init__(self, start: ThinkingStart) -> None:
        self.thinking = start.thinking
        self.state = start.state
        self.closed = False  # the block closed in this answer (its last token so far)

    def route(self, token: int) -> str:
        thinking = self.thinking
        self.closed = False
        if self.state == BEFORE:
            if token == thinking.open_id:
                self.state = INSIDE
                return TAG
            self.state = AFTER
            return CONTENT
        if self.state == INSIDE:
            if token == thinking.close_id:
                self.state = AFTER
                self.closed = True
                return TAG
            return REASONING
        return CONTENT


class Trimmed:
    """Text that goes out without leading and (once `end` is called) trailing
    whitespace: leading whitespace is dropped, trailing whitespace held until more
    text follows it."""

    def __init__(self) -> None:
        self.started = False
        self.held = ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ""
            self.started = True
        text = self.held + text
        out = text.rstrip()
        self.held = text[len(out) :]
        return out

    def end(self) -> None:
        self.held = ""


def after_thinking(start: ThinkingStart, budget: int | None, answer: str | None) -> str | None:
    """The grammar of an answer whose thinking comes first: `answer` (an llguidance
    grammar, None: free text) held only after the block, the block's text at most
    `budget` tokens (None: unbounded). None when nothing needs enforcing."""
    if start.state == AFTER:
        return answer  # no thinking to come: the grammar holds from the first token
    if answer is None and budget is None:
        return None
    thinking = start.thinking
    close, body = f"<[{thinking.close_id}]>", f"<[^{thinking.close_id}]>"
    body += "*" if budget is None else f"{{0,{budget}}}"
    if start.state == INSIDE:
        block = f"{body} {close}"
    else:  # the model may open a block, or answer at once
        block = f"(<[{thinking.open_id}]> {body} {close})?"
    if answer is None:
        return json.dumps(
            {"grammars": [{"lark_grammar": f"start: {block} ANSWER\nANSWER: /(?s:.*)/\n"}]}
        )
    grammars = json.loads(answer)["grammars"]
    first = dict(grammars[0])
    name = first.setdefault("name", "fencepost_answer")
    main = {
        "name": "fencepost_thinking",
        "lark_grammar": f"start: {block} GAP @{name}\nGAP: {GAP}\n",
    }
    return json.dumps({"grammars": [main, first, *grammars[1:]]})
