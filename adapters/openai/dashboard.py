"""The router's live cluster page: GET /dashboard (the page) and GET /dashboard.json (its data).

What it owns: the JSON a person reads about this router (its id, uptime and
counters), its workers (health, epoch, slots, the cache report each last sent)
and the requests in flight (phase, attempts, resumes, tokens); and a bounded
history of the router's counters, one Sample every INTERVAL_S for the last
WINDOW_S, from which the page draws fenced messages by kind and tokens/s. The
history is sampled by `Dashboard.run`, a task in the HTTP app's nursery, whether
anyone watches or not, so a page opened after an incident still shows it. Wall
clock readings live here, never in core/: the router is read only through
`Controller.statistics()` and `Router.open_requests()`, which return copies.

The page is one static document, dashboard.html beside this module, read once
and served as is: inline CSS, an inline script, an inline SVG chart; no build
step, nothing fetched but /dashboard.json from the same origin, and a
Content-Security-Policy that lets the browser enforce exactly that. The policy
names the page's one <style> and one <script> by their hashes, taken from the
file as read, so an edit to the page needs no edit here.

Keys. A browser sends no bearer token by itself, so a page behind the key could
never be opened by one. The page therefore holds no data and is open like
/health; its figures, /dashboard.json, are guarded exactly like /metrics
(auth.py: behind the key unless --metrics-public, judged the same by the front
door and the ASGI check). When /dashboard.json answers 401 the page asks for a
key once, keeps it in the tab's sessionStorage (gone when the tab closes, never
in a URL, a cookie or the server's logs) and sends it as `Authorization: Bearer`
with every poll. With no key configured (the default) it just works.
"""

from __future__ import annotations

import base64
import hashlib
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from adapters.runtime.controller import Controller, ControllerStatistics
from core.protocol import MAX_CACHE_KEYS
from core.router import RequestView, RouterStatistics, WorkerView

INTERVAL_S = 2.0  # one sample of the router's counters this often
WINDOW_S = 300.0  # ... kept this long
MAX_REQUEST_ROWS = 50  # the oldest open requests shown (the JSON says how many there are)
RATE_MIN_SPAN_S = 1.0  # tokens/s now: against the newest sample at least this old


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # wall clock, seconds
    tokens_delivered: int
    fenced: Mapping[str, int]  # a copy of the router's counts, by reason


class History:
    """The router's counters every interval_s over the last window_s (a bounded deque)."""

    def __init__(self, interval_s: float = INTERVAL_S, window_s: float = WINDOW_S) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.samples: deque[Sample] = deque(maxlen=math.ceil(window_s / interval_s) + 1)

    def record(self, stats: RouterStatistics, now: float) -> None:
        self.samples.append(Sample(now, stats.tokens_delivered, dict(stats.fenced)))

    def tokens_per_s(self, tokens_delivered: int, now: float) -> float | None:
        """Tokens delivered per second, from the newest sample a little older than now."""
        for sample in reversed(self.samples):
            span = now - sample.at
            if span >= RATE_MIN_SPAN_S:
                return max(0, tokens_delivered - sample.tokens_delivered) / span
        return None

    def series(self, now: float) -> dict[str, Any]:
        """Per interval: its end (seconds before now), tokens/s, and fences by reason."""
        pairs = list(zip(self.samples, list(self.samples)[1:], strict=False))
        ends: list[float] = []
        rates: list[float] = []
        fenced: dict[str, list[int]] = {}
        for i, (before, after) in enumerate(pairs):
            span = after.at - before.at
            ends.append(round(after.at - now, 3))
            tokens = after.tokens_delivered - before.tokens_delivered
            rates.append(round(max(0, tokens) / span, 2) if span > 0 else 0.0)
            for reason, count in after.fenced.items():
                delta = count - before.fenced.get(reason, 0)
                if delta > 0:
                    fenced.setdefault(reason, [0] * len(pairs))[i] = delta
        by_total = sorted(fenced.items(), key=lambda item: (-sum(item[1]), item[0]))
        return {
            "interval_s": self.interval_s,
            "window_s": self.window_s,
            "t": ends,
            "tokens_per_s": rates,
            "fenced": dict(by_total),
        }


def worker_row(view: WorkerView) -> dict[str, Any]:
    cache = view.cache
    report = None
    if cache is not None:
        hit = 1 - cache.computed_tokens / cache.prompt_tokens if cache.prompt_tokens else None
        pool = cache.total_blocks  # 0: a worker that does not say how its pool stands
        used = cache.total_blocks - cache.free_blocks - cache.cached_blocks
        report = {
            "block_size": cache.block_size,
            "total_blocks": pool or None,
            "used_blocks": used if pool else None,  # held by running sequences
            "cached_blocks": cache.cached_blocks if pool else None,  # kept for reuse only
            "free_blocks": cache.free_blocks if pool else None,
            "keys": len(cache.keys),  # full blocks offered for reuse (running or cached)
            "keys_capped": len(cache.keys) >= MAX_CACHE_KEYS,  # a report lists at most this
            "prompt_tokens": cache.prompt_tokens,
            "computed_tokens": cache.computed_tokens,
            "hit_rate": None if hit is None else round(hit, 4),
            "prefill_rate": round(cache.prefill_rate, 1),
            "spec_proposed": cache.spec_proposed,
            "spec_accepted": cache.spec_accepted,
            # tokens accepted per verification (each also delivers the model's own next one)
            "spec_mean_accepted": (
                round(cache.spec_accepted / cache.spec_rows, 2) if cache.spec_rows else None
            ),
        }
    return {
        "id": view.worker_id,
        "health": view.health.value,
        "healthy": view.healthy,
        "epoch": view.epoch,
        "slots": view.slots,
        "held": view.held,  # by this router's attempts
        "others": view.others,  # by other routers' work, as its heartbeat tells
        "free": view.reported_free_slots,  # as its last heartbeat reported
        "max_context": view.max_context,
        "placed": view.placed,
        "cache": report,
    }


def request_row(view: RequestView) -> dict[str, Any]:
    return {
        "id": view.request_id,
        "phase": view.phase.value,
        "worker": view.worker_id,
        "attempt": view.attempt,
        "resumes": view.resumes,
        "delivered": view.delivered,
        "max_new_tokens": view.max_new_tokens,
        "prompt_tokens": view.prompt_tokens,
        "handed_off_by": view.handed_off_by,
    }


def snapshot(
    stats: ControllerStatistics,
    requests: tuple[RequestView, ...],
    history: History,
    *,
    now: float,
    router_id: str,
    started_at: float,
) -> dict[str, Any]:
    """The body of /dashboard.json: what the page shows, from copies of the router's state."""
    router = stats.router
    series = history.series(now)
    return {
        "now": now,
        "router": {
            "id": router_id,
            "started_at": started_at,
            "uptime_s": round(now - started_at, 1),
            "open_streams": stats.open_streams,
            "queued": router.queued,
            "phases": router.requests_by_phase,
            "outcomes": router.outcomes,
            "tokens_delivered": router.tokens_delivered,
            "tokens_per_s": history.tokens_per_s(router.tokens_delivered, now),
            "retries": router.retries,
            "resumes": router.resumes,
            "handoffs": router.handoffs,
            "handoffs_back": router.handoffs_back,
            "fenced": router.fenced,  # since the router started
            "fenced_in_window": {k: sum(v) for k, v in series["fenced"].items()},
            "dropped_sends": stats.dropped_sends,
        },
        "workers": [worker_row(view) for view in router.workers],
        "requests": {
            "open": sum(router.requests_by_phase.values()),
            "rows": [request_row(view) for view in requests],
        },
        "history": series,
    }


class Dashboard:
    """The page, its data, and the sampling task; one per HTTP app."""

    def __init__(
        self,
        controller: Controller,
        clock: Callable[[], float] = time.time,
        history: History | None = None,
    ) -> None:
        self.controller = controller
        self.clock = clock
        self.history = history or History()
        self.started_at = clock()

    def sample(self, now: float | None = None) -> None:
        stats = self.controller.statistics().router
        self.history.record(stats, self.clock() if now is None else now)

    def data(self, now: float | None = None) -> dict[str, Any]:
        router = self.controller.router
        return snapshot(
            self.controller.statistics(),
            router.open_requests(MAX_REQUEST_ROWS),
            self.history,
            now=self.clock() if now is None else now,
            router_id=router.config.router_id,
            started_at=self.started_at,
        )

    async def run(self) -> None:
        """Sample every interval until cancelled (the app's nursery owns this task)."""
        while True:
            self.sample()
            await trio.sleep(self.history.interval_s)


def _hash(source: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode()).digest()).decode() + "'"


PAGE_FILE = Path(__file__).with_name("dashboard.html")
PAGE = PAGE_FILE.read_bytes()  # read once, served as is


def _element_text(page: str, tag: str) -> str:
    """What stands between the page's one <tag> and its </tag>: what the policy hashes."""
    start = page.index(f"<{tag}>") + len(tag) + 2
    return page[start : page.index(f"</{tag}>", start)]


_STYLE = _element_text(PAGE.decode(), "style")
_SCRIPT = _element_text(PAGE.decode(), "script")

# The browser runs only this script and style, and talks only to this server.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        f"default-src 'none'; script-src {_hash(_SCRIPT)}; style-src {_hash(_STYLE)}; "
        "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
DATA_HEADERS = {"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"}
