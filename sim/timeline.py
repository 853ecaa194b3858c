"""What one simulated run did, kept as data for a picture (`fencepost sim --html`).

A Timeline is handed to a Simulation, which tells it each message as it leaves and
what became of each copy (delivered, fenced and why, lost, cut by a partition, gone
with a dead process), each client's arrival and what the client was handed (tokens,
the outcome), and, at the end, the disturbances the run injected and the violation if
one was found. It only listens: it draws nothing from the run's random streams and
changes no machine, so a run with a timeline is the run without one (same trace hash).

`data()` returns plain lists and dicts, compact enough for the long runs (700
requests over 100 s, about 100,000 messages): strings are put in tables once and
rows hold their indexes, and times are rounded to a tenth of a millisecond.
adapters/cli/timeline.py turns it into the self-contained HTML page.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

ROUND = 4  # decimals of a second kept: a tenth of a millisecond


def request_key(router_id: str, request_id: str) -> str:
    """A request's name across routers (their ids collide): "r3", or "a1:r3"."""
    return f"{router_id}:{request_id}" if router_id else request_id


@dataclass(slots=True)
class _Flight:
    """One copy of one message on its way (a duplicate or a replay is another)."""

    sent_s: float
    source: str  # lane ids
    target: str
    kind: str
    request: str | None  # the request key it is about, if any
    attempt: int
    index: int  # a token's index, else -1
    copy: str  # "", "duplicate", "replay" or "late"
    landed_s: float | None = None
    fate: str = "in flight"  # delivered, fenced <machine.reason>, lost, cut, gone


@dataclass(slots=True)
class _Request:
    key: str
    client: int
    router: str
    arrived_s: float
    first_token_s: float | None = None
    ended_s: float | None = None
    outcome: str | None = None
    tokens: int = 0


@dataclass
class Timeline:
    flights: list[_Flight] = field(default_factory=list)
    requests: dict[str, _Request] = field(default_factory=dict)
    routers: list[str] = field(default_factory=list)  # router places (lane order)
    workers: list[str] = field(default_factory=list)
    faults: list[tuple[str, float, float, str]] = field(default_factory=list)
    violation: str | None = None
    violation_s: float | None = None
    end_s: float = 0.0
    seed: int = 0
    swarm: str = ""

    # --- what the simulation tells it ---

    def sent(
        self,
        sent_s: float,
        source: str,
        target: str,
        message: object,
        request: str | None,
        copy: str = "",
    ) -> int:
        """One copy of a message leaves; returns its flight, for `landed` or `lost`."""
        assignment = getattr(message, "assignment", None)
        attempt = int(getattr(assignment, "attempt", 0) or 0)
        index = getattr(message, "index", None)
        flight = _Flight(
            sent_s,
            source,
            target,
            type(message).__name__,
            request,
            attempt,
            index if isinstance(index, int) else -1,
            copy,
        )
        self.flights.append(flight)
        return len(self.flights) - 1

    def lost(self, flight: int, at_s: float) -> None:
        """That copy never arrives: the network dropped it."""
        self.landed(flight, at_s, "lost by the network")

    def landed(self, flight: int, at_s: float, fate: str) -> None:
        """That copy arrived (delivered, fenced, to a process gone) or was cut."""
        f = self.flights[flight]
        f.landed_s, f.fate = at_s, fate

    def arrived(self, key: str, client: int, router: str, at_s: float) -> None:
        self.requests[key] = _Request(key, client, router, at_s)

    def handed(self, key: str, at_s: float, what: str) -> None:
        """The client was handed a token ("token") or its outcome (the reason)."""
        request = self.requests.get(key)
        if request is None:
            return
        if what == "token":
            request.tokens += 1
            if request.first_token_s is None:
                request.first_token_s = at_s
        else:
            request.ended_s, request.outcome = at_s, what

    def fault(self, lane: str, start_s: float, end_s: float, kind: str) -> None:
        self.faults.append((lane, start_s, end_s, kind))

    def failed(self, violation: str, at_s: float) -> None:
        self.violation, self.violation_s = violation, at_s

    # --- the picture's data ---

    def data(self) -> dict[str, Any]:
        end = self.end_s
        kinds = _Table()
        fates = _Table()
        lanes = _Table()
        keys = _Table()
        for router in self.routers:
            lanes.index(f"router {router}")
        for worker in self.workers:
            lanes.index(worker)
        clients = sorted({r.client for r in self.requests.values()}, key=_client_order)
        for client in clients:
            lanes.index(_client_lane(client))
        requests = []
        attempts: dict[tuple[str, int], list[Any]] = {}
        by_key = {}
        for request in self.requests.values():
            by_key[request.key] = keys.index(request.key)
            requests.append(
                [
                    by_key[request.key],
                    lanes.index(_client_lane(request.client)),
                    lanes.index(f"router {request.router}"),
                    _t(request.arrived_s),
                    _t(request.first_token_s),
                    _t(request.ended_s),
                    request.outcome or "open",
                    request.tokens,
                ]
            )
        messages: list[list[Any]] = []
        for f in self.flights:
            about = by_key.get(f.request, -1) if f.request is not None else -1
            landed = f.landed_s if f.landed_s is not None else end
            messages.append(
                [
                    _t(f.sent_s),
                    _t(landed),
                    lanes.index(f.source),
                    lanes.index(f.target),
                    kinds.index(f.kind),
                    about,
                    f.attempt,
                    f.index,
                    fates.index(f.fate),
                    f.copy,
                ]
            )
            if about >= 0 and f.attempt:
                worker = f.target if f.source.startswith("router") else f.source
                span = attempts.setdefault(
                    (f.request or "", f.attempt),
                    [about, f.attempt, lanes.index(worker), 0.0, 0.0],
                )
                span[3] = _t(f.sent_s) if not span[3] else min(span[3], _t(f.sent_s))
                span[4] = max(span[4], _t(landed))
        messages.sort(key=lambda m: m[0])
        faults = [
            [lanes.index(lane), _t(start), _t(min(stop, end) if math.isfinite(stop) else end), kind]
            for lane, start, stop, kind in self.faults
        ]
        return {
            "seed": self.seed,
            "swarm": self.swarm,
            "end": _t(end),
            "violation": None
            if self.violation is None
            else {
                "text": self.violation,
                "at": _t(self.violation_s),
                "requests": [by_key[k] for k in _mentioned(self.violation, list(by_key))],
                "lanes": [lanes.index(w) for w in self.workers if _names(self.violation, w)],
            },
            "lanes": lanes.items,
            "keys": keys.items,
            "kinds": kinds.items,
            "fates": fates.items,
            "requests": requests,
            "attempts": sorted(attempts.values(), key=lambda a: a[3]),
            "messages": messages,
            "faults": faults,
        }


class _Table:
    """Strings stored once; rows hold their index."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._at: dict[str, int] = {}

    def index(self, item: str) -> int:
        at = self._at.get(item)
        if at is None:
            at = self._at[item] = len(self.items)
            self.items.append(item)
        return at


def _t(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, ROUND)


def _client_lane(client: int) -> str:
    # A client cut by a router crash sends again as a new client, numbered below zero.
    return f"client {client}" if client >= 0 else f"client retry {-client}"


def _client_order(client: int) -> tuple[int, int]:
    return (0, client) if client >= 0 else (1, -client)


def _mentioned(text: str, keys: list[str]) -> list[str]:
    """The request keys a violation names ("r12"; with several routers, whose ids
    collide, every router's r12 unless the text says "b1:r12")."""
    found = []
    for router, rid in re.findall(r"(?:\b([\w-]+):)?\b(r\d+)\b", text):
        wanted = f"{router}:{rid}" if router else None
        found += [k for k in keys if k in (wanted, rid) or (not router and k.endswith(":" + rid))]
    return list(dict.fromkeys(found))


def _names(text: str, worker: str) -> bool:
    return re.search(rf"\b{re.escape(worker)}\b", text) is not None
