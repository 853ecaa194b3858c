"""`fencepost bench serve`: streaming clients against a served model on 127.0.0.1.

Starts `fencepost serve` as a separate process, drives it with N concurrent
streaming clients (each sends `rounds` requests one after another; the run is
bounded in count and by --time-limit), and prints time to first token and
inter-token latency (p50/p99), aggregate completion tokens/s, errors and the
server's peak RSS. --mixed adds slow readers and clients that hang up
mid-stream beside the fast ones, and compares the fast clients' latency with
the clean run at the same concurrency; afterwards the server must hold no
request and no slot. With the real model the same requests then run on the
engine alone, in this process, for the HTTP + router overhead. --baselines
adds, in the same run and with the same load, the naive sequential-generate
server (adapters/bench_naive.py) and `transformers serve --continuous-batching`.

Every request is greedy (temperature 0) so every system does the same work.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from adapters.loadgen import FAST, ClientBehaviour, StreamResult, stream_chat

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
SLOW = ClientBehaviour(slow_read_s=0.2, slow_read_bytes=512, receive_buffer=4096)
HANG_UP = ClientBehaviour(hang_up_after=5)


@dataclass
class Level:
    label: str
    concurrency: int
    results: list[StreamResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results)

    @property
    def rate(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.results if r.error is not None]

    def ttft(self, q: float) -> float:
        return percentile([r.ttft_s for r in self.results if r.ttft_s is not None], q)

    def itl(self, q: float) -> float:
        return percentile([g for r in self.results for g in r.gaps_s], q)

    def row(self) -> str:
        return (
            f"  {self.label:34} {self.concurrency:3d}  {self.ttft(50):7.3f} {self.ttft(99):7.3f}"
            f"  {self.itl(50) * 1000:7.1f} {self.itl(99) * 1000:7.1f}  {self.rate:8.1f}"
            f"  {len(self.errors):3d}"
        )


HEADER = "  system / run                        N   ttft p50  p99 s  itl p50  p99 ms  tokens/s  err"


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


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

    def wait_ready(self, timeout_s: float) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s}s; see {self.log}")

    def peak_rss_mb(self) -> float:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return float("nan")
        match = re.search(r"VmHWM:\s+(\d+) kB", status)
        return int(match.group(1)) / 1024 if match else float("nan")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


async def run_level(
    port: int,
    label: str,
    concurrency: int,
    tokens: int,
    rounds: int,
    time_limit_s: float,
    model: str,
    extra: list[ClientBehaviour] | None = None,
) -> Level:
    level = Level(label, concurrency)

    def body(i: int) -> dict[str, Any]:
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        return {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}

    fast_left = concurrency

    async def fast_client(i: int) -> None:
        nonlocal fast_left
        for r in range(rounds):
            level.results.append(
                await stream_chat("127.0.0.1", port, body(i * rounds + r), FAST, time_limit_s)
            )
        fast_left -= 1
        if not fast_left:  # throughput is the fast clients' own; others may still be reading
            level.wall_s = time.perf_counter() - began

    async def other_client(i: int, behaviour: ClientBehaviour) -> None:
        await stream_chat("127.0.0.1", port, body(i), behaviour, time_limit_s)

    began = time.perf_counter()
    with trio.move_on_after(time_limit_s):
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(fast_client, i)
            for j, behaviour in enumerate(extra or []):
                nursery.start_soon(other_client, 1000 + j, behaviour)
    level.wall_s = level.wall_s or time.perf_counter() - began
    return level


async def scrape(port: int, names: tuple[str, ...]) -> dict[str, float]:
    import urllib.request

    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return str(reply.read().decode())

    text = await trio.to_thread.run_sync(get)
    found: dict[str, float] = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + " ") or line.startswith(name + "{"):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def engine_only(
    model_path: str | None, concurrency: int, tokens: int, rounds: int, threads: int | None
) -> float:
    """The same greedy requests on the engine alone (no HTTP, no router): tokens/s."""
    import torch

    from adapters.engine.engine import Engine
    from adapters.engine.model import load_model
    from adapters.openai.models import ChatModel
    from adapters.openai.normalize import ChatMessage
    from adapters.runtime.worker_host import default_threads
    from core.batching import BatchLimits
    from core.protocol import Assignment, Decoded, DecodeDone, GenerationRequest, Sampling

    loaded = load_model(model_path, quiet=True)
    engine = Engine(loaded, BatchLimits(max_seqs=concurrency, max_context=2048))
    # the same torch threads as the server's engine thread had
    torch.set_num_threads(threads or default_threads(engine.device.type) or torch.get_num_threads())
    chat = ChatModel("bench", loaded.tokenizer, 2048)  # the server's own chat tokenizing
    pending = []
    for i in range(concurrency * rounds):
        prompt = chat.tokenize_chat([ChatMessage("user", PROMPTS[i % len(PROMPTS)])])
        pending.append(GenerationRequest(f"e{i}", tuple(prompt), tokens, Sampling(0.0)))
    pending.reverse()

    def start_next() -> None:
        if pending:
            request = pending.pop()
            engine.start(Assignment(request.request_id, 1), request)

    for _ in range(concurrency):
        start_next()
    produced = 0
    began = time.perf_counter()
    while engine.has_work():
        for event in engine.step():
            if isinstance(event, Decoded):
                produced += 1
            elif isinstance(event, DecodeDone):
                start_next()
    return produced / (time.perf_counter() - began)


def main(
    model_path: str | None,
    fake: bool,
    levels: list[int],
    tokens: int,
    rounds: int,
    time_limit_s: float,
    mixed: bool,
    baselines: bool,
    threads: int | None,
) -> int:
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"fencepost-bench-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    top = max(levels)
    port = free_port()
    extras = 2 * max(1, top // 4) if mixed else 0  # slow and hang-up clients get slots too
    command = [sys.executable, "-m", "adapters.cli", "serve", "--port", str(port),
               "--served-model-name", "bench", "--slots", str(top + extras)]  # fmt: skip
    command += ["--fake", "--fake-step-ms", "10"] if fake else []
    command += ["--model", model_path] if model_path else []
    command += ["--threads", str(threads)] if threads else []
    print(f"fencepost bench serve: {tokens} tokens per request, {rounds} request(s) per client,"
          f" greedy; {os.cpu_count()} CPUs; torch threads {threads or 'default'};"
          f" logs in {logs}", flush=True)  # fmt: skip
    server = Server("fencepost", command, port, logs / "fencepost.log")
    rows: list[Level] = []
    leaked: dict[str, float] = {}
    try:
        server.wait_ready(600)
        trio.run(run_level, port, "warm-up", 1, 8, 1, time_limit_s, "bench")
        for c in levels:
            rows.append(trio.run(run_level, port, "fencepost", c, tokens, rounds, time_limit_s,
                                 "bench"))  # fmt: skip
            print(rows[-1].row(), flush=True)
        if mixed:
            extra = [SLOW] * max(1, top // 4) + [HANG_UP] * max(1, top // 4)
            label = f"fencepost + {top // 4 or 1} slow, {top // 4 or 1} hang-up"
            rows.append(trio.run(run_level, port, label, top, tokens, rounds, time_limit_s,
                                 "bench", extra))  # fmt: skip
            print(rows[-1].row(), flush=True)
            time.sleep(2)  # let the hung-up requests' cancellations land
            leaked = trio.run(scrape, port, ("fencepost_active_requests", "fencepost_slots_used"))
        rss = server.peak_rss_mb()
    finally:
        server.stop()
    engine_rate = None
    if not fake:
        engine_rate = engine_only(model_path, top, tokens, rounds, threads)
    base_rows: list[Level] = []
    if baselines and not fake:
        base_rows = run_baselines(model_path, levels, tokens, rounds, time_limit_s, threads, logs)
    report(rows, base_rows, levels, mixed, leaked, rss, engine_rate)
    return 0


def run_baselines(
    model_path: str | None,
    levels: list[int],
    tokens: int,
    rounds: int,
    time_limit_s: float,
    threads: int | None,
    logs: Path,
) -> list[Level]:
    out = []
    port = free_port()
    naive = [sys.executable, "-m", "adapters.cli", "bench", "naive-server", "--port", str(port)]
    naive += ["--model", model_path] if model_path else []
    naive += ["--threads", str(threads)] if threads else []
    server = Server("naive", naive, port, logs / "naive.log")
    try:
        server.wait_ready(600)
        trio.run(run_level, port, "warm-up", 1, 8, 1, time_limit_s, "bench")
        for c in sorted({1, min(4, max(levels))}):  # sequential: more clients only queue
            level = trio.run(run_level, port, "naive sequential generate", c, tokens, 1,
                             time_limit_s, "bench")  # fmt: skip
            print(level.row(), flush=True)
            out.append(level)
    finally:
        server.stop()
    peer = shutil.which("transformers", path=str(Path(sys.executable).parent))
    hf_dir = _hf_directory(model_path)
    if peer is None or hf_dir is None:
        print("  transformers serve: not available (pip install 'transformers[serving]')")
        return out
    port = free_port()
    command = [peer, "serve", "--continuous-batching", "--device", "cpu", "--port", str(port),
               "--host", "127.0.0.1", str(hf_dir)]  # fmt: skip
    server = Server("transformers serve", command, port, logs / "transformers-serve.log")
    try:
        server.wait_ready(600)
        trio.run(run_level, port, "warm-up", 1, 8, 1, time_limit_s, str(hf_dir))
        for c in sorted({1, max(levels)}):
            level = trio.run(run_level, port, "transformers serve --cb", c, tokens, rounds,
                             time_limit_s, str(hf_dir))  # fmt: skip
            print(level.row(), flush=True)
            out.append(level)
    except RuntimeError as error:
        print(f"  transformers serve: {error}")
    finally:
        server.stop()
    return out


def _hf_directory(model_path: str | None) -> Path | None:
    """An HF directory of the model: given, or the engine's dequantized cache of the GGUF."""
    from adapters.engine.model import load_model

    if model_path is not None and Path(model_path).is_dir():
        return Path(model_path)
    loaded = load_model(model_path, quiet=True)
    source = Path(loaded.source)
    return source if source.is_dir() else None


def report(
    rows: list[Level],
    base_rows: list[Level],
    levels: list[int],
    mixed: bool,
    leaked: dict[str, float],
    rss_mb: float,
    engine_rate: float | None,
) -> None:
    print()
    print(HEADER)
    for row in [*rows, *base_rows]:
        print(row.row())
    print(f"  fencepost server peak RSS: {rss_mb:.0f} MB")
    clean = {r.concurrency: r for r in rows if r.label == "fencepost"}
    top = max(levels)
    naive = next((r for r in base_rows if r.label.startswith("naive") and r.concurrency == 1), None)
    if naive is not None and top in clean:
        ratio = clean[top].rate / naive.rate
        print(f"  aggregate at {top} / naive single stream: {ratio:.2f}x (goal >= 8x)")
    for peer in (r for r in base_rows if r.label.startswith("transformers")):
        if peer.concurrency in clean:
            ratio = clean[peer.concurrency].rate / peer.rate if peer.rate else float("inf")
            print(f"  fencepost / transformers serve at {peer.concurrency}: {ratio:.2f}x")
    if 8 in clean:
        print(f"  TTFT p50 at 8 concurrent: {clean[8].ttft(50):.3f} s (goal <= 1 s)")
    if mixed:
        noisy = rows[-1]
        ratio = noisy.itl(99) / clean[top].itl(99)
        print(f"  fast clients' ITL p99 with slow readers / clean: {ratio:.2f}x (goal <= 1.5x)")
        print(f"  left behind after the mixed run: {leaked.get('fencepost_active_requests')} "
              f"requests, {leaked.get('fencepost_slots_used')} slots (must be 0)")  # fmt: skip
    if engine_rate is not None and top in clean:
        overhead = 1 - clean[top].rate / engine_rate
        print(f"  engine alone at {top}: {engine_rate:.1f} tokens/s; HTTP + router overhead "
              f"{overhead * 100:.1f}% (goal <= 10%)")  # fmt: skip
    errors = [e for r in rows if r.label == "fencepost" for e in r.errors]
    if errors:
        print(f"  errors in clean runs: {len(errors)}; first: {errors[0]}")
