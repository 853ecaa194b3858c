"""The state store (adapters/state), on each of its three places: SQLite in memory, a
SQLite file, and a real PostgreSQL server (tests/support/postgres.py; skipped, naming
scripts/install-postgres, where it is absent, and failed under CI=true).

Every behaviour a router relies on is checked on all three, through the store's
public methods: records and why they are gone, the bounds (count, bytes, age) and
that live records are never evicted, the events of a streamed response, leases and
reaping, cancels, the schema's version. Then what only a shared store has: two stores
on one file or database (two routers) see each other's records, leases and cancels,
and open (migrate) together; and, on PostgreSQL, a server that is unreachable, goes
down and comes back. Each test runs its trio code under a bound (`run`).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from adapters.state import open_store, sql
from adapters.state.sql import SqlStore
from adapters.state.store import (
    Gone,
    Kind,
    Record,
    StoreLimits,
    StoreUnavailable,
    parse_store,
)
from tests.support.postgres import PostgresServer, need_bindir

BACKENDS = ("memory", "sqlite", "postgresql")
TEST_TIMEOUT_S = 60.0
NOW = time.time()  # records are created around now (far inside the default 30-day ttl)


def run(test: Callable[[], Awaitable[None]], timeout_s: float = TEST_TIMEOUT_S) -> None:
    """Run one test's trio code, failing it if it takes longer than `timeout_s`."""

    async def bounded() -> None:
        with trio.fail_after(timeout_s):
            await test()

    trio.run(bounded)


@pytest.fixture(params=BACKENDS)
def address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A `--state-store` address of each kind, empty and this test's own."""
    if request.param == "memory":
        return "memory"
    if request.param == "sqlite":
        return f"sqlite:{tmp_path / 'state' / 'state.sqlite3'}"
    url: str = request.getfixturevalue("postgres_database")
    return url


@pytest.fixture(params=BACKENDS[1:])
def shared_address(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An address two stores (two routers) can share: a SQLite file, a PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:{tmp_path / 'state.sqlite3'}"
    url: str = request.getfixturevalue("postgres_database")
    return url


def store_at(address: str, limits: StoreLimits | None = None) -> SqlStore:
    store = open_store(parse_store(address), limits)
    assert isinstance(store, SqlStore)
    return store


@asynccontextmanager
async def opened(address: str, limits: StoreLimits | None = None) -> AsyncIterator[SqlStore]:
    store = store_at(address, limits)
    await store.open()
    try:
        yield store
    finally:
        await store.close()


def record(
    record_id: str,
    *,
    created: float = NOW,
    status: str = "completed",
    owner: str | None = None,
    model: str = "m",
    kind: Kind = "response",
    text: str = "hello",
) -> Record:
    body = {"id": record_id, "object": kind, "status": status, "metadata": {}, "output": text}
    items = [{"role": "user", "content": "hi"}]
    return Record(record_id, kind, body, items, model, created, status=status, owner=owner)


async def size_of(candidate: Record, events: list[str] | None = None) -> int:
    """The bytes `candidate` takes as stored (measured in a store of its own)."""
    async with opened("memory") as probe:
        assert await probe.put(candidate, events, 0 if events else None)
        found = await probe.get(candidate.id)
        assert isinstance(found, Record)
        return found.size


async def meta_rows(store: SqlStore) -> list[tuple[str, str]]:
    rows = await store._call(lambda cur: cur.run("SELECT key, value FROM fencepost_meta").all())
    return [(str(key), str(value)) for key, value in rows]


# --- records, and why they are gone --------------------------------------------------------


def test_put_get_delete_round_trip(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            assert await store.get("resp_1") is None  # never seen
            original = record("resp_1", owner=None)
            original.metadata = {"topic": "tests"}
            original.background = True
            assert await store.put(original)
            found = await store.get("resp_1")
            assert isinstance(found, Record)
            assert found.size > 0
            original.size = found.size
            assert found == original
            assert await store.delete("resp_1")
            assert await store.get("resp_1") == Gone("resp_1", "deleted")
            assert not await store.delete("resp_1")  # nothing left to delete
            assert await store.list_records("response", None) == []

    run(main)


def test_create_starts_a_live_record_that_put_then_ends(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            live = record("resp_1", status="in_progress", owner="a", text="")
            await store.create(live)
            found = await store.get("resp_1")
            assert isinstance(found, Record) and found.live and found.owner == "a"
            assert found.size == await size_of(live)  # as a put would have counted it
            assert await store.append_events("resp_1", 0, ["e0"]) == 1
            with pytest.raises(StoreUnavailable):
                await store.create(live)  # already there: refused, not replaced
            done = record("resp_1", status="completed", text="all")
            assert await store.put(done, ["e0", "e1"], first=0)
            assert await store.events_after("resp_1", -1, 10) == [(0, "e0"), (1, "e1")]

    run(main)


def test_put_replaces_a_record_keeping_its_events(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            live = record("resp_1", status="in_progress", owner="a", text="so far")
            assert await store.put(live, ["e0", "e1"], first=0)
            done = record("resp_1", status="completed", text="all of it")
            assert await store.put(done)
            found = await store.get("resp_1")
            assert isinstance(found, Record)
            assert (found.status, found.owner, found.body["output"]) == (
                "completed",
                None,
                "all of it",
            )
            assert found.events == 2
            assert found.size == await size_of(done) + len("e0e1")
            assert await store.events_after("resp_1", -1, 10) == [(0, "e0"), (1, "e1")]

    run(main)


def test_the_oldest_finished_records_are_evicted_past_the_count(address: str) -> None:
    async def main() -> None:
        async with opened(address, StoreLimits(max_records=2)) as store:
            for i in range(3):
                assert await store.put(record(f"resp_{i}", created=NOW + i), [f"event {i}"], 0)
            assert await store.get("resp_0") == Gone("resp_0", "evicted")
            assert await store.events_after("resp_0", -1, 10) == []
            assert [r.id for r in await store.list_records("response", None)] == [
                "resp_1",
                "resp_2",
            ]

    run(main)


def test_the_oldest_finished_records_are_evicted_past_the_bytes(address: str) -> None:
    async def main() -> None:
        one = await size_of(record("resp_0"))
        async with opened(address, StoreLimits(max_bytes=2 * one + one // 2)) as store:
            for i in range(3):
                assert await store.put(record(f"resp_{i}", created=NOW + i))
            assert await store.get("resp_0") == Gone("resp_0", "evicted")
            assert isinstance(await store.get("resp_1"), Record)
            assert isinstance(await store.get("resp_2"), Record)

    run(main)


def test_records_past_their_ttl_are_expired(address: str) -> None:
    async def main() -> None:
        async with opened(address, StoreLimits(ttl_s=60.0)) as store:
            hour_ago = time.time() - 3600
            assert await store.put(record("old", created=hour_ago))
            assert await store.put(record("stale", created=hour_ago))
            assert await store.put(record("running", created=hour_ago, status="in_progress"))
            assert await store.put(record("fresh", created=time.time()))
            assert [r.id for r in await store.list_records("response", None)] == ["fresh"]
            assert await store.get("old") == Gone("old", "expired")
            assert await store.get("old") == Gone("old", "expired")  # the tombstone stays
            assert isinstance(await store.get("running"), Record)  # live: never expired
            await store.reap()  # forgets the expired ones nobody asked for
            assert await store.get("stale") == Gone("stale", "expired")
            assert isinstance(await store.get("fresh"), Record)

    run(main)


def test_live_records_are_never_evicted(address: str) -> None:
    async def main() -> None:
        one = await size_of(record("resp_0"))
        async with opened(address, StoreLimits(max_records=1, max_bytes=3 * one)) as store:
            assert await store.put(record("live_a", created=NOW, status="in_progress", owner="r"))
            assert await store.put(record("done", created=NOW + 1))
            # over the count: the only finished record goes, though it is the newest
            assert await store.get("done") == Gone("done", "evicted")
            assert await store.put(record("live_b", created=NOW + 2, status="queued", owner="r"))
            assert await store.put(record("live_c", created=NOW + 3, status="in_progress"))
            for name in ("live_a", "live_b", "live_c"):  # over both bounds, all kept
                assert isinstance(await store.get(name), Record), name
            # once one ends it may go: the oldest finished first
            assert await store.put(record("live_a", created=NOW, status="completed"))
            assert await store.get("live_a") == Gone("live_a", "evicted")
            assert isinstance(await store.get("live_b"), Record)

    run(main)


def test_a_record_alone_over_the_byte_bound_is_refused_whole(address: str) -> None:
    async def main() -> None:
        small = record("small")
        limit = 3 * await size_of(small)  # room for two small ones
        async with opened(address, StoreLimits(max_bytes=limit)) as store:
            assert await store.put(small)
            assert await store.put(record("big", text="short"), ["e0"], 0)
            huge = record("big", text="x" * limit)
            assert not await store.put(huge, ["e1"], 1)
            assert await store.get("big") == Gone("big", "evicted")
            assert await store.events_after("big", -1, 10) == []
            assert not await store.put(record("huge", text="y" * limit))
            assert await store.get("huge") == Gone("huge", "evicted")
            assert [r.id for r in await store.list_records("response", None)] == ["small"]
            assert isinstance(await store.get("small"), Record)  # nothing else was evicted

    run(main)


# --- the events of a streamed response -------------------------------------------------------


def test_events_append_once_and_refuse_a_gap(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            assert await store.put(record("resp_1", status="in_progress", owner="a"))
            assert await store.append_events("resp_1", 0, ["a", "b", "c"]) == 3
            assert await store.append_events("resp_1", 0, ["a", "b", "c"]) == 3  # retried
            assert await store.append_events("resp_1", 1, ["b", "c", "d"]) == 4  # overlapping
            with pytest.raises(ValueError, match="gap"):
                await store.append_events("resp_1", 5, ["f"])
            assert await store.events_after("resp_1", -1, 100) == [
                (0, "a"),
                (1, "b"),
                (2, "c"),
                (3, "d"),
            ]
            found = await store.get("resp_1")
            assert isinstance(found, Record)
            assert found.events == 4
            assert found.size == await size_of(record("resp_1", status="in_progress")) + 4
            assert await store.append_events("nobody", 0, ["x"]) == -1

    run(main)


def test_put_with_events_skips_those_kept_and_refuses_a_gap(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            live = record("resp_1", status="in_progress", owner="a")
            assert await store.put(live, ["a", "b"], first=0)
            assert await store.put(live, ["a", "b", "c"], first=0)
            assert await store.put(live, ["c", "d"], first=2)
            with pytest.raises(ValueError, match="gap"):
                await store.put(live, ["z"], first=9)
            assert [data for _, data in await store.events_after("resp_1", -1, 10)] == list("abcd")

    run(main)


def test_events_after_pages_in_order(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            assert await store.put(record("resp_1", status="in_progress", owner="a"))
            frames = [f"event {i}" for i in range(10)]
            assert await store.append_events("resp_1", 0, frames) == 10
            pages, after = [], -1
            for _ in range(10):  # bounded: 3 pages expected
                page = await store.events_after("resp_1", after, 4)
                if not page:
                    break
                pages.append([seq for seq, _ in page])
                after = page[-1][0]
            assert pages == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
            assert await store.events_after("resp_1", 7, 100) == [(8, "event 8"), (9, "event 9")]
            assert await store.events_after("other", -1, 100) == []

    run(main)


def test_an_append_over_the_byte_bound_is_refused(address: str) -> None:
    async def main() -> None:
        live = record("resp_1", status="in_progress", owner="a")
        limit = await size_of(live) + 10
        async with opened(address, StoreLimits(max_bytes=limit)) as store:
            assert await store.put(live)
            assert await store.append_events("resp_1", 0, ["x" * 11]) == -1
            assert await store.events_after("resp_1", -1, 10) == []
            assert await store.append_events("resp_1", 0, ["x" * 10]) == 1  # exactly fits
            assert await store.append_events("resp_1", 1, ["y"]) == -1

    run(main)


# --- metadata and listing --------------------------------------------------------------------


def test_update_metadata_changes_the_body_too(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            assert await store.put(record("resp_1"))
            before = await store.get("resp_1")
            assert isinstance(before, Record)
            updated = await store.update_metadata("resp_1", {"project": "fencepost"})
            assert updated is not None
            found = await store.get("resp_1")
            assert isinstance(found, Record)
            assert found == updated
            assert found.metadata == {"project": "fencepost"}
            assert found.body["metadata"] == {"project": "fencepost"}
            assert found.size == before.size + len('"project":"fencepost"')
            assert await store.update_metadata("nobody", {"a": "b"}) is None

    run(main)


def test_list_records_oldest_first_by_kind_and_model(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            assert await store.put(record("r2", created=NOW + 2, model="a"))
            assert await store.put(record("r0", created=NOW + 0, model="b"))
            assert await store.put(record("r1", created=NOW + 1, model="a"))
            assert await store.put(record("c0", created=NOW, model="a", kind="chat.completion"))
            assert [r.id for r in await store.list_records("response", None)] == ["r0", "r1", "r2"]
            assert [r.id for r in await store.list_records("response", "a")] == ["r1", "r2"]
            assert [r.id for r in await store.list_records("chat.completion", None)] == ["c0"]
            assert await store.list_records("chat.completion", "b") == []

    run(main)


# --- ownership: leases, reaping, cancels -------------------------------------------------------


def test_reap_fails_only_live_records_whose_owner_lost_its_lease(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            await store.renew("a", 60.0)
            await store.renew("b", 60.0)
            assert await store.put(record("of_a", status="in_progress", owner="a"))
            assert await store.put(record("of_b", status="queued", owner="b"))
            assert await store.put(record("done_b", status="completed", owner="b"))
            assert await store.reap() == []  # both leases hold
            await store.renew("b", -1.0)  # b's lease lapsed a second ago
            assert await store.put(record("of_nobody", status="in_progress", owner="gone"))
            assert sorted(await store.reap()) == ["of_b", "of_nobody"]
            failed = await store.get("of_b")
            assert isinstance(failed, Record)
            assert (failed.status, failed.owner) == ("failed", None)
            assert failed.body["status"] == "failed"
            assert failed.body["error"] == sql.LOST
            done = await store.get("done_b")
            assert isinstance(done, Record) and done.status == "completed"
            assert await store.reap() == []  # failed once
            alive = await store.get("of_a")
            assert isinstance(alive, Record) and alive.status == "in_progress"
            await store.release("a")  # a router that stops: its records are reapable now
            assert await store.reap() == ["of_a"]

    run(main)


def test_cancels_reach_the_owner_of_a_live_record(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            assert await store.put(record("live", status="in_progress", owner="a"))
            assert await store.put(record("done", status="completed", owner="a"))
            assert await store.cancels("a") == []
            asked = await store.request_cancel("live")
            assert isinstance(asked, Record) and asked.cancel
            finished = await store.request_cancel("done")
            assert isinstance(finished, Record) and not finished.cancel  # nothing to cancel
            assert await store.cancels("a") == ["live"]
            assert await store.cancels("b") == []
            assert await store.request_cancel("nobody") is None
            assert await store.delete("done")
            assert await store.request_cancel("done") == Gone("done", "deleted")
            assert await store.put(record("live", status="cancelled", owner=None))
            assert await store.cancels("a") == []  # acted on: no longer live

    run(main)


# --- a failing transaction -----------------------------------------------------------------------


def test_a_failing_put_leaves_nothing_half_written(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        async with opened(address) as store:
            first = record("resp_1", status="in_progress", owner="a", text="first")
            assert await store.put(first)
            # An event row the record does not count: a put's events collide with it
            # after the record itself was written.
            await store._call(
                lambda cur: cur.run(
                    "INSERT INTO fencepost_events (id, seq, data) VALUES ('resp_1', 0, 'stray')"
                )
            )
            second = record("resp_1", status="in_progress", owner="a", text="second")
            with pytest.raises(StoreUnavailable):
                await store.put(second, ["e0"], first=0)
            found = await store.get("resp_1")
            assert isinstance(found, Record)
            assert (found.body["output"], found.events) == ("first", 0)

            def broken(self: SqlStore, cur: sql.Cursor) -> None:
                raise RuntimeError("the eviction failed")

            monkeypatch.setattr(SqlStore, "_evict", broken)
            with pytest.raises(RuntimeError, match="eviction failed"):
                await store.put(record("resp_2"), ["e0", "e1"], first=0)
            monkeypatch.undo()
            assert await store.get("resp_2") is None
            assert await store.events_after("resp_2", -1, 10) == []
            assert await store.put(record("resp_3"))  # the store still works

    run(main)


# --- the schema ---------------------------------------------------------------------------------


def test_opening_again_migrates_once(address: str) -> None:
    async def main() -> None:
        async with opened(address) as store:
            assert await store.put(record("resp_1"))
            await store.open()  # again, on the same store
            assert await store.schema_version() == sql.SCHEMA_VERSION
            assert await meta_rows(store) == [("schema_version", str(sql.SCHEMA_VERSION))]
            assert isinstance(await store.get("resp_1"), Record)
        if address != "memory":  # a store of its own on the same file or database
            async with opened(address) as again:
                assert await meta_rows(again) == [("schema_version", str(sql.SCHEMA_VERSION))]
                assert isinstance(await again.get("resp_1"), Record)

    run(main)


def test_a_store_newer_than_this_code_is_refused(address: str) -> None:
    newer = sql.SCHEMA_VERSION + 1

    async def main() -> None:
        async with opened(address) as store:
            await store._call(
                lambda cur: cur.run(
                    "UPDATE fencepost_meta SET value = ? WHERE key = 'schema_version'",
                    (str(newer),),
                )
            )
            for attempt in (store, store_at(address)):  # memory lives in the first only
                with pytest.raises(StoreUnavailable) as refused:
                    await attempt.open()
                message = str(refused.value)
                assert f"schema version {newer}" in message
                assert f"up to {sql.SCHEMA_VERSION}" in message
                if attempt is not store:
                    await attempt.close()
                if address == "memory":
                    break
            assert await meta_rows(store) == [("schema_version", str(newer))]  # untouched

    run(main)


# --- two routers on one store ---------------------------------------------------------------------


def test_two_stores_on_one_place_share_records_leases_and_cancels(shared_address: str) -> None:
    async def main() -> None:
        async with opened(shared_address) as one, opened(shared_address) as two:
            await one.renew("router-1", 60.0)
            assert await one.put(record("resp_1", status="in_progress", owner="router-1"))
            assert await one.append_events("resp_1", 0, ["e0", "e1"]) == 2
            seen = await two.get("resp_1")
            assert isinstance(seen, Record) and seen.owner == "router-1"
            assert await two.events_after("resp_1", 0, 10) == [(1, "e1")]
            assert await two.append_events("resp_1", 1, ["e1", "e2"]) == 3  # rejoined, retried
            assert await one.events_after("resp_1", 1, 10) == [(2, "e2")]
            assert await two.reap() == []  # router-1's lease holds, whoever reaps
            asked = await two.request_cancel("resp_1")
            assert isinstance(asked, Record) and asked.cancel
            assert await one.cancels("router-1") == ["resp_1"]
            assert await two.put(record("resp_2"))
            assert [r.id for r in await one.list_records("response", None)] == ["resp_1", "resp_2"]
            await one.release("router-1")
            assert await two.reap() == ["resp_1"]
            failed = await one.get("resp_1")
            assert isinstance(failed, Record) and failed.status == "failed"
            assert await two.delete("resp_2")
            assert await one.get("resp_2") == Gone("resp_2", "deleted")

    run(main)


def test_stores_opening_together_on_a_fresh_place_all_migrate(shared_address: str) -> None:
    async def main() -> None:
        stores = [store_at(shared_address) for _ in range(4)]
        try:
            async with trio.open_nursery() as nursery:
                for store in stores:
                    nursery.start_soon(store.open)
            for store in stores:
                assert await store.schema_version() == sql.SCHEMA_VERSION
            assert await meta_rows(stores[0]) == [("schema_version", str(sql.SCHEMA_VERSION))]
            assert await stores[1].put(record("resp_1"))
            assert isinstance(await stores[2].get("resp_1"), Record)
        finally:
            for store in stores:
                await store.close()

    run(main)


# --- PostgreSQL going away ------------------------------------------------------------------------


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port  # nothing listens on it once the probe is closed


def test_an_unreachable_postgres_is_unavailable_at_once_in_one_line() -> None:
    port = _closed_port()
    url = f"postgresql://fencepost:hunter2@127.0.0.1:{port}/fencepost"

    async def main() -> None:
        store = store_at(url)
        assert store.name == f"postgresql://127.0.0.1:{port}/fencepost"
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as refused:
            await store.open()
        assert time.monotonic() - started < 5.0
        message = str(refused.value)
        assert "\n" not in message.strip()
        assert store.name in message
        assert "hunter2" not in message
        with pytest.raises(StoreUnavailable):  # and every call after, likewise
            await store.get("resp_1")

    run(main, timeout_s=20)


def test_a_postgres_that_goes_down_and_comes_back() -> None:
    # A server of its own: stopping the shared one would disturb the tests after this.
    with PostgresServer(need_bindir()) as server:

        async def main() -> None:
            async with opened(server.url) as store:
                assert await store.put(record("resp_1"))

                def held(cur: sql.Cursor) -> None:
                    time.sleep(0.2)  # hold the connection, so that four are dialled

                async with trio.open_nursery() as nursery:
                    for _ in range(sql.POSTGRES_CONNECTIONS):
                        nursery.start_soon(store._call, held)
                assert len(store._idle) == sql.POSTGRES_CONNECTIONS  # idle and soon broken

                server.stop()
                for _ in range(2):
                    with pytest.raises(StoreUnavailable) as down:
                        await store.get("resp_1")
                    assert "\n" not in str(down.value).strip()
                server.start()  # from the test's thread: the server dies with its starter
                found = await store.get("resp_1")  # no stale connection is tried again
                assert isinstance(found, Record)
                assert await store.put(record("resp_2"))

                server.stop()  # down and up between two calls: nobody saw it go
                server.start()
                assert isinstance(await store.get("resp_2"), Record)

        run(main)
