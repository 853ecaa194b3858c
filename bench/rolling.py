"""`fencepost bench drill --rolling`: restart every worker in turn under load.

A router (`fencepost serve --no-local-worker --worker-listen`) and --workers
`fencepost worker` processes (the fake decoder at --step-ms a token with
fixed-length outputs by default; --model for a real one) on 127.0.0.1. First
the reference: --streams streaming chats of --tokens tokens (greedy), and a
short chat for each prompt the steady clients use, with nobody disturbed.
Then the same long streams again, plus --steady clients sending short chats
back to back, while each worker in turn gets SIGTERM, is waited for until it
exits, and is started again under the same id; the next one only once the
router counts every worker healthy. Workers drain with --drain-mode (handoff,
the default: their streams go on elsewhere at the exact token; or finish).

Reported: per worker, the time from SIGTERM to its exit and how many streams
it held; per long stream, the longest gap between two chunks its client saw
(and the same for the reference run, beside it); the streams the router
handed off; and whether every text, long and short, equals its reference and
no request failed. The drill exits 1 when one did not.
"""

from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import trio

from bench.harness import (
    FENCEPOST,
    PROMPTS,
    Server,
    free_port,
    log_folder,
    percentile,
    scrape,
    wait_for_workers,
)
from bench.loadgen import FAST, StreamResult, stream_chat


@dataclass(frozen=True)
class Rolling:
    model_path: str | None  # None: fake workers
    workers: int
    streams: int  # long streams running through the whole rollout
    tokens: int  # max_tokens of each long stream
    steady: int  # clients sending short requests back to back meanwhile
    steady_tokens: int
    step_ms: float  # the fake decoder's time per step
    drain_mode: str  # handoff | finish
    drain_timeout_s: float


@dataclass
class Restart:
    worker: str
    held: int  # streams its log says it held at SIGTERM
    exit_s: float  # SIGTERM -> the process exited
    back_s: float  # SIGTERM -> the router counts every worker healthy again


def _body(prompt: str, tokens: int) -> dict[str, object]:
    messages = [{"role": "user", "content": prompt}]
    return {"model": "drill", "messages": messages, "max_tokens": tokens, "temperature": 0}


def main(rolling: Rolling) -> int:
    logs = log_folder("rolling")
    http, listen = free_port(), free_port()
    model = ["--fake"] if rolling.model_path is None else ["--model", rolling.model_path]
    serve = [*FENCEPOST, "serve", *model, "--port", str(http), "--no-local-worker",
             "--heartbeat-timeout", "2", "--worker-listen", f"127.0.0.1:{listen}",
             "--served-model-name", "drill"]  # fmt: skip
    fake = []
    if rolling.model_path is None:
        fake = ["--fake-step-ms", str(rolling.step_ms), "--fake-ignore-eos"]
    worker = [*FENCEPOST, "worker", *model, *fake, "--connect", f"127.0.0.1:{listen}",
              "--slots", str(max(16, rolling.streams + rolling.steady)),
              "--heartbeat-interval", "0.25", "--drain-mode", rolling.drain_mode,
              "--drain-timeout", str(rolling.drain_timeout_s)]  # fmt: skip
    names = [f"w{i}" for i in range(1, rolling.workers + 1)]
    served = "fake" if rolling.model_path is None else rolling.model_path
    print(f"fencepost bench drill --rolling: {rolling.workers} {served} workers, "
          f"{rolling.streams} streams of {rolling.tokens} tokens and {rolling.steady} steady "
          f"clients ({rolling.steady_tokens}-token answers); each worker SIGTERMed "
          f"(--drain-mode {rolling.drain_mode}) and restarted in turn; logs in {logs}",
          flush=True)  # fmt: skip
    router = Server("router", serve, http, logs / "router.log")
    workers: dict[str, Server] = {}
    restarts: list[Restart] = []
    try:
        for name in names:
            workers[name] = Server(name, [*worker, "--worker-id", name], 0, logs / f"{name}.log")
        router.wait_ready(600)  # (its /health answers 200 once a worker is linked)
        wait_for_workers(http, rolling.workers, timeout_s=600)
        long_bodies = [_body(PROMPTS[i % len(PROMPTS)], rolling.tokens)
                       for i in range(rolling.streams)]  # fmt: skip
        short_bodies = [_body(PROMPTS[i % len(PROMPTS)], rolling.steady_tokens)
                        for i in range(max(rolling.steady, 1))]  # fmt: skip
        reference = trio.run(_run_all, http, long_bodies + short_bodies)
        before = trio.run(scrape, http, ("fencepost_stream_handoffs",))
        long_runs, short_runs = trio.run(
            _rollout, http, rolling, long_bodies, short_bodies, workers, worker, logs, restarts
        )
        after = trio.run(scrape, http, ("fencepost_stream_handoffs",))
    finally:
        router.stop()
        for server in workers.values():
            server.stop()
    handed = after.get("fencepost_stream_handoffs", 0) - before.get("fencepost_stream_handoffs", 0)
    return report(rolling, reference, long_runs, short_runs, restarts, handed)


async def _run_all(port: int, bodies: list[dict[str, object]]) -> list[StreamResult]:
    results: list[StreamResult | None] = [None] * len(bodies)

    async def one(i: int) -> None:
        results[i] = await stream_chat("127.0.0.1", port, bodies[i], FAST, 600)

    async with trio.open_nursery() as nursery:
        for i in range(len(bodies)):
            nursery.start_soon(one, i)
    return [r for r in results if r is not None]


async def _rollout(
    port: int,
    rolling: Rolling,
    long_bodies: list[dict[str, object]],
    short_bodies: list[dict[str, object]],
    workers: dict[str, Server],
    command: list[str],
    logs: Path,
    restarts: list[Restart],
) -> tuple[list[StreamResult], list[tuple[int, StreamResult]]]:
    """The long streams and the steady clients, and the restarts while they run."""
    long_runs: list[StreamResult] = []
    short_runs: list[tuple[int, StreamResult]] = []
    rolled = trio.Event()

    async def steady(i: int) -> None:
        body = short_bodies[i % len(short_bodies)]
        while not rolled.is_set():
            short_runs.append((i % len(short_bodies), await stream_chat(
                "127.0.0.1", port, body, FAST, 600)))  # fmt: skip

    async def roll() -> None:
        await trio.sleep(1.0)  # every long stream under way
        for name in list(workers):
            restarts.append(await _restart(port, name, workers, command, logs, rolling))
        rolled.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(roll)
        for i in range(rolling.steady):
            nursery.start_soon(steady, i)
        long_runs.extend(await _run_all(port, long_bodies))
        await rolled.wait()
    return long_runs, short_runs


async def _restart(
    port: int,
    name: str,
    workers: dict[str, Server],
    command: list[str],
    logs: Path,
    rolling: Rolling,
) -> Restart:
    old = workers[name]
    began = time.monotonic()
    old.process.send_signal(signal.SIGTERM)
    limit = rolling.drain_timeout_s + 30
    while old.process.poll() is None and time.monotonic() - began < limit:
        await trio.sleep(0.01)
    exit_s = time.monotonic() - began
    held = _held_at_sigterm(old.log)
    log = logs / f"{name}.after-restart.log"
    workers[name] = Server(name, [*command, "--worker-id", name], 0, log)
    await trio.to_thread.run_sync(wait_for_workers, port, rolling.workers, 600)
    back_s = time.monotonic() - began
    print(f"  {name}: SIGTERM -> exit {exit_s:.2f}s ({held} streams held), "
          f"-> every worker healthy again {back_s:.2f}s", flush=True)  # fmt: skip
    return Restart(name, held, exit_s, back_s)


def _held_at_sigterm(log: Path) -> int:
    """The streams the worker said it held when told to drain (its log line)."""
    text = log.read_text(errors="replace")
    found = re.search(r"draining for up to \S+ (?:handing off|finishing) (\d+) stream", text)
    return int(found.group(1)) if found else -1


def report(
    rolling: Rolling,
    reference: list[StreamResult],
    long_runs: list[StreamResult],
    short_runs: list[tuple[int, StreamResult]],
    restarts: list[Restart],
    handed: float,
) -> int:
    n = len(long_runs)
    ref_long, ref_short = reference[:n], reference[n:]
    pairs = zip(long_runs, ref_long, strict=True)
    wrong_long = sum(r.content != ref.content or not r.done for r, ref in pairs)
    wrong_short = sum(r.content != ref_short[i].content or not r.done for i, r in short_runs)
    failed = [r.error_code or r.error for r in long_runs + [r for _, r in short_runs] if r.error]
    gaps = [max(r.gaps_s, default=0.0) for r in long_runs]
    ref_gaps = [max(r.gaps_s, default=0.0) for r in ref_long]
    print(f"  streams handed off: {handed:.0f}")
    print("  longest gap between two chunks, per long stream (ms): "
          + ", ".join(f"{g * 1000:.0f}" for g in gaps))  # fmt: skip
    print(f"    max {max(gaps) * 1000:.0f} ms, p50 {percentile(gaps, 50) * 1000:.0f} ms; "
          f"undisturbed run: max {max(ref_gaps) * 1000:.0f} ms")  # fmt: skip
    exits = [r.exit_s for r in restarts]
    print(f"  SIGTERM -> exit: max {max(exits):.2f}s over {len(exits)} workers")
    print(f"  texts equal to the undisturbed run: long {n - wrong_long}/{n}, steady "
          f"{len(short_runs) - wrong_short}/{len(short_runs)}; failed requests: {len(failed)}"
          + (f" ({', '.join(sorted(set(map(str, failed))))})" if failed else ""))  # fmt: skip
    if wrong_long or wrong_short or failed or len(long_runs) != rolling.streams:
        print("  FAILED")
        return 1
    return 0
