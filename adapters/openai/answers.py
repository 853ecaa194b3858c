"""How an answer looks: one request's choices, from deliveries to the JSON and SSE frames
of its API.

Every API answers through the same two pieces. A Choice is one GenerationRequest
being answered: its deliveries become text (detokenizer, stop strings, logprob
entries: TextEgress), its timings go to the metrics, and its outcome is recorded
once. An Answer is one HTTP request's response: its choices, its id, and how its
chunks, its final body and its usage look. ChatAnswer (/v1/chat/completions) and
CompletionAnswer (/v1/completions) live here; ResponseAnswer (/v1/responses) in
responses.py. The server (server.py) drives any of them the same way: submit,
then pump a stream or collect a plain body.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any, NamedTuple

import msgspec
import trio

from adapters.openai.callsyntax import HERMES, CallSyntax
from adapters.openai.egress import IncrementalDetokenizer, Sink, StopMatcher
from adapters.openai.errors import OpenAIError, from_outcome
from adapters.openai.logprobs import Entry, LogprobEntries, chat_logprobs, completion_logprobs
from adapters.openai.metrics import Metrics
from adapters.openai.models import ServedModel
from adapters.openai.reasoning import INSIDE, REASONING, TAG, ThinkingSplit, ThinkingStart, Trimmed
from adapters.openai.toolcalls import Call, Content, read_answer
from adapters.openai.tools import NO_TOOLS, ToolCall, ToolSetup
from adapters.runtime.controller import RequestStream
from core.protocol import DeliverError, DeliverFinished, DeliverToken, Delivery, TokenLogprob

DONE = b"data: [DONE]\n\n"
REASONING_KEYS = {
    "reasoning_content": ("reasoning_content",),
    "reasoning": ("reasoning",),
    "both": ("reasoning_content", "reasoning"),
}
FINISH_REASONS = {"eos": "stop", "length": "length"}


class TextEgress:
    """Token ids in, client text out: detokenizer, stop strings, the count, and (when
    asked) the logprob entries that go out with the text (logprobs.py).

    `marked`: the text is read for tool calls, so it keeps the call syntax's markers
    that are special tokens (models.py); the reader takes them out of the content.
    Stop strings see them, as they see every other character of the text.

    `thinking`: the answer of a thinking model (reasoning.py). Its thinking block's
    tokens go to a detokenizer of their own, trimmed of the whitespace at either end,
    and come out of `take_reasoning`; the tags go to neither side; stop strings,
    logprob entries and tool calls see the content alone, whose whitespace just
    after the closing tag is dropped (as if part of the tag)."""

    def __init__(
        self,
        model: ServedModel,
        stops: tuple[str, ...],
        logprobs: bool = False,
        marked: bool = False,
        thinking: ThinkingStart | None = None,
    ) -> None:
        decode = model.decode_with_markers if marked else model.decode
        self.detokenizer = IncrementalDetokenizer(decode)
        self.stop = StopMatcher(stops)
        self.completion_tokens = 0
        self.reasoning_tokens = 0  # of completion_tokens, those of the thinking block
        self.logprobs = LogprobEntries(model.token_bytes) if logprobs else None
        self.split = ThinkingSplit(thinking) if thinking is not None else None
        self.thought = IncrementalDetokenizer(model.decode)
        self.trim = Trimmed()
        self.reasoning = ""  # thinking text not yet taken
        self.after_close = False  # content's leading whitespace still to drop

    @property
    def stopped(self) -> bool:
        return self.stop.matched is not None

    def token(self, token_id: int, record: TokenLogprob | None = None) -> str:
        self.completion_tokens += 1
        if self.split is not None:
            route = self.split.route(token_id)
            if route == REASONING:
                self.reasoning_tokens += 1
                self.reasoning += self.trim.push(self.thought.push(token_id))
                return ""
            if route == TAG:
                self.reasoning_tokens += 1
                if self.split.closed:
                    self._end_thinking()
                return ""
        text = self.detokenizer.push(token_id)
        if self.after_close:
            text = text.lstrip()
            self.after_close = not text
        if self.logprobs is not None:
            self.logprobs.add(token_id, record, text)
        return self.stop.feed(text)

    def _end_thinking(self) -> None:
        self.reasoning += self.trim.push(self.thought.flush())
        self.trim.end()
        self.after_close = True

    def take_reasoning(self) -> str:
        """The thinking text released since the last call."""
        text, self.reasoning = self.reasoning, ""
        return text

    def entries(self, sent: str, ended: bool) -> tuple[Entry, ...]:
        """The entries that go out with `sent` (at the end: all there will be)."""
        if self.logprobs is None:
            return ()
        if ended:
            return tuple(self.logprobs.finish(sent, self.stopped))
        return tuple(self.logprobs.release(sent))

    def finish(self) -> str:
        if self.split is not None and self.split.state == INSIDE:
            self._end_thinking()  # the answer ended inside its thinking (length)
        text = self.detokenizer.flush()
        if self.after_close:
            text = text.lstrip()
        text = self.stop.feed(text)
        return text + self.stop.flush()


class Step(NamedTuple):
    """What one delivery means for the client."""

    text: str  # the text it completes (often "" while a character or stop is pending)
    finish_reason: str | None = None  # the answer ends here: "stop" or "length"
    error: OpenAIError | None = None  # the answer ends here with this error
    entries: tuple[Entry, ...] = ()  # logprob entries of the tokens whose text this begins
    reasoning: str = ""  # thinking text it completes (a thinking model's, reasoning.py)


class Choice:
    """One GenerationRequest being answered: its deliveries to text, timings, outcome.

    One per choice: n for a chat completion, n per prompt for a legacy completion.
    """

    def __init__(
        self,
        metrics: Metrics,
        model: ServedModel,
        stream: RequestStream,
        index: int,
        stop: tuple[str, ...],
        marked: bool = False,  # read for tool calls (TextEgress)
        thinking: ThinkingStart | None = None,  # a thinking model's answer (TextEgress)
    ) -> None:
        self.metrics = metrics
        self.stream = stream
        self.index = index
        self.began = trio.current_time()
        self.last_token_at: float | None = None
        self.asks_logprobs = stream.request.logprobs is not None
        self.egress = TextEgress(model, stop, self.asks_logprobs, marked, thinking)
        self.thinks = thinking is not None
        self.reasoning = ""  # the thinking text so far (the plain body's)
        self.text = ""  # the answer's text so far (the plain body's; streams send theirs)
        self.entries: list[Entry] = []  # every entry released so far, in order
        self.outcome_recorded = False
        self.finish_reason: str | None = None
        self.error: OpenAIError | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.stream.request.prompt_token_ids)

    def on_token(self, token_id: int, record: TokenLogprob | None) -> str:
        now = trio.current_time()
        metrics = self.metrics
        if self.last_token_at is None:
            metrics.ttft.observe(now - self.began)
        else:
            metrics.inter_token.observe(now - self.last_token_at)
        self.last_token_at = now
        metrics.completion_tokens.inc()
        before = self.egress.reasoning_tokens
        text = self.egress.token(token_id, record)
        if self.egress.reasoning_tokens != before:
            metrics.reasoning_tokens.inc()
        return text

    def apply(self, item: Delivery) -> Step:
        """One delivery in, what the client gets; records the outcome when it ends.

        The streamed and the plain response both read deliveries through here,
        so they agree on text, stop strings and finish reasons.
        """
        step = self._apply(item)
        if self.thinks:
            reasoning = self.egress.take_reasoning()
            self.reasoning += reasoning
            step = step._replace(reasoning=reasoning)
        return step

    def _apply(self, item: Delivery) -> Step:
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
            self.metrics.requests.labels(outcome).inc()


class Answer:
    """The response to one HTTP request, as the server drives it: its choices, then
    (streamed) an opening, each choice's text and finish, and a closing or an
    error, into a ClientQueue; or (plain) a body from each choice's text.

    The pump, the plain-response collector, errors and metrics are the server's,
    the same for every API; an Answer says only what its API's frames and bodies
    look like.
    """

    delta_overhead: int | None = None  # for ClientQueue: None measures an empty delta

    def __init__(self, answer_id: str, choices: list[Choice]) -> None:
        self.id = answer_id
        self.choices = choices  # in choice order

    def opening(self, queue: Sink) -> None:
        """What a stream sends before any generated text."""

    def put_text(self, queue: Sink, index: int, text: str, entries: Sequence[Entry] = ()) -> None:
        """Choice `index` generated `text` (after stop strings), with the logprob
        entries that go out with it."""
        raise NotImplementedError

    def put_reasoning(self, queue: Sink, index: int, text: str) -> None:
        """Choice `index` thought `text` (a thinking model's, before its answer's text);
        an API without a place for thinking drops it."""

    def put_finish(self, queue: Sink, index: int, finish_reason: str) -> None:
        """Choice `index` ended: stream what it still holds and its end."""
        raise NotImplementedError

    def put_error(self, queue: Sink, error: OpenAIError) -> None:
        """The answer failed after its stream began: say so in-stream and end it."""
        queue.put_frame(b"data: " + msgspec.json.encode(error.body()) + b"\n\n" + DONE)

    def closing(self, queue: Sink) -> None:
        """Every choice finished: what ends the stream."""
        queue.put_frame(DONE)

    def encode_delta(self, text: str, index: int) -> bytes:
        """The frame of a (possibly merged) text delta of choice `index`."""
        raise NotImplementedError

    def body(self, texts: list[str]) -> dict[str, Any]:
        """The plain (not streamed) response, given each choice's generated text."""
        raise NotImplementedError


class ChoicesAnswer(Answer):
    """Chat and legacy completions: `choices` in every chunk and body; ChatAnswer and
    CompletionAnswer differ only in a choice's JSON."""

    chunk_object = ""

    def __init__(
        self,
        answer_id: str,
        model: str,
        include_usage: bool,
        choices: list[Choice],
        n: int,
    ) -> None:
        super().__init__(answer_id, choices)
        self.model = model
        self.include_usage = include_usage
        self.n = n  # choices per prompt
        self.created = int(time.time())
        base = {"id": self.id, "object": self.chunk_object, "created": self.created}
        self._base = base | {"model": model, "system_fingerprint": None}

    def usage(self) -> dict[str, Any]:
        # Each prompt counts once, however many choices it has (as OpenAI counts);
        # choices[::n] is the first choice of each prompt.
        prompt = sum(g.prompt_tokens for g in self.choices[:: self.n])
        completion = sum(g.egress.completion_tokens for g in self.choices)
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

    # --- what differs between the two ---

    def put_text(self, queue: Sink, index: int, text: str, entries: Sequence[Entry] = ()) -> None:
        """Stream text (entries in a frame of their own, since frames with entries do
        not merge like text)."""
        if entries:
            queue.put_frame(self.delta_chunk(text, index, entries))
        elif text:
            queue.put_delta(text, index)

    def put_finish(self, queue: Sink, index: int, finish_reason: str) -> None:
        queue.put_frame(self.finish_chunk(index, finish_reason))

    def closing(self, queue: Sink) -> None:
        if self.include_usage:
            queue.put_frame(self.usage_chunk())
        queue.put_frame(DONE)

    def encode_delta(self, text: str, index: int) -> bytes:
        return self.delta_chunk(text, index)

    def delta_chunk(self, text: str, index: int, entries: Sequence[Entry] = ()) -> bytes:
        """A chunk of one choice's text, with the logprob entries that go out with it."""
        raise NotImplementedError

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        raise NotImplementedError


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatAnswer(ChoicesAnswer):
    """Chat: content deltas, or, when the request has tools to call, content and
    tool-call deltas as each choice's reader of the model's call syntax finds them
    (callsyntax.py, toolcalls.py)."""

    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        answer_id: str,
        model: str,
        include_usage: bool,
        choices: list[Choice],
        n: int,
        tools: ToolSetup = NO_TOOLS,
        syntax: CallSyntax = HERMES,
        reasoning_field: str = "reasoning_content",
    ) -> None:
        super().__init__(answer_id, model, include_usage, choices, n)
        # Where thinking goes: reasoning_content (DeepSeek's, llama.cpp's, SGLang's
        # name), reasoning (vLLM's since 2026), or both.
        self.reasoning_keys = REASONING_KEYS[reasoning_field]
        self.thinks = any(c.thinks for c in choices)
        self.tools = tools
        self.syntax = syntax
        self.names = frozenset(t.name for t in tools.callable)
        self.readers = {
            g.index: syntax.reader(self.names, new_call_id, tools.parallel) for g in choices
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

    def opening(self, queue: Sink) -> None:
        for choice in self.choices:  # each choice opens with the role
            queue.put_frame(self._chunk(choice.index, {"role": "assistant", "content": ""}))

    def delta_chunk(self, text: str, index: int, entries: Sequence[Entry] = ()) -> bytes:
        return self._chunk(index, {"content": text}, entries=entries)

    def put_reasoning(self, queue: Sink, index: int, text: str) -> None:
        if text:
            queue.put_frame(self._chunk(index, dict.fromkeys(self.reasoning_keys, text)))

    def usage(self) -> dict[str, Any]:
        usage: dict[str, Any] = super().usage()
        if self.thinks:
            reasoning = sum(g.egress.reasoning_tokens for g in self.choices)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage

    def finish_chunk(self, index: int, finish_reason: str) -> bytes:
        return self._chunk(index, {}, finish_reason)

    def put_text(self, queue: Sink, index: int, text: str, entries: Sequence[Entry] = ()) -> None:
        if not self.tools.parses:
            return super().put_text(queue, index, text, entries)
        if text:
            self._put_pieces(queue, index, self.readers[index].feed(text))
        if entries:  # the reader may hold text back: entries go in a chunk of their own
            queue.put_frame(self._chunk(index, {}, entries=entries))

    def put_finish(self, queue: Sink, index: int, finish_reason: str) -> None:
        if not self.tools.parses:
            return super().put_finish(queue, index, finish_reason)
        reader = self.readers[index]
        self._put_pieces(queue, index, reader.finish())
        queue.put_frame(self.finish_chunk(index, with_calls(finish_reason, reader.calls)))

    def _put_pieces(self, queue: Sink, index: int, pieces: list[Content | Call]) -> None:
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
            self._choice(choice, text) for choice, text in zip(self.choices, texts, strict=True)
        ]
        return self.result("chat.completion", choices)

    def _choice(self, choice: Choice, text: str) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if choice.thinks:
            message.update(dict.fromkeys(self.reasoning_keys, choice.reasoning or None))
        finish_reason = choice.finish_reason
        if self.tools.parses:
            content, calls = read_answer(
                text, self.names, new_call_id, self.tools.parallel, self.syntax.reader
            )
            message["content"] = content
            if calls:
                message["tool_calls"] = [_call_json(c) for c in calls]
                assert finish_reason is not None
                finish_reason = with_calls(finish_reason, calls)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": chat_logprobs(choice.entries) if choice.asks_logprobs else None,
            "finish_reason": finish_reason,
        }


def with_calls(finish_reason: str, calls: list[ToolCall]) -> str:
    """An answer that ended by itself after calling tools finishes with "tool_calls"."""
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _call_json(call: ToolCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


class CompletionAnswer(ChoicesAnswer):
    """The legacy /v1/completions: `text_completion` objects, n choices per prompt."""

    chunk_object = "text_completion"

    def __init__(
        self,
        answer_id: str,
        model: str,
        include_usage: bool,
        choices: list[Choice],
        n: int,
        echoes: list[str],
    ) -> None:
        super().__init__(answer_id, model, include_usage, choices, n)
        self.echoes = echoes  # per choice: the prompt text to put first ("" without echo)

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, queue: Sink) -> None:
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
            for g, echo, text in zip(self.choices, self.echoes, texts, strict=True)
        ]
        return self.result("text_completion", choices)
