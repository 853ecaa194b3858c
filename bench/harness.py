"""What the process-level benches share: servers under test, ports, prompts, figures.

`fencepost bench serve` and `fencepost bench drill` (and the real-model resume
check) start `fencepost` processes on 127.0.0.1, wait for them, read their
/metrics and stop them; the same prompts drive both load runs so their
figures compare. Everything here is loopback-only and bounded in time.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import trio

# `fencepost` as a child process: the code of this tree, whatever is installed.
FENCEPOST = (sys.executable, "-m", "adapters.cli")

PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe a walk through a busy market in a coastal town.",
    "Write a detailed guide to planting and caring for a vegetable garden.",
    "Tell the history of the bicycle from its invention to today.",
    "Write a letter from a sailor to his family describing a storm at sea.",
    "Explain how bread is made, from wheat in the field to the loaf.",
    "Describe the life cycle of a star in as much detail as you can.",
    "Write a story about a robot learning to paint.",
    "Explain why the sky is blue and sunsets are red.",
    "Describe how a city changes over one day, from dawn to midnight.",
    "Write a long poem about autumn in the mountains.",
    "Explain how computers store numbers and text.",
    "Tell a story about two friends building a boat.",
    "Describe how bees make honey and why they matter.",
    "Write an essay about the importance of libraries.",
]

# Words for long prompts: common English words, one token each to most tokenizers.
FILLER_TEXT = (
    "the river ran past the old mill and the town where people met each morning to "
    "trade bread fish wool and news of the roads the hills the weather and the ships "
    "that came in from the sea with salt iron and letters from far away"
)
FILLER = tuple(FILLER_TEXT.split())


def long_prompt(index: int, words: int) -> str:
    """A prompt of about `words` tokens, different from the first word on for each
    `index` (so that no server reuses another request's cached prefix), ending with
    PROMPTS' request."""
    start = index * 7 % len(FILLER)
    body = " ".join(FILLER[(start + k) % len(FILLER)] for k in range(words))
    return f"Note {index}: {body}. {PROMPTS[index % len(PROMPTS)]}"


def log_folder(bench: str) -> Path:
    """A fresh folder for this run's server logs, under $TMPDIR."""
    folder = Path(os.environ.get("TMPDIR", "/tmp")) / f"fencepost-{bench}-{os.getpid()}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def memory_mb(pid: int, field: str = "VmRSS") -> float:
    """A memory figure of /proc/PID/status (VmRSS, VmHWM) in MB; nan once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    match = re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """A server process under test: started, waited for, measured, stopped."""

    def __init__(self, name: str, command: list[str], port: int, log: Path) -> None:
        self.name, self.port = name, port
        self.log = log
        env = os.environ | {"HF_HUB_OFFLINE": "1"}
        with log.open("wb") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=out, env=env)

    def wait_ready(self, timeout_s: float, path: str = "/health") -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s}s; see {self.log}")

    def peak_rss_mb(self) -> float:
        return memory_mb(self.process.pid, "VmHWM")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


async def series(port: int) -> dict[str, float]:
    """Every /metrics series by its full name, labels included (`name{kind="x"}`)."""

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    text = await trio.to_thread.run_sync(get)
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            found[name] = float(value)
    return found


async def scrape(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """The named /metrics series, each summed over its labels."""
    found: dict[str, float] = {}
    for full, value in (await series(port)).items():
        name = full.split("{", 1)[0]
        if name in names:
            found[name] = found.get(name, 0.0) + value
    return found


SETTLING = ("fencepost_active_requests", "fencepost_slots_used", "fencepost_healthy_workers")


async def settled_scrape(
    port: int, names: tuple[str, ...], healthy: int, timeout_s: float = 60
) -> dict[str, float]:
    """The named series (SETTLING among them) once the server has settled: no request
    open, no slot held and `healthy` workers; past timeout_s, as they stand then (the
    report shows what did not settle)."""
    wanted = tuple(dict.fromkeys((*names, *SETTLING)))
    with trio.move_on_after(timeout_s):
        while True:
            found = await scrape(port, wanted)
            busy = found.get("fencepost_active_requests") or found.get("fencepost_slots_used")
            if found.get("fencepost_healthy_workers") == healthy and not busy:
                return found
            await trio.sleep(0.1)
    return await scrape(port, wanted)


def wait_for_workers(port: int, count: int, timeout_s: float) -> None:
    """Until the server at `port` counts `count` healthy workers."""
    deadline = time.monotonic() + timeout_s
    healthy = ("fencepost_healthy_workers",)
    while trio.run(scrape, port, healthy).get("fencepost_healthy_workers", 0) < count:
        if time.monotonic() > deadline:
            raise RuntimeError("the workers never registered")
        time.sleep(0.2)
