"""Speculative decoding across real processes: a stream cut by kill -9, or handed off by a
draining worker, continues to the undisturbed text (the default model, both workers
proposing by n-gram, 127.0.0.1). The answer copies a paragraph, so the runs of guesses
are long and a cut lands inside speculation, not between plain steps."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Iterator

import openai
import pytest
import requests

from bench import speculative
from tests.support.process_helpers import (
    healthy_workers,
    kill_the_serving_worker_after_a_token,
    metric,
    router_with_workers,
    serving_worker,
    wait_for,
)
from tests.support.runtime_helpers import kill_all

pytestmark = pytest.mark.xdist_group("default_model")

PARAGRAPH = (
    "The old lighthouse stood on the northern cliff for more than two hundred years. Every "
    "night its keeper climbed the narrow stairs, trimmed the wick and polished the great "
    "lens until it shone. Ships passing in the dark relied on its steady beam to find the "
    "harbour and avoid the rocks below."
)
PROMPT = f"Repeat this paragraph exactly, word for word:\n\n{PARAGRAPH}"
LONG_PROMPT = f"Repeat this paragraph exactly, word for word:\n\n{speculative.PARAGRAPH}"
SERVE = ["--heartbeat-timeout", "10", "--max-context", "512"]
WORKER = ["--slots", "2", "--max-context", "512", "--speculative", "ngram"]


def accepted(base: str) -> float:
    """Guesses the router's workers (their current processes) report accepted."""
    text = requests.get(f"{base}/metrics", timeout=10).text
    found = re.search(r'^fencepost_speculative_tokens_total\{kind="accepted"\} (\S+)$', text, re.M)
    assert found is not None, text
    return float(found.group(1))


def streamed(chunks: Iterator[openai.types.chat.ChatCompletionChunk]) -> tuple[str, str | None]:
    text, finish = "", None
    for chunk in chunks:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_kill_9_inside_speculative_runs_resumes_to_the_undisturbed_text(
    temperature: float,
) -> None:
    processes: list[subprocess.Popen[str]] = []
    try:
        base, health = router_with_workers(processes, SERVE, WORKER)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id

        def stream() -> openai.Stream:  # type: ignore[type-arg]
            return client.chat.completions.create(
                model=model, temperature=temperature, seed=5, max_tokens=120, stream=True,
                messages=[{"role": "user", "content": PROMPT}],
            )  # fmt: skip

        undisturbed = streamed(iter(stream()))
        wait_for(lambda: accepted(base) > 0, 10)  # the undisturbed answer was speculated
        chunks = iter(stream())
        text = kill_the_serving_worker_after_a_token(chunks, processes, health)
        wait_for(lambda: healthy_workers(base) == 1, 30)  # the figure is the survivor's now
        before = accepted(base)
        rest, finish = streamed(chunks)
        assert metric(base, "fencepost_stream_resumes") == 1  # it died mid-answer
        assert (text + rest, finish) == undisturbed
        wait_for(lambda: accepted(base) > before, 10)  # the survivor speculated the rest
    finally:
        kill_all(processes)


def test_a_draining_worker_hands_a_speculative_stream_off_at_the_exact_token() -> None:
    """A 300-word paragraph to copy: seconds of answer, so the handoff lands inside it."""
    processes: list[subprocess.Popen[str]] = []
    try:
        serve = [*SERVE, "--max-context", "1024"]
        worker = [*WORKER, "--max-context", "1024", "--drain-mode", "handoff",
                  "--drain-timeout", "120"]  # fmt: skip
        base, health = router_with_workers(processes, serve, worker)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id

        def stream() -> openai.Stream:  # type: ignore[type-arg]
            return client.chat.completions.create(
                model=model, temperature=0.8, seed=9, max_tokens=450, stream=True,
                messages=[{"role": "user", "content": LONG_PROMPT}],
            )  # fmt: skip

        undisturbed = streamed(iter(stream()))
        chunks = iter(stream())
        text = ""
        while not text:
            text += next(chunks).choices[0].delta.content or ""
        leaving = processes[1 + serving_worker(health)]
        leaving.send_signal(signal.SIGTERM)
        rest = streamed(chunks)
        assert (text + rest[0], rest[1]) == undisturbed
        assert leaving.wait(60) == 0
        page = requests.get(f"{base}/metrics", timeout=10).text
        assert 'fencepost_stream_handoffs{result="continued"} 1.0' in page, page
        assert metric(base, "fencepost_stream_resumes") == 0  # a handoff, not a loss
    finally:
        kill_all(processes)
