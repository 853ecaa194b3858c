"""The HTTP app: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health,
/live, /metrics, /dashboard (with /dashboard.json, its data: dashboard.py), and /tokenize
and /detokenize (tokenizing.py), which count tokens without generating.

Served on Quart-trio. The three generating APIs differ only in the JSON they
read (normalize.py, responses.py) and write (answers.py, response_answer.py);
the rest is one path: submit, pump or collect, errors, metrics. Every choice
is its own GenerationRequest: a chat request with n choices is n of them, a
legacy completion with several prompts n per prompt (choice prompt * n + i),
a response one. The router never sees n; the choices of a prompt share its
prefill through the engine's prefix cache.

A request is validated completely before anything is sent, so every
validation failure is an HTTP error with the OpenAI envelope. A request that
fails at once (no worker, queue full, shutting down) is also answered with an
HTTP error. Only after a stream has started does an error travel in-stream,
in its API's form (chat and completions: `data: {"error": ...}` then
`data: [DONE]`; responses: a response.failed event).

Streaming: a pump task (in the app's nursery) reads the request's deliveries
as they arrive, detokenizes, applies stop strings, and puts SSE frames into a
ClientQueue; the response body takes from that queue. The pump never waits
for the client, so a slow reader costs only its own queue (see egress.py).
When the client disconnects, Quart-trio cancels the response, the body is
closed, and closing it cancels the pump, which cancels the request.

Stored responses and chat completions live in the state store
(adapters/state, chosen by --state-store; store.py says what is kept): GET
and DELETE /v1/responses/{id}, its input_items, previous_response_id, and the
stored chat completions' list, retrieve, update and delete read it, on any
router that shares the store. A stored response that streams or runs in the
background is a LiveRun (live.py): generated apart from the connection, its
numbered events kept, so a client may rejoin it (`GET /v1/responses/{id}
?stream=true&starting_after=N`) and `POST .../cancel` may stop it. Each router
holds a lease in the store while it lives and renews it; any router fails the
live responses of a router whose lease lapsed (it died), so none stays
`in_progress` forever.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from adapters.openai.answers import (
    Answer,
    ChatAnswer,
    Choice,
    CompletionAnswer,
)
from adapters.openai.auth import REFUSAL_BODY, REFUSAL_HEADERS, ApiKeys
from adapters.openai.dashboard import DATA_HEADERS, PAGE, PAGE_HEADERS, Dashboard
from adapters.openai.egress import ClientLimits, ClientOverflow, ClientQueue, Sink
from adapters.openai.errors import OpenAIError, from_outcome, invalid
from adapters.openai.live import EventLog, LiveRun, follow
from adapters.openai.metrics import Metrics
from adapters.openai.models import ServedModel
from adapters.openai.normalize import (
    ChatJob,
    ChatMessage,
    CompletionJob,
    ModelInfo,
    normalize_chat_request,
    normalize_completion_request,
    read_metadata,
)
from adapters.openai.response_answer import ResponseAnswer
from adapters.openai.responses import ResponsesJob, normalize_responses_request
from adapters.openai.store import (
    RETRY_AFTER_S,
    conversation,
    not_found,
    previous_missing,
    store_down,
)
from adapters.openai.tokenizing import detokenize, tokenize
from adapters.openai.tools import Tool
from adapters.runtime.controller import Controller, RequestStream
from adapters.state import (
    Gone,
    Record,
    StateStore,
    StoreLimits,
    StoreUnavailable,
    open_store,
    parse_store,
)
from core.protocol import DeliverError, GenerationRequest

log = logging.getLogger("fencepost.http")

FLUSH_S = 0.1  # a live response's events go to the store in batches this far apart
FINAL_WRITE_S = 10.0  # a live response's final write waits at most this (then it is retried)
LEASE_TICK_S = 0.5  # how often the lease task looks for cancels asked elsewhere
REAP_S = 2.0  # how often it looks for live responses of routers that died
MAX_UNWRITTEN = 1000  # final records held for a store that is down, at most
REMOTE_CANCEL_S = 3.0  # a cancel of another router's response waits this for it to end

J = TypeVar("J", ChatJob, CompletionJob, ResponsesJob)  # what a request normalizes to
Keep = Callable[[], Awaitable[None]]  # stores a finished streamed answer
# (body, model) -> the answer of /tokenize or /detokenize, or its refusal
CountAnswer = Callable[[dict[str, Any], ServedModel], dict[str, Any] | OpenAIError]


@dataclass
class HttpLimits:
    max_body_bytes: int = 1024 * 1024
    body_timeout_s: float = 30.0  # a declared body must arrive within this (else 408)
    client: ClientLimits = field(default_factory=ClientLimits)
    store: StoreLimits = field(default_factory=StoreLimits)  # stored responses and chats
    rejoin_grace_s: float = 30.0  # a stored stream with no reader is cancelled after this
    lease_s: float = 10.0  # a router that has not renewed its lease this long is dead
    reasoning_field: str = "reasoning_content"  # thinking's key: or "reasoning", "both"
    reasoning_budget: int | None = None  # thinking tokens when a request names none


def error_response(error: OpenAIError) -> Response:
    response = Response(
        msgspec.json.encode(error.body()), error.status, content_type="application/json"
    )
    if error.code == "store_unavailable":
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, content_type="application/json")


class SSEBody:
    """The response body of a stream: frames from the ClientQueue until it closes.

    Quart closes it (aclose) when the response ends or is cancelled, which
    stops the pump and so cancels the request.
    """

    def __init__(self, queue: ClientQueue, pump_scope: trio.CancelScope) -> None:
        self.queue = queue
        self.pump_scope = pump_scope

    def __aiter__(self) -> SSEBody:
        return self

    async def __anext__(self) -> bytes:
        data = await self.queue.take()  # ClientOverflow propagates: the connection is dropped
        if not data:
            raise StopAsyncIteration
        return data

    async def aclose(self) -> None:
        self.pump_scope.cancel()


class FollowBody:
    """The body of a stream of stored events (live.follow); `left` runs when it closes,
    however it ends (finished, or the client went away)."""

    def __init__(self, frames: AsyncIterator[bytes], left: Callable[[], None]) -> None:
        self.frames = frames
        self.left = left
        self.closed = False

    def __aiter__(self) -> FollowBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await anext(self.frames)
        except StoreUnavailable as down:
            log.warning("a stream of stored events ends early: %s", down)
            raise StopAsyncIteration from down

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.left()
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:
                await aclose()


class FencepostApp:
    def __init__(
        self,
        controller: Controller,
        models: Sequence[ServedModel],
        limits: HttpLimits | None = None,
        keys: ApiKeys | None = None,
        state: StateStore | None = None,
    ) -> None:
        self.controller = controller
        self.keys = keys if keys is not None else ApiKeys()
        self.models = {m.id: m for m in models}
        self.limits = limits or HttpLimits()
        self.metrics = Metrics(controller)
        self.dashboard = Dashboard(controller)
        self._sampling = trio.CancelScope()
        # The state store: an in-memory one unless the caller (serve.py) opened another.
        self.state = state or open_store(parse_store("memory"), self.limits.store)
        self.owner = controller.router.config.router_id or "router-" + uuid.uuid4().hex[:8]
        self.runs: dict[str, LiveRun] = {}  # this router's live responses, by id
        # Final records whose write failed (the store was down): retried while it lives.
        self.unwritten: dict[str, tuple[Record, list[str], int]] = {}
        self._leasing = trio.CancelScope()
        self.metrics.live_responses.set_function(lambda: len(self.runs))
        self.created = int(time.time())
        self.quart = self._build()

    async def asgi(self, scope: Any, receive: Any, send: Any) -> None:
        """The ASGI entry point Hypercorn serves (the Quart app, with one fix).

        A response's last message makes Hypercorn finish the exchange inside
        that send: start the next keep-alive cycle, or, when the client's body
        is unfinished (a 408 or 413 before it all arrived), shut the socket.
        Quart-trio cancels its request task as soon as Hypercorn reports the
        exchange over, which lands in the middle of that very send, so the
        shutdown was cut short and the socket stayed open until the client
        left. The last send is therefore shielded; it does no unbounded
        waiting that is not already shielded inside Hypercorn.
        """

        async def send_last_shielded(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        if scope["type"] == "http" and self.keys.needs_key(scope["path"]):
            headers = dict(scope["headers"])  # lower-cased names, as ASGI gives them
            if not self.keys.admits(headers.get(b"authorization")):
                self.metrics.unauthorized.inc()
                await self._refuse(send_last_shielded)
                return
        await self.quart(scope, receive, send_last_shielded)

    async def _refuse(self, send: Any) -> None:
        """401 before Quart: no body read, nothing built, nothing sent on (auth.py)."""
        headers = list(REFUSAL_HEADERS)
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": REFUSAL_BODY})

    def _build(self) -> QuartTrio:
        app = QuartTrio("fencepost")
        app.config["MAX_CONTENT_LENGTH"] = self.limits.max_body_bytes
        app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as generation does
        app.config["BODY_TIMEOUT"] = self.limits.body_timeout_s
        app.add_url_rule("/v1/chat/completions", view_func=self.chat, methods=["POST"])
        app.add_url_rule("/v1/chat/completions", view_func=self.list_chats, methods=["GET"])
        chat = "/v1/chat/completions/<completion_id>"
        app.add_url_rule(chat, view_func=self.get_chat, methods=["GET"])
        app.add_url_rule(chat, view_func=self.update_chat, methods=["POST"])
        app.add_url_rule(chat, view_func=self.delete_chat, methods=["DELETE"])
        app.add_url_rule(f"{chat}/messages", view_func=self.chat_messages, methods=["GET"])
        app.add_url_rule("/v1/completions", view_func=self.completions, methods=["POST"])
        app.add_url_rule("/v1/responses", view_func=self.responses, methods=["POST"])
        one = "/v1/responses/<response_id>"
        app.add_url_rule(one, view_func=self.get_response, methods=["GET"])
        app.add_url_rule(one, view_func=self.delete_response, methods=["DELETE"])
        app.add_url_rule(f"{one}/input_items", view_func=self.input_items, methods=["GET"])
        app.add_url_rule(f"{one}/cancel", view_func=self.cancel_response, methods=["POST"])
        app.add_url_rule("/v1/models", view_func=self.list_models, methods=["GET"])
        app.add_url_rule("/v1/models/<path:model_id>", view_func=self.get_model, methods=["GET"])
        app.add_url_rule("/tokenize", view_func=self.tokenize, methods=["POST"])
        app.add_url_rule("/detokenize", view_func=self.detokenize, methods=["POST"])
        app.add_url_rule("/health", view_func=self.health, methods=["GET"])
        app.add_url_rule("/live", view_func=self.live, methods=["GET"])
        app.add_url_rule("/metrics", view_func=self.render_metrics, methods=["GET"])
        app.add_url_rule("/dashboard", view_func=self.dashboard_page, methods=["GET"])
        app.add_url_rule("/dashboard.json", view_func=self.dashboard_data, methods=["GET"])
        app.before_serving(self._start_sampling)
        app.after_serving(self._stop_sampling)
        app.register_error_handler(HTTPException, self.http_error)
        app.register_error_handler(Exception, self.internal_error)
        return app

    # --- errors from the framework (404, 405, 413, ...) and from our own bugs ---

    async def http_error(self, error: HTTPException) -> Response:
        status = error.code or 500
        if status == 413:
            message = f"the request body exceeds {self.limits.max_body_bytes} bytes"
            response = error_response(OpenAIError(413, message, code="request_too_large"))
        else:
            kind = "invalid_request_error" if status < 500 else "server_error"
            response = error_response(OpenAIError(status, error.description or error.name, kind))
        # The request's body may be unread (too large, or a route that takes none):
        # the connection cannot carry another request after it.
        response.headers["Connection"] = "close"
        return response

    async def internal_error(self, error: Exception) -> Response:
        log.exception("unhandled error", exc_info=error)
        return error_response(OpenAIError(500, "internal server error", "server_error"))

    # --- small endpoints ---

    async def list_models(self) -> Response:
        return json_response({"object": "list", "data": [self._model(m) for m in self.models]})

    async def get_model(self, model_id: str) -> Response:
        if model_id not in self.models:
            return error_response(_model_not_found(model_id))
        return json_response(self._model(model_id))

    def _model(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "fencepost"}

    async def live(self) -> Response:
        """200 while the event loop answers, workers or not (a liveness probe; open)."""
        return json_response({"status": "alive"})

    async def health(self) -> Response:
        stats = self.controller.statistics().router
        healthy = sum(w.healthy for w in stats.workers)
        body = {"status": "ok" if healthy else "no_worker", "healthy_workers": healthy}
        return json_response(body, 200 if healthy else 503)

    async def render_metrics(self) -> Response:
        return Response(self.metrics.render(), 200, content_type="text/plain; version=0.0.4")

    async def dashboard_page(self) -> Response:
        """The cluster page: static, open like /health; its data is behind the key."""
        headers = PAGE_HEADERS
        return Response(PAGE, 200, content_type="text/html; charset=utf-8", headers=headers)

    async def dashboard_data(self) -> Response:
        """What the page polls; guarded exactly like /metrics (auth.py)."""
        body = msgspec.json.encode(self.dashboard.data())
        return Response(body, 200, content_type="application/json", headers=DATA_HEADERS)

    async def _start_sampling(self) -> None:
        """Open the state store; then the dashboard's history, sampled in the app's
        nursery while it serves, and this router's lease in the store."""
        await self.state.open()

        async def sample() -> None:
            with self._sampling:
                await self.dashboard.run()

        async def lease() -> None:
            with self._leasing:
                await self._keep_lease()

        self.quart.nursery.start_soon(sample)
        self.quart.nursery.start_soon(lease)

    async def _stop_sampling(self) -> None:
        # A coroutine, so that Quart calls it in the event loop: a plain function it
        # would run on a worker thread, where cancelling a trio scope raises.
        self._sampling.cancel()
        self._leasing.cancel()
        for run in list(self.runs.values()):
            run.scope.cancel()  # a live response left is recorded as cancelled
            with trio.move_on_after(FINAL_WRITE_S):
                await run.ended.wait()
        with trio.move_on_after(2), contextlib.suppress(StoreUnavailable):
            await self.state.release(self.owner)
        await self.state.close()

    # --- chat completions and legacy completions ---

    async def chat(self) -> Response:
        accepted = await self._accept(
            "chatcmpl-",
            lambda body, answer_id: normalize_chat_request(
                body, self._resolve_model, self._tokenize_chat, answer_id
            ),
        )
        if isinstance(accepted, Response):
            return accepted
        answer_id, job, choices = accepted
        shared = job.shared
        answer = ChatAnswer(
            answer_id,
            shared.model.id,
            shared.include_usage,
            choices,
            shared.n,
            job.tools,
            shared.model.call_syntax,
            self.limits.reasoning_field,
        )
        if not job.store:
            return await self._respond(answer, shared.stream)
        if shared.stream:
            return self._start_stream(answer, lambda: self._keep_chat(answer, job))
        error = await self._collect_all(answer)
        if error is not None:
            return error_response(error)
        completion = answer.body([choice.text for choice in answer.choices])
        try:
            await self._keep_chat(answer, job, completion)
        except StoreUnavailable as down:
            return self._store_down(down)
        return json_response(completion)

    async def _keep_chat(
        self, answer: ChatAnswer, job: ChatJob, completion: dict[str, Any] | None = None
    ) -> None:
        """Store a finished chat completion (store: true) with its request's messages."""
        if completion is None:  # streamed: the body its chunks add up to
            completion = answer.body([choice.text for choice in answer.choices])
        record = Record(
            id=answer.id,
            kind="chat.completion",
            body=completion | {"metadata": job.metadata},
            items=list(job.messages),
            model=job.shared.model.id,
            created=time.time(),  # finer than the object's `created`: lists keep their order
            metadata=dict(job.metadata),
        )
        await self.state.put(record)
        self.metrics.stored.labels("chat.completion").inc()

    # --- stored chat completions ---

    async def list_chats(self) -> Response:
        """GET /v1/chat/completions: stored ones, oldest first unless `order=desc`, a page
        of `limit` after the id `after`, of one `model`, with every `metadata[KEY]=VALUE`."""
        args = request.args
        page = _page_args(args, default_order="asc")
        if isinstance(page, OpenAIError):
            return error_response(page)
        limit, order, after = page
        wanted = {k[len("metadata[") : -1]: v for k, v in args.items()
                  if k.startswith("metadata[") and k.endswith("]")}  # fmt: skip
        try:
            records = await self.state.list_records("chat.completion", args.get("model"))
        except StoreUnavailable as down:
            return self._store_down(down)
        records = [r for r in records if all(r.metadata.get(k) == v for k, v in wanted.items())]
        bodies = [r.body for r in (records if order == "asc" else reversed(records))]
        return _page(bodies, limit, after)

    async def get_chat(self, completion_id: str) -> Response:
        record = await self._stored(completion_id, "chat.completion")
        return record if isinstance(record, Response) else json_response(record.body)

    async def update_chat(self, completion_id: str) -> Response:
        """POST /v1/chat/completions/{id}: a stored completion's metadata, replaced."""
        body = await self._json_body()
        if isinstance(body, OpenAIError):
            return error_response(body)
        if not isinstance(body, dict) or "metadata" not in body:
            return error_response(invalid("the body must be an object with 'metadata'", "metadata"))
        metadata = read_metadata(body["metadata"])
        if isinstance(metadata, OpenAIError):
            return error_response(metadata)
        record = await self._stored(completion_id, "chat.completion")
        if isinstance(record, Response):
            return record
        try:
            updated = await self.state.update_metadata(completion_id, metadata)
        except StoreUnavailable as down:
            return self._store_down(down)
        if updated is None:  # deleted meanwhile
            return await self.get_chat(completion_id)
        return json_response(updated.body)

    async def delete_chat(self, completion_id: str) -> Response:
        record = await self._stored(completion_id, "chat.completion")
        if isinstance(record, Response):
            return record
        try:
            await self.state.delete(completion_id)
        except StoreUnavailable as down:
            return self._store_down(down)
        body = {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}
        return json_response(body)

    async def chat_messages(self, completion_id: str) -> Response:
        """GET /v1/chat/completions/{id}/messages: the request's messages, each with an id."""
        paged = await self._stored_page(completion_id, "chat.completion", "asc")
        if isinstance(paged, Response):
            return paged
        record, (limit, order, after) = paged
        messages = [
            {"id": f"{completion_id}-{i}", **m} if isinstance(m, dict) else m
            for i, m in enumerate(record.items)
        ]
        return _page(messages if order == "asc" else messages[::-1], limit, after)

    async def completions(self) -> Response:
        accepted = await self._accept(
            "cmpl-",
            lambda body, answer_id: normalize_completion_request(
                body, self._resolve_model, self._tokenize, answer_id
            ),
        )
        if isinstance(accepted, Response):
            return accepted
        answer_id, job, choices = accepted
        shared = job.shared
        model = self.models[shared.model.id]
        echoes = [
            (p.text if p.text is not None else model.decode(list(p.token_ids))) if job.echo else ""
            for p in job.prompts
            for _ in range(shared.n)  # every choice of a prompt echoes it
        ]
        answer = CompletionAnswer(
            answer_id, model.id, shared.include_usage, choices, shared.n, echoes
        )
        return await self._respond(answer, shared.stream)

    # --- counting tokens: nothing is generated, nothing reaches the controller ---

    async def tokenize(self) -> Response:
        """POST /tokenize: a prompt's or a conversation's tokens (tokenizing.py)."""
        return await self._count(tokenize)

    async def detokenize(self) -> Response:
        """POST /detokenize: token ids' text (tokenizing.py)."""
        return await self._count(detokenize)

    async def _count(self, answer: CountAnswer) -> Response:
        body = await self._json_body()
        if isinstance(body, OpenAIError):
            return error_response(body)
        if not isinstance(body, dict):
            return error_response(invalid("the request body must be a JSON object"))
        model = self._pick_model(body.get("model"))
        if isinstance(model, OpenAIError):
            return error_response(model)
        result = answer(body, model)
        if isinstance(result, OpenAIError):
            return error_response(result)
        return json_response(result)

    def _pick_model(self, name: object) -> ServedModel | OpenAIError:
        """The model `name`s; without a name, the one served, if only one is."""
        if name is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        if name is None:
            return invalid("'model' is required: several models are served", "model")
        if not isinstance(name, str) or not name:
            return invalid("'model' must be a non-empty string", "model")
        model = self.models.get(name)
        return model if model is not None else _model_not_found(name)

    # --- the Responses API ---

    async def responses(self) -> Response:
        body = await self._json_body()
        if isinstance(body, OpenAIError):
            return self._reject(body)
        earlier = await self._previous(body)
        accepted = self._admit(
            body,
            "resp_",
            lambda body, answer_id: normalize_responses_request(
                body,
                self._resolve_model,
                self._tokenize_chat,
                answer_id,
                lambda _: earlier,
            ),
        )
        if isinstance(accepted, Response):
            return accepted
        answer_id, job, choices = accepted
        answer = ResponseAnswer(answer_id, job, choices[0], job.shared.model.call_syntax)
        stream = job.shared.stream
        if not job.store:
            return await self._respond(answer, stream)
        if stream or job.background:
            return await self._go_live(answer, job)
        error = await self._collect_all(answer)
        if error is not None:
            return error_response(error)
        response = answer.body([answer.choice.text])
        try:
            await self.state.put(_response_record(answer, response))
            self.metrics.stored.labels("response").inc()
        except StoreUnavailable as down:
            log.warning("%s: not stored: %s", answer_id, down)
            return self._store_down(down)
        return json_response(response)

    async def _previous(self, body: object) -> list[dict[str, Any]] | OpenAIError | None:
        """The conversation `previous_response_id` continues, read from the store first
        (normalizing is pure); None where there is none to read (normalize says why)."""
        previous = body.get("previous_response_id") if isinstance(body, dict) else None
        if not isinstance(previous, str) or not previous:
            return None
        try:
            found = await self.state.get(previous)
        except StoreUnavailable as down:
            self.metrics.store_errors.inc()
            return store_down(down)
        if isinstance(found, Gone):
            return previous_missing(previous, found)
        if found is None or found.kind != "response":
            return None
        if found.live:
            return invalid(
                f"the previous response '{previous}' is still {found.status}: continue it "
                "once it has ended",
                "previous_response_id",
            )
        return conversation(found)

    async def _go_live(self, answer: ResponseAnswer, job: ResponsesJob) -> Response:
        """A stored response that streams or runs in the background: its record is
        written first (owned by this router), then a LiveRun generates it apart from
        this connection, and the client reads its log (or, in the background, gets
        the queued response at once)."""
        record = _response_record(answer, answer.response())
        record.owner, record.background = self.owner, job.background
        try:
            await self.state.create(record)
        except StoreUnavailable as down:
            answer.choice.stream.cancel()
            answer.choice.record("error_store")
            return self._store_down(down)
        run = LiveRun(record, EventLog(answer.encode_delta), answer)
        self.runs[record.id] = run
        self.quart.nursery.start_soon(self._run_live, run)
        if job.shared.stream:
            return self._follow_response(record.id, -1)
        return json_response(record.body)

    async def _run_live(self, run: LiveRun) -> None:
        answer, events = run.answer, run.log
        choice = answer.choice
        try:
            async with trio.open_nursery() as flushing:
                flushing.start_soon(self._flush_live, run)
                try:
                    with run.scope:
                        answer.opening(events)
                        await self._pump_one(choice, answer, events, run.scope)
                        if choice.finish_reason is not None:
                            answer.closing(events)
                finally:
                    choice.record("cancelled")  # a no-op unless it was cancelled
                    if answer.status in ("queued", "in_progress"):
                        answer.status = "cancelled"  # asked for, abandoned, or shut down
                    events.close()
        finally:
            await self._finish_live(run)

    async def _flush_live(self, run: LiveRun) -> None:
        """The run's events into the store in batches, while it runs."""
        warned = False
        while not run.log.closed:
            with trio.move_on_after(FLUSH_S):
                await run.log.wait_beyond(2**62)  # returns when the log closes
            if run.log.closed:
                return  # the final write takes the rest
            try:
                await run.flush(self.state)
            except StoreUnavailable as down:
                if not warned:
                    log.warning("%s: events not stored while it runs: %s", run.id, down)
                    warned = True

    async def _finish_live(self, run: LiveRun) -> None:
        """The final response and the events not yet stored, in one write; shielded,
        so that a cancelled run is still recorded as it ended."""
        record = run.record
        record.body, record.status, record.owner = run.answer.response(), run.answer.status, None
        frames = [frame.decode() for frame in run.log.frames[run.flushed :]]
        with trio.CancelScope(shield=True):
            try:
                with trio.fail_after(FINAL_WRITE_S):
                    await self.state.put(record, frames, run.flushed)
                self.metrics.stored.labels("response").inc()
            except (StoreUnavailable, trio.TooSlowError) as down:
                log.warning("%s: its final record is not stored yet (%s); retrying", run.id, down)
                self.metrics.store_errors.inc()
                self._keep_trying(record, frames, run.flushed)
        del self.runs[run.id]
        run.ended.set()

    def _keep_trying(self, record: Record, frames: list[str], first: int) -> None:
        """A final record the store refused: the lease task retries it (a bounded list:
        past it the oldest is given up, and its record is reaped as failed)."""
        self.unwritten[record.id] = (record, frames, first)
        while len(self.unwritten) > MAX_UNWRITTEN:
            dropped = next(iter(self.unwritten))
            del self.unwritten[dropped]
            log.error("%s: its final record could not be stored; given up", dropped)

    def _follow_response(self, response_id: str, after: int) -> Response:
        """An SSE response of a stored response's events after `after`."""
        run = self.runs.get(response_id)
        if run is not None:
            run.readers += 1
        frames = follow(self.runs, self.state, response_id, after)
        if after >= 0:
            self.metrics.rejoins.inc()

        def left() -> None:
            if run is None:
                return
            run.readers -= 1
            if run.readers == 0 and not run.record.background and not run.log.closed:
                self.quart.nursery.start_soon(self._abandon_later, run)

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        body = FollowBody(frames, left)
        return Response(body, 200, content_type="text/event-stream", headers=headers)

    async def _abandon_later(self, run: LiveRun) -> None:
        """A stored stream whose client left: kept for a reader to rejoin, for a while."""
        await trio.sleep(self.limits.rejoin_grace_s)
        if run.readers == 0 and not run.log.closed:
            log.info("%s: no reader came back in %.0f s; cancelled", run.id,
                     self.limits.rejoin_grace_s)  # fmt: skip
            run.scope.cancel()

    async def _stored(self, record_id: str, kind: str) -> Record | Response:
        """A stored record of `kind`, or the error response that says why not."""
        what = "response" if kind == "response" else "chat completion"
        param, code = (
            ("response_id", "response_not_found")
            if kind == "response"
            else ("completion_id", "chat_completion_not_found")
        )
        run = self.runs.get(record_id) if kind == "response" else None
        if run is not None:
            record = run.record
            record.body = run.answer.response()  # fresher than the store's
            return record
        try:
            found = await self.state.get(record_id)
        except StoreUnavailable as down:
            return self._store_down(down)
        if isinstance(found, Record) and found.kind == kind:
            return found
        gone = found if isinstance(found, Gone) else None
        return error_response(not_found(what, record_id, gone, param, code))

    async def _stored_page(
        self, record_id: str, kind: str, default_order: str
    ) -> tuple[Record, tuple[int, str, str | None]] | Response:
        """A stored record and the page of its conversation a list endpoint asks for."""
        record = await self._stored(record_id, kind)
        if isinstance(record, Response):
            return record
        page = _page_args(request.args, default_order)
        if isinstance(page, OpenAIError):
            return error_response(page)
        return record, page

    def _store_down(self, down: StoreUnavailable) -> Response:
        """The 503 of a request that needs the store, which cannot be reached."""
        self.metrics.store_errors.inc()
        return error_response(store_down(down))

    async def get_response(self, response_id: str) -> Response:
        record = await self._stored(response_id, "response")
        if isinstance(record, Response):
            return record
        args = request.args
        if args.get("stream", "false").lower() not in ("true", "1"):
            return json_response(record.body)
        run = self.runs.get(response_id)
        count = len(run.log) if run is not None else record.events
        if run is None and count == 0 and not record.live:
            message = f"the response '{response_id}' did not stream: it has no events to replay"
            return error_response(invalid(message, "stream"))
        after_text = args.get("starting_after", "-1")
        try:
            after = int(after_text)
        except ValueError:
            after = -2
        if after < -1:
            message = "'starting_after' must be an integer sequence number (or -1: from the start)"
            return error_response(invalid(message, "starting_after"))
        # Another router's live response may have more than the store has seen yet.
        if after >= count and (run is not None or not record.live):
            message = (
                f"'starting_after' is {after}, beyond the last event of '{response_id}' "
                f"({count - 1})"
            )
            return error_response(invalid(message, "starting_after"))
        return self._follow_response(response_id, after)

    async def cancel_response(self, response_id: str) -> Response:
        """POST /v1/responses/{id}/cancel: stop a background response. Its owner stops
        it: this router at once, another when it next reads the store's cancels."""
        record = await self._stored(response_id, "response")
        if isinstance(record, Response):
            return record
        if not record.background:
            message = "only a response created with background: true can be cancelled"
            return error_response(invalid(message, "response_id"))
        run = self.runs.get(response_id)
        if run is not None:
            run.scope.cancel()
            with trio.move_on_after(FINAL_WRITE_S):
                await run.ended.wait()
            return json_response(run.record.body)
        if not record.live:
            return json_response(record.body)  # it has ended: cancelling changes nothing
        try:
            await self.state.request_cancel(response_id)
            found: Record | Gone | None = record
            with trio.move_on_after(REMOTE_CANCEL_S):
                while isinstance(found, Record) and found.live:
                    await trio.sleep(0.1)
                    found = await self.state.get(response_id)
        except StoreUnavailable as down:
            return self._store_down(down)
        if isinstance(found, Record):
            return json_response(found.body)
        return error_response(not_found("response", response_id, found, "response_id",
                                        "response_not_found"))  # fmt: skip

    async def delete_response(self, response_id: str) -> Response:
        if response_id in self.runs:
            message = f"the response '{response_id}' is in progress; cancel it first"
            return error_response(invalid(message, "response_id"))
        record = await self._stored(response_id, "response")
        if isinstance(record, Response):
            return record
        if record.live:
            message = f"the response '{response_id}' is in progress; cancel it first"
            return error_response(invalid(message, "response_id"))
        try:
            await self.state.delete(response_id)
        except StoreUnavailable as down:
            return self._store_down(down)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, response_id: str) -> Response:
        """A stored response's input items, a page at a time (`limit`, `order`, `after`)."""
        paged = await self._stored_page(response_id, "response", "desc")
        if isinstance(paged, Response):
            return paged
        record, (limit, order, after) = paged
        items = list(record.items) if order == "asc" else list(reversed(record.items))
        return _page(items, limit, after)

    # --- the lease: this router's claim on its live responses ---

    async def _keep_lease(self) -> None:
        """Renew this router's lease, act on cancels asked of its live responses
        elsewhere, fail the live responses of routers that died, and retry final
        writes that failed; a store that is down is retried, never fatal."""
        renew_every = self.limits.lease_s / 3
        next_renew = next_reap = trio.current_time()
        down_logged = False
        while True:
            now = trio.current_time()
            try:
                if now >= next_renew:
                    await self.state.renew(self.owner, self.limits.lease_s)
                    next_renew = now + renew_every
                if self.runs:
                    for response_id in await self.state.cancels(self.owner):
                        run = self.runs.get(response_id)
                        if run is not None:
                            run.scope.cancel()
                if now >= next_reap:
                    for response_id in await self.state.reap():
                        log.warning("%s: its router stopped while generating it; failed",
                                    response_id)  # fmt: skip
                    next_reap = now + REAP_S
                for response_id, (record, frames, first) in list(self.unwritten.items()):
                    await self.state.put(record, frames, first)
                    del self.unwritten[response_id]
                if down_logged:
                    log.info("the state store is back: %s", self.state.name)
                    down_logged = False
            except StoreUnavailable as down:
                self.metrics.store_errors.inc()
                if not down_logged:
                    log.warning("the state store is unavailable: %s", down)
                    down_logged = True
            await trio.sleep(LEASE_TICK_S)

    # --- the path every API shares ---

    async def _accept(
        self, prefix: str, normalize: Callable[[object, str], J | OpenAIError]
    ) -> tuple[str, J, list[Choice]] | Response:
        """Read, validate and submit one request of any endpoint: its answer id, its
        job and a Choice per requested choice, or the error response that refuses it."""
        body = await self._json_body()
        if isinstance(body, OpenAIError):
            return self._reject(body)
        return self._admit(body, prefix, normalize)

    def _admit(
        self, body: object, prefix: str, normalize: Callable[[object, str], J | OpenAIError]
    ) -> tuple[str, J, list[Choice]] | Response:
        """Validate and submit a request whose body is read (_accept)."""
        answer_id = prefix + uuid.uuid4().hex
        job = normalize(body, answer_id)
        if isinstance(job, OpenAIError):
            return self._reject(job)
        streams = self._submit(list(job.requests))
        if isinstance(streams, Response):
            return streams
        shared = job.shared
        model = self.models[shared.model.id]
        thinking = None
        if isinstance(job, ChatJob):
            marked, thinking = job.tools.parses, job.thinking
        elif isinstance(job, ResponsesJob):
            marked, thinking = job.tool_setup.parses, job.chat.thinking
        else:
            marked = False
        choices = [
            Choice(self.metrics, model, s, i, shared.stop, marked, thinking)
            for i, s in enumerate(streams)
        ]
        return answer_id, job, choices

    async def _json_body(self) -> object:
        """The decoded JSON body, or the OpenAIError that refuses it."""
        # Read the body even when the request is refused for its content type: a
        # body left unread would be taken for the next request on the connection.
        raw = await request.get_data(cache=False)
        if request.mimetype != "application/json":
            message = "the Content-Type must be application/json"
            return invalid(message, code="unsupported_content_type")
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as error:
            return invalid(f"the request body is not valid JSON: {error}")
        except RecursionError:
            return invalid("the request body is nested too deeply")

    def _submit(self, requests: list[GenerationRequest]) -> list[RequestStream] | Response:
        """Submit every request, or none: one refused at once cancels those before it."""
        streams: list[RequestStream] = []
        for generation_request in requests:
            stream = self.controller.submit(generation_request)  # seeds a sampled request
            if isinstance(stream.outcome, DeliverError):  # refused at once: an HTTP error
                for submitted in streams:
                    submitted.cancel()
                outcome = stream.outcome
                self.metrics.requests.labels(f"error_{outcome.kind}").inc()
                return error_response(from_outcome(outcome.kind, outcome.message))
            streams.append(stream)
        for stream in streams:
            self.metrics.prompt_tokens.inc(len(stream.request.prompt_token_ids))
        return streams

    def _reject(self, error: OpenAIError) -> Response:
        self.metrics.requests.labels(f"rejected_{error.status}").inc()
        return error_response(error)

    def _resolve_model(self, name: str) -> ModelInfo | None:
        model = self.models.get(name)
        if model is None:
            return None
        return ModelInfo(
            model.id,
            model.max_context,
            model.vocab_size,
            model.constrains,
            model.call_syntax,
            model.thinking,
            self.limits.reasoning_budget,
        )

    def _tokenize_chat(
        self,
        model_id: str,
        messages: Sequence[ChatMessage],
        tools: tuple[Tool, ...],
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.models[model_id].tokenize_chat(messages, tools, template_kwargs)

    def _tokenize(self, model_id: str, text: str) -> list[int]:
        return self.models[model_id].tokenize(text)

    async def _respond(self, answer: Answer, stream: bool) -> Response:
        if stream:
            return self._start_stream(answer)
        return await self._complete(answer)

    async def _complete(self, answer: Answer) -> Response:
        error = await self._collect_all(answer)
        if error is not None:
            return error_response(error)
        return json_response(answer.body([choice.text for choice in answer.choices]))

    async def _collect_all(self, answer: Answer) -> OpenAIError | None:
        """Every choice's text (into choice.text), or the error of the first that failed."""
        try:
            async with trio.open_nursery() as nursery:
                for choice in answer.choices:
                    nursery.start_soon(self._collect, choice, nursery.cancel_scope)
        finally:
            for choice in answer.choices:
                choice.record("cancelled")  # a no-op unless the client went away
        return next((c.error for c in answer.choices if c.error is not None), None)

    async def _collect(self, choice: Choice, siblings: trio.CancelScope) -> None:
        async with choice.stream as stream:
            async for item in stream:
                step = choice.apply(item)
                if step.error is not None:
                    siblings.cancel()  # one failed choice fails the response
                    return
                choice.text += step.text
                if step.finish_reason is not None:
                    return  # after a stop string, leaving the block cancels the generation

    def _start_stream(self, answer: Answer, keep: Keep | None = None) -> Response:
        queue = ClientQueue(self.limits.client, answer.encode_delta, answer.delta_overhead)
        scope = trio.CancelScope()
        nursery: trio.Nursery = self.quart.nursery
        nursery.start_soon(self._pump, answer, queue, scope, keep)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return Response(
            SSEBody(queue, scope), 200, content_type="text/event-stream", headers=headers
        )

    async def _pump(
        self, answer: Answer, queue: ClientQueue, scope: trio.CancelScope, keep: Keep | None
    ) -> None:
        try:
            with scope:
                answer.opening(queue)
                async with trio.open_nursery() as nursery:
                    for choice in answer.choices:
                        nursery.start_soon(
                            self._pump_one, choice, answer, queue, nursery.cancel_scope
                        )
                if all(c.finish_reason is not None for c in answer.choices):
                    if keep is not None:  # stored before the stream ends, so a client
                        try:  # that reads it back at once finds it
                            await keep()
                        except StoreUnavailable as down:
                            self.metrics.store_errors.inc()
                            log.warning("%s: not stored: %s", answer.id, down)
                    answer.closing(queue)
        finally:
            for choice in answer.choices:
                choice.record("cancelled")  # the client went away first
            queue.close()

    async def _pump_one(
        self, choice: Choice, answer: Answer, queue: Sink, siblings: trio.CancelScope
    ) -> None:
        """One choice's deliveries into the shared queue (chunks of choices interleave)."""
        async with choice.stream as stream:
            async for item in stream:
                if siblings.cancel_called:  # a sibling failed: nothing more goes out
                    return
                step = choice.apply(item)
                choice.text += step.text
                answer.put_reasoning(queue, choice.index, step.reasoning)
                answer.put_text(queue, choice.index, step.text, step.entries)
                if step.error is not None:
                    answer.put_error(queue, step.error)
                    siblings.cancel()
                    return
                if step.finish_reason is not None:
                    answer.put_finish(queue, choice.index, step.finish_reason)
                    return
                if queue.failed is not None:
                    choice.record("overflow")
                    log.warning("%s: %s; cancelled", answer.id, queue.failed)
                    siblings.cancel()
                    return


def _page_args(args: Any, default_order: str) -> tuple[int, str, str | None] | OpenAIError:
    """A list endpoint's `limit` (1-100, 20 by default), `order` and `after`."""
    limit = args.get("limit", "20")
    if not limit.isdigit() or not 1 <= int(limit) <= 100:
        return invalid("'limit' must be an integer from 1 to 100", "limit")
    order = args.get("order", default_order)
    if order not in ("asc", "desc"):
        return invalid("'order' must be 'asc' or 'desc'", "order")
    return int(limit), order, args.get("after")


def _page(objects: list[dict[str, Any]], limit: int, after: str | None) -> Response:
    """One page of a list, in the order given, after the object whose id is `after`."""
    if after is not None:
        at = next((i for i, thing in enumerate(objects) if thing.get("id") == after), None)
        if at is None:
            return error_response(invalid(f"'after': no object has the id '{after}'", "after"))
        objects = objects[at + 1 :]
    page = objects[:limit]
    body = {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(objects) > len(page),
    }
    return json_response(body)


def _response_record(answer: ResponseAnswer, response: dict[str, Any]) -> Record:
    job = answer.job
    return Record(
        id=answer.id,
        kind="response",
        body=response,
        items=list(job.items),
        model=job.shared.model.id,
        created=time.time(),  # finer than the object's `created_at`: the store's age order
        metadata=dict(job.metadata),
        status=answer.status,
        background=job.background,
    )


def _model_not_found(model_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"the model '{model_id}' does not exist", "invalid_request_error", "model",
        "model_not_found",
    )  # fmt: skip


__all__ = ["ClientOverflow", "FencepostApp", "HttpLimits"]
