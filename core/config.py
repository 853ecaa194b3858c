"""The router's configuration: identity, deadlines, bounds and placement policy.

One frozen struct, read by every part of the router machine (core/router.py,
core/requests.py and the modules under it, core/fleet.py and core/slots.py)
and by the runtime and the simulator that build routers. It lives apart from
the router so that those parts import it downward, never from the module that
assembles them.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

__all__ = ["RouterConfig"]


class RouterConfig(Struct, frozen=True):
    # This router's identity, carried by every assignment it makes. Routers that
    # share workers need distinct ones (a restarted router, a new one): the runtime
    # draws it at start. A lone router may leave it empty.
    router_id: str = ""
    offer_timeout_s: float = 2.0
    heartbeat_timeout_s: float = 3.0
    resend_interval_s: float = 0.1  # at most one Resend per request this often
    max_attempts: int = 3
    queue_limit: int = 256
    max_resumes: int = 2  # continuations after the first token; 0 = never resume
    # Progress deadlines of an accepted attempt (a decoder can hang while its worker
    # heartbeats): its first token within first_token_timeout_s plus
    # prefill_timeout_per_token_s per context token (prompt and output prefix), each
    # next token within token_timeout_s. A miss fails the attempt over (or resumes it)
    # and marks the worker stuck: no offers until it shows progress, or for
    # stuck_probe_s, after which it may try again.
    first_token_timeout_s: float = 20.0
    prefill_timeout_per_token_s: float = 0.05
    token_timeout_s: float = 10.0
    stuck_probe_s: float = 30.0
    # Placement. "cache-aware" ranks fitting workers with a free slot by predicted
    # time to first token: (prefill tokens already placed there and not yet past
    # their first token + this request's tokens that worker's reported prefix
    # cache lacks) / its reported prefill rate. A report older than
    # cache_report_max_age_s, or from an earlier epoch, counts as empty.
    # "least-loaded" ranks by held slots only.
    routing: Literal["cache-aware", "least-loaded"] = "cache-aware"
    cache_report_max_age_s: float = 3.0
    default_prefill_rate: float = 1000.0  # tokens/s, for a worker that reports none
