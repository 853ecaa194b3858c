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

Stored responses (store.py) live in this process: GET and DELETE
/v1/responses/{id}, its input_items, and previous_response_id read them.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
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
from adapters.openai.egress import ClientLimits, ClientOverflow, ClientQueue
from adapters.openai.errors import OpenAIError, from_outcome, invalid
from adapters.openai.metrics import Metrics
from adapters.openai.models import ServedModel
from adapters.openai.normalize import (
    ChatJob,
    ChatMessage,
    CompletionJob,
    ModelInfo,
    normalize_chat_request,
    normalize_completion_request,
)
from adapters.openai.response_answer import ResponseAnswer
from adapters.openai.responses import ResponsesJob, normalize_responses_request
from adapters.openai.store import ResponseStore, StoreLimits
from adapters.openai.tokenizing import detokenize, tokenize
from adapters.openai.tools import Tool
from adapters.runtime.controller import Controller, RequestStream
from core.protocol import DeliverError, GenerationRequest

log = logging.getLogger("fencepost.http")

J = TypeVar("J", ChatJob, CompletionJob, ResponsesJob)  # what a request normalizes to
# (body, model) -> the answer of /tokenize or /detokenize, or its refusal
CountAnswer = Callable[[dict[str, Any], ServedModel], dict[str, Any] | OpenAIError]


@dataclass
class HttpLimits:
    max_body_bytes: int = 1024 * 1024
    body_timeout_s: float = 30.0  # a declared body must arrive within this (else 408)
    client: ClientLimits = field(default_factory=ClientLimits)
    store: StoreLimits = field(default_factory=StoreLimits)  # stored Responses
    reasoning_field: str = "reasoning_content"  # thinking's key: or "reasoning", "both"
    reasoning_budget: int | None = None  # thinking tokens when a request names none


def error_response(error: OpenAIError) -> Response:
    return Response(
        msgspec.json.encode(error.body()), error.status, content_type="application/json"
    )


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


class FencepostApp:
    def __init__(
        self,
        controller: Controller,
        models: Sequence[ServedModel],
        limits: HttpLimits | None = None,
        keys: ApiKeys | None = None,
    ) -> None:
        self.controller = controller
        self.keys = keys if keys is not None else ApiKeys()
        self.models = {m.id: m for m in models}
        self.limits = limits or HttpLimits()
        self.metrics = Metrics(controller)
        self.dashboard = Dashboard(controller)
        self._sampling = trio.CancelScope()
        self.store = ResponseStore(self.limits.store)
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
        app.add_url_rule("/v1/completions", view_func=self.completions, methods=["POST"])
        app.add_url_rule("/v1/responses", view_func=self.responses, methods=["POST"])
        one = "/v1/responses/<response_id>"
        app.add_url_rule(one, view_func=self.get_response, methods=["GET"])
        app.add_url_rule(one, view_func=self.delete_response, methods=["DELETE"])
        app.add_url_rule(f"{one}/input_items", view_func=self.input_items, methods=["GET"])
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
        """The dashboard's history, sampled in the app's nursery while it serves."""

        async def sample() -> None:
            with self._sampling:
                await self.dashboard.run()

        self.quart.nursery.start_soon(sample)

    async def _stop_sampling(self) -> None:
        # A coroutine, so that Quart calls it in the event loop: a plain function it
        # would run on a worker thread, where cancelling a trio scope raises.
        self._sampling.cancel()

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
        return await self._respond(answer, shared.stream)

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
        accepted = await self._accept(
            "resp_",
            lambda body, answer_id: normalize_responses_request(
                body,
                self._resolve_model,
                self._tokenize_chat,
                answer_id,
                self.store.conversation,
            ),
        )
        if isinstance(accepted, Response):
            return accepted
        answer_id, job, choices = accepted
        store = self.store if job.store else None
        answer = ResponseAnswer(answer_id, job, choices[0], job.shared.model.call_syntax, store)
        return await self._respond(answer, job.shared.stream)

    async def get_response(self, response_id: str) -> Response:
        stored = self.store.get(response_id)
        if stored is None:
            return error_response(_response_not_found(response_id))
        return json_response(stored.response)

    async def delete_response(self, response_id: str) -> Response:
        if not self.store.delete(response_id):
            return error_response(_response_not_found(response_id))
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, response_id: str) -> Response:
        """A stored response's input items, a page at a time (`limit`, `order`, `after`)."""
        stored = self.store.get(response_id)
        if stored is None:
            return error_response(_response_not_found(response_id))
        args = request.args
        limit = args.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= 100:
            return error_response(invalid("'limit' must be an integer from 1 to 100", "limit"))
        order = args.get("order", "desc")
        if order not in ("asc", "desc"):
            return error_response(invalid("'order' must be 'asc' or 'desc'", "order"))
        items = list(stored.items) if order == "asc" else list(reversed(stored.items))
        after = args.get("after")
        if after is not None:
            at = next((i for i, item in enumerate(items) if item["id"] == after), None)
            if at is None:
                return error_response(invalid(f"'after': no input item '{after}'", "after"))
            items = items[at + 1 :]
        page = items[: int(limit)]
        body = {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
        return json_response(body)

    # --- the path every API shares ---

    async def _accept(
        self, prefix: str, normalize: Callable[[object, str], J | OpenAIError]
    ) -> tuple[str, J, list[Choice]] | Response:
        """Read, validate and submit one request of any endpoint: its answer id, its
        job and a Choice per requested choice, or the error response that refuses it."""
        body = await self._json_body()
        if isinstance(body, OpenAIError):
            return self._reject(body)
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
        texts: list[list[str]] = [[] for _ in answer.choices]
        try:
            async with trio.open_nursery() as nursery:
                for choice in answer.choices:
                    nursery.start_soon(
                        self._collect, choice, texts[choice.index], nursery.cancel_scope
                    )
        finally:
            for choice in answer.choices:
                choice.record("cancelled")  # a no-op unless the client went away
        error = next((c.error for c in answer.choices if c.error is not None), None)
        if error is not None:
            return error_response(error)
        return json_response(answer.body(["".join(t) for t in texts]))

    async def _collect(self, choice: Choice, text: list[str], siblings: trio.CancelScope) -> None:
        async with choice.stream as stream:
            async for item in stream:
                step = choice.apply(item)
                if step.error is not None:
                    siblings.cancel()  # one failed choice fails the response
                    return
                text.append(step.text)
                if step.finish_reason is not None:
                    return  # after a stop string, leaving the block cancels the generation

    def _start_stream(self, answer: Answer) -> Response:
        queue = ClientQueue(self.limits.client, answer.encode_delta, answer.delta_overhead)
        scope = trio.CancelScope()
        nursery: trio.Nursery = self.quart.nursery
        nursery.start_soon(self._pump, answer, queue, scope)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return Response(
            SSEBody(queue, scope), 200, content_type="text/event-stream", headers=headers
        )

    async def _pump(self, answer: Answer, queue: ClientQueue, scope: trio.CancelScope) -> None:
        try:
            with scope:
                answer.opening(queue)
                async with trio.open_nursery() as nursery:
                    for choice in answer.choices:
                        nursery.start_soon(
                            self._pump_one, choice, answer, queue, nursery.cancel_scope
                        )
                if all(c.finish_reason is not None for c in answer.choices):
                    answer.closing(queue)
        finally:
            for choice in answer.choices:
                choice.record("cancelled")  # the client went away first
            queue.close()

    async def _pump_one(
        self, choice: Choice, answer: Answer, queue: ClientQueue, siblings: trio.CancelScope
    ) -> None:
        """One choice's deliveries into the shared queue (chunks of choices interleave)."""
        async with choice.stream as stream:
            async for item in stream:
                if siblings.cancel_called:  # a sibling failed: nothing more goes out
                    return
                step = choice.apply(item)
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


def _model_not_found(model_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"the model '{model_id}' does not exist", "invalid_request_error", "model",
        "model_not_found",
    )  # fmt: skip


__all__ = ["ClientOverflow", "FencepostApp", "HttpLimits"]


def _response_not_found(response_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"no stored response has the id '{response_id}'", "invalid_request_error",
        "response_id", "response_not_found",
    )  # fmt: skip
