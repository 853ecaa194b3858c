"""Kill -9 a real-model worker mid-stream and check the resumed text is unchanged.

    .venv/bin/python -m bench.real_model_resume [--tokens 300]

Starts, on 127.0.0.1 only, `fencepost serve --no-local-worker --worker-listen`
and two `fencepost worker` processes with the embedded default model (2 slots,
512 context each). Streams one greedy chat completion through the official
openai SDK undisturbed, then the same request again, killing the worker that
serves it (w1, chosen first by id) after 30 chunks, and compares the texts.
Every wait is bounded; every process is killed at the end.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading
import time

import openai
import requests
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from bench.harness import FENCEPOST

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Write a short story about a lighthouse keeper."}
]


def spawn(*args: str) -> subprocess.Popen[str]:
    command = [*FENCEPOST, *args]
    return subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def wait_for(check: object, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=300)
    tokens = parser.parse_args().tokens
    log: list[str] = []
    serve = spawn("serve", "--port", "0", "--no-local-worker", "--worker-listen", "127.0.0.1:0",
                  "--heartbeat-timeout", "2", "--max-context", "512")  # fmt: skip
    assert serve.stderr is not None
    stderr = serve.stderr
    threading.Thread(target=lambda: log.extend(stderr), daemon=True).start()
    processes = [serve]
    try:

        def logged(pattern: str) -> str:
            found: list[str] = []

            def check() -> bool:
                found.extend(m.group(1) for line in list(log) if (m := re.search(pattern, line)))
                return bool(found)

            wait_for(check, pattern)
            return found[0]

        base = "http://127.0.0.1:" + logged(r"serving \S+ on http://127\.0\.0\.1:(\d+)/v1")
        worker_port = logged(r"accepting workers on 127\.0\.0\.1:(\d+)")
        for worker_id in ("w1", "w2"):
            flags = ["--slots", "2", "--max-context", "512", "--heartbeat-interval", "0.25"]
            connect = ["--connect", f"127.0.0.1:{worker_port}", "--worker-id", worker_id]
            processes.append(spawn("worker", *connect, *flags))

        def healthy() -> int:
            return int(requests.get(f"{base}/health", timeout=10).json()["healthy_workers"])

        wait_for(lambda: healthy() == 2, "two workers")
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")

        def stream() -> openai.Stream[ChatCompletionChunk]:
            return client.chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=MESSAGES, temperature=0,
                max_tokens=tokens, stream=True,
            )  # fmt: skip

        undisturbed = "".join(c.choices[0].delta.content or "" for c in stream() if c.choices)
        chunks = iter(stream())
        resumed = "".join(next(chunks).choices[0].delta.content or "" for _ in range(30))
        processes[1].send_signal(signal.SIGKILL)
        print(f"killed w1 after {len(resumed)} characters of the stream")
        resumed += "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        count = re.search(r"^fencepost_stream_resumes (\S+)", metrics, re.MULTILINE)
        print(f"streams resumed: {count.group(1) if count else '?'}")
        print(f"resumed text equals the undisturbed run: {resumed == undisturbed}")
        if resumed != undisturbed:
            print(f"undisturbed: {undisturbed!r}\nresumed:     {resumed!r}")
        return 0 if resumed == undisturbed else 1
    finally:
        for process in processes:
            process.kill()
            process.wait(10)


if __name__ == "__main__":
    sys.exit(main())
