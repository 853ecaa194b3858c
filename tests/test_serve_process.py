"""`fencepost serve` as a real process: remote workers, then SIGTERM with a stream in flight."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.http_helpers import chat_body, sse_events
from tests.runtime_helpers import kill_all


class LogWatcher:
    """Collects a process's stderr lines and finds values in them."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        assert process.stderr is not None
        stream = process.stderr
        threading.Thread(target=lambda: self.lines.extend(stream), daemon=True).start()

    def find(self, pattern: str, timeout_s: float = 60) -> re.Match[str]:
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
    command = [sys.executable, "-m", "adapters.cli", *args]
    return subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)


def test_serve_with_a_remote_worker_then_sigterm_drains_and_exits_0(tmp_path: Path) -> None:
    serve = fencepost("serve", "--fake", "--fake-step-ms", "5", "--port", "0",
                      "--worker-listen", "127.0.0.1:0", "--no-local-worker",
                      "--heartbeat-timeout", "1", "--drain-timeout", "10")  # fmt: skip
    worker = None
    try:
        log = LogWatcher(serve)
        http_port = log.find(r"serving fake on http://127\.0\.0\.1:(\d+)/v1").group(1)
        worker_port = log.find(r"accepting workers on 127\.0\.0\.1:(\d+)").group(1)
        base = f"http://127.0.0.1:{http_port}"
        assert requests.get(f"{base}/health", timeout=10).status_code == 503  # no worker yet
        worker = fencepost("worker", "--connect", f"127.0.0.1:{worker_port}", "--fake",
                           "--fake-step-ms", "5", "--fake-ignore-eos",
                           "--worker-id", "remote-1")  # fmt: skip
        deadline = time.monotonic() + 30
        while requests.get(f"{base}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the remote worker never registered"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=10
        )
        assert reply.choices[0].message.content

        # a 2 s stream is running when SIGTERM arrives: it must finish whole
        result: dict[str, bytes] = {}
        body = chat_body(max_tokens=400, stream=True, stream_options={"include_usage": True})

        def stream() -> None:
            url = f"{base}/v1/chat/completions"
            result["body"] = requests.post(url, json=body, timeout=60).content

        reader = threading.Thread(target=stream)
        reader.start()
        time.sleep(0.5)
        serve.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert serve.wait(30) == 0
        assert time.monotonic() - began < 15  # drain timeout plus a margin
        reader.join(10)
        events = sse_events(result["body"])
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 400
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{base}/health", timeout=5)
    finally:
        kill_all((serve, worker))


def start_cluster(*serve_flags: str) -> tuple[subprocess.Popen[str], LogWatcher, str, str]:
    serve = fencepost("serve", "--fake", "--port", "0", "--worker-listen", "127.0.0.1:0",
                      "--no-local-worker", "--heartbeat-timeout", "1", *serve_flags)  # fmt: skip
    log = LogWatcher(serve)
    http_port = log.find(r"serving fake on http://127\.0\.0\.1:(\d+)/v1").group(1)
    worker_port = log.find(r"accepting workers on 127\.0\.0\.1:(\d+)").group(1)
    return serve, log, f"http://127.0.0.1:{http_port}", worker_port


def fake_worker(worker_port: str, worker_id: str) -> subprocess.Popen[str]:
    return fencepost("worker", "--connect", f"127.0.0.1:{worker_port}", "--fake",
                     "--fake-step-ms", "10", "--fake-ignore-eos", "--worker-id", worker_id,
                     "--heartbeat-interval", "0.2")  # fmt: skip


def healthy_workers(base: str) -> int:
    return int(requests.get(f"{base}/health", timeout=10).json()["healthy_workers"])


def wait_for(condition: Callable[[], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("resume", [True, False])
def test_kill_9_mid_stream_the_sdk_stream_resumes_on_the_other_worker(resume: bool) -> None:
    from adapters.openai.models import FakeChatModel
    from adapters.openai.normalize import ChatMessage
    from core.fake_model import reference_tokens
    from core.protocol import GenerationRequest

    serve, _, base, worker_port = start_cluster(*([] if resume else ["--no-resume"]))
    first = second = None
    try:
        first = fake_worker(worker_port, "w1")
        wait_for(lambda: healthy_workers(base) == 1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        content = "tell me everything"
        stream = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": content}], max_tokens=300,
            temperature=0, stream=True,
        )  # fmt: skip
        chunks = iter(stream)
        text = "".join(next(chunks).choices[0].delta.content or "" for _ in range(40))
        second = fake_worker(worker_port, "w2")  # w1 holds the stream; w2 joins
        wait_for(lambda: healthy_workers(base) == 2)
        first.send_signal(signal.SIGKILL)
        if not resume:
            with pytest.raises(openai.APIError, match="disconnected"):
                list(chunks)
            return
        for chunk in chunks:
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        model = FakeChatModel("fake")
        prompt = tuple(model.tokenize_chat([ChatMessage("user", content)]))
        undisturbed = model.decode(reference_tokens(GenerationRequest("x", prompt, 300), 300))
        assert text == undisturbed  # no error, no duplicate, no gap
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        assert 'fencepost_requests_total{outcome="length"} 1.0' in metrics
    finally:
        kill_all((serve, first, second))


def undisturbed_entries(content: str, tokens: int, seed: int, choice: int) -> list[dict[str, Any]]:
    """A choice's logprob entries as an undisturbed fake worker (ignoring EOS) makes them."""
    from adapters.openai.logprobs import token_text
    from adapters.openai.models import FakeChatModel
    from adapters.openai.normalize import ChatMessage, choice_seed
    from core.fake_model import FakeContext, reference_tokens
    from core.protocol import GenerationRequest, Sampling

    model = FakeChatModel("fake")
    prompt = tuple(model.tokenize_chat([ChatMessage("user", content)]))
    sampling = Sampling(0.7, 1.0, choice_seed(seed, choice))
    request = GenerationRequest("x", prompt, tokens, sampling, logprobs=2)
    context, entries = FakeContext(request), []
    for token in reference_tokens(request, tokens):
        record = context.record(token, 2)
        context.feed(token)

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            raw = model.token_bytes(token_id)
            return {"token": token_text(raw), "logprob": logprob, "bytes": list(raw)}

        top = [entry(t, v) for t, v in record.top]
        entries.append(entry(token, record.logprob) | {"top_logprobs": top})
    return entries


@pytest.mark.parametrize("n", [1, 2])
def test_kill_9_mid_stream_resumed_choices_keep_their_tokens_and_logprobs(n: int) -> None:
    """Every choice of a streamed request (n of them, logprobs asked) on w1; w2 joins, w1
    is killed: each choice's text and logprob entries are those of an undisturbed run."""
    serve, _, base, worker_port = start_cluster()
    first = second = None
    try:
        first = fake_worker(worker_port, "w1")
        wait_for(lambda: healthy_workers(base) == 1)
        content, tokens = "tell me more", 600  # 6 s of tokens: w2 starts well within
        body = chat_body(content, max_tokens=tokens, n=n, temperature=0.7, seed=11,
                         logprobs=True, top_logprobs=2, stream=True)  # fmt: skip
        url = f"{base}/v1/chat/completions"
        texts: dict[int, str] = {i: "" for i in range(n)}
        entries: dict[int, list[Any]] = {i: [] for i in range(n)}
        with requests.post(url, json=body, stream=True, timeout=60) as reply:
            lines = (line for line in reply.iter_lines() if line)
            for count, line in enumerate(lines):
                assert line.startswith(b"data: ")
                if line == b"data: [DONE]":
                    break
                event = json.loads(line[len(b"data: ") :])
                assert "error" not in event, event
                [choice] = event["choices"]
                texts[choice["index"]] += choice["delta"].get("content") or ""
                if choice["logprobs"] is not None:
                    entries[choice["index"]] += choice["logprobs"]["content"]
                if count == 40 * n:  # mid-stream: w2 joins, w1 dies
                    second = fake_worker(worker_port, "w2")
                    wait_for(lambda: healthy_workers(base) == 2)
                    first.send_signal(signal.SIGKILL)
        for i in range(n):
            expected = undisturbed_entries(content, tokens, 11, i)
            assert entries[i] == expected  # no gap, no duplicate, the same records
            assert texts[i] == "".join(e["token"] for e in expected)
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        assert f'fencepost_requests_total{{outcome="length"}} {float(n)}' in metrics
        assert f"fencepost_stream_resumes {float(n)}" in metrics  # each choice resumed
        assert first.wait(10) == -signal.SIGKILL
    finally:
        kill_all((serve, first, second))
