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

The page is one static document: inline CSS, an inline script, an inline SVG
chart; no build step, nothing fetched but /dashboard.json from the same origin,
and a Content-Security-Policy that lets the browser enforce exactly that.

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


_STYLE = """
:root { --bg: #f7f7f5; --fg: #1d232a; --muted: #6b7280; --line: #dcdcd8;
  --ok: #1b7f3b; --warn: #b45309; --bad: #b91c1c; --card: #ffffff; }
* { box-sizing: border-box; }
body { margin: 0; padding: 16px 20px; background: var(--bg); color: var(--fg);
  font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
header { display: flex; align-items: baseline; gap: 12px; margin-bottom: 12px; }
h1 { font-size: 18px; margin: 0; }
h2 { font-size: 13px; margin: 0 0 6px; text-transform: uppercase; letter-spacing: .04em;
  color: var(--muted); }
.muted { color: var(--muted); font-weight: normal; }
.status { margin-left: auto; padding: 2px 8px; border-radius: 10px; background: var(--line); }
.status.ok { background: #dcfce7; color: var(--ok); }
.status.bad { background: #fee2e2; color: var(--bad); }
.tiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(130px, 1fr));
  gap: 8px; margin-bottom: 14px; }
.tile { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: 8px 10px; }
.tile b { display: block; font-size: 20px; font-variant-numeric: tabular-nums; }
.tile span { color: var(--muted); }
section { margin-bottom: 14px; }
table { width: 100%; border-collapse: collapse; background: var(--card);
  border: 1px solid var(--line); font-variant-numeric: tabular-nums; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line);
  white-space: nowrap; }
th { font-weight: 600; color: var(--muted); background: #fafaf9; }
td.num, th.num { text-align: right; }
td.empty { color: var(--muted); font-style: italic; }
.pill { padding: 1px 7px; border-radius: 9px; font-size: 12px; }
.healthy, .streaming, .assigned { background: #dcfce7; color: var(--ok); }
.stuck, .offered, .received { background: #fef3c7; color: var(--warn); }
.silent, .gone { background: #fee2e2; color: var(--bad); }
.charts { display: grid; grid-template-columns: 2fr 1fr; gap: 14px; }
.chart { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: 8px; }
svg.plot { width: 100%; height: 170px; display: block; }
svg.plot text { font-size: 10px; fill: var(--muted); }
svg.plot .grid { stroke: var(--line); stroke-width: 1; }
svg.plot .series { fill: none; stroke-width: 1.6; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 12px; margin-top: 4px; }
.legend svg { width: 10px; height: 10px; vertical-align: -1px; margin-right: 4px; }
form { background: var(--card); border: 1px solid var(--line); border-radius: 6px;
  padding: 12px; margin-bottom: 14px; }
input { font: inherit; padding: 3px 6px; width: 22em; }
button { font: inherit; }
footer { color: var(--muted); margin-top: 8px; }
footer button { margin-left: 8px; }
"""

_SCRIPT = """
"use strict";
const KEY = "fencepost.dashboard.key";
const SVG = "http://www.w3.org/2000/svg";
const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2",
  "#db2777", "#65a30d", "#9333ea", "#ea580c", "#475569", "#0d9488"];
const colors = new Map();
const $ = (id) => document.getElementById(id);
let timer = null;

function color(kind) {
  if (!colors.has(kind)) colors.set(kind, PALETTE[colors.size % PALETTE.length]);
  return colors.get(kind);
}

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs || {})) node.setAttribute(name, value);
  return node;
}

function pill(text) {
  const td = el("td");
  td.append(el("span", text, "pill " + text));
  return td;
}

function num(value) {
  return el("td", value === null || value === undefined ? "\\u2013" : value, "num");
}

function duration(s) {
  s = Math.floor(s);
  const d = Math.floor(s / 86400), h = Math.floor(s % 86400 / 3600);
  const m = Math.floor(s % 3600 / 60), sec = s % 60;
  if (d) return d + "d " + h + "h";
  if (h) return h + "h " + m + "m";
  if (m) return m + "m " + sec + "s";
  return sec + "s";
}

function fill(table, rows, empty, columns) {
  const body = table.tBodies[0];
  if (!rows.length) {
    const td = el("td", empty, "empty");
    td.colSpan = columns;
    const tr = el("tr");
    tr.append(td);
    body.replaceChildren(tr);
    return;
  }
  body.replaceChildren(...rows);
}

function tile(id, value) { $(id).textContent = value; }

function status(text, cls) {
  const node = $("status");
  node.textContent = text;
  node.className = "status " + (cls || "");
}

function workerRows(workers) {
  return workers.map((w) => {
    const tr = el("tr");
    tr.dataset.worker = w.id;
    tr.dataset.health = w.health;
    const cache = w.cache;
    const used = w.held + w.others;
    const blocks = !cache ? null : cache.total_blocks === null ?
      cache.keys + (cache.keys_capped ? "+" : "") + " offered" :
      cache.used_blocks + " / " + cache.cached_blocks + " / " + cache.total_blocks;
    const lost = w.health === "silent" || w.health === "gone";  // its last report is stale
    const kv = num(lost ? null : blocks);
    if (cache) kv.title = cache.block_size + " tokens a block";
    const hit = cache && cache.hit_rate !== null ? (100 * cache.hit_rate).toFixed(1) + "%" : null;
    tr.append(el("td", w.id), pill(w.health), num(w.epoch),
      num(used + " / " + w.slots + (w.others ? " (" + w.others + " other)" : "")),
      num(lost ? null : w.free), num(w.placed), kv, num(hit),
      num(cache && cache.prefill_rate ? Math.round(cache.prefill_rate) : null));
    return tr;
  });
}

function requestRows(rows) {
  return rows.map((r) => {
    const tr = el("tr");
    tr.dataset.request = r.id;
    tr.dataset.phase = r.phase;
    const where = r.worker === null ? "\\u2013" :
      r.worker + (r.handed_off_by ? " (from " + r.handed_off_by + ")" : "");
    tr.append(el("td", r.id), pill(r.phase), el("td", where), num(r.attempt),
      num(r.resumes), num(r.delivered + " / " + r.max_new_tokens), num(r.prompt_tokens));
    return tr;
  });
}

function chart(node, t, series, windowS) {
  // drawn at the element's own size (no scaling), so text stays the page's size
  const W = Math.max(200, node.clientWidth || 600), H = 170, L = 34, R = 14, T = 8, B = 18;
  node.setAttribute("viewBox", "0 0 " + W + " " + H);
  let top = 1;
  for (const values of Object.values(series)) for (const v of values) top = Math.max(top, v);
  const x = (s) => L + (W - L - R) * (1 + s / windowS);
  const y = (v) => T + (H - T - B) * (1 - v / top);
  const parts = [];
  for (const f of [0, 0.5, 1]) {
    parts.push(svg("line", {x1: L, x2: W - R, y1: y(top * f), y2: y(top * f), class: "grid"}));
    const label = svg("text", {x: L - 4, y: y(top * f) + 3, "text-anchor": "end"});
    label.textContent = top * f >= 10 ? Math.round(top * f) : +(top * f).toFixed(1);
    parts.push(label);
  }
  for (let m = Math.floor(windowS / 60); m >= 0; m--) {
    const anchor = m ? (60 * m >= windowS ? "start" : "middle") : "end";
    const label = svg("text", {x: x(-60 * m), y: H - 4, "text-anchor": anchor});
    label.textContent = m ? "-" + m + "m" : "now";
    parts.push(label);
  }
  for (const [name, values] of Object.entries(series)) {
    const points = values.map((v, i) => x(t[i]).toFixed(1) + "," + y(v).toFixed(1));
    if (points.length === 1) points.push((x(t[0]) - 2) + "," + y(values[0]).toFixed(1));
    parts.push(svg("polyline", {points: points.join(" "), class: "series",
      stroke: name === "tokens/s" ? "#2563eb" : color(name)}));
  }
  node.replaceChildren(...parts);
}

function legend(node, totals) {
  const items = Object.entries(totals).map(([kind, n]) => {
    const span = el("span");
    span.dataset.kind = kind;
    const swatch = svg("svg", {viewBox: "0 0 10 10"});
    swatch.append(svg("rect", {width: 10, height: 10, fill: color(kind)}));
    span.append(swatch, document.createTextNode(kind + " " + n));
    return span;
  });
  if (!items.length) items.push(el("span", "nothing fenced in this window", "muted"));
  node.replaceChildren(...items);
}

function render(d) {
  const r = d.router;
  $("router-id").textContent = r.id ? "router " + r.id : "router";
  const healthy = d.workers.filter((w) => w.healthy).length;
  tile("t-uptime", duration(r.uptime_s));
  tile("t-workers", healthy + " / " + d.workers.length);
  tile("t-open", d.requests.open);
  tile("t-queued", r.queued);
  tile("t-tps", r.tokens_per_s === null ? "\\u2013" : r.tokens_per_s.toFixed(1));
  tile("t-tokens", r.tokens_delivered);
  tile("t-retries", r.retries + " / " + r.resumes);
  const fencedNow = Object.values(r.fenced_in_window).reduce((a, b) => a + b, 0);
  tile("t-fenced", fencedNow);
  fill($("workers"), workerRows(d.workers), "no worker has connected", 9);
  fill($("requests"), requestRows(d.requests.rows), "nothing in flight", 7);
  const shown = d.requests.rows.length;
  $("req-count").textContent = d.requests.open > shown ?
    "(oldest " + shown + " of " + d.requests.open + ")" : "(" + d.requests.open + ")";
  const h = d.history;
  chart($("fence-chart"), h.t, h.fenced, h.window_s);
  legend($("fence-legend"), r.fenced_in_window);
  chart($("tps-chart"), h.t, {"tokens/s": h.tokens_per_s}, h.window_s);
  const outcomes = Object.entries(r.outcomes).sort((a, b) => b[1] - a[1]).map(([k, n]) => {
    const tr = el("tr");
    tr.append(el("td", k), num(n));
    return tr;
  });
  fill($("outcomes"), outcomes, "none yet", 2);
  const fencedAll = Object.entries(r.fenced).sort((a, b) => b[1] - a[1]).map(([k, n]) => {
    const tr = el("tr");
    tr.append(el("td", k), num(n));
    return tr;
  });
  fill($("fenced"), fencedAll, "none yet", 2);
}

function askForKey(note) {
  $("main").hidden = true;
  $("key-form").hidden = false;
  $("key-note").textContent = note;
  status("needs an API key", "bad");
  $("key").focus();
}

async function poll() {
  clearTimeout(timer);
  const key = sessionStorage.getItem(KEY);
  const headers = key ? {Authorization: "Bearer " + key} : {};
  let reply;
  try {
    reply = await fetch("/dashboard.json", {headers, cache: "no-store"});
  } catch (error) {
    status("router unreachable; retrying", "bad");
    timer = setTimeout(poll, 2000);
    return;
  }
  if (reply.status === 401) {
    askForKey(key ? "that key was refused" : "");
    return;
  }
  if (!reply.ok) {
    status("HTTP " + reply.status + "; retrying", "bad");
    timer = setTimeout(poll, 2000);
    return;
  }
  const data = await reply.json();
  $("key-form").hidden = true;
  $("main").hidden = false;
  $("forget").hidden = !key;
  render(data);
  status("live", "ok");
  timer = setTimeout(poll, 1000);
}

$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const key = $("key").value.trim();
  $("key").value = "";
  if (key) sessionStorage.setItem(KEY, key);
  poll();
});
$("forget").addEventListener("click", () => {
  sessionStorage.removeItem(KEY);
  poll();
});
poll();
"""

_BODY = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>fencepost cluster</title>
<link rel="icon" href="data:,">
<style>{style}</style>
</head>
<body>
<header>
<h1>fencepost <span id="router-id" class="muted"></span></h1>
<span id="status" class="status">connecting&hellip;</span>
</header>
<form id="key-form" hidden>
<label>This port needs an API key:
<input id="key" type="password" autocomplete="off" spellcheck="false"></label>
<button type="submit">Show the cluster</button>
<span id="key-note" class="muted"></span>
<p class="muted">The key stays in this tab (sessionStorage) and goes only to this server,
as the Authorization header of each poll of /dashboard.json.</p>
</form>
<main id="main" hidden>
<section class="tiles">
<div class="tile"><b id="t-uptime">&ndash;</b><span>uptime</span></div>
<div class="tile"><b id="t-workers">&ndash;</b><span>workers healthy</span></div>
<div class="tile"><b id="t-open">&ndash;</b><span>requests open</span></div>
<div class="tile"><b id="t-queued">&ndash;</b><span>queued</span></div>
<div class="tile"><b id="t-tps">&ndash;</b><span>tokens/s</span></div>
<div class="tile"><b id="t-tokens">&ndash;</b><span>tokens delivered</span></div>
<div class="tile"><b id="t-retries">&ndash;</b><span>retries / resumes</span></div>
<div class="tile"><b id="t-fenced">&ndash;</b><span>fenced (5 min)</span></div>
</section>
<section>
<h2>Workers</h2>
<table id="workers"><thead><tr><th>worker</th><th>health</th><th class="num">epoch</th>
<th class="num">slots used</th><th class="num">free (reported)</th>
<th class="num">attempts placed</th><th class="num">KV blocks used / cached / all</th>
<th class="num">prefix hit rate</th><th class="num">prefill tok/s</th></tr></thead>
<tbody></tbody></table>
</section>
<section>
<h2>Requests in flight <span id="req-count" class="muted"></span></h2>
<table id="requests"><thead><tr><th>request</th><th>phase</th><th>worker</th>
<th class="num">attempt</th><th class="num">resumes</th><th class="num">tokens</th>
<th class="num">prompt</th></tr></thead><tbody></tbody></table>
</section>
<section class="charts">
<div class="chart"><h2>Fenced messages by kind, per 2 s, last 5 min</h2>
<svg id="fence-chart" class="plot"></svg><div id="fence-legend" class="legend"></div></div>
<div class="chart"><h2>Tokens/s, last 5 min</h2><svg id="tps-chart" class="plot"></svg></div>
</section>
<section class="charts">
<div><h2>Outcomes since start</h2><table id="outcomes"><tbody></tbody></table></div>
<div><h2>Fenced since start</h2><table id="fenced"><tbody></tbody></table></div>
</section>
</main>
<footer>Polls /dashboard.json every second.<button id="forget" hidden>Forget the key</button>
</footer>
<script>{script}</script>
</body>
</html>
"""

PAGE = _BODY.replace("{style}", _STYLE).replace("{script}", _SCRIPT).encode()
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
