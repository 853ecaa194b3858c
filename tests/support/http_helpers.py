"""A real fencepost server on 127.0.0.1 in a background thread, for HTTP tests."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import requests
import trio

from adapters.cli.serve import FAKE_CONTEXT, ServeOptions, Serving, serve
from adapters.openai.models import FakeChatModel, ServedModel
from adapters.runtime.controller import ControllerStatistics
from adapters.runtime.worker_host import Decoder, FakeDecoder

T = TypeVar("T")


class ServerThread:
    """`with ServerThread(...) as server:` serves until the block ends."""

    def __init__(
        self,
        options: ServeOptions | None = None,
        decoder: Decoder | None = None,
        model: ServedModel | None = None,
    ) -> None:
        self.options = options or ServeOptions(port=0, fake=True)
        context = self.options.max_context or FAKE_CONTEXT
        self.model: ServedModel = model or FakeChatModel("fake", context)
        self.decoder = (decoder or FakeDecoder()) if self.options.local_worker else None
        self._ready: queue.Queue[Serving | BaseException] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None

    def __enter__(self) -> ServerThread:
        self._thread.start()
        ready = self._ready.get(timeout=120)  # a busy machine starts slowly
        if isinstance(ready, BaseException):
            raise ready
        self.serving = ready
        self.base_url = f"http://127.0.0.1:{ready.http_port}"
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self.call(self._stop.set)
        self._thread.join(60)
        assert not self._thread.is_alive(), "the server did not stop"

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the server's trio thread (its objects are not thread-safe)."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    def statistics(self) -> ControllerStatistics:
        return self.call(self.serving.controller.statistics)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as error:  # reported to the test thread
            self._ready.put(error)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            serving = await nursery.start(serve, self.options, self.model, self.decoder, self._stop)
            self._ready.put(serving)


def sse_events(raw: bytes) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded ('[DONE]' kept as the string)."""
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def chat_body(content: str = "hello", **fields: Any) -> dict[str, Any]:
    """A chat request; greedy unless told otherwise, so the fake model's answer is known
    (a sampled request without a seed gets a random one at the server)."""
    body = {"model": "fake", "messages": [{"role": "user", "content": content}], "temperature": 0}
    return body | fields


def post_json(server: ServerThread, path: str, payload: Any) -> requests.Response:
    """POST `payload` as JSON to `path` of a running server."""
    return requests.post(f"{server.base_url}{path}", json=payload, timeout=30)
