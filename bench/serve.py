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
server (bench/naive_server.py) and `transformers serve --continuous-batching`.

Every request is greedy (temperature 0) so every system does the same work.

--url http://127.0.0.1:PORT drives a server already running on this machine
(`fencepost cluster`, say) instead of starting one: the same clients and rows,
the model the server lists first, no engine comparison and no baselines.

--peer-llama-server BIN adds llama.cpp's own C++ server (`scripts/build-llama-server`
builds one) on the same GGUF file and load, once per --peer-threads count, so that
each server can be compared at its best thread count in one run; --peer-llama-cpp
PYTHON adds llama-cpp-python's server the same way.

--plot FILE.png draws the rows, peers' beside fencepost's, once the run is over
(bench/plot.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from bench.harness import (
    FENCEPOST,
    PROMPTS,
    Server,
    free_port,
    log_folder,
    long_prompt,
    percentile,
    scrape,
)
from bench.loadgen import FAST, ClientBehaviour, StreamResult, stream_chat, tokens_of

SLOW = ClientBehaviour(slow_read_s=0.2, slow_read_bytes=512, receive_buffer=4096)
HANG_UP = ClientBehaviour(hang_up_after=5)


@dataclass(frozen=True)
class ServeLoad:
    """One run's settings: which model, how many clients, how much each asks for."""

    model_path: str | None
    fake: bool
    concurrency: tuple[int, ...]  # clean runs, one per level
    tokens: int  # max_tokens of each request
    rounds: int  # requests each client sends, one after another
    time_limit_s: float  # per level
    mixed: bool
    baselines: bool
    threads: int | None
    peer_llama_cpp: str | None = None  # a Python with llama-cpp-python[server] installed
    peer_llama_server: str | None = None  # llama.cpp's own C++ server binary
    peer_threads: tuple[int, ...] = ()  # its thread counts, one set of rows each (): ours
    weights: str = "auto"  # the server's and the engine-only run's weight format
    url: str | None = None  # drive the server there instead of starting one
    plot: Path | None = None  # a PNG of the rows (bench/plot.py), written at the end
    prompt_tokens: int | None = None  # about this many prompt tokens a request (None: short)
    first_prompt: int = 0  # long prompts are numbered from here (the warm-up's apart)

    @property
    def context(self) -> int:
        """The context each request gets (a server's slot, the engine's rows)."""
        need = (self.prompt_tokens or 0) + self.tokens + 256  # the template and the text's slack
        return max(2048, -(-need // 256) * 256)

    def prompt(self, i: int) -> str:
        """Request i's user message."""
        if self.prompt_tokens:
            return long_prompt(self.first_prompt + i, self.prompt_tokens)
        return PROMPTS[i % len(PROMPTS)]

    @property
    def top(self) -> int:
        return max(self.concurrency)

    def warm_up(self) -> ServeLoad:
        """A short run first; its long prompts are none of the measured ones, so that no
        server's prefix cache answers a measured prompt from the warm-up."""
        return dataclasses.replace(self, tokens=8, rounds=1, first_prompt=1_000_000)


@dataclass
class Level:
    label: str
    concurrency: int
    results: list[StreamResult] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(tokens_of(r) for r in self.results)

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


@dataclass
class Served:
    """What the fencepost server showed: a row per run, leftovers, peak RSS."""

    rows: list[Level] = field(default_factory=list)
    leaked: dict[str, float] = field(default_factory=dict)  # after the mixed run
    rss_mb: float = float("nan")


async def run_level(
    port: int,
    label: str,
    concurrency: int,
    load: ServeLoad,
    model: str,
    extra: list[ClientBehaviour] | None = None,
) -> Level:
    """`concurrency` fast clients (and `extra` others beside them); the fast ones' figures."""
    level = Level(label, concurrency)

    def body(i: int) -> dict[str, Any]:
        messages = [{"role": "user", "content": load.prompt(i)}]
        return {"model": model, "messages": messages, "max_tokens": load.tokens, "temperature": 0}

    fast_left = concurrency

    async def fast_client(i: int) -> None:
        nonlocal fast_left
        for r in range(load.rounds):
            request = body(i * load.rounds + r)
            level.results.append(
                await stream_chat("127.0.0.1", port, request, FAST, load.time_limit_s)
            )
        fast_left -= 1
        if not fast_left:  # throughput is the fast clients' own; others may still be reading
            level.wall_s = time.perf_counter() - began

    async def other_client(i: int, behaviour: ClientBehaviour) -> None:
        await stream_chat("127.0.0.1", port, body(i), behaviour, load.time_limit_s)

    began = time.perf_counter()
    with trio.move_on_after(load.time_limit_s):
        async with trio.open_nursery() as nursery:
            for i in range(concurrency):
                nursery.start_soon(fast_client, i)
            for j, behaviour in enumerate(extra or []):
                nursery.start_soon(other_client, 1000 + j, behaviour)
    level.wall_s = level.wall_s or time.perf_counter() - began
    return level


def engine_only(load: ServeLoad) -> tuple[float, int | None]:
    """The same greedy requests on the engine alone (no HTTP, no router), built and
    threaded as the server's was: (tokens/s, its CPU threads; None: torch's own)."""
    import torch

    from adapters.engine.build import build_engine
    from adapters.engine.model import load_model
    from adapters.engine.options import EngineOptions
    from adapters.openai.models import ChatModel
    from adapters.openai.normalize import ChatMessage
    from core.protocol import Assignment, Decoded, DecodeDone, GenerationRequest, Sampling

    loaded = load_model(load.model_path, quiet=True)
    asked = EngineOptions(
        slots=load.top, max_context=load.context, weights=load.weights, threads=load.threads
    )
    built = build_engine(loaded, asked)
    engine, threads = built.engine, built.threads
    if threads is not None:  # the server's engine thread sets them on itself
        torch.set_num_threads(threads)
    chat = ChatModel("bench", loaded.tokenizer, load.context)  # the server's own tokenizing
    pending = []
    for i in range(load.top * load.rounds):
        prompt = chat.tokenize_chat([ChatMessage("user", load.prompt(i))])
        pending.append(GenerationRequest(f"e{i}", tuple(prompt), load.tokens, Sampling(0.0)))
    pending.reverse()

    def start_next() -> None:
        if pending:
            request = pending.pop()
            engine.start(Assignment(request.request_id, 1), request)

    for _ in range(load.top):
        start_next()
    produced = 0
    began = time.perf_counter()
    while engine.has_work():
        for event in engine.step():
            if isinstance(event, Decoded):
                produced += 1
            elif isinstance(event, DecodeDone):
                start_next()
    return produced / (time.perf_counter() - began), threads


def main(load: ServeLoad) -> int:
    logs = log_folder("bench")
    print(f"fencepost bench serve: {load.tokens} tokens per request, {load.rounds} request(s)"
          f" per client, greedy; {os.cpu_count()} CPUs; torch threads {load.threads or 'default'};"
          f" weights {load.weights};"
          f" logs in {logs}", flush=True)  # fmt: skip
    if load.url is not None:
        served = measure_running(load, load.url)
        report(load, served, [], None)
        plot(load, served.rows)
        return 0
    served = measure_fencepost(load, logs)
    engine_rate, threads = (None, None) if load.fake else engine_only(load)
    base_rows = run_baselines(load, logs) if load.baselines and not load.fake else []
    if load.peer_llama_cpp and not load.fake:
        base_rows += llama_cpp_rows(load, logs, threads)
    if load.peer_llama_server and not load.fake:
        for count in load.peer_threads or (_engine_threads(load, threads),):
            base_rows += llama_server_rows(load, logs, count)
    report(load, served, base_rows, engine_rate)
    plot(load, [*served.rows, *base_rows])
    return 0


def plot(load: ServeLoad, rows: list[Level]) -> None:
    """The rows as a PNG, when --plot asked for one (matplotlib was checked at the start)."""
    if load.plot is None:
        return
    from bench.plot import write_plot

    model = "fake model" if load.fake else load.model_path or "default model"
    title = (f"fencepost bench serve: {model}, {load.tokens} tokens per request, "
             f"{load.rounds} request(s) per client, greedy")  # fmt: skip
    write_plot(rows, load.plot, title)
    print(f"  plot: {load.plot}", flush=True)


def measure_running(load: ServeLoad, url: str) -> Served:
    """The rows of a server already running at url (loopback only: the clients dial
    127.0.0.1), for the model it lists first."""
    parts = urllib.parse.urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost") or parts.port is None:
        raise SystemExit(f"--url must be http://127.0.0.1:PORT, not {url!r}")
    port = parts.port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10) as reply:
        model = str(json.loads(reply.read())["data"][0]["id"])
    print(f"  driving the server at http://127.0.0.1:{port} (model {model})", flush=True)
    served = Served()
    trio.run(run_level, port, "warm-up", 1, load.warm_up(), model)
    for c in load.concurrency:
        served.rows.append(trio.run(run_level, port, "fencepost", c, load, model))
        print(served.rows[-1].row(), flush=True)
    if load.mixed:
        top = load.top
        extra = [SLOW] * max(1, top // 4) + [HANG_UP] * max(1, top // 4)
        label = f"fencepost + {top // 4 or 1} slow, {top // 4 or 1} hang-up"
        served.rows.append(trio.run(run_level, port, label, top, load, model, extra))
        print(served.rows[-1].row(), flush=True)
    return served


def measure_fencepost(load: ServeLoad, logs: Path) -> Served:
    top, port = load.top, free_port()
    extras = 2 * max(1, top // 4) if load.mixed else 0  # slow and hang-up clients get slots too
    command = [*FENCEPOST, "serve", "--port", str(port), "--served-model-name", "bench",
               "--slots", str(top + extras)]  # fmt: skip
    command += ["--fake", "--fake-step-ms", "10"] if load.fake else []
    command += ["--model", load.model_path] if load.model_path else []
    command += ["--threads", str(load.threads)] if load.threads else []
    command += ["--weights", load.weights]
    command += ["--max-context", str(load.context)] if load.prompt_tokens else []
    server = Server("fencepost", command, port, logs / "fencepost.log")
    served = Served()
    try:
        server.wait_ready(600)
        trio.run(run_level, port, "warm-up", 1, load.warm_up(), "bench")
        for c in load.concurrency:
            served.rows.append(trio.run(run_level, port, "fencepost", c, load, "bench"))
            print(served.rows[-1].row(), flush=True)
        if load.mixed:
            extra = [SLOW] * max(1, top // 4) + [HANG_UP] * max(1, top // 4)
            label = f"fencepost + {top // 4 or 1} slow, {top // 4 or 1} hang-up"
            served.rows.append(trio.run(run_level, port, label, top, load, "bench", extra))
            print(served.rows[-1].row(), flush=True)
            time.sleep(2)  # let the hung-up requests' cancellations land
            leftovers = ("fencepost_active_requests", "fencepost_slots_used")
            served.leaked = trio.run(scrape, port, leftovers)
        served.rss_mb = server.peak_rss_mb()
    finally:
        server.stop()
    return served


def run_baselines(load: ServeLoad, logs: Path) -> list[Level]:
    """The naive server's rows, then transformers serve's (when it is installed)."""
    rows = naive_rows(load, logs)
    peer = shutil.which("transformers", path=str(Path(sys.executable).parent))
    hf_dir = _hf_directory(load.model_path)
    if peer is None or hf_dir is None:
        print("  transformers serve: not available (pip install 'transformers[serving]')")
        return rows
    port = free_port()
    command = [peer, "serve", "--continuous-batching", "--device", "cpu", "--port", str(port),
               "--host", "127.0.0.1", str(hf_dir)]  # fmt: skip
    server = Server("transformers serve", command, port, logs / "transformers-serve.log")
    label = "transformers serve --cb"
    return rows + peer_rows(server, label, sorted({1, load.top}), load, str(hf_dir), "/health")


def peer_rows(
    server: Server, label: str, levels: list[int], load: ServeLoad, model: str, ready: str
) -> list[Level]:
    """A peer server's rows at each level (it is stopped afterwards, whatever happened)."""
    rows: list[Level] = []
    try:
        server.wait_ready(600, path=ready)
        trio.run(run_level, server.port, "warm-up", 1, load.warm_up(), model)
        for c in levels:
            rows.append(trio.run(run_level, server.port, label, c, load, model))
            print(rows[-1].row(), flush=True)
    except RuntimeError as error:
        print(f"  {server.name}: {error}")
    finally:
        server.stop()
    return rows


def llama_cpp_rows(load: ServeLoad, logs: Path, threads: int | None) -> list[Level]:
    """llama-cpp-python's OpenAI server, started as its docs say, on the GGUF file fencepost
    serves (the default model's Q4_1), the same load at every level. It streams one
    token per chunk and no usage, so its tokens are its content chunks."""
    gguf = _served_gguf(load, "llama-cpp-python")
    if gguf is None:
        return []
    port = free_port()
    threads = _engine_threads(load, threads)
    command = [load.peer_llama_cpp or sys.executable, "-m", "llama_cpp.server",
               "--model", str(gguf), "--model_alias", "bench", "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", str(load.context), "--n_threads", str(threads),
               # by default a new request interrupts the running one; clients should queue
               "--interrupt_requests", "False"]  # fmt: skip
    server = Server("llama-cpp-python", command, port, logs / "llama-cpp-python.log")
    label = f"llama-cpp-python ({threads} thr)"
    return peer_rows(server, label, list(load.concurrency), load, "bench", "/v1/models")


def _engine_threads(load: ServeLoad, threads: int | None) -> int:
    """As many threads as fencepost's engine had: given, or its default for the format it
    chose, or all cores but one. A peer that is not told otherwise gets as many."""
    return load.threads or threads or max(1, (os.cpu_count() or 2) - 1)


def _served_gguf(load: ServeLoad, peer: str) -> Path | None:
    """The GGUF file fencepost serves, which a llama.cpp peer must serve too."""
    from adapters.engine.model import default_gguf_path

    gguf = Path(load.model_path) if load.model_path else default_gguf_path()
    if gguf.suffix != ".gguf":
        print(f"  {peer}: needs a .gguf model")
        return None
    return gguf


def llama_server_rows(load: ServeLoad, logs: Path, threads: int) -> list[Level]:
    """llama.cpp's C++ `llama-server` on the same GGUF file, the same load at every
    level: continuous batching over as many parallel slots as the most clients, each
    slot with the context fencepost's requests get (load.context), `threads` threads for
    generation and for prompts alike."""
    gguf = _served_gguf(load, "llama-server")
    if gguf is None:
        return []
    binary = load.peer_llama_server or "llama-server"
    port, slots = free_port(), load.top
    command = [binary, "--model", str(gguf), "--alias", "bench", "--host", "127.0.0.1",
               "--port", str(port), "--parallel", str(slots),
               "--ctx-size", str(load.context * slots),
               "--threads", str(threads), "--threads-batch", str(threads),
               "--cont-batching"]  # fmt: skip
    server = Server("llama-server", command, port, logs / f"llama-server-{threads}t.log")
    label = f"llama-server ({threads} thr)"
    return peer_rows(server, label, list(load.concurrency), load, "bench", "/health")


def naive_rows(load: ServeLoad, logs: Path) -> list[Level]:
    rows = []
    port = free_port()
    naive = [*FENCEPOST, "bench", "naive-server", "--port", str(port)]
    naive += ["--model", load.model_path] if load.model_path else []
    naive += ["--threads", str(load.threads)] if load.threads else []
    server = Server("naive", naive, port, logs / "naive.log")
    one_round = dataclasses.replace(load, rounds=1)
    try:
        server.wait_ready(600)
        trio.run(run_level, port, "warm-up", 1, load.warm_up(), "bench")
        for c in sorted({1, min(4, load.top)}):  # sequential: more clients only queue
            label = "naive sequential generate"
            rows.append(trio.run(run_level, port, label, c, one_round, "bench"))
            print(rows[-1].row(), flush=True)
    finally:
        server.stop()
    return rows


def _hf_directory(model_path: str | None) -> Path | None:
    """An HF directory of the model: given, or the engine's dequantized cache of the GGUF."""
    from adapters.engine.model import load_model

    if model_path is not None and Path(model_path).is_dir():
        return Path(model_path)
    loaded = load_model(model_path, quiet=True)
    source = Path(loaded.source)
    return source if source.is_dir() else None


def report(
    load: ServeLoad, served: Served, base_rows: list[Level], engine_rate: float | None
) -> None:
    rows, leaked = served.rows, served.leaked
    print()
    print(HEADER)
    for row in [*rows, *base_rows]:
        print(row.row())
    if load.url is None:  # a server it did not start is not its to measure
        print(f"  fencepost server peak RSS: {served.rss_mb:.0f} MB")
    clean = {r.concurrency: r for r in rows if r.label == "fencepost"}
    top = load.top
    naive = next((r for r in base_rows if r.label.startswith("naive") and r.concurrency == 1), None)
    if naive is not None and top in clean:
        ratio = clean[top].rate / naive.rate
        print(f"  aggregate at {top} / naive single stream: {ratio:.2f}x (goal >= 8x)")
    for peer in (r for r in base_rows if r.label.startswith("transformers")):
        if peer.concurrency in clean:
            ratio = clean[peer.concurrency].rate / peer.rate if peer.rate else float("inf")
            print(f"  fencepost / transformers serve at {peer.concurrency}: {ratio:.2f}x")
    for peer in (r for r in base_rows if r.label.startswith("llama-")):
        if peer.concurrency in clean:
            mine = clean[peer.concurrency]
            ratio = mine.rate / peer.rate if peer.rate else float("inf")
            print(f"  fencepost / {peer.label} at {peer.concurrency}: {ratio:.2f}x tokens/s, "
                  f"ITL p50 {mine.itl(50) * 1e3:.0f} vs {peer.itl(50) * 1e3:.0f} ms, "
                  f"TTFT p50 {mine.ttft(50):.2f} vs {peer.ttft(50):.2f} s")  # fmt: skip
    if 8 in clean:
        print(f"  TTFT p50 at 8 concurrent: {clean[8].ttft(50):.3f} s (goal <= 1 s)")
    if load.prompt_tokens:
        for row in [*rows, *base_rows]:
            sent = sorted(r.prompt_tokens for r in row.results if r.prompt_tokens)
            if sent:
                print(f"  {row.label} at {row.concurrency}: prompts of {sent[0]}-{sent[-1]} "
                      f"tokens, TTFT p50 {row.ttft(50):.3f} s")  # fmt: skip
    if load.mixed:
        noisy = rows[-1]
        ratio = noisy.itl(99) / clean[top].itl(99)
        print(f"  fast clients' ITL p99 with slow readers / clean: {ratio:.2f}x (goal <= 1.5x)")
        if leaked:
            print(f"  left behind after the mixed run: {leaked.get('fencepost_active_requests')} "
                  f"requests, {leaked.get('fencepost_slots_used')} slots (must be 0)")  # fmt: skip
    if engine_rate is not None and top in clean:
        overhead = 1 - clean[top].rate / engine_rate
        print(f"  engine alone at {top}: {engine_rate:.1f} tokens/s; HTTP + router overhead "
              f"{overhead * 100:.1f}% (goal <= 10%)")  # fmt: skip
    errors = [e for r in rows if r.label == "fencepost" for e in r.errors]
    if errors:
        print(f"  errors in clean runs: {len(errors)}; first: {errors[0]}")
