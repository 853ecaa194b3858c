"""`fencepost bench chat`: multi-turn conversations, the load a prefix cache is for.

C conversations of T turns each share one system prompt (a few hundred
tokens of fixed English text). Every turn sends the whole history (system,
then user and assistant in turn, the assistant's own earlier answers) and a
new user message, streamed through the OpenAI chat API on 127.0.0.1. The
conversations run concurrently and in step: every conversation's turn t is
answered before any turn t+1 is sent, and the workers' heartbeats are let to
settle in between (as a user's reading time would), so that /metrics can be
read per turn and the router sees fresh cache reports, for every routing alike.

Each configuration gets a fresh server (and worker processes), one at a time:
the real model on 1 worker (in the server) and on 2 (worker processes), prefix
cache on and off; the fake decoder (its prefill costs
--fake-prefill-ms-per-token per uncached token) on 2 and 4 workers, under
each --routing. One table: TTFT p50/p99 on turn 1 and on later turns, the
TTFT p50 of each turn, prefill tokens computed / submitted (from the workers'
cache reports, /metrics deltas) on turn 1 and on later turns, completion
tokens/s, errors, and requests per worker with the busiest one's share
against a fair share.

Every request is greedy, so cache on and off produce the same conversations
on the real model. The system prompt is sized at about 4 characters a token
for the real model's tokenizer; the fake model's is one token a character.
"""

from __future__ import annotations

import re
import time
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
    percentile,
    series,
    wait_for_workers,
)
from bench.loadgen import FAST, StreamResult, stream_chat, tokens_of

MODEL = "chat"
# Two heartbeats and a little: of the server's own worker (every 0.5 s), of worker processes
# (the bench starts them with 0.25 s).
SETTLE_EMBEDDED_S = 1.2
SETTLE_REMOTE_S = 0.7
SUBMITTED = 'fencepost_prefill_tokens_total{kind="submitted"}'
COMPUTED = 'fencepost_prefill_tokens_total{kind="computed"}'
PER_WORKER = re.compile(r'^fencepost_worker_requests_total\{worker="([^"]*)"\}$')

GUIDELINES = (
    "You are the reference desk assistant of a small public library by the sea.",
    "Answer the visitor's question plainly, in a friendly tone, and keep to the point.",
    "When a question has several parts, take them one at a time and in order.",
    "Prefer short paragraphs to lists, and lists to tables, unless asked otherwise.",
    "If you are not sure of a fact, say so, and suggest where in the library to look.",
    "The library opens at nine in the morning and closes at six in the evening.",
    "Books may be borrowed for three weeks and renewed twice, in person or by telephone.",
    "The reading room on the first floor is kept quiet; the garden room is not.",
    "Children's books are on the ground floor, beside the window that faces the harbour.",
    "Maps, charts and the records of the old lighthouse are kept in the archive room.",
    "Never invent a title, an author or a shelf mark; describe the subject instead.",
    "Thank the visitor at the end only when the conversation is clearly over.",
)


def system_prompt(tokens: int, chars_per_token: float) -> str:
    """About `tokens` tokens of fixed guidance, the same text every run."""
    sentences: list[str] = []
    length, target = 0, tokens * chars_per_token
    for index in range(10_000):  # bounded; ~80 characters a sentence
        if length >= target:
            break
        sentence = f"{index + 1}. {GUIDELINES[index % len(GUIDELINES)]}"
        sentences.append(sentence)
        length += len(sentence) + 1
    return " ".join(sentences)


def user_message(conversation: int, turn: int) -> str:
    topic = PROMPTS[(conversation * 7 + turn) % len(PROMPTS)]
    return f"Visitor {conversation + 1}, question {turn + 1}: {topic} Keep it short."


@dataclass(frozen=True)
class ChatLoad:
    conversations: int
    turns: int
    tokens: int  # max_tokens of each answer
    system_tokens: int
    real_workers: tuple[int, ...]  # real-model configurations, each with cache on and off
    fake_workers: tuple[int, ...]  # fake configurations, under each routing
    routings: tuple[str, ...]  # "default": the server's own
    fake_prefill_ms_per_token: float = 0.5
    fake_step_ms: float = 10.0
    model_path: str | None = None
    time_limit_s: float = 300.0  # per configuration's conversations


@dataclass(frozen=True)
class Setup:
    """One configuration: a fresh server and its workers."""

    fake: bool
    workers: int
    cache: bool
    routing: str | None  # None: the server's default

    @property
    def label(self) -> str:
        model = "fake" if self.fake else "real"
        cache = "cache on" if self.cache else "cache off"
        routing = f", {self.routing}" if self.routing else ""
        return f"{model} {self.workers}w {cache}{routing}"


def setups(load: ChatLoad) -> list[Setup]:
    chosen = [Setup(False, n, cache, None) for n in load.real_workers for cache in (True, False)]
    for n in load.fake_workers:
        for routing in load.routings:
            chosen.append(Setup(True, n, True, None if routing == "default" else routing))
    return chosen


@dataclass
class Row:
    """What one configuration showed."""

    setup: Setup
    turns: list[list[StreamResult]] = field(default_factory=list)  # [turn][conversation]
    submitted: list[float] = field(default_factory=list)  # prefill tokens, per turn
    computed: list[float] = field(default_factory=list)
    per_worker: dict[str, float] = field(default_factory=dict)  # requests placed
    busy_s: float = 0.0  # time spent in turns (not settling)

    def ttft(self, turns: slice, q: float) -> float:
        values = [r.ttft_s for rs in self.turns[turns] for r in rs if r.ttft_s is not None]
        return percentile(values, q)

    def prefill(self, turns: slice) -> tuple[float, float]:
        """(computed, submitted) prefill tokens over these turns."""
        return sum(self.computed[turns]), sum(self.submitted[turns])

    @property
    def results(self) -> list[StreamResult]:
        return [r for rs in self.turns for r in rs]

    @property
    def errors(self) -> int:
        return sum(1 for r in self.results if r.error is not None or not r.done)

    @property
    def rate(self) -> float:
        return sum(tokens_of(r) for r in self.results) / self.busy_s if self.busy_s else 0.0

    @property
    def max_share(self) -> float:
        """The busiest worker's requests against a fair share (1.0: perfectly even)."""
        counts = list(self.per_worker.values())
        if not counts or not sum(counts):
            return float("nan")
        return max(counts) / (sum(counts) / self.setup.workers)

    def row(self) -> str:
        first, later = slice(0, 1), slice(1, None)

        def hits(turns: slice) -> str:
            computed, submitted = self.prefill(turns)
            if not submitted:
                return f"{'n/a':>18}"
            return f"{computed:>6.0f}/{submitted:<6.0f} {1 - computed / submitted:>4.0%}"

        by_turn = "/".join(f"{self.ttft(slice(t, t + 1), 50):.2f}" for t in range(len(self.turns)))
        workers = " ".join(f"{w}:{n:.0f}" for w, n in sorted(self.per_worker.items()))
        share = f"({self.max_share:.2f}x)" if self.per_worker else "n/a"
        return (
            f"  {self.setup.label:30} {self.ttft(first, 50):6.3f} {self.ttft(first, 99):6.3f}"
            f"  {self.ttft(later, 50):6.3f} {self.ttft(later, 99):6.3f}  {hits(first)}"
            f"  {hits(later)}  {self.rate:7.1f} {self.errors:4d}  {by_turn:23}  {workers} {share}"
        )


HEADER = (
    f"  {'':30} {'TTFT turn 1 s':>13}  {'TTFT turns 2+':>13}  {'prefill turn 1':>18}"
    f"  {'prefill turns 2+':>18}  {'':7} {'':4}  {'TTFT p50 s':23}  requests per worker\n"
    f"  {'configuration':30} {'p50    p99':>13}  {'p50    p99':>13}  {'computed/submitted':>18}"
    f"  {'computed/submitted':>18}  {'tok/s':>7} {'err':>4}  {'by turn':23}  (busiest/fair share)"
)


def commands(setup: Setup, load: ChatLoad, http: int, worker_port: int) -> list[list[str]]:
    """The server's command line, then each worker process's."""
    serve = [*FENCEPOST, "serve", "--port", str(http), "--served-model-name", MODEL]
    model: list[str] = []
    if setup.fake:
        model = ["--fake", "--fake-step-ms", str(load.fake_step_ms),
                 "--fake-prefill-ms-per-token", str(load.fake_prefill_ms_per_token),
                 "--max-context", "8192"]  # fmt: skip
    elif load.model_path:
        model = ["--model", load.model_path]
    model += [] if setup.cache else ["--no-prefix-cache"]
    serve += ["--routing", setup.routing] if setup.routing else []
    if setup.workers == 1:
        return [serve + model]
    serve += ["--no-local-worker", "--worker-listen", f"127.0.0.1:{worker_port}"]
    if setup.fake:
        serve += ["--fake", "--max-context", "8192"]
    elif load.model_path:
        serve += ["--model", load.model_path]
    worker = [*FENCEPOST, "worker", "--connect", f"127.0.0.1:{worker_port}",
              "--heartbeat-interval", "0.25", *model]  # fmt: skip
    return [serve] + [[*worker, "--worker-id", f"w{i + 1}"] for i in range(setup.workers)]


def measure(setup: Setup, load: ChatLoad, logs: Path) -> Row:
    http, worker_port = free_port(), free_port()
    serve, *workers = commands(setup, load, http, worker_port)
    name = setup.label.replace(" ", "-").replace(",", "")
    server = Server("fencepost", serve, http, logs / f"{name}.log")
    processes = [
        Server(f"w{i + 1}", command, http, logs / f"{name}-w{i + 1}.log")
        for i, command in enumerate(workers)
    ]
    try:
        server.wait_ready(600)
        if processes:
            wait_for_workers(http, len(processes), timeout_s=600)
        return trio.run(converse, http, setup, load)
    finally:
        server.stop()
        for process in processes:
            process.stop()


async def converse(port: int, setup: Setup, load: ChatLoad) -> Row:
    """Warm up (a prompt sharing no block with the conversations), then the turns."""
    row = Row(setup)
    settle_s = SETTLE_EMBEDDED_S if setup.workers == 1 else SETTLE_REMOTE_S
    warm = [{"role": "system", "content": "Warm-up."}, {"role": "user", "content": "Hello!"}]
    await stream_chat("127.0.0.1", port, _body(warm, 4), FAST, load.time_limit_s)
    await trio.sleep(settle_s)
    before = await series(port)
    system = system_prompt(load.system_tokens, 1.0 if setup.fake else 4.0)
    histories: list[list[dict[str, str]]] = [
        [{"role": "system", "content": system}] for _ in range(load.conversations)
    ]
    deadline = trio.current_time() + load.time_limit_s
    for turn in range(load.turns):
        if trio.current_time() >= deadline:
            break
        results: list[StreamResult] = [StreamResult() for _ in histories]

        async def ask(c: int, turn: int = turn, results: list[StreamResult] = results) -> None:
            history = histories[c]
            history.append({"role": "user", "content": user_message(c, turn)})
            timeout_s = max(1.0, deadline - trio.current_time())
            results[c] = await stream_chat(
                "127.0.0.1", port, _body(history, load.tokens), FAST, timeout_s
            )
            history.append({"role": "assistant", "content": results[c].content})

        began = trio.current_time()
        async with trio.open_nursery() as nursery:
            for c in range(load.conversations):
                nursery.start_soon(ask, c)
        row.busy_s += trio.current_time() - began
        row.turns.append(results)
        await trio.sleep(settle_s)  # the last heartbeats carry this turn's cache counters
        after = await series(port)
        row.submitted.append(after.get(SUBMITTED, 0.0) - before.get(SUBMITTED, 0.0))
        row.computed.append(after.get(COMPUTED, 0.0) - before.get(COMPUTED, 0.0))
        for key, value in after.items():
            if match := PER_WORKER.match(key):
                worker = match.group(1)
                row.per_worker[worker] = (
                    row.per_worker.get(worker, 0.0) + value - before.get(key, 0.0)
                )
        before = after
    return row


def _body(messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0}


def run(load: ChatLoad, logs: Path | None = None) -> list[Row]:
    """Every configuration in turn, each row printed as it is done."""
    logs = logs or log_folder("chat")
    print(f"fencepost bench chat: {load.conversations} conversations x {load.turns} turns, "
          f"{load.tokens} tokens an answer, a {load.system_tokens}-token system prompt; fake "
          f"prefill {load.fake_prefill_ms_per_token} ms/token, step {load.fake_step_ms} ms; "
          f"logs in {logs}", flush=True)  # fmt: skip
    print(HEADER, flush=True)
    rows = []
    for setup in setups(load):
        began = time.monotonic()
        rows.append(measure(setup, load, logs))
        print(rows[-1].row(), f" [{time.monotonic() - began:.0f}s]", flush=True)
    return rows


def table(rows: list[Row]) -> str:
    return "\n".join([HEADER, *(row.row() for row in rows)])


def main(load: ChatLoad) -> int:
    rows = run(load)
    print()
    print(table(rows))
    return 0 if all(row.errors == 0 for row in rows) else 1
