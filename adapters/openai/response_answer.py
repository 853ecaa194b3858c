"""The Responses API's answer: a `response` object, or its typed events streamed.

A thinking model's thinking (answers.Choice routes it, reasoning.py) is the
first item, `reasoning` (`rs_...`), with one `reasoning_text` part and an empty
`summary`; it closes when the thinking block does, or when the answer ends.
Then one choice's text becomes output items as it arrives: text opens a `message`
item with one `output_text` part, a tool call (read out of the text by the
model's call syntax, as for chat) closes any open message and is a
`function_call` item, and text after a call opens a new message. The streamed
and the plain answer run the same builder (the plain one with no queue), so
they hold the same items.

Streamed, every change is an event, `event: <type>` plus `data: {...}`, with
a `sequence_number` counting from 0: response.created and .in_progress;
for the thinking output_item.added, content_part.added, reasoning_text.delta
..., reasoning_text.done, content_part.done, output_item.done;
per message output_item.added, content_part.added, output_text.delta ...,
output_text.done, content_part.done, output_item.done; per call
output_item.added, function_call_arguments.delta and .done,
output_item.done; then response.completed, or response.incomplete (the
token budget ran out: incomplete_details.reason "max_output_tokens"), or
response.failed with the error. Events are encoded when the client's writer
takes them (egress.ClientQueue), which numbers them in the order they go out,
merged text deltas (of the thinking or of a message) included.

A background response is `queued` until its stream opens (response.created
says so), then `in_progress`. The server stores what this builds (store.py,
live.py) unless the request said store false; a run cancelled before it
ended is `cancelled`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec

from adapters.openai.answers import Answer, Choice, new_call_id
from adapters.openai.callsyntax import CallSyntax
from adapters.openai.egress import Sink
from adapters.openai.errors import OpenAIError
from adapters.openai.logprobs import Entry, chat_logprobs
from adapters.openai.reasoning import AFTER
from adapters.openai.responses import ResponsesJob, new_item_id
from adapters.openai.toolcalls import Call, Content, Piece
from adapters.openai.tools import ToolCall

Queue = Sink | None  # None: building the plain answer, nothing is streamed


class ResponseAnswer(Answer):
    delta_overhead = 160  # a text delta event without its text, about

    def __init__(
        self,
        response_id: str,
        job: ResponsesJob,
        choice: Choice,
        syntax: CallSyntax,
    ) -> None:
        super().__init__(response_id, [choice])
        self.job = job
        self.choice = choice
        self.created_at = int(time.time())
        setup = job.tool_setup
        names = frozenset(t.name for t in setup.callable)
        self.reader = syntax.reader(names, new_call_id, setup.parallel) if setup.parses else None
        self.output: list[dict[str, Any]] = []  # the items, as they stand
        self.message: dict[str, Any] | None = None  # the message item being written
        self.thought: dict[str, Any] | None = None  # the reasoning item being written
        self.waiting: list[Entry] = []  # logprob entries whose message is not open yet
        self.status = "queued" if job.background else "in_progress"
        self.error: dict[str, Any] | None = None
        self.sequence = 0

    # --- the stream ---

    def opening(self, queue: Sink) -> None:
        self._emit(queue, "response.created", {"response": self.response()})
        self.status = "in_progress"
        self._emit(queue, "response.in_progress", {"response": self.response()})

    def put_reasoning(self, queue: Sink | None, index: int, text: str) -> None:
        if not text:
            return
        if self.thought is None:
            # Thinking comes before anything else the answer says (reasoning.ThinkingSplit).
            assert not self.output, "thinking after the answer began"
            self._open_thought(queue)
        item = self.thought
        assert item is not None
        item["content"][0]["text"] += text
        if queue is not None:
            queue.put_delta(text, 0)  # encode_delta writes it as reasoning_text.delta

    def put_text(
        self, queue: Sink | None, index: int, text: str, entries: Sequence[Entry] = ()
    ) -> None:
        if self.thought is not None and self._thinking_over():
            self._close_thought(queue)
        self.waiting += entries
        if self.reader is None:
            self._pieces(queue, [Content(text)] if text else [])
        elif text:
            self._pieces(queue, self.reader.feed(text))

    def put_finish(self, queue: Sink | None, index: int, finish_reason: str) -> None:
        ended = "incomplete" if finish_reason == "length" else "completed"
        # Thinking the token budget cut off is incomplete; any other ended with the answer.
        self._close_thought(queue, "completed" if self._thinking_over() else ended)
        if self.reader is not None:
            self._pieces(queue, self.reader.finish())
        if all(item["type"] == "reasoning" for item in self.output):
            self._open_message(queue)  # nothing was answered: one empty message
        if self.message is not None:
            self._attach(self.message, self.waiting)
            self.waiting = []
        self._close_message(queue, ended)
        self.status = ended

    def put_error(self, queue: Sink, error: OpenAIError) -> None:
        self.status = "failed"
        self.error = {"code": error.code or error.type, "message": error.message}
        self._emit(queue, "response.failed", {"response": self.response()})

    def closing(self, queue: Sink) -> None:
        self._emit(queue, f"response.{self.status}", {"response": self.response()})

    def encode_delta(self, text: str, index: int) -> bytes:
        item = self.output[index]
        if item["type"] == "reasoning":
            return self._numbered("response.reasoning_text.delta", self._where(item, index, text))
        return self._numbered("response.output_text.delta", self._delta(item, index, text, []))

    # --- the plain answer ---

    def body(self, texts: list[str]) -> dict[str, Any]:
        choice = self.choice
        self.put_reasoning(None, 0, choice.reasoning)
        self.put_text(None, 0, texts[0], choice.entries)
        assert choice.finish_reason is not None
        self.put_finish(None, 0, choice.finish_reason)
        return self.response()

    def response(self) -> dict[str, Any]:
        """The response object as it stands."""
        job = self.job
        done = self.status in ("completed", "incomplete", "failed", "cancelled")
        usage = None
        if done:
            prompt = self.choice.prompt_tokens
            output = self.choice.egress.completion_tokens
            reasoning = self.choice.egress.reasoning_tokens  # 0 unless the model thinks
            usage = {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": output,
                "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": prompt + output,
            }
        incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": job.background,
            "error": self.error,
            "incomplete_details": incomplete,
            "instructions": job.instructions,
            "max_output_tokens": job.max_output_tokens,
            "max_tool_calls": None,
            "model": job.shared.model.id,
            "output": [dict(item) for item in self.output],
            "parallel_tool_calls": job.tool_setup.parallel,
            "previous_response_id": job.previous_response_id,
            "reasoning": dict(job.reasoning),
            "service_tier": "default",
            "store": job.store,
            "temperature": job.temperature,
            "text": {"format": job.text_format, "verbosity": "medium"},
            "tool_choice": job.tool_choice,
            "tools": list(job.tools),
            "top_logprobs": job.top_logprobs,
            "top_p": job.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": job.user,
            "metadata": job.metadata,
        }

    # --- the items ---

    def _thinking_over(self) -> bool:
        """The thinking block has closed (or this answer has none to come)."""
        split = self.choice.egress.split
        return split is None or split.state == AFTER

    def _open_thought(self, queue: Queue) -> None:
        item: dict[str, Any] = {
            "id": new_item_id("rs"),
            "type": "reasoning",
            "summary": [],
            "content": [],
            "status": "in_progress",
        }
        self.output.append(item)
        self.thought = item
        self._emit(queue, "response.output_item.added", {"output_index": 0, "item": item})
        part = {"type": "reasoning_text", "text": ""}
        self._emit(queue, "response.content_part.added", self._where(item, 0) | {"part": part})
        item["content"] = [part]

    def _close_thought(self, queue: Queue, status: str = "completed") -> None:
        item = self.thought
        if item is None or item["status"] != "in_progress":
            return
        part = item["content"][0]
        where = self._where(item, 0)
        self._emit(queue, "response.reasoning_text.done", where | {"text": part["text"]})
        self._emit(queue, "response.content_part.done", where | {"part": part})
        item["status"] = status
        self._emit(queue, "response.output_item.done", {"output_index": 0, "item": item})

    def _pieces(self, queue: Queue, pieces: list[Piece]) -> None:
        for piece in pieces:
            if isinstance(piece, Call):
                self._call(queue, piece.call)
            elif piece.text:
                self._text(queue, piece.text)

    def _text(self, queue: Queue, text: str) -> None:
        if self.message is None:
            self._open_message(queue)
        item = self.message
        assert item is not None
        part = item["content"][0]
        part["text"] += text
        entries, self.waiting = self.waiting, []
        self._attach(item, entries)
        if queue is None:
            return
        index = self.output.index(item)
        if entries:
            payload = self._delta(item, index, text, entries)
            self._emit(queue, "response.output_text.delta", payload, len(text))
        else:
            queue.put_delta(text, index)

    def _open_message(self, queue: Queue) -> None:
        self._close_thought(queue)
        item: dict[str, Any] = {
            "id": new_item_id("msg"),
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        index = len(self.output)
        self.output.append(item)
        self.message = item
        self._emit(queue, "response.output_item.added", {"output_index": index, "item": item})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._emit(
            queue,
            "response.content_part.added",
            {"item_id": item["id"], "output_index": index, "content_index": 0, "part": part},
        )
        item["content"] = [part]

    def _close_message(self, queue: Queue, status: str = "completed") -> None:
        item = self.message
        if item is None:
            return
        self.message = None
        index = self.output.index(item)
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        done = where | {"text": part["text"], "logprobs": part["logprobs"]}
        self._emit(queue, "response.output_text.done", done)
        self._emit(queue, "response.content_part.done", where | {"part": part})
        item["status"] = status
        self._emit(queue, "response.output_item.done", {"output_index": index, "item": item})

    def _call(self, queue: Queue, call: ToolCall) -> None:
        self._close_thought(queue)
        self._close_message(queue)
        item = {
            "id": new_item_id("fc"),
            "type": "function_call",
            "status": "in_progress",
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
        }
        index = len(self.output)
        self.output.append(item)
        self._emit(queue, "response.output_item.added", {"output_index": index, "item": item})
        where = {"item_id": item["id"], "output_index": index}
        self._emit(
            queue, "response.function_call_arguments.delta", where | {"delta": call.arguments}
        )
        item["arguments"] = call.arguments
        done = where | {"name": call.name, "arguments": call.arguments}
        self._emit(queue, "response.function_call_arguments.done", done)
        item["status"] = "completed"
        self._emit(queue, "response.output_item.done", {"output_index": index, "item": item})

    def _attach(self, item: dict[str, Any], entries: list[Entry]) -> None:
        if entries and self.choice.asks_logprobs:
            item["content"][0]["logprobs"] += chat_logprobs(entries)["content"]

    def _where(self, item: dict[str, Any], index: int, delta: str | None = None) -> dict[str, Any]:
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return where if delta is None else where | {"delta": delta}

    def _delta(
        self, item: dict[str, Any], index: int, text: str, entries: Sequence[Entry]
    ) -> dict[str, Any]:
        logprobs = chat_logprobs(entries)["content"] if entries else []
        return {
            "item_id": item["id"],
            "output_index": index,
            "content_index": 0,
            "delta": text,
            "logprobs": logprobs,
        }

    # --- events and storing ---

    def _emit(self, queue: Queue, kind: str, payload: dict[str, Any], text: int = 0) -> None:
        """Queue one event; it is numbered when it goes out. Its payload is encoded now,
        so later changes to the items it shows do not reach it."""
        if queue is None:
            return
        encoded = msgspec.json.encode(payload)
        queue.put_frame(lambda: self._number(kind, encoded), len(encoded) + 64)

    def _numbered(self, kind: str, payload: dict[str, Any]) -> bytes:
        return self._number(kind, msgspec.json.encode(payload))

    def _number(self, kind: str, encoded: bytes) -> bytes:
        head = msgspec.json.encode({"type": kind, "sequence_number": self.sequence})
        self.sequence += 1
        data = head[:-1] + (b"," + encoded[1:] if len(encoded) > 2 else b"}")
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"
