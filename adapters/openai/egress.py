"""From token ids to what a client reads: detokenizing, stop strings, the per-client queue.

IncrementalDetokenizer turns a growing list of token ids into text deltas. It
decodes a short window of recent tokens and holds back text while the window
ends in U+FFFD, so a character whose bytes span several tokens is sent once,
whole, and never as a replacement character.

StopMatcher removes stop strings from the text: it passes on text that cannot
be the start of a stop string, holds back a suffix that could be, and on a
match reports it and drops everything from the match on. Held text is never
sent and then retracted.

ClientQueue sits between the task reading a request's deliveries and the
task writing the HTTP response. The reader never waits on it, so a slow
client never slows the controller or the decode loop. It holds at most
`max_events` events; when the events or their bytes pass the high watermark
the queue is congested and new text is merged into the last pending delta
(fewer, larger chunks, the same text) until the writer brings it under the
low watermark. Deltas carry their choice's index (a legacy completion with
several prompts streams several choices through one queue); only deltas of the
same choice merge. Past a hard byte ceiling the client is hopeless: the queue
fails, the request is cancelled and the connection closed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

Decode = Callable[[list[int]], str]
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self.tokens: list[int] = []
        self._prefix = 0  # window start: tokens before it are fully emitted
        self._read = 0  # tokens up to here are emitted as text

    def push(self, token_id: int) -> str:
        """Add a token; return the text it completes (often all of it, sometimes none)."""
        self.tokens.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """At the end of generation: whatever is still held, replacement characters and all."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        before = self._decode(self.tokens[self._prefix : self._read])
        now = self._decode(self.tokens[self._prefix :])
        if len(now) <= len(before) or (now.endswith(REPLACEMENT) and not final):
            return ""
        # Windows advance only at complete-text boundaries, so `before` is a prefix of `now`.
        self._prefix, self._read = self._read, len(self.tokens)
        return now[len(before) :]


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        """Text that is safe to send; sets `matched` when a stop string completes."""
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        pending = self._held + text
        cut = min((i for s in self.stops if (i := pending.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.matched = next(s for s in self.stops if pending.find(s) == cut)
            self._held = ""
            return pending[:cut]
        keep = self._partial_suffix(pending)
        self._held = pending[len(pending) - keep :] if keep else ""
        return pending[: len(pending) - keep]

    def flush(self) -> str:
        """The generation ended without a match: the held text was not a stop after all."""
        held, self._held = self._held, ""
        return held if self.matched is None else ""

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest


@dataclass(frozen=True)
class ClientLimits:
    max_events: int = 256
    high_water_bytes: int = 64 * 1024
    low_water_bytes: int = 32 * 1024
    ceiling_bytes: int = 1024 * 1024


class ClientOverflow(Exception):
    """The client fell so far behind that its queue passed the hard ceiling."""


Frame = bytes | Callable[[], bytes]  # encoded, or encoded when taken (in queue order)


@dataclass
class _Event:
    text: str | None  # a content delta (mergeable), or None for an opaque frame
    frame: Frame  # the frame (deltas are encoded when taken)
    size: int
    choice: int = 0  # for deltas: the index of the choice the text belongs to


class Sink(Protocol):
    """Where an Answer writes its frames: a ClientQueue (one client, deltas merged when
    it lags) or a live response's EventLog (live.py: every event kept, as numbered)."""

    failed: ClientOverflow | None

    def put_delta(self, text: str, choice: int = 0) -> None: ...
    def put_frame(self, frame: Frame, size: int | None = None) -> None: ...
    def close(self) -> None: ...


class ClientQueue:
    """Frames for one client. A frame given as a callable, and every delta, is encoded
    when the writer takes it, in queue order: an API whose events carry a running
    sequence number (the Responses API) numbers them there, merged deltas included.
    `delta_overhead` is a delta frame's size without its text; by default one empty
    delta is encoded to measure it."""

    def __init__(
        self,
        limits: ClientLimits,
        encode_delta: Callable[[str, int], bytes],
        delta_overhead: int | None = None,
    ) -> None:
        self.limits = limits
        self._encode_delta = encode_delta  # (text, choice index) -> frame
        if delta_overhead is None:
            delta_overhead = len(encode_delta("", 0))
        self._delta_overhead = delta_overhead
        self._events: deque[_Event] = deque()
        self.bytes = 0
        self.congested = False
        self.closed = False
        self.failed: ClientOverflow | None = None
        self._lot = trio.lowlevel.ParkingLot()
        self.merged = 0  # deltas merged into an earlier one (for statistics and tests)

    def __len__(self) -> int:
        return len(self._events)

    def put_delta(self, text: str, choice: int = 0) -> None:
        size = len(text.encode()) + self._delta_overhead
        last = self._events[-1] if self._events else None
        congested = self._is_congested()
        if congested and last is not None and last.text is not None and last.choice == choice:
            last.text += text
            last.size += size - self._delta_overhead
            self.bytes += size - self._delta_overhead
            self.merged += 1
        else:
            self._append(_Event(text, b"", size, choice))
        self._check_ceiling()

    def put_frame(self, frame: Frame, size: int | None = None) -> None:
        """An opaque frame; a callable one needs its (estimated) `size`."""
        if size is None:
            assert isinstance(frame, bytes)
            size = len(frame)
        self._append(_Event(None, frame, size))
        self._check_ceiling()

    def close(self) -> None:
        self.closed = True
        self._lot.unpark_all()

    async def take(self) -> bytes:
        """Everything queued, encoded, waiting for at least one event; b"" once closed."""
        while not self._events:
            if self.failed is not None:
                raise self.failed
            if self.closed:
                return b""
            await self._lot.park()
        if self.failed is not None:
            raise self.failed
        frames = [
            self._encode_delta(e.text, e.choice)
            if e.text is not None
            else e.frame
            if isinstance(e.frame, bytes)
            else e.frame()
            for e in self._events
        ]
        self._events.clear()
        self.bytes = 0
        self.congested = False
        return b"".join(frames)

    def _append(self, event: _Event) -> None:
        self._events.append(event)
        self.bytes += event.size
        self._lot.unpark_all()

    def _is_congested(self) -> bool:
        limits = self.limits
        events = len(self._events)
        if (
            self.congested
            and self.bytes < limits.low_water_bytes
            and events < limits.max_events // 2
        ):
            self.congested = False
        elif events >= limits.max_events - 4 or self.bytes >= limits.high_water_bytes:
            self.congested = True
        return self.congested

    def _check_ceiling(self) -> None:
        if self.bytes > self.limits.ceiling_bytes and self.failed is None:
            self.failed = ClientOverflow(
                f"{self.bytes} bytes queued for a client that is not reading"
            )
            self._lot.unpark_all()
