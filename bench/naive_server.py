"""The naive server a user would otherwise write: one HF `generate` at a time.

A baseline for `fencepost bench serve`, not a product: POST /v1/chat/completions
(streamed, with usage) on Quart-trio, the same model loaded the same way, and
a lock so requests run one after another through transformers' own generate
loop. Tokens come back through a streamer and go out as SSE chunks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import torch
import trio
from hypercorn.config import Config
from hypercorn.trio import serve
from quart import Response, request
from quart_trio import QuartTrio

from adapters.engine.model import chat_token_ids, load_model
from adapters.openai.egress import IncrementalDetokenizer
from adapters.openai.normalize import OPENAI_DEFAULT_TEMPERATURE
from core.protocol import is_sampled


class _TokenQueue:
    """A transformers streamer: generate() puts token ids, the server takes them."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # the first put is the prompt
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self.items.put(int(token))

    def end(self) -> None:
        self.items.put(None)


def main(port: int, model_path: str | None, threads: int | None) -> int:
    if threads is not None:
        torch.set_num_threads(threads)
    loaded = load_model(model_path)
    from bench.engine import transformers_model

    tokenizer, model = loaded.tokenizer, transformers_model(loaded)
    app = QuartTrio("naive")
    app.config["RESPONSE_TIMEOUT"] = None  # queued streams wait for the lock
    lock = trio.Lock()

    @app.get("/health")
    async def health() -> Response:
        return Response(b"ok", 200)

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        body: dict[str, Any] = await request.get_json()
        ids = chat_token_ids(tokenizer, body["messages"])
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 128)
        temperature = float(body.get("temperature", OPENAI_DEFAULT_TEMPERATURE))

        async def events() -> AsyncIterator[bytes]:
            async with lock:  # one generate at a time: the naive part
                streamer = _TokenQueue()
                settings: dict[str, Any] = {"max_new_tokens": max_tokens, "streamer": streamer}
                if is_sampled(temperature):
                    settings |= {"do_sample": True, "temperature": temperature}
                else:
                    settings |= {"do_sample": False}

                def generate() -> None:
                    with torch.inference_mode():
                        model.generate(torch.tensor([ids]), **settings)

                worker = threading.Thread(target=generate, daemon=True)
                worker.start()
                detok = IncrementalDetokenizer(
                    lambda t: tokenizer.decode(t, skip_special_tokens=True)
                )
                count = 0
                while (token := await trio.to_thread.run_sync(streamer.items.get)) is not None:
                    count += 1
                    delta = {"content": detok.push(token)}
                    yield _frame({"choices": [{"index": 0, "delta": delta}]})
                await trio.to_thread.run_sync(worker.join)
            usage = {"prompt_tokens": len(ids), "completion_tokens": count}
            yield _frame({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
            yield _frame({"choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return Response(events(), 200, content_type="text/event-stream")

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    trio.run(serve, app, config)
    return 0


def _frame(body: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"
