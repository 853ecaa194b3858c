"""Tool calls, answer side: the model's text in, content and tool calls out.

ToolCallReader reads the generated text as it grows (the same way for a
streamed answer and a plain one, so the two agree) in the call syntax of
tools.py, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`:

- Text before the first call is content. Text that could be the start of the
  marker (`<tool_` at the end of a delta) is held back until the next text
  shows whether it is one; at the end it is released as content. Nothing is
  sent and then retracted.
- From a start marker to its end marker the text is held. A complete block
  whose body is a JSON object with a known function `name` and an object of
  `arguments` becomes a tool call (arguments re-encoded as JSON text); anything
  else, and a block the generation ended inside, is released as content,
  markers and all.
- After a call, whitespace before the next call is dropped; other text is
  content again. With parallel calls off, only the first call is a call:
  everything after it stays content.

Its output is a list of Pieces: content text, or a whole call (sent as a first
tool-call delta with id and name, then the arguments). A call is sent only
once it is complete and valid, so a malformed one can still fall back to text.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import msgspec

from adapters.openai.tools import CALL_END, CALL_START, ToolCall


class Content(msgspec.Struct, frozen=True):
    text: str


class Call(msgspec.Struct, frozen=True):
    index: int  # the call's position among this answer's calls
    call: ToolCall


Piece = Content | Call


class ToolCallReader:
    def __init__(
        self, names: frozenset[str], new_id: Callable[[], str], parallel: bool = True
    ) -> None:
        self.names = names  # the functions a call may name
        self.new_id = new_id
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.content: list[str] = []  # all content sent so far
        self._held = ""  # text not yet decided
        self._in_call = False  # _held is the body of a call after its start marker
        self._done = False  # no more calls will be read (parallel calls off)

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        pieces: list[Piece] = []
        for _ in range(len(self._held) + 1):  # each pass consumes a marker or stops
            if self._done:  # the rest is content, but whitespace after the call is dropped
                if self._held.strip():
                    pieces.append(Content(self._held))
                    self._held = ""
                break
            if not self._step(pieces):
                break
        return self._merged(pieces)

    def finish(self) -> list[Piece]:
        """The generation ended: whatever is held is content (an unclosed call too)."""
        held = (CALL_START if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        pieces: list[Piece] = []
        if held and not (self.calls and not held.strip()):
            pieces.append(Content(held))
        return self._merged(pieces)

    def _step(self, pieces: list[Piece]) -> bool:
        """Move past one marker if the held text has it; False when it must wait."""
        held = self._held
        if self._in_call:
            end = held.find(CALL_END)
            if end < 0:
                return False
            body, self._held, self._in_call = held[:end], held[end + len(CALL_END) :], False
            call = self._call(body)
            if call is None:
                pieces.append(Content(CALL_START + body + CALL_END))
            else:
                pieces.append(Call(len(self.calls), call))
                self.calls.append(call)
                self._done = not self.parallel
            return True
        start = held.find(CALL_START)
        if start < 0:
            keep = _partial_marker(held)
            text, self._held = held[: len(held) - keep], held[len(held) - keep :]
            if self.calls and not text.strip():  # whitespace after a call: wait and see
                self._held = held
            elif text:
                pieces.append(Content(text))
            return False
        text = held[:start]
        if text and not (self.calls and not text.strip()):
            pieces.append(Content(text))
        self._held, self._in_call = held[start + len(CALL_START) :], True
        return True

    def _call(self, body: str) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
            return None
        name, arguments = value["name"], value["arguments"]
        if not isinstance(name, str) or name not in self.names or not isinstance(arguments, dict):
            return None
        return ToolCall(self.new_id(), name, json.dumps(arguments, ensure_ascii=False))

    def _merged(self, pieces: list[Piece]) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if isinstance(piece, Content):
                if not piece.text:
                    continue
                self.content.append(piece.text)
                if out and isinstance(out[-1], Content):
                    out[-1] = Content(out[-1].text + piece.text)
                    continue
            out.append(piece)
        return out


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of the start marker."""
    for k in range(min(len(CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(CALL_START[:k]):
            return k
    return 0


def read_answer(
    text: str, names: frozenset[str], new_id: Callable[[], str], parallel: bool = True
) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: its content (None when it is only calls) and its calls."""
    reader = ToolCallReader(names, new_id, parallel)
    reader.feed(text)
    reader.finish()
    content = "".join(reader.content)
    return (None if reader.calls and not content else content), reader.calls
