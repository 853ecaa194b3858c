"""A real PostgreSQL server for the state store's tests, one per test process.

The store's PostgreSQL path (adapters/state/sql.py) is only honestly tested against a
real server: its advisory lock, its clock, its errors when the server goes away. This
module runs Debian's own binaries (scripts/install-postgres installs them; tests skip,
naming it, where they are absent, and fail instead under CI=true, where CI installed
them) on a throwaway cluster in a temporary folder: trust authentication, no fsync,
listening on 127.0.0.1 at a free port and on a unix socket inside that folder.

initdb and postgres refuse to run as root, and CI runs as root: there both run as the
`postgres` user (else `nobody`) through setpriv, which execs in place, so the process
held here is the server itself. The server is given a parent-death signal, so even a
test process killed outright leaves no server behind; otherwise `close` kills it and
removes the folder. Every wait is bounded.

Fixtures (registered by importing them into a conftest.py, as tests/state/conftest.py
does): `postgres_server`, one server per test process (each pytest-xdist worker starts
its own: initdb and start take about a second); `postgres_url`, its URL; and
`postgres_database`, the URL of a fresh, empty database for one test.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType

import pytest

INSTALL_HINT = (
    "no PostgreSQL server binaries here (initdb, postgres): run scripts/install-postgres "
    "(apt-get install postgresql)"
)
SUPERUSER = "fencepost"
DATABASE = "fencepost"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# Settings for a disposable cluster: nothing is worth an fsync, nothing is kept long.
# synchronous_commit stays on: with fsync off it costs a write() to the page cache, and
# it keeps every commit across `stop()` (an immediate shutdown is a crash to the server).
SETTINGS = {
    "listen_addresses": "127.0.0.1",
    "fsync": "off",
    "full_page_writes": "off",
    "shared_buffers": "16MB",
    "max_connections": "60",
    "max_wal_senders": "0",
    "wal_level": "minimal",
    "autovacuum": "off",
    "logging_collector": "off",
    "lc_messages": "C",
}


class PostgresUnavailable(RuntimeError):
    """The server could not be set up or did not start (the reason and its log say why)."""


def find_bindir() -> Path | None:
    """The folder holding initdb and postgres: FENCEPOST_POSTGRES_BIN if set, else
    `pg_config --bindir` (where it has the server: libpq-dev's pg_config alone names
    a folder without it), else the newest /usr/lib/postgresql/*/bin."""
    override = os.environ.get("FENCEPOST_POSTGRES_BIN")
    candidates = [Path(override)] if override else []
    if not override:
        pg_config = shutil.which("pg_config")
        if pg_config is not None:
            try:
                found = subprocess.run(
                    [pg_config, "--bindir"], capture_output=True, text=True, timeout=10
                )
                if found.returncode == 0 and found.stdout.strip():
                    candidates.append(Path(found.stdout.strip()))
            except (OSError, subprocess.TimeoutExpired):
                pass
        versions = Path("/usr/lib/postgresql").glob("*/bin")
        candidates += sorted(versions, key=_version, reverse=True)
    for bindir in candidates:
        if all((bindir / name).is_file() for name in ("initdb", "postgres")):
            return bindir
    return None


def _version(bindir: Path) -> tuple[int, ...]:
    """/usr/lib/postgresql/15/bin -> (15,): so that 15 sorts above 9.6."""
    parts = bindir.parent.name.split(".")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else (-1,)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _unprivileged_user() -> pwd.struct_passwd:
    """Whom a root test process runs the server as: `postgres`, else `nobody`."""
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise PostgresUnavailable("running as root, with neither a postgres nor a nobody user")


class PostgresServer:
    """A throwaway cluster, started on entry and gone (process and folder) on exit.

    `stop()` shuts it down at once (the immediate mode: connections break, as when a
    database host goes down); `start()` brings it back on the same port with the
    same data. Call `start` from a thread that outlives the server (the test's own):
    the server dies with the thread that started it."""

    def __init__(self, bindir: Path, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        self.bindir = bindir
        self.ready_timeout_s = ready_timeout_s
        self.port = 0
        self.folder: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._prefix: list[str] = []  # how each command drops root, or keeps the user
        self._owner: pwd.struct_passwd | None = None  # whom the files belong to, as root

    @property
    def url(self) -> str:
        return self.database_url(DATABASE)

    def database_url(self, name: str) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{name}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    # --- the lifetime ---

    def __enter__(self) -> PostgresServer:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def _create(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="fencepost-pg-", dir=_shared_temp()))
        self._prefix = self._drop_root()
        data = self.folder / "data"
        initdb = [
            str(self.bindir / "initdb"),
            f"--pgdata={data}",
            f"--username={SUPERUSER}",
            "--auth=trust",
            "--no-sync",
            "--no-locale",
            "--encoding=UTF8",
        ]
        self._run(initdb, "initdb")
        for _attempt in range(3):  # a free port may be taken before the server binds it
            self.port = _free_port()
            try:
                self.start()
                break
            except PostgresUnavailable as error:
                if "could not bind" not in str(error) and "in use" not in str(error):
                    raise
        else:
            raise PostgresUnavailable("no free port on 127.0.0.1 after 3 tries")
        self.create_database(DATABASE)

    def _drop_root(self) -> list[str]:
        """The command prefix that runs the server's programs as an unprivileged user
        (root only: they refuse root), with the folder handed to that user. setpriv
        execs in place, so the pid held is the server's; its parent-death signal ends
        the server if this process dies without closing it."""
        setpriv = shutil.which("setpriv")
        prefix = [setpriv, "--pdeathsig=KILL"] if setpriv else []
        if os.geteuid() != 0:
            return [*prefix, "--"] if prefix else []
        user = _unprivileged_user()
        assert self.folder is not None
        os.chown(self.folder, user.pw_uid, user.pw_gid)
        self._owner = user
        if setpriv:
            ids = [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
            return [*prefix, *ids, "--"]
        runuser = shutil.which("runuser")
        if runuser is None:
            raise PostgresUnavailable("running as root without setpriv or runuser")
        return [runuser, "-u", user.pw_name, "--"]

    def _run(self, command: list[str], what: str) -> None:
        try:
            done = subprocess.run(
                [*self._prefix, *command],
                capture_output=True,
                text=True,
                timeout=self.ready_timeout_s * 2,
                env=_environment(),
            )
        except subprocess.TimeoutExpired as error:
            raise PostgresUnavailable(f"{what} took over {error.timeout} s") from error
        if done.returncode != 0:
            raise PostgresUnavailable(f"{what} exited {done.returncode}: {done.stderr[-2000:]}")

    def start(self) -> None:
        """Start the server (again) and wait, bounded, until it takes connections."""
        assert self.folder is not None and self.port, "start() after entering the context"
        if self.running:
            return
        log = self.folder / "server.log"
        options = [f"--{name.replace('_', '-')}={value}" for name, value in SETTINGS.items()]
        command = [
            str(self.bindir / "postgres"),
            "-D",
            str(self.folder / "data"),
            "-p",
            str(self.port),
            "-k",
            str(self.folder),
            *options,
        ]
        with log.open("ab") as sink:
            self._process = subprocess.Popen(
                [*self._prefix, *command],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=_environment(),
                start_new_session=True,  # a ^C to the tests reaches it only through close
            )
        self._wait_ready(log)

    def _wait_ready(self, log: Path) -> None:
        import psycopg

        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self._process is not None and self._process.poll() is not None:
                raise PostgresUnavailable(
                    f"postgres exited {self._process.returncode}: {_tail(log)}"
                )
            try:
                with psycopg.connect(self.database_url("postgres"), connect_timeout=2):
                    return
            except psycopg.OperationalError as error:
                if time.monotonic() > deadline:
                    self.stop()
                    raise PostgresUnavailable(
                        f"postgres took no connection within {self.ready_timeout_s} s "
                        f"({str(error).strip()}): {_tail(log)}"
                    ) from error
            time.sleep(0.05)

    def stop(self) -> None:
        """Shut the server down at once (SIGQUIT: immediate mode; SIGKILL if it lingers)."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGQUIT)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=STOP_TIMEOUT_S)

    def close(self) -> None:
        """Stop the server and remove its folder (safe to call more than once)."""
        try:
            self.stop()
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = None

    # --- databases ---

    def create_database(self, name: str) -> str:
        """An empty database of this name (a plain identifier); its URL."""
        import psycopg

        if not name.replace("_", "").isalnum():
            raise ValueError(f"{name!r} is no plain identifier")
        with psycopg.connect(self.database_url("postgres"), autocommit=True) as connection:
            connection.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
        return self.database_url(name)

    def drop_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(self.database_url("postgres"), autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    @contextmanager
    def fresh_database(self) -> Iterator[str]:
        """A new empty database for one test (its URL), dropped afterwards."""
        name = f"test_{uuid.uuid4().hex[:16]}"
        url = self.create_database(name)
        try:
            yield url
        finally:
            if self.running:
                self.drop_database(name)


def _shared_temp() -> str:
    """The system's temp folder where the server's user can reach it: under root,
    TMPDIR may be private (pytest's own basetemp is), so fall back to /tmp."""
    base = tempfile.gettempdir()
    if os.geteuid() == 0 and not os.stat(base).st_mode & 0o001:
        return "/tmp"
    return base


def _environment() -> dict[str, str]:
    """The tests' environment, minus anything that would point libpq or the server
    elsewhere, in the C locale (a missing locale would stop initdb)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def _tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError as error:
        return f"(no log: {error})"


# --- pytest ----------------------------------------------------------------------------


def need_bindir() -> Path:
    """The binaries, or the test is skipped naming scripts/install-postgres; under
    CI=true (CI installs them) their absence fails instead."""
    bindir = find_bindir()
    if bindir is not None:
        return bindir
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true, yet {INSTALL_HINT}", pytrace=False)
    pytest.skip(INSTALL_HINT)


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """One server for this test process (under xdist, one per worker)."""
    with PostgresServer(need_bindir()) as server:
        yield server


@pytest.fixture(scope="session")
def postgres_url(postgres_server: PostgresServer) -> str:
    """The URL of the shared server's `fencepost` database (shared by every test)."""
    return postgres_server.url


@pytest.fixture
def postgres_database(postgres_server: PostgresServer) -> Iterator[str]:
    """The URL of a fresh, empty database that only this test sees."""
    if not postgres_server.running:  # a test before this one stopped it and failed
        postgres_server.start()
    with postgres_server.fresh_database() as url:
        yield url
