"""The HTTP app: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics.

Served on Quart-trio. Chat and the legacy completions differ only in the JSON
they read and write (normalize.py; ChatAnswer, CompletionAnswer); the rest is
one path: submit, pump or collect, errors, metrics. Every choice is its own
GenerationRequest (normalize.py): a request with n choices is n of them, a
legacy completion with several prompts n per prompt (choice prompt * n + i).
The router never sees n; the choices of a prompt share its prefill through
the engine's prefix cache.

A request is validated completely (normalize.py) before anything is sent, so
every validation failure is an HTTP error with the OpenAI envelope. A request
that fails at once (no worker, queue full, shutting down) is also answered
with an HTTP error. Only after a stream has started does an error travel
in-stream, as `data: {"error": ...}` followed by `data: [DONE]`.

Streaming: a pump task (in the app's nursery) reads the request's deliveries
as they arrive, detokenizes, applies stop strings, and puts SSE frames into a
ClientQueue; the response body takes from that queue. The pump never waits
for the client, so a slow reader costs only its own queue (see egress.py).
When the client disconnects, Quart-trio cancels the response, the body is
closed, and closing it cancels the pump, which cancels the request.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

import msgspec
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from adapters.openai.callsyntax import HERMES, CallSyntax
from adapters.openai.egress import (
    ClientLimits,
    ClientOverflow,
    ClientQueue,
    IncrementalDetokenizer,
    StopMatcher,
)
from adapters.openai.errors import OpenAIError, from_outcome, invalid
from adapters.openai.logprobs import Entry, LogprobEntries, chat_logprobs, completion_logprobs
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
from adapters.openai.toolcalls import Call, Content, read_answer
from adapters.openai.tools import NO_TOOLS, Tool, ToolCall, ToolSetup
from adapters.runtime.controller import Controller, RequestStream
from core.protocol import (
    DeliverError,
    DeliverFinished,
    DeliverToken,
    Delivery,
    GenerationRequest,
    TokenLogprob,
)

log = logging.getLogger("fencepost.http")

J = TypeVar("J", ChatJob, CompletionJob)  # what an endpoint's request normalizes to

DONE = b"data: [DONE]\n\n"
FINISH_REASONS = {"eos": "stop", "length": "length"}


@dataclass
class HttpLimits:
    max_body_bytes: int = 1024 * 1024
    body_timeout_s: float = 30.0  # a declared body must arrive within this (else 408)
    client: ClientLimits = field(default_factory=ClientLimits)


def error_response(error: OpenAIError) -> Response:
    return Response(
        msgspec.json.encode(error.body()), error.status, content_type="application/json"
    )


def json_response(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status, content_type="application/json")


class TextEgress:
    """Token ids in, client text out: detokenizer, stop strings, the count, and (when
    asked) the logprob entries that go out with the text (logprobs.py).

    `marked`: the text is read for tool calls, so it keeps the call syntax's markers
    that are special tokens (models.py); the reader takes them out of the content.
    Stop strings see them, as they see every other character of the text."""

    def __init__(
        self,
        model: ServedModel,
        stops: tuple[str, ...],
        logprobs: bool = False,
        marked: bool = False,
    ) -> None:
        decode = model.decode_with_markers if marked else model.decode
        self.detokenizer = IncrementalDetokenizer(decode)
        self.stop = StopMatcher(stops)
        self.completion_tokens = 0
        self.logprobs = LogprobEntries(model.token_bytes) if logprobs else None

    @property
    def stopped(self) -> bool:
        return self.stop.matched is not None

    def token(self, token_id: int, record: TokenLogprob | None = None) -> str:
        self.completion_tokens += 1
        text = self.detokenizer.push(token_id)
        if self.logprobs is not None:
            self.logprobs.add(token_id, record, text)
        return self.stop.feed(text)

    def entries(self, sent: str, ended: bool) -> tuple[Entry, ...]:
        """The entries that go out with `sent` (at the end: all there will be)."""
        if self.logprobs is None:
            return ()
        if ended:
            return tuple(self.logprobs.finish(sent, self.stopped))
        return tuple(self.logprobs.release(sent))

    def finish(self) -> str:
        text = self.stop.feed(self.detokenizer.flush())
        return text + self.stop.flush()


class Step(NamedTuple):
    """What one delivery means for the client."""

    text: str  # the text it completes (often "" while a character or stop is pending)
    finish_reason: str | None = None  # the answer ends here: "stop" or "length"
    error: OpenAIError | None = None  # the answer ends here with this error
    entries: tuple[Entry, ...] = ()  # logprob entries of the tokens whose text this begins


class Generation:
    """One GenerationRequest being answered: its deliveries to text, timings, outcome.

    One per choice: n for a chat completion, n per prompt for a legacy completion.
    """

    def __init__(
        self,
        app: FencepostApp,
        model: ServedModel,
        stream: RequestStream,
        index: int,
        stop: tuple[str, ...],
        marked: bool = False,  # read for tool calls (TextEgress)
    ) -> None:
        self.app = app
        self.stream = stream
        self.index = index
        self.began = trio.current_time()
        self.last_token_at: float | None = None
        self.asks_logprobs = stream.request.logprobs is not None
        self.egress = TextEgress(model, stop, self.asks_logprobs, marked)
        self.entries: list[Entry] = []  # every entry released so far, in order
        self.outcome_recorded = False
        self.finish_reason: str | None = None
        self.error: OpenAIError | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.stream.request.prompt_token_ids)

    def on_token(self, token_id: int, record: TokenLogprob | None) -> str:
        now = trio.current_time()
        metrics = self.app.metrics
        if self.last_token_at is None:
            metrics.ttft.observe(now - self.began)
        else:
            metrics.inter_token.observe(now - self.last_token_at)
        self.last_token_at = now
        metrics.completion_tokens.inc()
        return self.egress.token(token_id, record)

    def apply(self, item: Delivery) -> Step:
        """One delivery in, what the client gets; records the outcome when it ends.

        The streamed and the plain response both read deliveries through here,
        so they agree on text, stop strings and finish reasons.
        """
        egress = self.egress
        match item:
            case DeliverToken(token_id=token_id, logprob=record):
                text = self.on_token(token_id, record)
                if egress.stopped:
                    return self._ended(Step(text, "stop", entries=self._released(text, True)))
                return Step(text, entries=self._released(text, False))
            case DeliverFinished(reason=reason):
                text = egress.finish()
                finish_reason = "stop" if egress.stopped else FINISH_REASONS[reason]
                return self._ended(Step(text, finish_reason, entries=self._released(text, True)))
            case DeliverError(kind=kind, message=message):
                self.record(f"error_{kind}")
                self.error = from_outcome(kind, message)
                return Step("", error=self.error)
        raise AssertionError(f"not a delivery: {item!r}")

    def _released(self, text: str, ended: bool) -> tuple[Entry, ...]:
        entries = self.egress.entries(text, ended)
        self.entries += entries
        return entries

    def _ended(self, step: Step) -> Step:
        assert step.finish_reason is not None
        self.finish_reason = step.finish_reason
        self.record(step.finish_reason)
        return step

    def record(self, outcome: str) -> None:
        if not self.outcome_recorded:
            self.outcome_recorded = True
            self.app.metrics.requests.labels(outcome).inc()


class Answer:
    """The response to one HTTP request: its generations, ids, and how chunks look.

    ChatAnswer and CompletionAnswer differ only in the JSON; the pump, the
    plain-response collector, errors and metrics are the same code for both.
    """

    chunk_object = ""

    def __init__(
        self,
        answer_id: str,
        model: str,
        include_usage: bool,
        generations: list[Generation],
        n: int,
    ) -> None:
        self.id = answer_id
        self.model = model
        self.include_usage = include_usage
        self.generations = generations  # in choice order
        self.n = n  # choices per prompt
        self.created = int(time.time())
        base = {"id": self.id, "object": self.chunk_object, "created": self.created}
        self._base = base | {"model": model, "system_fingerprint": None}

    def usage(self) -> dict[str, int]:
        # Each prompt counts once, however many choices it has (as OpenAI counts);
        # generations[::n] is the first choice of each prompt.
        prompt = sum(g.prompt_tokens for g in self.generations[:: self.n])
        completion = sum(g.egress.completion_tokens for g in self.generations)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def frame(self, choice: dict[str, Any]) -> bytes:
        body = self._base | {"choices": [choice]}
        if self.include_usage:
            body["usage"] = None
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def usage_chunk(self) -> bytes:
        body = self._base | {"choices": [], "usage": self.usage()}
        return b"data: " + msgspec.json.encode(body) + b"\n\n"

    def result(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": self.usage(),
        }

    # --- what differs between the endpoints ---

    def opening(self, queue: ClientQueue) -> None:
        """What a stream sends before any generated text."""

    def put_text(
        self, queue: ClientQueue, index: int, text: str, entries: Sequence[Entry] = ()
    ) -> None:
        """Choice `index` generated `text` (after stop strings), with the logprob entries
        that go out with it: stream them (entries in a frame of their own, since frames
        with entries do not merge like text)."""
        if entries:
            queue.put_frame(self.delta_chunk(text, index, entries))
        elif text:
            queue.put_delta(text, index)

    def put_finish(self, queue: ClientQueue, index: int, finish_reason: str) -> None:
        """Choice `index` ended: stream what it still holds and its finish chunk."""
        queue.put_frame(self.finish_chunk(index, finish_reason))

    def delta_chunk(self, text: str, index: int, entries: Sequence[Entry] = ()) -> bytes:
        """A chunk of one choice's text, with the logprob entries that go out with it."""
        raise NotImplementedError

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        raise NotImplementedError

    def body(self, texts: list[str]) -> dict[str, Any]:
        """The plain (not streamed) response, given each choice's generated text."""
        raise NotImplementedError


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatAnswer(Answer):
    """Chat: content deltas, or, when the request has tools to call, content and
    tool-call deltas as each choice's reader of the model's call syntax finds them
    (callsyntax.py, toolcalls.py)."""

    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        answer_id: str,
        model: str,
        include_usage: bool,
        generations: list[Generation],
        n: int,
        tools: ToolSetup = NO_TOOLS,
        syntax: CallSyntax = HERMES,
    ) -> None:
        super().__init__(answer_id, model, include_usage, generations, n)
        self.tools = tools
        self.syntax = syntax
        self.names = frozenset(t.name for t in tools.callable)
        self.readers = {
            g.index: syntax.reader(self.names, new_call_id, tools.parallel) for g in generations
        }

    def _chunk(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        entries: Sequence[Entry] = (),
    ) -> bytes:
        logprobs = chat_logprobs(entries) if entries else None
        return self.frame(
            {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        )

    def opening(self, queue: ClientQueue) -> None:
        for generation in self.generations:  # each choice opens with the role
            queue.put_frame(self._chunk(generation.index, {"role": "assistant", "content": ""}))

    def delta_chunk(self, text: str, index: int, entries: Sequence[Entry] = ()) -> bytes:
        return self._chunk(index, {"content": text}, entries=entries)

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return self._chunk(index, {}, finish_reason)

    def put_text(
        self, queue: ClientQueue, index: int, text: str, entries: Sequence[Entry] = ()
    ) -> None:
        if not self.tools.parses:
            return super().put_text(queue, index, text, entries)
        if text:
            self._put_pieces(queue, index, self.readers[index].feed(text))
        if entries:  # the reader may hold text back: entries go in a chunk of their own
            queue.put_frame(self._chunk(index, {}, entries=entries))

    def put_finish(self, queue: ClientQueue, index: int, finish_reason: str) -> None:
        if not self.tools.parses:
            return super().put_finish(queue, index, finish_reason)
        reader = self.readers[index]
        self._put_pieces(queue, index, reader.finish())
        queue.put_frame(self.finish_chunk(index, _with_calls(finish_reason, reader.calls)))

    def _put_pieces(self, queue: ClientQueue, index: int, pieces: list[Content | Call]) -> None:
        for piece in pieces:
            if isinstance(piece, Content):
                queue.put_delta(piece.text, index)
                continue
            call = piece.call
            first = {"index": piece.index, "id": call.id, "type": "function"}
            first["function"] = {"name": call.name, "arguments": ""}
            queue.put_frame(self._chunk(index, {"tool_calls": [first]}))
            rest = {"index": piece.index, "function": {"arguments": call.arguments}}
            queue.put_frame(self._chunk(index, {"tool_calls": [rest]}))

    def body(self, texts: list[str]) -> dict[str, Any]:
        choices = [
            self._choice(generation, text)
            for generation, text in zip(self.generations, texts, strict=True)
        ]
        return self.result("chat.completion", choices)

    def _choice(self, generation: Generation, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        finish_reason = generation.finish_reason
        if self.tools.parses:
            content, calls = read_answer(
                text, self.names, new_call_id, self.tools.parallel, self.syntax.reader
            )
            message["content"] = content
            if calls:
                message["tool_calls"] = [_call_json(c) for c in calls]
                assert finish_reason is not None
                finish_reason = _with_calls(finish_reason, calls)
        return {
            "index": generation.index,
            "message": message,
            "logprobs": chat_logprobs(generation.entries) if generation.asks_logprobs else None,
            "finish_reason": finish_reason,
        }


def _with_calls(finish_reason: str, calls: list[ToolCall]) -> str:
    """An answer that ended by itself after calling tools finishes with "tool_calls"."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _call_json(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


class CompletionAnswer(Answer):
    """The legacy /v1/completions: `text_completion` objects, n choices per prompt."""

    chunk_object = "text_completion"

    def __init__(
        self,
        answer_id: str,
        model: str,
        include_usage: bool,
        generations: list[Generation],
        n: int,
        echoes: list[str],
    ) -> None:
        super().__init__(answer_id, model, include_usage, generations, n)
        self.echoes = echoes  # per choice: the prompt text to put first ("" without echo)

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, queue: ClientQueue) -> None:
        for index, echo in enumerate(self.echoes):
            if echo:
                queue.put_delta(echo, index)

    def delta_chunk(self, text: str, index: int, entries: Sequence[Entry] = ()) -> bytes:
        logprobs = completion_logprobs(entries, len(self.echoes[index])) if entries else None
        return self.frame(self._choice(index, text, None, logprobs))

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return self.frame(self._choice(index, "", finish_reason))

    def body(self, texts: list[str]) -> dict[str, Any]:
        choices = [
            self._choice(
                g.index,
                echo + text,
                g.finish_reason,
                completion_logprobs(g.entries, len(echo)) if g.asks_logprobs else None,
            )
            for g, echo, text in zip(self.generations, self.echoes, texts, strict=True)
        ]
        return self.result("text_completion", choices)


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
    ) -> None:
        self.controller = controller
        self.models = {m.id: m for m in models}
        self.limits = limits or HttpLimits()
        self.metrics = Metrics(controller)
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

        await self.quart(scope, receive, send_last_shielded)

    def _build(self) -> QuartTrio:
        app = QuartTrio("fencepost")
        app.config["MAX_CONTENT_LENGTH"] = self.limits.max_body_bytes
        app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as generation does
        app.config["BODY_TIMEOUT"] = self.limits.body_timeout_s
        app.add_url_rule("/v1/chat/completions", view_func=self.chat, methods=["POST"])
        app.add_url_rule("/v1/completions", view_func=self.completions, methods=["POST"])
        app.add_url_rule("/v1/models", view_func=self.list_models, methods=["GET"])
        app.add_url_rule("/v1/models/<path:model_id>", view_func=self.get_model, methods=["GET"])
        app.add_url_rule("/health", view_func=self.health, methods=["GET"])
        app.add_url_rule("/metrics", view_func=self.render_metrics, methods=["GET"])
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

    async def health(self) -> Response:
        stats = self.controller.statistics().router
        healthy = sum(w.healthy for w in stats.workers)
        body = {"status": "ok" if healthy else "no_worker", "healthy_workers": healthy}
        return json_response(body, 200 if healthy else 503)

    async def render_metrics(self) -> Response:
        return Response(self.metrics.render(), 200, content_type="text/plain; version=0.0.4")

    # --- chat completions and legacy completions ---

    async def chat(self) -> Response:
        accepted = await self._accept(
            "chatcmpl",
            lambda body, answer_id: normalize_chat_request(
                body, self._resolve_model, self._tokenize_chat, answer_id
            ),
        )
        if isinstance(accepted, Response):
            return accepted
        answer_id, job, generations = accepted
        shared = job.shared
        answer = ChatAnswer(
            answer_id,
            shared.model.id,
            shared.include_usage,
            generations,
            shared.n,
            job.tools,
            shared.model.call_syntax,
        )
        return await self._respond(answer, shared.stream)

    async def completions(self) -> Response:
        accepted = await self._accept(
            "cmpl",
            lambda body, answer_id: normalize_completion_request(
                body, self._resolve_model, self._tokenize, answer_id
            ),
        )
        if isinstance(accepted, Response):
            return accepted
        answer_id, job, generations = accepted
        shared = job.shared
        model = self.models[shared.model.id]
        echoes = [
            (p.text if p.text is not None else model.decode(list(p.token_ids))) if job.echo else ""
            for p in job.prompts
            for _ in range(shared.n)  # every choice of a prompt echoes it
        ]
        answer = CompletionAnswer(
            answer_id, model.id, shared.include_usage, generations, shared.n, echoes
        )
        return await self._respond(answer, shared.stream)

    async def _accept(
        self, prefix: str, normalize: Callable[[object, str], J | OpenAIError]
    ) -> tuple[str, J, list[Generation]] | Response:
        """Read, validate and submit one request of either endpoint: its answer id, its
        job and a Generation per choice, or the error response that refuses it."""
        body = await self._json_body()
        if isinstance(body, OpenAIError):
            return self._reject(body)
        answer_id = f"{prefix}-{uuid.uuid4().hex}"
        job = normalize(body, answer_id)
        if isinstance(job, OpenAIError):
            return self._reject(job)
        streams = self._submit(list(job.requests))
        if isinstance(streams, Response):
            return streams
        shared = job.shared
        model = self.models[shared.model.id]
        marked = isinstance(job, ChatJob) and job.tools.parses
        generations = [
            Generation(self, model, s, i, shared.stop, marked) for i, s in enumerate(streams)
        ]
        return answer_id, job, generations

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
            model.id, model.max_context, model.vocab_size, model.constrains, model.call_syntax
        )

    def _tokenize_chat(
        self, model_id: str, messages: Sequence[ChatMessage], tools: tuple[Tool, ...]
    ) -> list[int]:
        return self.models[model_id].tokenize_chat(messages, tools)

    def _tokenize(self, model_id: str, text: str) -> list[int]:
        return self.models[model_id].tokenize(text)

    async def _respond(self, answer: Answer, stream: bool) -> Response:
        if stream:
            return self._start_stream(answer)
        return await self._complete(answer)

    async def _complete(self, answer: Answer) -> Response:
        texts: list[list[str]] = [[] for _ in answer.generations]
        try:
            async with trio.open_nursery() as nursery:
                for generation in answer.generations:
                    nursery.start_soon(
                        self._collect, generation, texts[generation.index], nursery.cancel_scope
                    )
        finally:
            for generation in answer.generations:
                generation.record("cancelled")  # a no-op unless the client went away
        error = next((g.error for g in answer.generations if g.error is not None), None)
        if error is not None:
            return error_response(error)
        return json_response(answer.body(["".join(t) for t in texts]))

    async def _collect(
        self, generation: Generation, text: list[str], siblings: trio.CancelScope
    ) -> None:
        async with generation.stream as stream:
            async for item in stream:
                step = generation.apply(item)
                if step.error is not None:
                    siblings.cancel()  # one failed choice fails the response
                    return
                text.append(step.text)
                if step.finish_reason is not None:
                    return  # after a stop string, leaving the block cancels the generation

    def _start_stream(self, answer: Answer) -> Response:
        queue = ClientQueue(self.limits.client, answer.delta_chunk)
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
                    for generation in answer.generations:
                        nursery.start_soon(
                            self._pump_one, generation, answer, queue, nursery.cancel_scope
                        )
                if all(g.finish_reason is not None for g in answer.generations):
                    if answer.include_usage:
                        queue.put_frame(answer.usage_chunk())
                    queue.put_frame(DONE)
        finally:
            for generation in answer.generations:
                generation.record("cancelled")  # the client went away first
            queue.close()

    async def _pump_one(
        self, generation: Generation, answer: Answer, queue: ClientQueue, siblings: trio.CancelScope
    ) -> None:
        """One generation's deliveries into the shared queue (chunks of choices interleave)."""
        async with generation.stream as stream:
            async for item in stream:
                if siblings.cancel_called:  # a sibling failed: nothing more goes out
                    return
                step = generation.apply(item)
                answer.put_text(queue, generation.index, step.text, step.entries)
                if step.error is not None:
                    body = msgspec.json.encode(step.error.body())
                    queue.put_frame(b"data: " + body + b"\n\n" + DONE)
                    siblings.cancel()
                    return
                if step.finish_reason is not None:
                    answer.put_finish(queue, generation.index, step.finish_reason)
                    return
                if queue.failed is not None:
                    generation.record("overflow")
                    log.warning("%s: %s; cancelled", answer.id, queue.failed)
                    siblings.cancel()
                    return


def _model_not_found(model_id: str) -> OpenAIError:
    return OpenAIError(
        404, f"the model '{model_id}' does not exist", "invalid_request_error", "model",
        "model_not_found",
    )  # fmt: skip


__all__ = ["ClientOverflow", "FencepostApp", "HttpLimits"]
