"""A worker's health port: liveness, readiness and metrics for whoever runs it.

`fencepost worker --health-listen HOST:PORT` answers three GETs on the
worker's own event loop:

- /health: 200 whenever the loop answers at all. The engine steps on its own
  thread, so a worker busy decoding still answers; a wedged event loop does
  not (a liveness probe).
- /ready: 200 when the decoder runs and at least one router has registered
  the worker, else 503 (a readiness probe).
- /metrics: Prometheus text, read from the worker machine's statistics at
  scrape time.

The responder is a few lines of HTTP/1.1 on purpose: one request per
connection, a bounded request head read within a timeout, `Connection:
close`. A probe needs nothing more, and nothing here can block the worker.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from adapters.runtime.tcp_worker import RemoteWorker

log = logging.getLogger("fencepost.health")

HEAD_BYTES = 8192  # a probe's request head fits; anything longer is not one
HEAD_TIMEOUT_S = 5.0
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class WorkerCollector(Collector):
    """The worker's figures, read when scraped (nothing to keep up to date)."""

    def __init__(self, worker: RemoteWorker) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        machine = self.worker.host.worker
        stats = machine.statistics()
        yield _gauge("fencepost_worker_slots", "slots (concurrent sequences)", stats.slots)
        yield _gauge("fencepost_worker_free_slots", "slots free for any router", machine.free_slots)
        yield _gauge("fencepost_worker_active", "assignments decoding", stats.active)
        yield _gauge("fencepost_worker_linked_routers", "routers linked", len(stats.routers))
        yield _gauge("fencepost_worker_draining", "1 while draining", int(machine.draining))
        yield _gauge("fencepost_worker_ready", "1 when /ready says so", int(self.worker.ready()))
        accepted = CounterMetricFamily("fencepost_worker_offers_accepted", "offers accepted")
        accepted.add_metric([], stats.accepted)
        yield accepted
        yield _by_reason("fencepost_worker_offers_declined", "offers declined", stats.declined)
        yield _by_reason("fencepost_worker_fenced", "stale or foreign messages", stats.fenced)
        sent = CounterMetricFamily("fencepost_worker_tokens_sent", "tokens sent to routers")
        sent.add_metric([], stats.tokens_sent)
        yield sent


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _by_reason(name: str, documentation: str, counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=["reason"])
    for reason, count in sorted(counts.items()):
        family.add_metric([reason], count)
    return family


def answer(worker: RemoteWorker, registry: CollectorRegistry, path: str) -> tuple[int, str, bytes]:
    """status, content type and body for a GET of `path`."""
    match path.split("?", 1)[0]:
        case "/health":
            return 200, "text/plain", b"ok\n"
        case "/ready":
            if worker.ready():
                return 200, "text/plain", b"ready\n"
            why = b"no router link\n" if worker.decoding else b"decoder not running\n"
            return 503, "text/plain", why
        case "/metrics":
            return 200, PROMETHEUS_TEXT, generate_latest(registry)
        case _:
            return 404, "text/plain", b"not found\n"


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           503: "Service Unavailable"}  # fmt: skip


async def serve_health(
    worker: RemoteWorker,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer probes on host:port until cancelled; reports the bound port."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(WorkerCollector(worker))
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = int(listeners[0].socket.getsockname()[1])
    log.info("health, readiness and metrics on http://%s:%d", host, bound)
    task_status.started(bound)

    async def handler(stream: trio.SocketStream) -> None:
        try:
            status, kind, body = 400, "text/plain", b"bad request\n"
            head = b""
            with trio.move_on_after(HEAD_TIMEOUT_S):
                while b"\r\n\r\n" not in head and len(head) < HEAD_BYTES:
                    chunk = await stream.receive_some(HEAD_BYTES)
                    if not chunk:
                        break
                    head += chunk
            parts = head.split(b"\r\n", 1)[0].split()
            if len(parts) == 3 and parts[0] in (b"GET", b"HEAD"):
                status, kind, body = answer(worker, registry, parts[1].decode("latin-1"))
            elif len(parts) == 3:
                status, body = 405, b"GET only\n"
            reply = (
                f"HTTP/1.1 {status} {REASONS[status]}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            if parts[:1] != [b"HEAD"]:
                reply += body
            with trio.move_on_after(HEAD_TIMEOUT_S):
                await stream.send_all(reply)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the prober went away
        finally:
            with trio.CancelScope(shield=True):
                await stream.aclose()

    await trio.serve_listeners(handler, listeners)
