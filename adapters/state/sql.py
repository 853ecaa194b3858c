"""The state store in SQL: one implementation for SQLite (a file, or memory) and PostgreSQL.

Each method is one transaction, run on a connection of the store's own:
- SQLite on disk: one connection, one writer, in a worker thread (trio's
  to_thread), WAL mode, so readers of other processes are never blocked;
- SQLite in memory: the same connection, called inline (no disk to wait for);
- PostgreSQL: a few connections through psycopg 3, each call in a worker
  thread. A connection that fails, or that the server closed while it sat idle,
  is dropped and a fresh one dialled.
The SQL is written once with `?` placeholders; PostgreSQL's are `%s`.

The schema is versioned (fencepost_meta.schema_version) and migrated at
open, in one transaction (PostgreSQL: under an advisory lock, so routers that
start together migrate once). A store newer than this code is refused.
Time: the database's own clock for PostgreSQL (routers on different hosts
agree on leases and ages), the process's for SQLite.
"""

from __future__ import annotations

import contextlib
import select
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio

from adapters.state.store import (
    LIVE,
    Gone,
    Kind,
    Record,
    StoreLimits,
    StoreSpec,
    StoreUnavailable,
)

T = TypeVar("T")
SCHEMA_VERSION = 1
POSTGRES_CONNECTIONS = 4
CONNECT_TIMEOUT_S = 5
MIGRATION_LOCK = 0x66656E63  # "fenc": PostgreSQL's advisory lock key for migrations
ROUTER_FORGOTTEN_S = 24 * 3600.0  # a router row unrenewed this long is deleted
LOST = {"code": "server_error", "message": "the router generating this response stopped"}

_LIVE_SQL = "(" + ", ".join(f"'{s}'" for s in LIVE) + ")"

# Each version's statements, applied in order; {real} is the dialect's float type.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE fencepost_records (
            id TEXT PRIMARY KEY,
            kind TEXT NOT NULL,
            created {real} NOT NULL,
            expires {real} NOT NULL,
            status TEXT NOT NULL,
            owner TEXT,
            background INTEGER NOT NULL,
            cancel INTEGER NOT NULL,
            model TEXT NOT NULL,
            metadata TEXT NOT NULL,
            body TEXT NOT NULL,
            items TEXT NOT NULL,
            events INTEGER NOT NULL,
            size BIGINT NOT NULL
        )""",
        "CREATE INDEX fencepost_records_age ON fencepost_records (created, id)",
        "CREATE INDEX fencepost_records_kind ON fencepost_records (kind, created, id)",
        """CREATE TABLE fencepost_events (
            id TEXT NOT NULL,
            seq INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (id, seq)
        )""",
        """CREATE TABLE fencepost_gone (
            id TEXT PRIMARY KEY, reason TEXT NOT NULL, at {real} NOT NULL
        )""",
        "CREATE INDEX fencepost_gone_at ON fencepost_gone (at)",
        """CREATE TABLE fencepost_routers (id TEXT PRIMARY KEY, lease_until {real} NOT NULL)""",
    ),
)

_COLUMNS = (
    "id, kind, created, expires, status, owner, background, cancel, model, metadata, body, "
    "items, events, size"
)
_encode = msgspec.json.encode


def _text(value: Any) -> str:
    return _encode(value).decode()


class Cursor:
    """A DB-API cursor that takes `?` placeholders whatever the dialect."""

    def __init__(self, cursor: Any, postgres: bool) -> None:
        self.cursor = cursor
        self.postgres = postgres

    def run(self, sql: str, params: tuple[Any, ...] = ()) -> Cursor:
        self.cursor.execute(sql.replace("?", "%s") if self.postgres else sql, params)
        return self

    def many(self, sql: str, rows: list[tuple[Any, ...]]) -> None:
        self.cursor.executemany(sql.replace("?", "%s") if self.postgres else sql, rows)

    def one(self) -> Any:
        return self.cursor.fetchone()

    def all(self) -> list[Any]:
        return list(self.cursor.fetchall())

    @property
    def changed(self) -> int:
        return int(self.cursor.rowcount)

    def clock(self) -> tuple[str, tuple[float, ...]]:
        """`now` as a fragment of a query, so reading the clock costs no round trip."""
        if self.postgres:
            return "extract(epoch FROM clock_timestamp())::float8", ()
        return "?", (time.time(),)

    def now(self) -> float:
        if not self.postgres:
            return time.time()
        return float(self.run("SELECT extract(epoch FROM clock_timestamp())::float8").one()[0])


class SqlStore:
    def __init__(self, spec: StoreSpec, limits: StoreLimits) -> None:
        self.spec = spec
        self.limits = limits
        self.name = spec.shown
        self.postgres = spec.kind == "postgresql"
        self._sqlite: sqlite3.Connection | None = None
        self._writer = trio.CapacityLimiter(1)  # SQLite: one connection, one call at a time
        self._idle: list[Any] = []  # PostgreSQL connections not in use
        self._slots = trio.Semaphore(POSTGRES_CONNECTIONS)

    # --- connections ---

    async def open(self) -> None:
        """Connect and migrate; StoreUnavailable (with the reason) when it cannot."""
        if not self.postgres and self._sqlite is None:
            self._sqlite = self._connect_sqlite()
        await self._call(self._migrate)

    async def close(self) -> None:
        if self._sqlite is not None:
            self._sqlite.close()
            self._sqlite = None
        while self._idle:
            with contextlib.suppress(Exception):
                self._idle.pop().close()

    def _connect_sqlite(self) -> sqlite3.Connection:
        target = ":memory:" if self.spec.kind == "memory" else self.spec.target
        try:
            if target != ":memory:":
                Path(target).parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(target, isolation_level=None, check_same_thread=False)
            connection.execute("PRAGMA busy_timeout = 5000")  # other processes on the file
            if target != ":memory:":
                connection.execute("PRAGMA journal_mode = WAL")
                connection.execute("PRAGMA synchronous = NORMAL")  # durable at checkpoints
        except (OSError, sqlite3.Error) as error:
            raise StoreUnavailable(f"cannot open {self.name}: {error}") from error
        return connection

    def _connect_postgres(self) -> Any:
        import psycopg

        try:
            return psycopg.connect(self.spec.target, connect_timeout=CONNECT_TIMEOUT_S)
        except psycopg.Error as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
            raise StoreUnavailable(f"cannot connect to {self.name}: {reason}") from error

    async def _call(self, work: Callable[[Cursor], T]) -> T:
        """Run `work` as one transaction on a connection of this store."""
        if not self.postgres:
            if self.spec.kind == "memory":
                return self._sqlite_transaction(work)
            run = self._sqlite_transaction
            return await trio.to_thread.run_sync(run, work, limiter=self._writer)
        async with self._slots:
            return await trio.to_thread.run_sync(self._postgres_transaction, work)

    def _sqlite_transaction(self, work: Callable[[Cursor], T]) -> T:
        connection = self._sqlite
        if connection is None:
            raise StoreUnavailable(f"{self.name} is closed")
        try:
            connection.execute("BEGIN IMMEDIATE")
            try:
                result = work(Cursor(connection.cursor(), False))
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")
            return result
        except sqlite3.Error as error:
            raise StoreUnavailable(f"{self.name}: {error}") from error

    def _postgres_transaction(self, work: Callable[[Cursor], T]) -> T:
        import psycopg

        connection = self._take_postgres()
        try:
            with connection.transaction(), connection.cursor() as cursor:
                result = work(Cursor(cursor, True))
        except psycopg.Error as error:
            with contextlib.suppress(Exception):
                connection.close()  # a broken connection is not reused
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error)
            raise StoreUnavailable(f"{self.name}: {reason}") from error
        except BaseException:
            with contextlib.suppress(Exception):
                connection.close()
            raise
        self._idle.append(connection)
        return result

    def _take_postgres(self) -> Any:
        """An idle connection the server has not closed, else a fresh one. A server that
        restarts (or fails over) closes them all while they sit idle: each would fail
        one call after it is back. Idle, a connection has nothing to read, so one that
        has (the server's farewell, or its end of file) is dropped unused."""
        while True:
            try:
                connection = self._idle.pop()  # threads share the list: pop, never peek
            except IndexError:
                return self._connect_postgres()
            with contextlib.suppress(Exception):
                if not connection.closed and not _readable(connection.fileno()):
                    return connection
            with contextlib.suppress(Exception):
                connection.close()

    # --- the schema ---

    def _migrate(self, cur: Cursor) -> None:
        if self.postgres:
            cur.run("SELECT pg_advisory_xact_lock(?)", (MIGRATION_LOCK,))
        cur.run("CREATE TABLE IF NOT EXISTS fencepost_meta (key TEXT PRIMARY KEY, value TEXT)")
        row = cur.run("SELECT value FROM fencepost_meta WHERE key = 'schema_version'").one()
        version = int(row[0]) if row else 0
        if version > SCHEMA_VERSION:
            raise StoreUnavailable(
                f"{self.name} holds schema version {version}; this fencepost knows up to "
                f"{SCHEMA_VERSION} (upgrade fencepost, or use another store)"
            )
        real = "DOUBLE PRECISION" if self.postgres else "REAL"
        for statements in MIGRATIONS[version:]:
            for statement in statements:
                cur.run(statement.format(real=real))
        if version < SCHEMA_VERSION:
            cur.run("DELETE FROM fencepost_meta WHERE key = 'schema_version'")
            cur.run(
                "INSERT INTO fencepost_meta (key, value) VALUES ('schema_version', ?)",
                (str(SCHEMA_VERSION),),
            )

    async def schema_version(self) -> int:
        def read(cur: Cursor) -> int:
            row = cur.run("SELECT value FROM fencepost_meta WHERE key = 'schema_version'").one()
            return int(row[0])

        return await self._call(read)

    # --- records ---

    async def ping(self) -> None:
        await self._call(lambda cur: cur.run("SELECT 1").one())

    async def put(
        self, record: Record, events: list[str] | None = None, first: int | None = None
    ) -> bool:
        """Keep (or replace) a record, with events appended after those it has (`first`:
        the sequence number of events[0]; those already kept are skipped, as in
        append_events); False when it alone is over the byte bound (then nothing of
        it is kept)."""
        body, items, metadata = _text(record.body), _text(record.items), _text(record.metadata)

        def work(cur: Cursor) -> bool:
            old = cur.run("SELECT events, size, body, items FROM fencepost_records WHERE id = ?",
                          (record.id,)).one()  # fmt: skip
            kept = int(old[0]) if old else 0
            event_bytes = int(old[1]) - len(old[2]) - len(old[3]) if old else 0
            fresh = list(events or ())
            if first is not None:
                if first > kept:
                    raise ValueError(f"events of {record.id}: {first} given, {kept} kept (a gap)")
                fresh = fresh[kept - first :]
            size = len(body) + len(items) + event_bytes + sum(len(f) for f in fresh)
            if size > self.limits.max_bytes or self.limits.max_records < 1:
                _forget(cur, record.id, "evicted", cur.now())
                return False
            expires = record.created + self.limits.ttl_s
            cur.run(
                f"INSERT INTO fencepost_records ({_COLUMNS}) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET "
                "status = excluded.status, owner = excluded.owner, metadata = excluded.metadata, "
                "body = excluded.body, items = excluded.items, events = excluded.events, "
                "size = excluded.size",
                (record.id, record.kind, record.created, expires, record.status, record.owner,
                 int(record.background), int(record.cancel), record.model, metadata, body, items,
                 kept + len(fresh), size),
            )  # fmt: skip
            if fresh:
                rows = [(record.id, kept + i, frame) for i, frame in enumerate(fresh)]
                cur.many("INSERT INTO fencepost_events (id, seq, data) VALUES (?, ?, ?)", rows)
            self._evict(cur)
            return True

        return await self._call(work)

    async def create(self, record: Record) -> None:
        """Insert a record that is not there yet, live and without events: one statement
        (no eviction, as a live record is never evicted; its final put evicts)."""
        assert record.live and record.events == 0, "create is for a response starting"
        body, items = _text(record.body), _text(record.items)

        def work(cur: Cursor) -> None:
            cur.run(
                f"INSERT INTO fencepost_records ({_COLUMNS}) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (record.id, record.kind, record.created, record.created + self.limits.ttl_s,
                 record.status, record.owner, int(record.background), int(record.cancel),
                 record.model, _text(record.metadata), body, items, 0, len(body) + len(items)),
            )  # fmt: skip

        await self._call(work)

    def _evict(self, cur: Cursor) -> None:
        """Oldest finished records out until the count and byte bounds hold."""
        totals = "SELECT count(*), coalesce(sum(size), 0) FROM fencepost_records"
        count, size = cur.run(totals).one()
        count, size = int(count), int(size)
        if count <= self.limits.max_records and size <= self.limits.max_bytes:
            return  # the common case: one query, no clock
        now = cur.now()
        for _ in range(1 + count // 64):  # bounded: every round removes up to 64 or stops
            if count <= self.limits.max_records and size <= self.limits.max_bytes:
                return
            oldest = cur.run(
                f"SELECT id, size FROM fencepost_records WHERE status NOT IN {_LIVE_SQL} "
                "ORDER BY created, id LIMIT 64"
            ).all()
            if not oldest:
                return  # only live records are left: they stay until they end
            for record_id, record_size in oldest:
                if count <= self.limits.max_records and size <= self.limits.max_bytes:
                    return
                _forget(cur, record_id, "evicted", now)
                count, size = count - 1, size - int(record_size)

    async def get(self, record_id: str) -> Record | Gone | None:
        """The record; Gone when it was stored and is not any longer; None: never seen."""

        def work(cur: Cursor) -> Record | Gone | None:
            now, at = cur.clock()
            row = cur.run(f"SELECT {_COLUMNS}, {now} FROM fencepost_records WHERE id = ?",
                          (*at, record_id)).one()  # fmt: skip
            if row is None:
                return _gone(cur, record_id)
            if row[3] < row[-1] and row[4] not in LIVE:
                _forget(cur, record_id, "expired", float(row[-1]))
                return Gone(record_id, "expired")
            return _record(row[:-1])

        return await self._call(work)

    async def delete(self, record_id: str) -> bool:
        def work(cur: Cursor) -> bool:
            exists = cur.run("SELECT 1 FROM fencepost_records WHERE id = ?", (record_id,)).one()
            if exists is None:
                return False
            _forget(cur, record_id, "deleted", cur.now())
            return True

        return await self._call(work)

    async def list_records(self, kind: Kind, model: str | None) -> list[Record]:
        """Every unexpired record of a kind (of a model), oldest first."""

        def work(cur: Cursor) -> list[Record]:
            sql = f"SELECT {_COLUMNS} FROM fencepost_records WHERE kind = ? AND expires >= ?"
            params: tuple[Any, ...] = (kind, cur.now())
            if model is not None:
                sql, params = sql + " AND model = ?", (*params, model)
            return [_record(row) for row in cur.run(sql + " ORDER BY created, id", params).all()]

        return await self._call(work)

    async def update_metadata(self, record_id: str, metadata: dict[str, str]) -> Record | None:
        def work(cur: Cursor) -> Record | None:
            row = cur.run(f"SELECT {_COLUMNS} FROM fencepost_records WHERE id = ?",
                          (record_id,)).one()  # fmt: skip
            if row is None:
                return None
            record = _record(row)
            record.metadata = metadata
            record.body = {**record.body, "metadata": metadata}
            body = _text(record.body)
            grown = len(body) - len(row[10])
            cur.run(
                "UPDATE fencepost_records SET metadata = ?, body = ?, size = size + ? WHERE id = ?",
                (_text(metadata), body, grown, record_id),
            )
            record.size += grown
            return record

        return await self._call(work)

    # --- the events of a streamed response ---

    async def append_events(self, record_id: str, first: int, frames: list[str]) -> int:
        """Keep events `first`, `first + 1`, ... of a live record; those it already has
        are skipped (a retried append adds nothing twice). Returns how many it keeps
        now; -1 when the record is gone, or these would break its byte bound."""

        def work(cur: Cursor) -> int:
            row = cur.run("SELECT events, size FROM fencepost_records WHERE id = ?",
                          (record_id,)).one()  # fmt: skip
            if row is None:
                return -1
            kept, size = int(row[0]), int(row[1])
            if first > kept:
                raise ValueError(f"events of {record_id}: {first} given, {kept} kept (a gap)")
            fresh = frames[kept - first :]
            if not fresh:
                return kept
            grown = sum(len(f) for f in fresh)
            if size + grown > self.limits.max_bytes:
                return -1
            rows = [(record_id, kept + i, frame) for i, frame in enumerate(fresh)]
            cur.many("INSERT INTO fencepost_events (id, seq, data) VALUES (?, ?, ?)", rows)
            cur.run("UPDATE fencepost_records SET events = ?, size = ? WHERE id = ?",
                    (kept + len(fresh), size + grown, record_id))  # fmt: skip
            return kept + len(fresh)

        return await self._call(work)

    async def events_after(self, record_id: str, after: int, limit: int) -> list[tuple[int, str]]:
        """Up to `limit` kept events with a sequence number above `after`, in order."""

        def work(cur: Cursor) -> list[tuple[int, str]]:
            rows = cur.run(
                "SELECT seq, data FROM fencepost_events WHERE id = ? AND seq > ? "
                "ORDER BY seq LIMIT ?",
                (record_id, after, limit),
            ).all()
            return [(int(seq), str(data)) for seq, data in rows]

        return await self._call(work)

    # --- ownership: leases, cancels, and the records of routers that died ---

    async def request_cancel(self, record_id: str) -> Record | Gone | None:
        """Mark a live record for cancelling (its owner acts on it); the record as it is."""

        def work(cur: Cursor) -> Record | Gone | None:
            cur.run(
                f"UPDATE fencepost_records SET cancel = 1 WHERE id = ? AND status IN {_LIVE_SQL}",
                (record_id,),
            )
            row = cur.run(f"SELECT {_COLUMNS} FROM fencepost_records WHERE id = ?",
                          (record_id,)).one()  # fmt: skip
            return _record(row) if row is not None else _gone(cur, record_id)

        return await self._call(work)

    async def cancels(self, owner: str) -> list[str]:
        """The live records of `owner` that someone asked to cancel."""

        def work(cur: Cursor) -> list[str]:
            rows = cur.run(
                f"SELECT id FROM fencepost_records WHERE owner = ? AND cancel = 1 "
                f"AND status IN {_LIVE_SQL}",
                (owner,),
            ).all()
            return [str(row[0]) for row in rows]

        return await self._call(work)

    async def renew(self, owner: str, lease_s: float) -> None:
        def work(cur: Cursor) -> None:
            until = cur.now() + lease_s
            cur.run(
                "INSERT INTO fencepost_routers (id, lease_until) VALUES (?, ?) "
                "ON CONFLICT (id) DO UPDATE SET lease_until = excluded.lease_until",
                (owner, until),
            )

        await self._call(work)

    async def release(self, owner: str) -> None:
        """A router that stops: its lease ends now (its live records, if any, are reaped)."""
        await self._call(
            lambda cur: cur.run("DELETE FROM fencepost_routers WHERE id = ?", (owner,))
        )

    async def reap(self) -> list[str]:
        """Live records whose owner holds no lease are failed (the ids); expired records
        are forgotten, long-dead routers' rows deleted, tombstones bounded."""

        def work(cur: Cursor) -> list[str]:
            now = cur.now()
            rows = cur.run(
                f"SELECT {_COLUMNS} FROM fencepost_records r WHERE status IN {_LIVE_SQL} AND "
                "NOT EXISTS (SELECT 1 FROM fencepost_routers o WHERE o.id = r.owner "
                "AND o.lease_until >= ?)",
                (now,),
            ).all()
            failed = []
            for row in rows:
                record = _record(row)
                record.body = {**record.body, "status": "failed", "error": LOST}
                cur.run(
                    "UPDATE fencepost_records SET status = 'failed', owner = NULL, body = ? "
                    "WHERE id = ?",
                    (_text(record.body), record.id),
                )
                failed.append(record.id)
            expired = cur.run(
                f"SELECT id FROM fencepost_records WHERE expires < ? AND status NOT IN {_LIVE_SQL}",
                (now,),
            ).all()
            for (record_id,) in expired:
                _forget(cur, record_id, "expired", now)
            cur.run("DELETE FROM fencepost_routers WHERE lease_until < ?",
                    (now - ROUTER_FORGOTTEN_S,))  # fmt: skip
            keep = max(10_000, 10 * self.limits.max_records)
            edge = cur.run("SELECT at FROM fencepost_gone ORDER BY at DESC LIMIT 1 OFFSET ?",
                           (keep,)).one()  # fmt: skip
            if edge is not None:
                cur.run("DELETE FROM fencepost_gone WHERE at <= ?", (edge[0],))
            return failed

        return await self._call(work)


def _readable(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _record(row: Any) -> Record:
    (record_id, kind, created, _expires, status, owner, background, cancel, model, metadata,
     body, items, events, size) = row  # fmt: skip
    return Record(
        id=record_id,
        kind=kind,
        body=msgspec.json.decode(body),
        items=msgspec.json.decode(items),
        model=model,
        created=float(created),
        metadata=msgspec.json.decode(metadata),
        status=status,
        owner=owner,
        background=bool(background),
        cancel=bool(cancel),
        events=int(events),
        size=int(size),
    )


def _forget(cur: Cursor, record_id: str, reason: str, now: float) -> None:
    """Delete a record and its events, and say why it is gone."""
    cur.run("DELETE FROM fencepost_events WHERE id = ?", (record_id,))
    cur.run("DELETE FROM fencepost_records WHERE id = ?", (record_id,))
    cur.run(
        "INSERT INTO fencepost_gone (id, reason, at) VALUES (?, ?, ?) "
        "ON CONFLICT (id) DO UPDATE SET reason = excluded.reason, at = excluded.at",
        (record_id, reason, now),
    )


def _gone(cur: Cursor, record_id: str) -> Gone | None:
    row = cur.run("SELECT reason FROM fencepost_gone WHERE id = ?", (record_id,)).one()
    return Gone(record_id, row[0]) if row is not None else None
