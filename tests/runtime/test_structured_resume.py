"""kill -9 the real-model worker serving a json_schema stream: the resumed stream equals
the undisturbed run and is valid JSON (real processes, the default model, 127.0.0.1)."""

from __future__ import annotations

import json
import subprocess

import openai

from tests.support.process_helpers import (
    kill_the_serving_worker_after_a_token,
    metric,
    router_with_workers,
)
from tests.support.runtime_helpers import kill_all

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 30},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 99},
            "minItems": 12,
            "maxItems": 12,
        },
        "done": {"type": "boolean"},
    },
    "required": ["title", "scores", "done"],
    "additionalProperties": False,
}


def test_kill_9_mid_json_schema_stream_resumes_to_the_same_valid_json() -> None:
    processes: list[subprocess.Popen[str]] = []
    try:
        base, health = router_with_workers(
            processes,
            ["--heartbeat-timeout", "10", "--max-context", "512"],
            ["--slots", "2", "--max-context", "512", "--weights", "fp32"],
        )
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
        model = client.models.list().data[0].id

        def stream() -> openai.Stream:  # type: ignore[type-arg]
            return client.chat.completions.create(
                model=model, temperature=0, max_tokens=150, stream=True,
                messages=[{"role": "user", "content": "Score a film twelve times, as JSON."}],
                response_format={"type": "json_schema",
                                 "json_schema": {"name": "scores", "schema": SCHEMA}},
            )  # fmt: skip

        undisturbed = "".join(c.choices[0].delta.content or "" for c in stream() if c.choices)
        chunks = iter(stream())
        text = kill_the_serving_worker_after_a_token(chunks, processes, health)
        finish = None
        for chunk in chunks:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert metric(base, "fencepost_stream_resumes") == 1  # it died mid-answer
        assert (text, finish) == (undisturbed, "stop")
        answer = json.loads(text)
        assert len(answer["scores"]) == 12 and isinstance(answer["done"], bool)
    finally:
        kill_all(processes)
