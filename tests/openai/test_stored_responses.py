"""Responses and chat completions kept in the state store, over 127.0.0.1 with the official SDK:
background responses (poll, stream, rejoin, cancel), a dropped stream rejoined with every event
once, two routers on one store continuing each other's conversations (SQLite file and a real
PostgreSQL), a router killed with a background response in flight, the store going down while
serving, and stored chat completions (retrieve, list, update, delete, messages)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from adapters.cli.serve import ServeOptions
from adapters.openai.server import HttpLimits
from adapters.runtime.worker_host import FakeDecoder
from tests.openai.test_openai_server import metric, wait_settled
from tests.support.http_helpers import ServerThread
from tests.support.postgres import (
    PostgresServer,
    need_bindir,
    postgres_database,
    postgres_server,
)
from tests.support.process_helpers import LogWatcher, fencepost, wait_for

__all__ = ["postgres_database", "postgres_server"]  # fixtures, used by name

STEP_S = 0.03  # the slow fake's step: a 40-token answer takes about 1.2 s
# The slow fake ignores EOS, so every answer runs to its token budget: incomplete.
ENDED = "incomplete"


def options(store: str = "memory", **limits: Any) -> ServeOptions:
    return ServeOptions(port=0, fake=True, state_store=store, limits=HttpLimits(**limits))


def slow() -> FakeDecoder:
    return FakeDecoder(step_s=STEP_S, ignore_eos=True)


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def read_events(lines: Iterator[bytes], stop_after: int | None = None) -> list[dict[str, Any]]:
    """The decoded events of an SSE body; with stop_after, only that many (then it stops
    reading: the caller drops the connection)."""
    got: list[dict[str, Any]] = []
    kind = None
    for line in lines:
        if line.startswith(b"event: "):
            kind = line[7:].decode()
        elif line.startswith(b"data: "):
            data = json.loads(line[6:])
            assert data["type"] == kind
            got.append(data)
            if stop_after is not None and len(got) == stop_after:
                break
    return got


def replay(server: ServerThread, response_id: str, after: int = -1) -> list[dict[str, Any]]:
    url = f"{server.base_url}/v1/responses/{response_id}"
    params = {"stream": "true", "starting_after": str(after)}
    with requests.get(url, params=params, stream=True, timeout=60) as reply:
        assert reply.status_code == 200, reply.text
        return read_events(reply.iter_lines())


def text_of(events: list[dict[str, Any]]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def plain_text(server: ServerThread, prompt: str, tokens: int) -> str:
    """What the fake model answers, unstored and in one piece: the reference."""
    done = sdk(server).responses.create(
        model="fake", input=prompt, max_output_tokens=tokens, store=False, temperature=0
    )
    return done.output_text


# --- background responses ---


def test_a_background_response_returns_at_once_and_is_polled_to_its_end() -> None:
    with ServerThread(options(), slow()) as server:
        client = sdk(server)
        began = time.monotonic()
        queued = client.responses.create(
            model="fake", input="tell me", max_output_tokens=40, temperature=0, background=True
        )
        assert time.monotonic() - began < 1.0  # 40 steps take 1.2 s: it did not wait
        assert queued.status == "queued" and queued.background is True and queued.output == []
        wait_for(lambda: client.responses.retrieve(queued.id).status == ENDED, 30)
        done = client.responses.retrieve(queued.id)
        assert done.output_text == plain_text(server, "tell me", 40)
        assert done.usage is not None and done.usage.output_tokens == 40


def test_a_background_stream_dropped_and_rejoined_loses_and_repeats_no_event() -> None:
    with ServerThread(options(), slow()) as server:
        client = sdk(server)
        stream = client.responses.create(
            model="fake",
            input="rejoin me",
            max_output_tokens=40,
            temperature=0,
            background=True,
            stream=True,
        )
        first: list[Any] = []
        for event in stream:
            first.append(event)
            if len(first) == 8:
                break
        stream.close()  # the client's connection drops
        response_id = first[0].response.id
        last_seen = first[-1].sequence_number
        with client.responses.stream(response_id=response_id, starting_after=last_seen) as again:
            rest = list(again)
        final = client.responses.retrieve(response_id)
        numbers = [e.sequence_number for e in first + rest]
        assert numbers == list(range(len(numbers)))  # 0 lost, 0 repeated
        assert rest[-1].type == f"response.{ENDED}"
        text = "".join(e.delta for e in first + rest if e.type == "response.output_text.delta")
        assert text == final.output_text == plain_text(server, "rejoin me", 40)
        # After its end, the whole stream replays from the store, event for event.
        whole = replay(server, response_id)
        assert [e["sequence_number"] for e in whole] == numbers
        assert text_of(whole) == text
        assert metric(server, "fencepost_live_responses") == 0


def test_cancel_stops_a_background_response_and_its_decoding() -> None:
    with ServerThread(options(), slow()) as server:
        client = sdk(server)
        queued = client.responses.create(
            model="fake", input="long", max_output_tokens=2000, background=True
        )
        wait_for(lambda: server.statistics().open_streams == 1, 10)
        cancelled = client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled"
        wait_settled(server, 10)  # the worker stopped decoding it
        assert client.responses.retrieve(queued.id).status == "cancelled"
        again = client.responses.cancel(queued.id)  # it has ended: nothing changes
        assert again.status == "cancelled"
        finished = client.responses.create(model="fake", input="x", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError, match="background"):
            client.responses.cancel(finished.id)  # not a background response
        with pytest.raises(openai.NotFoundError):
            client.responses.cancel("resp_nothing")


# --- a stored stream whose client drops ---


def test_a_dropped_stream_is_rejoined_from_the_last_event_seen() -> None:
    with ServerThread(options(), slow()) as server:
        body = {
            "model": "fake",
            "input": "drop",
            "max_output_tokens": 40,
            "stream": True,
            "temperature": 0,
        }
        url = f"{server.base_url}/v1/responses"
        with requests.post(url, json=body, stream=True, timeout=30) as reply:
            first = read_events(reply.iter_lines(), stop_after=10)
        response_id = first[0]["response"]["id"]
        rest = replay(server, response_id, first[-1]["sequence_number"])
        numbers = [e["sequence_number"] for e in first + rest]
        assert numbers == list(range(len(numbers)))
        assert rest[-1]["type"] == f"response.{ENDED}"
        assert text_of(first + rest) == plain_text(server, "drop", 40)
        # Two readers at once, from different points, see the same events.
        assert replay(server, response_id, 4) == (first + rest)[5:]
        assert metric(server, "fencepost_stream_rejoins_total") == 2


def test_a_stream_dropped_every_few_events_still_arrives_whole() -> None:
    """Drop and rejoin every 3 events to the end: lost and repeated events are counted."""
    with ServerThread(options(), slow()) as server:
        body = {"model": "fake", "input": "again", "max_output_tokens": 30, "stream": True,
                "temperature": 0}  # fmt: skip
        url = f"{server.base_url}/v1/responses"
        with requests.post(url, json=body, stream=True, timeout=30) as reply:
            got = read_events(reply.iter_lines(), stop_after=3)
        response_id = got[0]["response"]["id"]
        for _ in range(100):  # bounded: 30 tokens make about 40 events
            if got[-1]["type"] == f"response.{ENDED}":
                break
            url_one = f"{server.base_url}/v1/responses/{response_id}"
            params = {"stream": "true", "starting_after": str(got[-1]["sequence_number"])}
            with requests.get(url_one, params=params, stream=True, timeout=30) as reply:
                got += read_events(reply.iter_lines(), stop_after=3)
        numbers = [e["sequence_number"] for e in got]
        lost = len(set(range(max(numbers) + 1)) - set(numbers))
        repeated = len(numbers) - len(set(numbers))
        assert (lost, repeated) == (0, 0) and numbers == sorted(numbers)
        assert got[-1]["type"] == f"response.{ENDED}"
        assert text_of(got) == plain_text(server, "again", 30)


def test_a_stream_nobody_rejoins_is_cancelled_after_the_grace() -> None:
    with ServerThread(options(rejoin_grace_s=0.3), slow()) as server:
        body = {"model": "fake", "input": "gone", "max_output_tokens": 2000, "stream": True}
        url = f"{server.base_url}/v1/responses"
        with requests.post(url, json=body, stream=True, timeout=30) as reply:
            first = read_events(reply.iter_lines(), stop_after=6)
        wait_settled(server, 10)
        stored = sdk(server).responses.retrieve(first[0]["response"]["id"])
        assert stored.status == "cancelled"
        # Unstored, nothing waits: the generation stops with the connection.
        with requests.post(url, json=body | {"store": False}, stream=True, timeout=30) as reply:
            read_events(reply.iter_lines(), stop_after=6)
        wait_settled(server, 10)


def test_replays_refuse_what_they_cannot_give() -> None:
    with ServerThread(options()) as server:
        client = sdk(server)
        plain = client.responses.create(model="fake", input="x", max_output_tokens=3)
        url = f"{server.base_url}/v1/responses/{plain.id}"
        not_streamed = requests.get(url, params={"stream": "true"}, timeout=10)
        assert not_streamed.status_code == 400 and "no events" in not_streamed.text
        streamed = client.responses.create(
            model="fake", input="x", max_output_tokens=3, stream=True
        )
        events = list(streamed)
        last = events[-1].sequence_number
        url = f"{server.base_url}/v1/responses/{events[0].response.id}"
        for after in (str(last + 1), "-5", "x"):
            bad = requests.get(url, params={"stream": "true", "starting_after": after}, timeout=10)
            assert bad.status_code == 400
            assert bad.json()["error"]["param"] == "starting_after"
        assert replay(server, events[0].response.id, last) == []  # nothing after the last
        with pytest.raises(openai.BadRequestError, match="stored"):
            client.responses.create(model="fake", input="x", background=True, store=False)


# --- two routers on one store ---


def two_routers_continue_each_other(store: str) -> None:
    with ServerThread(options(store)) as one, ServerThread(options(store)) as two:
        first = sdk(one).responses.create(model="fake", input="one", max_output_tokens=5)
        second = sdk(two).responses.create(
            model="fake", input="two", previous_response_id=first.id, max_output_tokens=5
        )
        assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]
        items = sdk(one).responses.input_items.list(second.id, order="asc")
        assert [i.type for i in items.data] == ["message", "message", "message"]
        assert sdk(one).responses.retrieve(second.id).output_text == second.output_text
        sdk(one).responses.delete(first.id)
        with pytest.raises(openai.NotFoundError, match="deleted"):
            sdk(two).responses.retrieve(first.id)
        # A background stream on one router is rejoined through the other.
        stream = sdk(one).responses.create(
            model="fake", input="far", max_output_tokens=20, background=True, stream=True
        )
        head = [e for _, e in zip(range(5), stream, strict=False)]
        stream.close()
        rest = replay(two, head[0].response.id, head[-1].sequence_number)
        numbers = [e.sequence_number for e in head] + [e["sequence_number"] for e in rest]
        assert numbers == list(range(len(numbers)))
        assert rest[-1]["type"] in ("response.completed", "response.incomplete")


def test_two_routers_on_one_sqlite_file(tmp_path: Path) -> None:
    two_routers_continue_each_other(f"sqlite:{tmp_path / 'state.db'}")


def test_two_routers_on_one_postgresql_database(postgres_database: str) -> None:
    two_routers_continue_each_other(postgres_database)


def test_concurrent_continuations_of_one_response_fork_the_conversation(tmp_path: Path) -> None:
    with ServerThread(options(f"sqlite:{tmp_path / 'state.db'}")) as server:
        client = sdk(server)
        root = client.responses.create(model="fake", input="root", max_output_tokens=3)
        with ThreadPoolExecutor(4) as pool:
            branches = list(pool.map(
                lambda i: client.responses.create(model="fake", input=f"branch {i}",
                                                  previous_response_id=root.id,
                                                  max_output_tokens=3),
                range(4),
            ))  # fmt: skip
        assert len({b.id for b in branches}) == 4
        for i, branch in enumerate(branches):
            items = client.responses.input_items.list(branch.id, order="asc").data
            texts = [item.content[0].text for item in items]  # type: ignore[union-attr]
            assert texts == ["root", root.output_text, f"branch {i}"]


def test_store_false_writes_nothing_of_the_prompt_or_answer(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    with ServerThread(options(f"sqlite:{folder / 'state.db'}")) as server:
        client = sdk(server)
        secret = "unforgettable-secret-7f3a"
        plain = client.responses.create(model="fake", input=secret, store=False)
        list(client.responses.create(model="fake", input=secret, store=False, stream=True))
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": secret}], max_tokens=3
        )
        kept = client.responses.create(model="fake", input="kept-marker-91c2")
    written = b"".join(path.read_bytes() for path in folder.iterdir())
    assert b"kept-marker-91c2" in written and kept.id.encode() in written  # the check can see
    assert secret.encode() not in written and plain.id.encode() not in written


def router_killed_mid_response(store: str) -> None:
    serve = fencepost("serve", "--fake", "--fake-step-ms", "50", "--fake-ignore-eos", "--port", "0",
                      "--state-store", store, "--store-lease", "1")  # fmt: skip
    try:
        log = LogWatcher(serve)
        port = log.find(r"serving fake on http://127\.0\.0\.1:(\d+)/v1").group(1)
        base = f"http://127.0.0.1:{port}/v1"
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        queued = client.responses.create(
            model="fake", input="x", max_output_tokens=2000, background=True
        )
        wait_for(lambda: client.responses.retrieve(queued.id).status == "in_progress", 10)
    finally:
        serve.send_signal(signal.SIGKILL)
        serve.wait(10)
    with ServerThread(options(store, lease_s=1.0)) as other:
        wait_for(lambda: sdk(other).responses.retrieve(queued.id).status == "failed", 15)
        failed = sdk(other).responses.retrieve(queued.id)
        assert failed.error is not None and "stopped" in failed.error.message


def test_a_router_killed_mid_response_is_failed_by_another_sqlite(tmp_path: Path) -> None:
    router_killed_mid_response(f"sqlite:{tmp_path / 'state.db'}")


def test_a_router_killed_mid_response_is_failed_by_another_postgresql(
    postgres_database: str,
) -> None:
    router_killed_mid_response(postgres_database)


# --- the store down ---


def test_a_store_down_at_start_exits_2_with_one_line() -> None:
    serve = fencepost("serve", "--fake", "--port", "0",
                      "--state-store", "postgresql://nobody@127.0.0.1:1/none")  # fmt: skip
    assert serve.wait(30) == 2
    assert serve.stderr is not None
    errors = [line for line in serve.stderr.read().splitlines() if "cannot connect" in line]
    assert len(errors) == 1 and "127.0.0.1:1/none" in errors[0]


def test_a_store_down_while_serving_refuses_what_needs_it() -> None:
    with PostgresServer(need_bindir()) as database:  # a server of its own: this test stops it
        url = database.url
        with ServerThread(options(url)) as server:
            client = sdk(server)
            kept = client.responses.create(model="fake", input="x", max_output_tokens=3)
            database.stop()
            reply = requests.post(f"{server.base_url}/v1/responses",
                                  json={"model": "fake", "input": "y"}, timeout=30)  # fmt: skip
            assert reply.status_code == 503 and reply.headers["Retry-After"]
            assert metric(server, "fencepost_store_errors_total") >= 1
            assert reply.json()["error"]["code"] == "store_unavailable"
            chat = client.chat.completions.create(
                model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=3
            )
            assert chat.choices[0].finish_reason in ("stop", "length")  # plain chats go on
            unstored = client.responses.create(model="fake", input="z", store=False)
            assert unstored.status == "completed"
            database.start()
            assert client.responses.retrieve(kept.id).output_text == kept.output_text
            client.responses.create(model="fake", input="w", previous_response_id=kept.id)


# --- stored chat completions ---


def test_stored_chat_completions_are_read_listed_updated_and_deleted() -> None:
    with ServerThread(options()) as server:
        client = sdk(server)
        messages: Any = [{"role": "user", "content": "hello"}]
        made = [
            client.chat.completions.create(
                model="fake",
                messages=messages,
                max_tokens=3,
                store=True,
                metadata={"topic": topic},
            )
            for topic in ("a", "b", "a")
        ]
        client.chat.completions.create(model="fake", messages=messages, max_tokens=3)  # unstored
        streamed = client.chat.completions.create(
            model="fake", messages=messages, max_tokens=3, store=True, stream=True
        )
        chunks = list(streamed)
        stream_id = chunks[0].id
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        got = client.chat.completions.retrieve(made[0].id)
        assert got.choices[0].message.content == made[0].choices[0].message.content
        assert client.chat.completions.retrieve(stream_id).choices[0].message.content == text
        listed = client.chat.completions.list(limit=10)
        assert [c.id for c in listed.data] == [c.id for c in made] + [stream_id]
        tagged = client.chat.completions.list(metadata={"topic": "a"})
        assert [c.id for c in tagged.data] == [made[0].id, made[2].id]
        page = client.chat.completions.list(limit=1, after=made[0].id, order="asc")
        assert [c.id for c in page.data] == [made[1].id] and page.has_more
        updated = client.chat.completions.update(made[1].id, metadata={"topic": "c"})
        assert updated.metadata == {"topic": "c"}
        assert [c.id for c in client.chat.completions.list(metadata={"topic": "c"}).data] == [
            made[1].id
        ]
        stored_messages = client.chat.completions.messages.list(made[0].id)
        assert [m.content for m in stored_messages.data] == ["hello"]
        stored = 'fencepost_stored_total{kind="chat.completion"}'
        assert metric(server, stored) == 4  # three plain and one streamed; not the unstored
        deleted = client.chat.completions.delete(made[0].id)
        assert deleted.deleted is True
        with pytest.raises(openai.NotFoundError, match="deleted"):
            client.chat.completions.retrieve(made[0].id)
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(
                model="fake",
                messages=messages,
                store=True,
                metadata={"k": 1},  # type: ignore[dict-item]
            )
