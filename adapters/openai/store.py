"""Stored responses: what `store` keeps, GET and DELETE read, `previous_response_id` continues.

One store per router process, in memory, bounded by count and by bytes (the
encoded JSON of each entry), least recently used first out: a response that
is read or continued moves to the back. An entry is the response object as
the client got it and the conversation it answered (its input items, those of
the responses it continued included), so continuing it needs nothing else:
the next request's conversation is the entry's items, then its output items,
then the new input. An entry larger than the whole byte bound is not kept.

A restart, an eviction or another router loses it; a continuation then gets
a 400 (responses.py), never a fresh start. Pure data: no IO, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import msgspec

DEFAULT_MAX_RESPONSES = 1000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoreLimits:
    max_responses: int = DEFAULT_MAX_RESPONSES
    max_bytes: int = DEFAULT_MAX_BYTES


@dataclass(frozen=True)
class Stored:
    response: dict[str, Any]  # the response object
    items: tuple[dict[str, Any], ...]  # the conversation's input items
    size: int


class ResponseStore:
    def __init__(self, limits: StoreLimits | None = None) -> None:
        self.limits = limits or StoreLimits()
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0
        self.evicted = 0  # entries pushed out by the bounds (for metrics and tests)

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict[str, Any], items: tuple[dict[str, Any], ...]) -> bool:
        """Keep a finished response; False when it alone is over the byte bound."""
        size = len(msgspec.json.encode(response)) + len(msgspec.json.encode(items))
        if size > self.limits.max_bytes or self.limits.max_responses < 1:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = Stored(response, items, size)
        self.bytes += size
        while len(self._entries) > self.limits.max_responses or self.bytes > self.limits.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.size
            self.evicted += 1
        return True

    def get(self, response_id: str) -> Stored | None:
        stored = self._entries.get(response_id)
        if stored is not None:
            self._entries.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is None:
            return False
        self.bytes -= stored.size
        return True

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The items a response continuing this one starts from, or None: not stored."""
        stored = self.get(response_id)
        if stored is None:
            return None
        return [*stored.items, *(_as_input(item) for item in stored.response["output"])]


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item that resends it (logprobs and annotations off)."""
    if item["type"] != "message":
        return item
    parts = [{"type": p["type"], "text": p["text"]} for p in item["content"]]
    return {**item, "content": parts}
