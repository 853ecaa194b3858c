"""`fencepost bench store`: what keeping a response costs, per state store.

For each store named (memory, sqlite:PATH, postgresql://...), a router with an
instant fake model serves N /v1/responses requests with `store: true` and N
with `store: false`, alternating one by one on one keep-alive connection
(so noise falls on both alike), plain and streamed. It prints each kind's
p50 and p99 latency and the difference, the store's added latency.
Everything runs on 127.0.0.1; the fake model answers in microseconds, so what
is left is the HTTP layer and the store.
"""

from __future__ import annotations

import http.client
import json
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trio

TOKENS = 16  # output tokens per response


def _serve_in_thread(store: str) -> tuple[int, trio.Event, threading.Thread, Any]:
    from adapters.cli.serve import ServeOptions, build_model, serve

    options = ServeOptions(port=0, fake=True, state_store=store)
    model, decoder = build_model(options)
    ready: queue.Queue[Any] = queue.Queue()
    token: list[Any] = []

    async def main() -> None:
        stop = trio.Event()
        token.append((trio.lowlevel.current_trio_token(), stop))
        async with trio.open_nursery() as nursery:
            ready.put(await nursery.start(serve, options, model, decoder, stop))

    thread = threading.Thread(target=trio.run, args=(main,), daemon=True)
    thread.start()
    serving = ready.get(timeout=120)
    trio_token, stop = token[0]
    return serving.http_port, stop, thread, trio_token


def _percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def _one(connection: http.client.HTTPConnection, body: bytes) -> float:
    began = time.perf_counter()
    connection.request("POST", "/v1/responses", body, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    data = reply.read()  # a stream is read to its end
    if reply.status != 200:
        raise RuntimeError(f"{reply.status}: {data[:200]!r}")
    return time.perf_counter() - began


def measure(store: str, count: int) -> dict[str, tuple[float, float]]:
    """(p50, p99) in ms for each of stored/unstored x plain/streamed."""
    port, stop, thread, trio_token = _serve_in_thread(store)
    try:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        times: dict[str, list[float]] = {}
        for stream in (False, True):
            for i in range(count * 2 + 20):
                stored = i % 2 == 0
                body = {"model": "fake", "input": f"question {i}", "max_output_tokens": TOKENS,
                        "store": stored, "stream": stream}  # fmt: skip
                took = _one(connection, json.dumps(body).encode())
                if i >= 20:  # the first few warm the path
                    kind = f"{'stored' if stored else 'unstored'} {'stream' if stream else 'plain'}"
                    times.setdefault(kind, []).append(took * 1000)
        connection.close()
        return {k: (_percentile(v, 0.5), _percentile(v, 0.99)) for k, v in times.items()}
    finally:
        trio.from_thread.run_sync(stop.set, trio_token=trio_token)
        thread.join(30)


def main(stores: list[str], count: int) -> int:
    print(f"{count} responses of {TOKENS} tokens per kind, stored and not alternating; "
          "latency in ms (p50 / p99)")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        named = [s.replace("sqlite:TEMP", f"sqlite:{Path(folder) / 'bench.db'}") for s in stores]
        print(f"{'store':<34} {'kind':<8} {'unstored':>17} {'stored':>17} {'added p50/p99':>17}")
        for store, shown in zip(named, stores, strict=True):
            figures = measure(store, count)
            for kind in ("plain", "stream"):
                off, on = figures[f"unstored {kind}"], figures[f"stored {kind}"]
                added = (on[0] - off[0], on[1] - off[1])
                label = shown if "@" not in shown else shown.split("@")[-1]
                cells = f"{off[0]:7.2f} / {off[1]:7.2f} {on[0]:7.2f} / {on[1]:7.2f}"
                print(f"{label:<34} {kind:<8} {cells} {added[0]:+7.2f} / {added[1]:+7.2f}")
    return 0
