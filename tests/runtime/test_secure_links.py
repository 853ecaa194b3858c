"""Mutual TLS on the worker links, drilled with real processes on 127.0.0.1.

A router (`fencepost serve --no-local-worker`, mutual TLS on its worker port)
and one certified worker serve a stream while impostors try the port: a worker
with no certificate, one with another CA's, one with w1's certificate claiming
w2, one whose certificate has expired, a raw client that passes the handshake
with w1's certificate and then claims w2, and a replay of the bytes a real
worker sent. Each is refused before any frame is processed, none is sent a
prompt, and the real stream's text is exactly its undisturbed text.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import trio
import trio.testing

from adapters.runtime.tls import (
    Credentials,
    TlsError,
    TlsFiles,
    allows,
    certificate,
    client_context,
    load_ca,
    make_certificates,
    server_context,
)
from core.protocol import Refused, Register
from core.wire import FrameReader, encode_frame
from tests.support.process_helpers import LogWatcher, fencepost, healthy_workers, wait_for
from tests.support.runtime_helpers import kill_all

pytestmark = pytest.mark.xdist_group("secure_links")

PROMPT = "tell the secret number 7788"


def test_a_certificate_names_one_worker_id_or_a_family() -> None:
    assert allows("w1", "w1") and not allows("w1", "w2") and not allows("w1", "w10")
    assert allows("fencepost-worker-*", "fencepost-worker-7d9f-x2-1")
    assert not allows("fencepost-worker-*", "fencepost-worker-")  # the family's name alone
    assert not allows("fencepost-worker-*", "other-worker-1") and not allows(None, "w1")


def test_unusable_tls_files_are_named(tmp_path: Path) -> None:
    made = tmp_path / "certs"
    make_certificates(made, ["localhost"], ["w1"], days=1)
    with pytest.raises(TlsError, match="does not exist"):
        server_context(TlsFiles(made / "router.crt", made / "router.key", tmp_path / "no-ca"))
    with pytest.raises(TlsError, match="not a PEM certificate and its key"):
        client_context(TlsFiles(made / "w1.crt", made / "router.key", made / "ca.crt"))


def _handshake(server: ssl.SSLContext, client: ssl.SSLContext) -> bool:
    """Whether a worker with `client` passes the router's handshake with `server`
    (over memory streams; the router's side decides, as TLS 1.3 ends the client's first)."""
    passed = False

    async def main() -> None:
        nonlocal passed
        ends = trio.testing.memory_stream_pair()
        router = trio.SSLStream(ends[0], server, server_side=True)
        worker = trio.SSLStream(ends[1], client, server_hostname="localhost")

        async def router_side() -> None:
            nonlocal passed
            with contextlib.suppress(trio.BrokenResourceError):
                await router.do_handshake()
                passed = True

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:

                async def worker_side() -> None:
                    try:
                        await worker.do_handshake()
                    except trio.BrokenResourceError:  # it refused the router: no link
                        nursery.cancel_scope.cancel()

                nursery.start_soon(router_side)
                nursery.start_soon(worker_side)

    trio.run(main)
    return passed


def test_renewed_certificates_are_used_for_new_links_without_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    old, new, live = tmp_path / "old", tmp_path / "new", tmp_path / "live"
    make_certificates(old, ["localhost"], ["w1"], days=1)
    make_certificates(new, ["localhost"], ["w1"], days=1)  # another CA: as after a rotation

    def install(
        source: Path, names: tuple[str, ...] = ("router.crt", "router.key", "ca.crt")
    ) -> None:
        live.mkdir(exist_ok=True)
        for name in names:  # as a Secret's volume does: a new file swapped in whole
            (live / f"{name}.tmp").write_bytes((source / name).read_bytes())
            (live / f"{name}.tmp").replace(live / name)

    def worker(folder: Path) -> ssl.SSLContext:
        return client_context(TlsFiles(folder / "w1.crt", folder / "w1.key", folder / "ca.crt"))

    install(old)
    held = Credentials(TlsFiles(live / "router.crt", live / "router.key", live / "ca.crt"),
                       server_context, check_s=0)  # fmt: skip
    first = held.context()
    assert held.context() is first  # nothing changed: the same context
    assert _handshake(first, worker(old)) and not _handshake(first, worker(new))
    install(new)
    renewed = held.context()
    assert renewed is not first and held.reloads == 1
    assert _handshake(renewed, worker(new)) and not _handshake(renewed, worker(old))
    (live / "router.key").write_bytes(b"half written")  # unusable: the renewed ones stay
    with caplog.at_level("WARNING", logger="fencepost.tls"):
        assert held.context() is renewed and held.reloads == 1
    assert "cannot be used" in caplog.text
    install(new, ("router.key",))  # whole again: loaded
    assert held.context() is not renewed and held.reloads == 2


def _expired(folder: Path, worker_id: str) -> None:
    """A certificate for worker_id from the CA in `folder`, valid only until yesterday."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    start = datetime.datetime.now(datetime.UTC) - datetime.timedelta(days=3)
    cert = certificate(worker_id, key, load_ca(folder), days=2, client=True, not_before=start)
    (folder / f"{worker_id}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / f"{worker_id}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _tls_flags(folder: Path, name: str) -> list[str]:
    return ["--tls-cert", str(folder / f"{name}.crt"), "--tls-key", str(folder / f"{name}.key"),
            "--tls-ca", str(folder / "ca.crt")]  # fmt: skip


class Recorder:
    """A TCP relay to the router that keeps what the client sent on its first connection."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.sent = bytearray()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target))

        def pump(a: socket.socket, b: socket.socket, keep: bytearray | None) -> None:
            try:
                while data := a.recv(65536):
                    if keep is not None:
                        keep.extend(data)
                    b.sendall(data)
            except OSError:
                pass
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=pump, args=(upstream, client, None), daemon=True).start()
        pump(client, upstream, self.sent)


def _ignores_sigpipe(pid: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    [mask] = [line.split()[1] for line in status.splitlines() if line.startswith("SigIgn:")]
    return bool(int(mask, 16) >> (13 - 1) & 1)  # SIGPIPE is signal 13


def _read_all(sock: ssl.SSLSocket | socket.socket) -> bytes:
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except (ssl.SSLError, ConnectionError):
        pass  # the router ended the connection: what came before it is what counts
    return received


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(this cluster's certificates, another CA's)."""
    ours, theirs = tmp_path_factory.mktemp("ours"), tmp_path_factory.mktemp("theirs")
    make_certificates(ours, ["localhost", "127.0.0.1"], ["w1", "w4"], days=2)
    make_certificates(theirs, ["localhost", "127.0.0.1"], ["w1"], days=2)
    _expired(ours, "w3")
    return ours, theirs


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    kill_all(started)


def test_impostors_are_refused_before_any_frame_and_the_real_stream_stays_exact(
    certs: tuple[Path, Path], processes: list[subprocess.Popen[str]]
) -> None:
    ours, theirs = certs
    processes.append(fencepost(
        "serve", "--fake", "--port", "0", "--no-local-worker",
        "--worker-listen", "127.0.0.1:0", *_tls_flags(ours, "router"),
    ))  # fmt: skip
    router = LogWatcher(processes[-1])
    base = "http://127.0.0.1:" + router.find(r"serving \S+ on http://127\.0\.0\.1:(\d+)/v1")[1]
    port = int(router.find(r"accepting workers on 127\.0\.0\.1:(\d+) \(mutual TLS\)")[1])

    def worker(worker_id: str, *flags: str, to: int = port) -> LogWatcher:
        processes.append(fencepost(
            "worker", "--fake", "--fake-step-ms", "10", "--fake-ignore-eos",
            "--connect", f"localhost:{to}", "--worker-id", worker_id,
            "--refused-grace", "1", *flags,
        ))  # fmt: skip
        return LogWatcher(processes[-1])

    worker("w1", *_tls_flags(ours, "w1")).find(r"linked to router \S+ at 127\.0\.0\.1")
    for process in processes:  # a write to a gone peer must raise, not kill (SIGPIPE)
        assert _ignores_sigpipe(process.pid), process.args
    wait_for(lambda: healthy_workers(base) == 1)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    ask = {"model": "fake", "messages": [{"role": "user", "content": PROMPT}],
           "max_tokens": 300, "temperature": 0}  # fmt: skip
    undisturbed = client.chat.completions.create(**ask).choices[0].message.content  # type: ignore[call-overload]
    streamed: list[str] = []
    stream = client.chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
    reader = threading.Thread(
        target=lambda: streamed.extend(
            c.choices[0].delta.content or "" for c in stream if c.choices
        )
    )
    reader.start()

    # 1. no certificate: the router's handshake fails on its first bytes
    plain = worker("w9")
    router.find(r"refused a worker connection from 127\.0\.0\.1: .*\(1 so far\)")
    plain.find(r"registering as w9 at 127\.0\.0\.1:\d+ failed|did not answer")
    # 2. another CA's certificate: neither side trusts the other
    foreign = worker("w1", *_tls_flags(theirs, "w1"))
    foreign.find(r"TLS with the router localhost at 127\.0\.0\.1:\d+ failed: certificate refused")
    # 3. w1's own certificate, claiming w2: refused by name, and the worker stops (exit 2)
    claimer = worker("w2", *_tls_flags(ours, "w1"))
    claimer.find(r"refused worker id w2: its certificate \('w1'\) does not name worker id 'w2'")
    assert processes[-1].wait(60) == 2
    # 4. an expired certificate: refused, and the log says why
    worker("w3", *_tls_flags(ours, "w3"))
    router.find(r"refused a worker connection from 127\.0\.0\.1: .*expired", 60)

    # 5. through the handshake with w1's certificate, then Register as w2 (and take it over)
    context = client_context(TlsFiles(ours / "w1.crt", ours / "w1.key", ours / "ca.crt"))
    with (
        socket.create_connection(("127.0.0.1", port), timeout=20) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        tls.sendall(encode_frame(Register("w2", takeover=True)))
        frames = FrameReader(1 << 20).feed(_read_all(tls))
    assert len(frames) == 1 and isinstance(frames[0], Refused), frames

    # 6. the bytes a real worker (w4) sent, replayed on a new connection
    relay = Recorder(port)
    worker("w4", *_tls_flags(ours, "w4"), to=relay.port)
    wait_for(lambda: healthy_workers(base) == 2)
    captured = bytes(relay.sent)
    logged = len(router.lines)
    with socket.create_connection(("127.0.0.1", port), timeout=20) as raw:
        raw.sendall(captured)
        answered = _read_all(raw)  # until the router closes it
    assert PROMPT.encode() not in answered
    wait_for(lambda: any("refused a worker connection" in x for x in router.lines[logged:]))

    reader.join(120)
    assert not reader.is_alive()
    assert "".join(streamed) == undisturbed  # the real worker's stream, exact
    assert healthy_workers(base) == 2  # w1 and w4, nobody else
    impostor_lines = [line for line in router.lines if "worker w2" in line or "worker w9" in line]
    assert not impostor_lines, impostor_lines  # never connected as a worker


def test_without_tls_the_router_says_its_worker_port_is_open(
    processes: list[subprocess.Popen[str]],
) -> None:
    processes.append(fencepost(
        "serve", "--fake", "--port", "0", "--no-local-worker", "--worker-listen", "127.0.0.1:0"
    ))  # fmt: skip
    LogWatcher(processes[-1]).find(r"the worker port is unauthenticated")


def test_half_the_tls_flags_is_an_error(certs: tuple[Path, Path]) -> None:
    from adapters.cli.main import main

    ours, _ = certs
    flags = ["--tls-cert", str(ours / "w1.crt")]
    assert main(["worker", "--fake", "--connect", "127.0.0.1:1", *flags]) == 2
    assert main(["serve", "--fake", "--worker-listen", "127.0.0.1:0", *flags]) == 2
