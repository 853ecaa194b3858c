"""deploy/grafana/fencepost.json charts only series that /metrics really exports.

Every PromQL expression of the dashboard (panel targets and template variable
queries) is read for the `fencepost_*` names it uses, and each must be a sample
name in a real Metrics.render() (a Controller whose router knows a worker and
has fenced a message, and each labelled counter counted once, so that every
family has samples). Names are
compared as Prometheus stores them: a counter as `_total`, a histogram as
`_bucket` / `_sum` / `_count`; a bare histogram name is not a series.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapters.openai.metrics import Metrics
from adapters.runtime.controller import Controller
from core.protocol import CacheReport, FromWorkerMessage, Heartbeat

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fencepost.json"
GRID_COLUMNS = 24

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_NAME = re.compile(r"(?<![A-Za-z0-9_:])fencepost_[A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The fencepost_ series an expression selects (label values in quotes are not names)."""
    return set(_NAME.findall(_STRING.sub('""', expr)))


def exported_series() -> set[str]:
    controller = Controller()
    metrics = Metrics(controller)
    report = CacheReport(16, (1, 2), 10.0, 40, 8, total_blocks=64, free_blocks=60)
    beat = Heartbeat("w1", 0, 1, 4, 3, 4096, (), report)
    controller.router.handle(FromWorkerMessage("w1", beat), 0.0)
    controller.router.handle(FromWorkerMessage("w1", beat), 0.0)  # stale: a fence by reason
    metrics.requests.labels("stop").inc()  # the HTTP layer makes each outcome's child so
    text = metrics.render().decode()
    return {s.name for family in text_string_to_metric_families(text) for s in family.samples}


def load() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def charts(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard["panels"]) if p["type"] != "row"]


def expressions(dashboard: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in charts(dashboard) for t in p["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            exprs.append(query["query"] if isinstance(query, dict) else query)
    return exprs


def test_the_extractor_reads_names_not_label_values() -> None:
    expr = 'sum by (le) (rate(fencepost_a_bucket{kind="fencepost_b", j=~"$job"}[5m])) / fencepost_c'
    assert metric_names(expr) == {"fencepost_a_bucket", "fencepost_c"}


def test_every_series_the_dashboard_charts_is_exported() -> None:
    exported = exported_series()
    used = {name for expr in expressions(load()) for name in metric_names(expr)}
    assert len(used) >= 10, used  # the extractor found the dashboard's names at all
    assert not used - exported, f"charted but not exported: {sorted(used - exported)}"
    # What the check guards against: histogram and counter names as written in Python.
    assert "fencepost_time_to_first_token_seconds" not in exported
    assert "fencepost_requests" not in exported


def test_the_dashboard_covers_what_operators_watch() -> None:
    used = {name for expr in expressions(load()) for name in metric_names(expr)}
    for name in (
        "fencepost_requests_total",
        "fencepost_time_to_first_token_seconds_bucket",
        "fencepost_inter_token_latency_seconds_bucket",
        "fencepost_completion_tokens_total",
        "fencepost_queue_depth",
        "fencepost_kv_blocks",
        "fencepost_prefill_tokens_total",
        "fencepost_attempt_retries",
        "fencepost_stream_resumes",
        "fencepost_stream_handoffs",
        "fencepost_fenced_messages",
        "fencepost_worker_healthy",
    ):
        assert name in used, name


@pytest.mark.parametrize("quantile", ["0.5", "0.9", "0.99"])
def test_latency_quantiles_come_from_buckets(quantile: str) -> None:
    exprs = [e for e in expressions(load()) if f"histogram_quantile({quantile}," in e]
    assert len(exprs) == 2  # time to first token and inter-token latency
    for expr in exprs:
        assert all(name.endswith("_bucket") for name in metric_names(expr)), expr
        assert "by (le)" in expr, expr  # summed over instances, the buckets kept apart


def test_panels_are_well_formed() -> None:
    dashboard = load()
    assert dashboard["schemaVersion"] >= 36
    panels = list(all_panels(dashboard["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    taken: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys(), panel["title"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
        cells = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells
    for panel in charts(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}"


def test_the_datasource_and_selectors_are_template_variables() -> None:
    variables = {v["name"]: v for v in load()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "instance"):
        assert variables[name]["type"] == "query"
    for expr in [t["expr"] for p in charts(load()) for t in p["targets"]]:
        assert 'job=~"$job"' in expr and 'instance=~"$instance"' in expr, expr
