"""What an unauthenticated flood costs the clients who hold a key.

One `fencepost serve --fake` process (a local fake worker that takes --step-ms
per token, API keys on its HTTP port, mutual TLS on its worker port, one
certified `fencepost worker --fake` linked to it) serves a steady client: a
few concurrent chat requests with the key, one after another, whose latency
is recorded. Three phases of --seconds each: idle, then under attack (a second
process sends requests without a key at --http-rate per second, each on its
own connection as a 401 closes it, and opens TLS connections to the worker
port with a certificate of another CA at --tls-rate per second), then idle
again. Reported: the client's p50 and p90 latency per phase and its ratio to
the first idle phase; the attack's achieved rates and what it was answered;
the server's resident memory before, at the end of the attack and after.
Everything on 127.0.0.1; the attacker is bounded by its phase's length and a
cap on open connections.
"""

from __future__ import annotations

import contextlib
import json
import os
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import trio

from bench.harness import (
    FENCEPOST,
    Server,
    free_port,
    log_folder,
    memory_mb,
    percentile,
)

KEY = "sk-bench-attack"


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ask(port: int, tokens: int) -> float:
    body = json.dumps({"model": "fake", "max_tokens": tokens, "temperature": 0,
                       "messages": [{"role": "user", "content": "count"}]}).encode()  # fmt: skip
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        body,
        {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    began = time.perf_counter()
    with urllib.request.urlopen(request, timeout=30) as reply:
        reply.read()
    return time.perf_counter() - began


async def _clients(
    port: int, seconds: float, concurrency: int, tokens: int
) -> tuple[list[float], int]:
    """(latencies of the answers, requests that failed: refused or reset connections)."""
    latencies: list[float] = []
    failed = 0
    deadline = trio.current_time() + seconds

    async def one() -> None:
        nonlocal failed
        while trio.current_time() < deadline:
            try:
                latencies.append(await trio.to_thread.run_sync(_ask, port, tokens))
            except OSError:
                failed += 1

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(one)
    return latencies, failed


async def _flood(
    http_port: int, worker_port: int, http_rate: int, tls_rate: int, seconds: float, certs: Path
) -> dict[str, int]:
    """The attacker: paced unauthenticated requests and failing TLS handshakes."""
    counts = {"http_sent": 0, "http_401": 0, "http_other": 0, "tls_sent": 0, "tls_refused": 0,
              "tls_accepted": 0, "dropped": 0, "errors": 0}  # fmt: skip
    context = ssl.create_default_context(
        ssl.Purpose.SERVER_AUTH, cafile=str(certs / "other-ca.crt")
    )
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE  # the attacker does not care who the router is
    context.load_cert_chain(str(certs / "intruder.crt"), str(certs / "intruder.key"))
    limit = trio.CapacityLimiter(512)  # open connections at most

    async def http() -> None:
        async with limit:
            with trio.move_on_after(5), _counted(counts):
                stream = await trio.open_tcp_stream("127.0.0.1", http_port)
                await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                                      b"Content-Type: application/json\r\n"
                                      b"Content-Length: 2\r\n\r\n{}")  # fmt: skip
                reply = b""
                while chunk := await stream.receive_some(4096):
                    reply += chunk
                await stream.aclose()
                key = "http_401" if reply.startswith(b"HTTP/1.1 401") else "http_other"
                counts[key] += 1

    async def handshake() -> None:
        async with limit:
            with trio.move_on_after(5), _counted(counts):
                raw = await trio.open_tcp_stream("127.0.0.1", worker_port)
                stream = trio.SSLStream(raw, context, server_hostname="localhost")
                try:
                    await stream.do_handshake()
                    await stream.receive_some(1)  # TLS 1.3: the refusal arrives after
                    counts["tls_accepted"] += 1
                except trio.BrokenResourceError:
                    counts["tls_refused"] += 1
                await raw.aclose()

    async def paced(kind: str, rate: int, task: object) -> None:
        start = trio.current_time()
        for n in range(int(rate * seconds)):
            await trio.sleep_until(start + n / rate)
            if limit.borrowed_tokens >= limit.total_tokens:
                counts["dropped"] += 1
                continue
            counts[f"{kind}_sent"] += 1
            nursery.start_soon(task)  # type: ignore[arg-type]

    async with trio.open_nursery() as nursery:
        if http_rate:
            nursery.start_soon(paced, "http", http_rate, http)
        if tls_rate:
            nursery.start_soon(paced, "tls", tls_rate, handshake)
    return counts


@contextlib.contextmanager
def _counted(counts: dict[str, int]) -> Iterator[None]:
    """A connection the server refused or reset counts as an error, not a crash."""
    try:
        yield
    except OSError:
        counts["errors"] += 1


def attacker_main(argv: list[str]) -> int:
    """Entry of the attacking process: ports, rates, seconds, certificate folder."""
    http_port, worker_port, http_rate, tls_rate = (int(a) for a in argv[:4])
    counts = trio.run(_flood, http_port, worker_port, http_rate, tls_rate, float(argv[4]),
                      Path(argv[5]))  # fmt: skip
    print(json.dumps(counts), flush=True)
    return 0


def main(
    seconds: float, http_rate: int, tls_rate: int, concurrency: int, tokens: int, step_ms: float
) -> int:
    from adapters.runtime.tls import make_certificates

    folder = log_folder("attack")
    with tempfile.TemporaryDirectory() as scratch:
        certs = Path(scratch)
        make_certificates(certs, ["localhost", "127.0.0.1"], ["w1"], days=1)
        other = certs / "other"
        make_certificates(other, ["localhost"], ["intruder"], days=1)
        for name in ("intruder.crt", "intruder.key"):
            (certs / name).write_bytes((other / name).read_bytes())
        (certs / "other-ca.crt").write_bytes((other / "ca.crt").read_bytes())
        tls = ["--tls-cert", str(certs / "router.crt"), "--tls-key", str(certs / "router.key"),
               "--tls-ca", str(certs / "ca.crt")]  # fmt: skip
        port, worker_port = free_port(), free_port()
        server = Server("router", [*FENCEPOST, "serve", "--fake", "--port", str(port),
                                   "--fake-step-ms", str(step_ms), "--api-key", KEY,
                                   "--worker-listen", f"127.0.0.1:{worker_port}", *tls],
                        port, folder / "router.log")  # fmt: skip
        worker = subprocess.Popen(
            [*FENCEPOST, "worker", "--fake", "--fake-step-ms", str(step_ms), "--worker-id", "w1",
             "--connect", f"localhost:{worker_port}", "--tls-cert", str(certs / "w1.crt"),
             "--tls-key", str(certs / "w1.key"), "--tls-ca", str(certs / "ca.crt")],
            stdout=subprocess.DEVNULL, stderr=(folder / "worker.log").open("wb"),
        )  # fmt: skip
        try:
            server.wait_ready(120)
            trio.run(_clients, port, 3.0, concurrency, tokens)  # warm up
            print(
                f"attack cost: {concurrency} clients with the key ({tokens}-token answers, "
                f"{step_ms:g} ms a token), {seconds:g} s a phase; attack: {http_rate} keyless "
                f"requests/s on the HTTP port and {tls_rate} TLS handshakes/s with another "
                "CA's certificate on the worker port"
            )
            base: float | None = None
            for phase in ("idle", "attack", "idle again"):
                rss_before = memory_mb(server.process.pid)
                cpu_before = _cpu_s(server.process.pid)
                attacker = None
                if phase == "attack":
                    attacker = subprocess.Popen(
                        [sys.executable, "-m", "bench.attack", str(port),
                         str(worker_port), str(http_rate), str(tls_rate), str(seconds),
                         str(certs)],
                        stdout=subprocess.PIPE, text=True,
                    )  # fmt: skip
                latencies, failed = trio.run(_clients, port, seconds, concurrency, tokens)
                rss_after = memory_mb(server.process.pid)
                busy = (_cpu_s(server.process.pid) - cpu_before) / seconds
                p50, p90 = percentile(latencies, 50) * 1000, percentile(latencies, 90) * 1000
                base = base or p50
                print(
                    f"  {phase:10}: {len(latencies):5} answers ({failed} failed), "
                    f"p50 {p50:7.1f} ms "
                    f"({p50 / base:4.2f}x idle), p90 {p90:7.1f} ms; router RSS "
                    f"{rss_before:6.1f} -> {rss_after:6.1f} MB, router CPU {busy:4.0%}"
                )
                if attacker is not None:
                    out, _ = attacker.communicate(timeout=seconds + 30)
                    counts = json.loads(out.strip().splitlines()[-1])
                    print(
                        f"              attack sent {counts['http_sent'] / seconds:,.0f} "
                        f"requests/s ({counts['http_401']} answered 401, "
                        f"{counts['http_other']} otherwise) and "
                        f"{counts['tls_sent'] / seconds:,.0f} handshakes/s "
                        f"({counts['tls_refused']} refused, {counts['tls_accepted']} "
                        f"accepted); {counts['dropped']} not sent (connection cap), "
                        f"{counts['errors']} connections failed"
                    )
        finally:
            worker.terminate()
            worker.wait(30)
            server.stop()
    print(f"  logs: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(attacker_main(sys.argv[1:]))
