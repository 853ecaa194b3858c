"""Log probabilities at the boundary: which token's record goes out with which text.

A delivered token may carry its TokenLogprob (core/protocol.py) when the
request asked. The record must reach the client with the text of its token,
but a token's text is not always sent when the token arrives: the
detokenizer holds back an incomplete UTF-8 character, and the stop matcher
holds back text that could be the start of a stop string. LogprobEntries
therefore notes, for each token, where its text starts in the choice's text
(`offset`: characters the detokenizer had produced before it) and releases
an entry once text past that offset has gone out, so an entry travels with
the first chunk that carries any of its token's text, and a token whose text
is held waits with it.

At the end of a choice: after eos or the length limit every entry still
waiting goes out (a token with no text of its own, such as the end token,
included), so there is one entry per completion token. After a stop string
the entries of tokens whose text lies wholly in the stop string or after it
are dropped: the client gets entries for the tokens whose text it got, the
one in which the stop string begins included.

Entries are rendered here too, in the two OpenAI shapes: chat's
`logprobs.content` list and the legacy completions' parallel lists.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from core.protocol import TokenLogprob

TokenBytes = Callable[[int], bytes]  # a token id's own bytes (possibly part of a character)
NEG_INF_LOGPROB = -9999.0  # what JSON gets for -inf (a token the grammar forbids), as OpenAI


class Candidate(NamedTuple):
    token: str
    raw: bytes
    logprob: float


class Entry(NamedTuple):
    """One token's logprob entry, ready to render: its text, value, top, and offset."""

    chosen: Candidate
    top: tuple[Candidate, ...]
    offset: int  # where its text starts in the choice's generated text


def token_text(raw: bytes) -> str:
    """A token's text as a string: bytes that are not whole UTF-8 characters (a token
    can hold part of one) are written as \\xNN escapes; `bytes` has them exactly."""
    return raw.decode("utf-8", errors="backslashreplace")


def _finite(value: float) -> float:
    return value if math.isfinite(value) else NEG_INF_LOGPROB


class LogprobEntries:
    """The entries of one choice, waiting for their text to go out."""

    def __init__(self, token_bytes: TokenBytes) -> None:
        self._token_bytes = token_bytes
        self._waiting: list[Entry] = []
        self._produced = 0  # characters the detokenizer has given so far
        self._sent = 0  # characters sent to the client so far

    def add(self, token_id: int, record: TokenLogprob | None, detokenized: str) -> None:
        """A token arrived (with its record; None only from a decoder that broke its
        contract: no entry); `detokenized` is the text the detokenizer gave for it."""
        if record is not None:
            chosen = self._candidate(token_id, record.logprob)
            top = tuple(self._candidate(t, v) for t, v in record.top)
            self._waiting.append(Entry(chosen, top, self._produced))
        self._produced += len(detokenized)

    def release(self, sent: str) -> list[Entry]:
        """`sent` just went out: the entries whose text it begins (or continues)."""
        self._sent += len(sent)
        cut = 0
        while cut < len(self._waiting) and self._waiting[cut].offset < self._sent:
            cut += 1
        out, self._waiting = self._waiting[:cut], self._waiting[cut:]
        return out

    def finish(self, sent: str, stopped: bool) -> list[Entry]:
        """The choice ended with `sent` as its last text: after a stop string, only the
        entries whose text was sent; otherwise all that are left."""
        out = self.release(sent)
        if not stopped:
            out += self._waiting
        self._waiting = []
        return out

    def _candidate(self, token_id: int, logprob: float) -> Candidate:
        raw = self._token_bytes(token_id)
        return Candidate(token_text(raw), raw, _finite(logprob))


def chat_logprobs(entries: Sequence[Entry]) -> dict[str, Any]:
    """A chat choice's `logprobs` object for these entries."""
    return {
        "content": [
            {
                **_chat_candidate(entry.chosen),
                "top_logprobs": [_chat_candidate(c) for c in entry.top],
            }
            for entry in entries
        ],
        "refusal": None,
    }


def _chat_candidate(candidate: Candidate) -> dict[str, Any]:
    return {"token": candidate.token, "logprob": candidate.logprob, "bytes": list(candidate.raw)}


def completion_logprobs(entries: Sequence[Entry], text_offset: int = 0) -> dict[str, Any]:
    """A legacy completion choice's `logprobs` object; offsets count from `text_offset`
    (the length of an echoed prompt)."""
    return {
        "tokens": [e.chosen.token for e in entries],
        "token_logprobs": [e.chosen.logprob for e in entries],
        "top_logprobs": [{c.token: c.logprob for c in e.top} for e in entries],
        "text_offset": [text_offset + e.offset for e in entries],
    }


def byte_level_decoder() -> dict[str, int]:
    """The inverse of the byte-to-character table of byte-level BPE vocabularies (GPT-2
    and its descendants, SmolLM2 among them): each of the 256 byte values is written
    as one printable character, itself where it already is one."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + shifted)] = b
            shifted += 1
    return table
