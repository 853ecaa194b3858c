"""`fencepost serve` as a real process: remote workers, then SIGTERM with a stream in flight."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.support.http_helpers import chat_body, sse_events
from tests.support.process_helpers import (
    LogWatcher,
    fencepost,
    healthy_workers,
    metric,
    serving_worker,
    wait_for,
    worker_health,
)
from tests.support.runtime_helpers import kill_all


def test_serve_with_a_remote_worker_then_sigterm_drains_and_exits_0(tmp_path: Path) -> None:
    serve = fencepost("serve", "--fake", "--port", "0",
                      "--worker-listen", "127.0.0.1:0", "--no-local-worker",
                      "--heartbeat-timeout", "5", "--drain-timeout", "60")  # fmt: skip
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
        LogWatcher(worker)  # reads its log, so that a full pipe never blocks it
        wait_for(lambda: requests.get(f"{base}/health", timeout=10).status_code == 200)
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
        wait_for(lambda: metric(base, "fencepost_active_requests") == 1)  # it is in flight
        serve.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert serve.wait(120) == 0
        # it left when the stream ended, not at the 60 s drain timeout
        assert time.monotonic() - began < 45
        reader.join(60)
        events = sse_events(result["body"])
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 400
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{base}/health", timeout=5)
        time.sleep(0.2)  # the log reader takes the last lines
        assert not [line for line in log.lines if "Traceback" in line], "".join(log.lines)
    finally:
        kill_all((serve, worker))


def start_cluster(*serve_flags: str) -> tuple[subprocess.Popen[str], LogWatcher, str, str]:
    serve = fencepost("serve", "--fake", "--port", "0", "--worker-listen", "127.0.0.1:0",
                      "--no-local-worker", "--heartbeat-timeout", "3", *serve_flags)  # fmt: skip
    log = LogWatcher(serve)
    http_port = log.find(r"serving fake on http://127\.0\.0\.1:(\d+)/v1").group(1)
    worker_port = log.find(r"accepting workers on 127\.0\.0\.1:(\d+)").group(1)
    return serve, log, f"http://127.0.0.1:{http_port}", worker_port


def fake_worker(worker_port: str, worker_id: str, *extra: str) -> LogWatcher:
    """A fake worker process, its log read from the start (a pipe nobody reads would
    block it once full)."""
    return LogWatcher(fencepost(
        "worker", "--connect", f"127.0.0.1:{worker_port}", "--fake", "--fake-ignore-eos",
        "--worker-id", worker_id, "--heartbeat-interval", "0.2", *extra,
    ))  # fmt: skip


@pytest.mark.parametrize("resume", [True, False])
def test_kill_9_mid_stream_the_sdk_stream_resumes_on_the_other_worker(resume: bool) -> None:
    from adapters.openai.models import FakeChatModel
    from adapters.openai.normalize import ChatMessage
    from core.fake_model import reference_tokens
    from core.protocol import GenerationRequest

    serve, _, base, worker_port = start_cluster(*([] if resume else ["--no-resume"]))
    workers: list[subprocess.Popen[str]] = []
    try:
        health = []
        for worker_id in ("w1", "w2"):
            log = fake_worker(worker_port, worker_id, "--fake-step-ms", "10",
                              "--health-listen", "127.0.0.1:0")  # fmt: skip
            workers.append(log.process)
            health.append(worker_health(log))
        wait_for(lambda: healthy_workers(base) == 2)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        content, tokens = "tell me everything", 800
        stream = client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": content}], max_tokens=tokens,
            temperature=0, stream=True,
        )  # fmt: skip
        chunks = iter(stream)
        text = "".join(next(chunks).choices[0].delta.content or "" for _ in range(40))
        # 8 s of tokens, 0.4 s of them read: kill the worker that serves the stream
        workers[serving_worker(health)].send_signal(signal.SIGKILL)
        if not resume:
            with pytest.raises(openai.APIError, match="disconnected"):
                list(chunks)
            return
        for chunk in chunks:
            text += chunk.choices[0].delta.content or "" if chunk.choices else ""
        model = FakeChatModel("fake")
        prompt = tuple(model.tokenize_chat([ChatMessage("user", content)]))
        request = GenerationRequest("x", prompt, tokens)
        assert text == model.decode(reference_tokens(request, tokens))  # no gap, no repeat
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        assert 'fencepost_requests_total{outcome="length"} 1.0' in metrics
        assert "fencepost_stream_resumes 1.0" in metrics  # resumed, not served whole by luck
    finally:
        kill_all((serve, *workers))


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
    """Every choice of a streamed request (n of them, logprobs asked) on w1; w2 wakes, w1
    is killed: each choice's text and logprob entries are those of an undisturbed run."""
    serve, _, base, worker_port = start_cluster()
    workers: list[subprocess.Popen[str]] = []
    try:
        # w2 starts now (a process start can take seconds on a busy machine) and is
        # frozen once linked: the router sees it silent, so every choice goes to w1.
        # w1 steps at 20 ms (the same tokens, slower): 12 s of them, ample time for w2
        # to wake and link again before the kill.
        logs = [fake_worker(worker_port, "w1", "--fake-step-ms", "20"),
                fake_worker(worker_port, "w2", "--fake-step-ms", "10")]  # fmt: skip
        workers = [log.process for log in logs]
        wait_for(lambda: healthy_workers(base) == 2)
        first, second = workers
        second.send_signal(signal.SIGSTOP)
        wait_for(lambda: healthy_workers(base) == 1)
        content, tokens = "tell me more", 600
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
                if count == 40 * n:  # mid-stream: w2 wakes and is healthy again, w1 dies
                    second.send_signal(signal.SIGCONT)
                    wait_for(lambda: healthy_workers(base) == 2)
                    first.send_signal(signal.SIGKILL)
        for i in range(n):
            expected = undisturbed_entries(content, tokens, 11, i)
            assert entries[i] == expected  # no gap, no duplicate, the same records
            assert texts[i] == "".join(e["token"] for e in expected)
        metrics = requests.get(f"{base}/metrics", timeout=10).text
        assert f'fencepost_requests_total{{outcome="length"}} {float(n)}' in metrics
        assert f"fencepost_stream_resumes {float(n)}" in metrics  # each choice resumed
        assert first.wait(30) == -signal.SIGKILL
    finally:
        kill_all((serve, *workers))
