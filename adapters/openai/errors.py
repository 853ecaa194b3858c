"""OpenAI-shaped errors: every failure at the HTTP boundary is one of these.

The body is always the OpenAI envelope {"error": {"message", "type", "param",
"code"}}, whatever went wrong, so clients written for the OpenAI API can parse
it; the status says whose fault it was (4xx the request's, 5xx ours).
"""

from __future__ import annotations

from typing import Any

import msgspec

from core.protocol import ErrorKind


class OpenAIError(msgspec.Struct, frozen=True):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


# How a terminal error from the controller reaches a client that has not yet
# received anything (an error after the stream started is sent in-stream).
_FROM_CONTROLLER: dict[str, tuple[int, str]] = {
    "no_worker": (503, "service_unavailable"),
    "overloaded": (503, "service_unavailable"),
    "worker_lost": (503, "service_unavailable"),
    "failed": (500, "server_error"),
    "cancelled": (503, "service_unavailable"),
}


def from_outcome(kind: ErrorKind, message: str) -> OpenAIError:
    status, kind_type = _FROM_CONTROLLER[kind]
    return OpenAIError(status, message, kind_type, None, kind)
