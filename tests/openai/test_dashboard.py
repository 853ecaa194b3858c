"""The router's /dashboard: its data over a real controller, its guard, and a real browser.

The JSON tests drive a Controller with two in-process fake workers and read what a
person would read: worker rows with their health, slots and cache, the request in
flight with its phase, attempt and resume count after its worker is lost, fences per
interval. The guard tests run a real server: /dashboard.json is behind the key
exactly like /metrics (refused by the front door and by the ASGI check alike), the
page itself is open and holds no data. The browser tests run the page's own script
in Chromium against a real two-worker cluster of processes, and against a guarded
port where the page asks for the key.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import trio

from adapters.cli.serve import ServeOptions
from adapters.openai.dashboard import PAGE, Dashboard, History
from adapters.runtime.controller import Controller
from adapters.runtime.embedded import run_local_worker
from adapters.runtime.worker_host import FakeDecoder, WorkerHost
from core.config import RouterConfig
from core.protocol import Assignment, GenerationRequest, Token
from core.router import RouterStatistics
from core.worker import WorkerConfig
from tests.support.browser import INSTALL_HINT, chromium, find_chromium
from tests.support.http_helpers import ServerThread, chat_body
from tests.support.process_helpers import router_with_workers
from tests.support.runtime_helpers import kill_all, raw_connection, wait_until

KEY = "sk-fencepost-dashboard-0123456789"
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "images" / "dashboard.png"


def _stats(tokens: int, fenced: dict[str, int]) -> RouterStatistics:
    return RouterStatistics({}, 0, (), fenced, {}, tokens, 0, 0, 0)


def test_history_turns_counter_samples_into_rates_and_fences_per_interval() -> None:
    history = History(interval_s=2.0, window_s=10.0)
    assert history.tokens_per_s(0, 0.0) is None  # no sample yet: no rate to show
    history.record(_stats(0, {}), 100.0)
    history.record(_stats(40, {"late": 1}), 102.0)
    history.record(_stats(40, {"late": 1, "duplicate": 3}), 104.0)
    series = history.series(now=105.0)
    assert series["t"] == [-3.0, -1.0]
    assert series["tokens_per_s"] == [20.0, 0.0]
    assert series["fenced"] == {"duplicate": [0, 3], "late": [1, 0]}  # most first
    assert history.tokens_per_s(70, 105.0) == 30.0  # against the sample a second or more old
    for i in range(20):  # bounded: the window's samples and no more
        history.record(_stats(40 + i, {}), 106.0 + 2 * i)
    assert len(history.samples) == 6


def test_the_json_shows_workers_and_the_request_in_flight_through_a_resume() -> None:
    clock = [1000.0]

    async def main() -> None:
        controller = Controller(RouterConfig(router_id="r-test", heartbeat_timeout_s=30))
        dashboard = Dashboard(controller, clock=lambda: clock[0])
        scopes: dict[str, trio.CancelScope] = {}

        async def worker(name: str, *, task_status: trio.TaskStatus[WorkerHost]) -> None:
            with trio.CancelScope() as scopes[name]:
                config = WorkerConfig(name, slots=4, heartbeat_interval_s=0.05)
                decoder = FakeDecoder(step_s=0.01, ignore_eos=True)
                await run_local_worker(controller, config, decoder, task_status=task_status)

        async with trio.open_nursery() as nursery:
            await nursery.start(controller.run)
            for name in ("w1", "w2"):
                await nursery.start(worker, name)
            await wait_until(
                controller,
                lambda s: len(s.router.workers) == 2 and all(w.cache for w in s.router.workers),
            )
            dashboard.sample()
            stream = controller.submit(GenerationRequest("held-open", (5, 6, 7), 2000))
            await wait_until(  # tokens out, and a heartbeat's cache report has the prompt
                controller,
                lambda s: (
                    s.router.tokens_delivered >= 5
                    and any(w.cache is not None and w.cache.prompt_tokens for w in s.router.workers)
                ),
            )
            placed = controller.router.placement("held-open")
            assert placed is not None
            first, assignment = placed
            # a token for a request the router never had: fenced as late, and counted
            controller.from_worker(first, Token(Assignment("nobody", 1, "r-test"), 0, 1))
            clock[0] += 2
            dashboard.sample()
            data = dashboard.data()

            assert data["router"]["id"] == "r-test" and data["router"]["uptime_s"] == 2.0
            rows = {w["id"]: w for w in data["workers"]}
            assert sorted(rows) == ["w1", "w2"]
            assert {w["health"] for w in rows.values()} == {"healthy"}
            assert rows[first]["held"] == 1 and rows[first]["slots"] == 4
            assert sum(w["held"] for w in rows.values()) == 1
            cache = rows[first]["cache"]
            assert cache["prompt_tokens"] == 3 and cache["block_size"] > 0
            assert cache["used_blocks"] >= 1  # the running request's
            pool = cache["used_blocks"] + cache["cached_blocks"] + cache["free_blocks"]
            assert pool == cache["total_blocks"]
            [row] = data["requests"]["rows"]
            assert row["id"] == "held-open" and row["phase"] == "streaming"
            assert (row["worker"], row["attempt"], row["resumes"]) == (first, 1, 0)
            assert row["delivered"] >= 5 and row["max_new_tokens"] == 2000
            assert data["requests"]["open"] == 1
            assert data["router"]["fenced_in_window"] == {"late": 1}
            assert data["history"]["fenced"] == {"late": [1]}
            assert data["history"]["tokens_per_s"][0] >= 2.5  # 5 tokens or more in 2 s

            # its worker goes away: the stream resumes on the other, which the page shows
            scopes[first].cancel()
            other = "w2" if first == "w1" else "w1"
            await wait_until(
                controller,
                lambda s: (
                    controller.router.placement("held-open") not in (None, placed)
                    and s.router.requests_by_phase.get("streaming") == 1
                ),
            )
            data = dashboard.data()
            rows = {w["id"]: w for w in data["workers"]}
            assert rows[first]["health"] == "gone" and rows[other]["health"] == "healthy"
            [row] = data["requests"]["rows"]
            assert (row["worker"], row["attempt"], row["resumes"]) == (other, 2, 1)
            assert row["phase"] == "streaming" and assignment.attempt == 1
            stream.cancel()
            await wait_until(controller, lambda s: s.open_streams == 0)
            assert dashboard.data()["requests"] == {"open": 0, "rows": []}
            nursery.cancel_scope.cancel()

    trio.run(main)


# --- the guard: /dashboard.json behind the key like /metrics; the page open, data-free ---


@pytest.fixture(scope="module")
def guarded() -> Iterator[ServerThread]:
    with ServerThread(ServeOptions(port=0, fake=True, api_keys=(KEY,))) as server:
        yield server


def test_the_data_needs_the_key_and_the_page_is_open_without_any_data(
    guarded: ServerThread,
) -> None:
    base = guarded.base_url
    bearer = {"Authorization": f"Bearer {KEY}"}
    for path in ("/dashboard.json", "/metrics"):
        assert requests.get(f"{base}{path}", timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer sk-not-it"}
        assert requests.get(f"{base}{path}", headers=wrong, timeout=10).status_code == 401
        assert requests.get(f"{base}{path}", headers=bearer, timeout=10).status_code == 200
    data = requests.get(f"{base}/dashboard.json", headers=bearer, timeout=10).json()
    router_id = guarded.serving.controller.router.config.router_id
    assert data["router"]["id"] == router_id and data["workers"][0]["id"] == "local"

    page = requests.get(f"{base}/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert page.content == PAGE  # the same static bytes for everyone: nothing of the cluster
    assert router_id.encode() not in page.content
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy


def test_the_front_door_and_the_app_refuse_the_data_alike(guarded: ServerThread) -> None:
    port = guarded.serving.http_port
    head = "GET {} HTTP/1.1\r\nHost: x\r\n\r\n"

    async def ask() -> tuple[bytes, bytes]:
        # the first head is the front door's to judge ...
        alone = await raw_connection(port, head.format("/dashboard.json").encode())
        # ... a second on the same connection reaches Hypercorn, and the ASGI check
        both = head.format("/dashboard") + head.format("/dashboard.json")
        return alone, await raw_connection(port, both.encode())

    alone, both = trio.run(ask)
    assert alone.startswith(b"HTTP/1.1 401") and b"server: fencepost" in alone
    replies = re.findall(rb"HTTP/1.1 (\d+)", both)
    assert replies == [b"200", b"401"], both[:300]


def test_metrics_public_opens_the_data_with_metrics_and_nothing_else() -> None:
    options = ServeOptions(port=0, fake=True, api_keys=(KEY,), metrics_public=True)
    with ServerThread(options) as server:
        base = server.base_url
        for path in ("/dashboard.json", "/metrics", "/dashboard"):
            assert requests.get(f"{base}{path}", timeout=10).status_code == 200, path
        assert requests.get(f"{base}/v1/models", timeout=10).status_code == 401


def test_with_no_key_configured_the_dashboard_just_works() -> None:
    with ServerThread() as server:
        data = requests.get(f"{server.base_url}/dashboard.json", timeout=10).json()
        assert [w["health"] for w in data["workers"]] == ["healthy"]


# --- a real browser ---


def _need_chromium() -> None:
    if find_chromium() is None:
        pytest.skip(INSTALL_HINT)


class _SlowStreams:
    """Streaming chat requests read in background threads until stopped."""

    def __init__(self, base: str, count: int) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._read, args=(base,)) for _ in range(count)]
        for thread in self._threads:
            thread.start()

    def _read(self, base: str) -> None:
        body = chat_body(max_tokens=1500, stream=True)
        try:
            url = f"{base}/v1/chat/completions"
            with requests.post(url, json=body, stream=True, timeout=60) as reply:
                for _ in reply.iter_content(None):
                    if self._stop.is_set():
                        return
        except requests.RequestException:
            return  # the cluster was stopped under it

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)


def test_the_page_shows_a_live_two_worker_cluster_and_asks_only_its_server(
    tmp_path: Path,
) -> None:
    _need_chromium()
    processes: list[subprocess.Popen[str]] = []
    streams: _SlowStreams | None = None
    try:
        base, _ = router_with_workers(
            processes,
            ["--fake", "--heartbeat-timeout", "10"],
            ["--fake", "--fake-step-ms", "25", "--fake-ignore-eos"],
        )
        streams = _SlowStreams(base, 3)
        with chromium() as page:
            page.open(f"{base}/dashboard", width=1200, height=800)
            page.wait_for(
                "document.querySelectorAll('#workers tr[data-health=\"healthy\"]').length === 2"
                " && document.querySelectorAll('#requests tr[data-phase=\"streaming\"]')"
                ".length >= 1",
                timeout_s=30,
            )
            workers = page.evaluate(
                "[...document.querySelectorAll('#workers tbody tr')].map("
                "r => [r.cells[0].textContent, r.cells[1].textContent])"
            )
            assert sorted(workers) == [["w1", "healthy"], ["w2", "healthy"]]
            # kill -9 the worker of the oldest stream: the page follows it to the other
            row = "document.querySelector('#requests tbody tr')"
            victim = page.evaluate(f"{row}.cells[2].textContent")
            survivor = {"w1": "w2", "w2": "w1"}[victim]
            processes[1 if victim == "w1" else 2].send_signal(signal.SIGKILL)
            page.wait_for(
                f"document.querySelector('#workers tr[data-worker=\"{victim}\"]')"
                ".dataset.health !== 'healthy'"
                f" && {row}.cells[2].textContent === '{survivor}'"
                f" && {row}.cells[4].textContent === '1'",  # resumes
                timeout_s=30,
            )
            # a few samples of history, so the charts have lines to draw
            page.wait_for("document.querySelector('#tps-chart polyline')?.points.length >= 3", 30)
            assert page.evaluate("document.getElementById('t-tps').textContent") != "\u2013"
            shot = tmp_path / "dashboard.png"
            page.screenshot(shot)
            assert page.errors == []
            assert page.requested and all(url.startswith(f"{base}/") for url in page.requested)
        assert shot.read_bytes().startswith(b"\x89PNG")
        if os.environ.get("FENCEPOST_SCREENSHOTS") == "1":
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, SCREENSHOT)
    finally:
        kill_all(processes)
        if streams is not None:
            streams.stop()


def test_on_a_guarded_port_the_page_asks_for_the_key_once_and_keeps_it_out_of_urls(
    guarded: ServerThread,
) -> None:
    _need_chromium()
    form_shown = "!document.getElementById('key-form').hidden"
    submit = (
        "document.getElementById('key').value = {!r};"
        "document.getElementById('key-form').requestSubmit(); true"
    )
    with chromium() as page:
        page.open(f"{guarded.base_url}/dashboard", width=1200, height=800)
        page.wait_for(form_shown)
        page.evaluate(submit.format("sk-wrong"))
        page.wait_for("document.getElementById('key-note').textContent === 'that key was refused'")
        page.evaluate(submit.format(KEY))
        page.wait_for("document.querySelectorAll('#workers tr[data-worker=\"local\"]').length")
        assert page.evaluate(form_shown) is False
        assert page.evaluate("document.getElementById('key').value") == ""
        page.open(f"{guarded.base_url}/dashboard", width=1200, height=800)  # a reload
        page.wait_for("document.querySelectorAll('#workers tr[data-worker=\"local\"]').length")
        assert not any(KEY in url for url in page.requested)
        # the two refusals are the only errors: the browser logs each 401 it fetched
        assert all("401" in error for error in page.errors), page.errors
