"""/metrics reads the router's own figures: fences by reason, each worker's health,
slots and prefix cache, as the router knows them at scrape time."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from adapters.openai.metrics import Metrics
from adapters.runtime.controller import Controller
from core.protocol import CacheReport, FromWorkerMessage, Heartbeat, WorkerGone

Sample = tuple[str, tuple[tuple[str, str], ...]]


def scrape(metrics: Metrics) -> dict[Sample, float]:
    text = metrics.render().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def beat(controller: Controller, worker: str, seq: int, cache: CacheReport | None) -> None:
    heartbeat = Heartbeat(worker, 0, seq, 4, 3, 4096, (), cache)
    controller.router.handle(FromWorkerMessage(worker, heartbeat), 0.0)


def test_workers_fences_and_cache_as_the_router_sees_them() -> None:
    controller = Controller()
    metrics = Metrics(controller)
    beat(controller, "a", 1, CacheReport(16, (11, 12, 13), 10.0, 40, 8, 100, 60, 15))
    beat(controller, "b", 1, None)
    beat(controller, "a", 1, None)  # said again: fenced as stale, the report kept
    found = scrape(metrics)
    w = "worker"
    assert found["fencepost_fenced_messages", (("reason", "stale_heartbeat"),)] == 1
    assert found["fencepost_worker_healthy", ((w, "a"),)] == 1
    assert found["fencepost_worker_capacity_slots", ((w, "a"),)] == 4
    assert found["fencepost_worker_reported_free_slots", ((w, "a"),)] == 3
    assert found["fencepost_worker_slots_held", ((w, "a"),)] == 0
    assert found["fencepost_kv_blocks", (("state", "used"), (w, "a"))] == 25
    assert found["fencepost_kv_blocks", (("state", "cached"), (w, "a"))] == 15
    assert found["fencepost_kv_blocks", (("state", "free"), (w, "a"))] == 60
    assert found["fencepost_prefix_cache_block_size_tokens", ((w, "a"),)] == 16
    assert ("fencepost_kv_blocks", (("state", "used"), (w, "b"))) not in found  # no report
    assert found["fencepost_prefill_tokens_total", (("kind", "computed"),)] == 8

    controller.router.handle(WorkerGone("a", 0, "connection closed"), 1.0)
    found = scrape(metrics)
    assert found["fencepost_worker_healthy", ((w, "a"),)] == 0
    assert found["fencepost_worker_healthy", ((w, "b"),)] == 1
    assert found["fencepost_healthy_workers", ()] == 1
