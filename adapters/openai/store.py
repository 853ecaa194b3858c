"""What the OpenAI APIs keep in the state store (adapters/state), and how they read it back.

A stored response is a Record of kind "response": its body is the response
object as the client got it, its items the conversation it answered (its
input items, those of the responses it continued included), so continuing it
needs nothing else: the next request's conversation is the record's items,
then its output items, then the new input. A stored chat completion is a
Record of kind "chat.completion": the completion object, and the request's
messages as sent.

The errors a client gets for ids the store does not hold say why, when the
store knows (deleted, evicted by its bounds, expired); a store that cannot be
reached is a 503 with a Retry-After, and the request is not run.
"""

from __future__ import annotations

from typing import Any

from adapters.openai.errors import OpenAIError, invalid
from adapters.state import Gone, Record, StoreUnavailable

RETRY_AFTER_S = 2  # what a 503 for an unreachable store asks the client to wait
_WHY = {
    "deleted": "was deleted",
    "evicted": "was evicted by the store's bounds (--response-store-max, --response-store-mib)",
    "expired": "expired (--response-store-ttl)",
}


def conversation(record: Record) -> list[dict[str, Any]]:
    """The items a response continuing this one starts from."""
    return [*record.items, *(_as_input(item) for item in record.body["output"])]


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    """An output item as the input item that resends it (logprobs and annotations off)."""
    if item["type"] != "message":
        return item
    parts = [{"type": p["type"], "text": p["text"]} for p in item["content"]]
    return {**item, "content": parts}


def not_found(what: str, record_id: str, found: Gone | None, param: str, code: str) -> OpenAIError:
    """404: no `what` with this id, and why not where the store remembers."""
    why = f" ({_WHY[found.reason]})" if found is not None else ""
    return OpenAIError(
        404, f"no stored {what} has the id '{record_id}'{why}", "invalid_request_error", param, code
    )


def previous_missing(record_id: str, found: Gone) -> OpenAIError:
    return invalid(
        f"the previous response '{record_id}' {_WHY[found.reason]}",
        "previous_response_id",
        "previous_response_not_found",
    )


def store_down(error: StoreUnavailable) -> OpenAIError:
    return OpenAIError(
        503,
        f"the state store is unavailable ({error}); try again shortly",
        "service_unavailable",
        None,
        "store_unavailable",
    )
