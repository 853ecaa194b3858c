"""Shared pieces for the tests that run `fencepost` as real processes on 127.0.0.1.

Nothing here waits a fixed time: every wait is for a condition, bounded by a
timeout generous enough for a loaded 2-core machine starting Python processes.
Which worker serves a stream is asked of the workers, as an operator would,
never assumed from the order they started in.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import requests


class LogWatcher:
    """Collects a process's stderr lines and finds values in them."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        assert process.stderr is not None
        stream = process.stderr
        threading.Thread(target=lambda: self.lines.extend(stream), daemon=True).start()

    def find(self, pattern: str, timeout_s: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if match := re.search(pattern, line):
                    return match
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{pattern!r} not logged; log so far:\n{''.join(self.lines)}")


def fencepost(*args: str) -> subprocess.Popen[str]:
    """A fencepost command; a router keeps its state in memory unless told otherwise
    (so tests never write to the user's own store)."""
    command = [sys.executable, "-m", "adapters.cli", *args]
    env = {"FENCEPOST_STATE_STORE": "memory"} | dict(os.environ)
    return subprocess.Popen(
        command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
    )


def wait_for(condition: Callable[[], bool], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not so after {timeout_s} s"
        time.sleep(0.05)


def healthy_workers(base: str) -> int:
    return int(requests.get(f"{base}/health", timeout=10).json()["healthy_workers"])


def metric(base: str, name: str) -> float:
    """One unlabelled figure from a /metrics page (a router's or a worker's)."""
    text = requests.get(f"{base}/metrics", timeout=10).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found is not None, f"{name} not in /metrics:\n{text}"
    return float(found.group(1))


def worker_health(log: LogWatcher, timeout_s: float = 300) -> str:
    """The base URL of a worker started with `--health-listen 127.0.0.1:0` (its log;
    a real model loads first, parsing its GGUF on a cold cache)."""
    port = log.find(r"metrics on http://127\.0\.0\.1:(\d+)", timeout_s).group(1)
    return f"http://127.0.0.1:{port}"


def serving_worker(health: Sequence[str], timeout_s: float = 30) -> int:
    """Which of these workers (by their health URLs) decodes the one stream in flight:
    the index of the only one whose /metrics counts an active assignment."""
    found: list[int] = []

    def one_active() -> bool:
        found[:] = [i for i, base in enumerate(health) if metric(base, "fencepost_worker_active")]
        return len(found) == 1

    wait_for(one_active, timeout_s)
    return found[0]


def router_with_workers(
    processes: list[subprocess.Popen[str]], serve: Sequence[str], worker: Sequence[str]
) -> tuple[str, list[str]]:
    """Start `fencepost serve` (no local worker, a worker port; `serve`: its other
    flags) and two workers w1, w2 connected to it (`worker`: their other flags),
    each appended to `processes` so the caller's cleanup kills them; return once both
    are healthy: (the router's base URL, the workers' health URLs, in order)."""
    processes.append(fencepost(
        "serve", "--port", "0", "--no-local-worker", "--worker-listen", "127.0.0.1:0", *serve
    ))  # fmt: skip
    log = LogWatcher(processes[-1])
    port = log.find(r"serving \S+ on http://127\.0\.0\.1:(\d+)/v1", 300)[1]
    base = f"http://127.0.0.1:{port}"
    worker_port = log.find(r"accepting workers on 127\.0\.0\.1:(\d+)")[1]
    health = []
    for worker_id in ("w1", "w2"):
        processes.append(fencepost(
            "worker", "--connect", f"127.0.0.1:{worker_port}", "--worker-id", worker_id,
            "--heartbeat-interval", "0.25", "--health-listen", "127.0.0.1:0", *worker,
        ))  # fmt: skip
        health.append(worker_health(LogWatcher(processes[-1])))
    wait_for(lambda: healthy_workers(base) == 2, timeout_s=300)
    return base, health


def kill_the_serving_worker_after_a_token(
    chunks: Iterator[Any], processes: Sequence[subprocess.Popen[str]], health: Sequence[str]
) -> str:
    """Read a chat stream until the client has text (from there on a loss is a resume),
    then kill -9 the worker that decodes it (asked of the workers: the router places a
    stream where it likes, by cache and load), wherever it is in the answer. Workers are
    processes[1:], in the order of `health`. -> the text read so far."""
    text = ""
    while not text:
        text += next(chunks).choices[0].delta.content or ""
    processes[1 + serving_worker(health)].send_signal(signal.SIGKILL)
    return text
