"""Tool calls, answer side: the model's text in, content and tool calls out.

A ToolCallReader reads the generated text as it grows (the same way for a
streamed answer and a plain one, so the two agree) in one call syntax
(callsyntax.py says which reader a model's syntax uses). Every reader keeps
the same promises:

- Nothing is sent and then retracted. Text that could still become (part of)
  a call is held until the next text decides it; a call is sent only once it
  is complete and valid, so a malformed one can still fall back to content.
- A call is valid when its JSON parses, names one of the callable functions
  and has an object of arguments (re-encoded as JSON text); anything else,
  and a call the generation ended inside, is released as content.
- Whitespace between and after calls is dropped. With parallel calls off,
  only the first call is a call: the rest stays content.

The three readers:

- HermesReader, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
  Text before, between and after blocks is content. Text that could be the
  start of the marker (`<tool_` at the end of a delta) is held back; a block
  is held from its start marker to its end marker and, when it is not a valid
  call, released as content, markers and all.
- Llama3JsonReader, Llama 3.1-3.3's `{"name": ..., "parameters": {...}}`
  (`arguments` accepted too), several separated by `;` or newlines, possibly
  after `<|python_tag|>`. The answer is calls only if it is such JSON from
  its first non-whitespace character: while it starts with `{` (or the tag)
  it is held until the object's braces balance, then parsed. A first object
  that is not a call makes the whole answer content; after the calls, the
  first thing that is not one is content, and so is everything after it.
- MistralReader, `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (the
  v3 tokenizers') or `[TOOL_CALLS]name[ARGS]{...}` (v11 and later; `[ARGS]`
  may be absent). Text before the marker is content; from the marker the
  text is held until the array (or the object) balances. The markers are
  special tokens, which a plain decode drops: the server decodes a tool
  answer keeping them (models.py, decode_with_markers) and this reader
  removes them from every piece of content, so content looks as it would
  have without them.

Leading whitespace: the Llama and Mistral readers hold whitespace at the
start of the answer until they know whether a call follows (then it is
dropped); the Hermes reader sends it as content, as it always has.

Output is a list of Pieces: content text, or a whole call (sent as a first
tool-call delta with id and name, then the arguments).
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable

import msgspec

from adapters.openai.tools import CALL_END, CALL_START, NAME_PATTERN, ToolCall

PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's "code follows" token, before a call
TOOL_CALLS = "[TOOL_CALLS]"  # Mistral's marker before the calls
ARGS = "[ARGS]"  # Mistral v11's marker between a call's name and its arguments
MAX_NAME = 64  # as NAME_PATTERN
NAME_CHARS = frozenset(string.ascii_letters + string.digits + "_-")  # as NAME_PATTERN
WHITESPACE = " \t\r\n"
SEPARATORS = WHITESPACE + ";"  # between Llama calls


class Content(msgspec.Struct, frozen=True):
    text: str


class Call(msgspec.Struct, frozen=True):
    index: int  # the call's position among this answer's calls
    call: ToolCall


Piece = Content | Call
NewId = Callable[[], str]


class ToolCallReader:
    """What every syntax's reader shares: the functions, ids, the calls and the content
    so far. A subclass reads its syntax in feed and finish."""

    def __init__(self, names: frozenset[str], new_id: NewId, parallel: bool = True) -> None:
        self.names = names  # the functions a call may name
        self.new_id = new_id
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self.content: list[str] = []  # all content sent so far
        self._held = ""  # text not yet decided
        self._done = False  # no more calls will be read (parallel calls off)

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        """The generation ended: whatever is held is content (an unclosed call too)."""
        raise NotImplementedError

    def _call(self, name: object, arguments: object) -> ToolCall | None:
        """The call, when it names a callable function with an object of arguments."""
        if not isinstance(name, str) or name not in self.names or not isinstance(arguments, dict):
            return None
        return ToolCall(self.new_id(), name, json.dumps(arguments, ensure_ascii=False))

    def _add(self, pieces: list[Piece], call: ToolCall) -> None:
        pieces.append(Call(len(self.calls), call))
        self.calls.append(call)
        self._done = not self.parallel

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


class HermesReader(ToolCallReader):
    def __init__(self, names: frozenset[str], new_id: NewId, parallel: bool = True) -> None:
        super().__init__(names, new_id, parallel)
        self._in_call = False  # _held is the body of a call after its start marker

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
            call = self._block(body)
            if call is None:
                pieces.append(Content(CALL_START + body + CALL_END))
            else:
                self._add(pieces, call)
            return True
        start = held.find(CALL_START)
        if start < 0:
            keep = _partial_marker(held, (CALL_START,))
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

    def _block(self, body: str) -> ToolCall | None:
        value = _json(body)
        if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
            return None
        return self._call(value["name"], value["arguments"])


class Llama3JsonReader(ToolCallReader):
    def __init__(self, names: frozenset[str], new_id: NewId, parallel: bool = True) -> None:
        super().__init__(names, new_id, parallel)
        self._content = False  # decided: everything from here on is content
        self._object: JsonExtent | None = None  # the object being held, from _held[_at]
        self._at = 0

    def feed(self, text: str) -> list[Piece]:
        if self._content:
            return self._merged([Content(text)])
        self._held += text
        pieces: list[Piece] = []
        while not self._content and self._step(pieces):
            pass
        return self._merged(pieces)

    def finish(self) -> list[Piece]:
        held, self._held = self._held, ""
        if self.calls and not held.strip(SEPARATORS):
            return []
        return self._merged([Content(held)])

    def _step(self, pieces: list[Piece]) -> bool:
        """Read one call off the held text; False when it must wait (or all is content)."""
        held = self._held
        if self._object is None:
            start = self._call_start(held)
            if start is None:
                return False
            if start < 0:
                self._to_content(pieces)
                return False
            self._object, self._at = JsonExtent(), start
        end = self._object.end(held, self._at)
        if not end:
            return False
        call = self._parsed(held[self._at : end])
        if call is None:
            self._to_content(pieces)
            return False
        self._add(pieces, call)
        self._held, self._object = held[end:], None
        return True

    def _call_start(self, held: str) -> int | None:
        """Where the next call's `{` is; -1: what follows is no call; None: wait."""
        at = len(held) - len(held.lstrip(SEPARATORS if self.calls else WHITESPACE))
        if not self.calls:  # the answer may open with the tag
            rest = held[at:]
            if len(rest) < len(PYTHON_TAG) and PYTHON_TAG.startswith(rest):
                return None  # nothing yet, or part of the tag
            if rest.startswith(PYTHON_TAG):
                at = len(held) - len(held[at + len(PYTHON_TAG) :].lstrip())
        if at == len(held):
            return None
        return at if held[at] == "{" and not self._done else -1

    def _parsed(self, text: str) -> ToolCall | None:
        value = _json(text)
        if not isinstance(value, dict) or value.pop("type", "function") != "function":
            return None
        for key in ("parameters", "arguments"):
            if set(value) == {"name", key}:
                return self._call(value["name"], value[key])
        return None

    def _to_content(self, pieces: list[Piece]) -> None:
        pieces.append(Content(self._held))
        self._held, self._content, self._object = "", True, None


class MistralReader(ToolCallReader):
    MARKERS = (TOOL_CALLS, ARGS)

    def __init__(self, names: frozenset[str], new_id: NewId, parallel: bool = True) -> None:
        super().__init__(names, new_id, parallel)
        self._in_call = False  # _held is what follows a [TOOL_CALLS] marker
        self._value: JsonExtent | None = None  # the array or object being held, from _held[_at]
        self._at = 0

    def feed(self, text: str) -> list[Piece]:
        self._held += text
        pieces: list[Piece] = []
        for _ in range(len(self._held) + 1):  # each pass consumes a marker or a call
            moved = self._step_call(pieces) if self._in_call else self._step_text(pieces)
            if not moved:
                break
        return self._merged(pieces)

    def finish(self) -> list[Piece]:
        held, self._held, self._in_call, self._value = self._held, "", False, None
        if self.calls and not _unmarked(held).strip():
            return []
        return self._merged([Content(_unmarked(held))])

    def _quiet(self, text: str) -> bool:
        """Whether `text` is whitespace that may yet be dropped: it opens the answer or
        follows a call, and a call may come after it."""
        return not text.strip() and (bool(self.calls) or not self.content)

    def _step_text(self, pieces: list[Piece]) -> bool:
        """Content up to the next marker; True when past a marker into a call."""
        held = self._held
        start = -1 if self._done else held.find(TOOL_CALLS)
        if start < 0:
            keep = _partial_marker(held, self.MARKERS)
            text = held[: len(held) - keep]
            if not self._quiet(text):  # else whitespace: wait and see
                pieces.append(Content(_unmarked(text)))
                self._held = held[len(text) :]
            return False
        text = held[:start]
        if not self._quiet(text):
            pieces.append(Content(_unmarked(text)))
        self._held, self._in_call = held[start + len(TOOL_CALLS) :], True
        return True

    def _step_call(self, pieces: list[Piece]) -> bool:
        """Read the call(s) after a marker; False when it must wait."""
        held = self._held
        if self._value is None:
            at = len(held) - len(held.lstrip())
            if at == len(held):
                return False
            if held[at] != "[":  # the v11 form: name, [ARGS], object
                opened = self._arguments_start(held, at)
                if opened is None:
                    return False
                if opened < 0 or held[opened] != "{":
                    return self._not_a_call(pieces, max(opened, at + 1))
                at = opened
            self._value, self._at = JsonExtent(), at
        end = self._value.end(held, self._at)
        if not end:
            return False
        body = held[self._at : end]
        found = self._array(body) if body[0] == "[" else self._named(held[: self._at], body)
        if found is None:
            return self._not_a_call(pieces, end)
        calls, rest = found
        for call in calls:
            self._add(pieces, call)
        if rest:  # parallel calls off: the array's other calls are content
            pieces.append(Content(json.dumps(rest, ensure_ascii=False)))
        self._held, self._in_call, self._value = held[end:], False, None
        return True

    def _arguments_start(self, held: str, at: int) -> int | None:
        """After a function name at `at`: where its arguments open (-1, or a place that
        is not a `{`: no call here; None: wait)."""
        end = at
        while end < len(held) and held[end] in NAME_CHARS:
            end += 1
        if end == at or end - at > MAX_NAME:
            return -1
        rest = held[end:]
        if len(rest) < len(ARGS) and ARGS.startswith(rest):
            return None  # the name, or [ARGS], still coming
        opened = end + len(ARGS) if rest.startswith(ARGS) else end
        return None if opened == len(held) else opened

    def _array(self, body: str) -> tuple[list[ToolCall], list[object]] | None:
        value = _json(body)
        if not isinstance(value, list) or not value:
            return None
        for item in value:  # every item a call (an "id" the model wrote is ignored)
            if not isinstance(item, dict) or not isinstance(item.pop("id", ""), str):
                return None
            if set(item) != {"name", "arguments"} or item["name"] not in self.names:
                return None
            if not isinstance(item["arguments"], dict):
                return None
        taken = value if self.parallel else value[:1]
        calls = [self._call(item["name"], item["arguments"]) for item in taken]
        return [c for c in calls if c is not None], value[len(taken) :]

    def _named(self, head: str, body: str) -> tuple[list[ToolCall], list[object]] | None:
        name = head.strip().removesuffix(ARGS)
        if not NAME_PATTERN.fullmatch(name):
            return None
        call = self._call(name, _json(body))
        return None if call is None else ([call], [])

    def _not_a_call(self, pieces: list[Piece], end: int) -> bool:
        """What followed the marker, up to `end`, is content; reading goes on after it."""
        pieces.append(Content(_unmarked(self._held[:end])))
        self._held, self._in_call, self._value = self._held[end:], False, None
        return True


class JsonExtent:
    """Where a JSON object or array that opens at text[at] closes, found as the text
    grows with each character read once: brackets are counted outside strings, escapes
    skipped inside them. Not a validator (json.loads decides): it only says where the
    value would end, so a malformed one is held no longer than a valid one."""

    def __init__(self) -> None:
        self._read = 0  # characters read, from `at`
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def end(self, text: str, at: int) -> int:
        """The index just past the value in text, or 0 while it is still open."""
        for i in range(at + self._read, len(text)):
            c = text[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
        self._read = len(text) - at
        return 0


def _json(text: str) -> object:
    """The JSON value of text, or None when it is not one (or nests past the stack)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _unmarked(text: str) -> str:
    """Mistral content without its markers (special tokens a plain decode drops)."""
    for marker in MistralReader.MARKERS:
        text = text.replace(marker, "")
    return text


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of one of the markers."""
    longest = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:k]):
                longest = k
                break
    return longest


def read_answer(
    text: str,
    names: frozenset[str],
    new_id: NewId,
    parallel: bool = True,
    reader: type[ToolCallReader] = HermesReader,
) -> tuple[str | None, list[ToolCall]]:
    """A whole answer: its content (None when it is only calls) and its calls."""
    read = reader(names, new_id, parallel)
    read.feed(text)
    read.finish()
    content = "".join(read.content)
    return (None if read.calls and not content else content), read.calls
