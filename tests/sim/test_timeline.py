"""`fencepost sim --html`: the timeline's data, and the page in a real browser.

The data tests run everywhere. The browser tests open the page in headless Chromium
(tests/support/browser.py) and skip, naming scripts/install-browser, where it is absent; CI
installs it. They open the timeline of a seed that a planted bug (a mutant of
`fencepost mutants`) makes fail, and of a long run, and check by the DOM what a
reader would look for. FENCEPOST_SCREENSHOTS=1 copies the screenshot to docs/images.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from adapters.cli import timeline as page
from adapters.cli.mutants import MUTANTS, _patched_tree
from sim.scenario import STANDARD
from sim.simulator import Simulation
from sim.timeline import Timeline
from tests.support.browser import INSTALL_HINT, chromium, find_chromium

ROOT = Path(__file__).resolve().parents[2]
MUTANT = "router accepts a duplicate index"


def _run(seed: int) -> tuple[Timeline, str | None, str | None]:
    timeline = Timeline()
    result = Simulation(seed, STANDARD, trace=True, timeline=timeline).run()
    return timeline, result.trace_hash, result.violation


def test_a_timeline_only_listens() -> None:
    """The run with a timeline is the run without one, event for event."""
    for seed in (5, 12):
        plain = Simulation(seed, STANDARD, trace=True).run()
        _, traced, violation = _run(seed)
        assert violation is None
        assert traced == plain.trace_hash


def test_the_data_holds_the_run() -> None:
    timeline, _, _ = _run(5)
    result = Simulation(5, STANDARD).run()
    data = json.loads(json.dumps(timeline.data(), allow_nan=False))
    lanes = data["lanes"]
    assert lanes[0] == "router a"
    assert lanes[1:4] == ["w0", "w1", "w2"]
    assert sum(lane.startswith("client") for lane in lanes) == result.requests
    assert len(data["requests"]) == result.requests
    for sent, landed, source, target, _, request, *_ in data["messages"]:
        assert 0 <= sent <= landed <= data["end"]
        assert {lanes[source].split()[0], lanes[target].split()[0]} & {"router"}
        assert source != target
        assert request == -1 or 0 <= request < len(data["keys"])
    fates = data["fates"]
    tokens = [m for m in data["messages"] if data["kinds"][m[4]] in ("Token", "TokenRun")]
    delivered = sum(1 for m in tokens if fates[m[8]] == "delivered")
    assert delivered > 0
    # every token the clients saw came in a delivered token message (a TokenRun holds several)
    assert sum(r[7] for r in data["requests"]) >= delivered
    fenced = sum(n for reason, n in result.fenced.items())
    marked = sum(1 for m in data["messages"] if fates[m[8]].startswith("fenced"))
    assert 0 < marked <= fenced  # a message can trip more than one counter
    outcomes = {r[6] for r in data["requests"]}
    assert outcomes <= {"eos", "length", "stop", "cancelled", "no_worker", "overloaded",
                        "worker_lost", "failed"}  # fmt: skip
    # every attempt bar sits on a worker lane and inside the run
    for _, attempt, lane, start, end in data["attempts"]:
        assert attempt >= 1 and lanes[lane].startswith("w") and 0 <= start <= end <= data["end"]
    assert data["violation"] is None


def test_the_page_is_whole_by_itself() -> None:
    timeline, _, _ = _run(5)
    data = timeline.data()
    data["violation"] = {"text": "r1: </script><b>x</b>", "at": 1.0, "requests": [], "lanes": []}
    html = page.render(data)
    # nothing loaded from elsewhere: no src or href to any address, no imports
    assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", html)
    assert "@import" not in html and "fetch(" not in html
    assert html.count("</script>") == 2  # the violation's text cannot end the data early
    inline = html.split('type="application/json">', 1)[1].split("</script>", 1)[0]
    assert json.loads(inline)["violation"]["text"] == "r1: </script><b>x</b>"


def _failing_timeline(folder: Path) -> tuple[Path, int, str]:
    """The timeline of the first seed that the mutant fails, drawn by its own tree."""
    [mutant] = [m for m in MUTANTS if m.name == MUTANT]
    tree = folder / "tree"
    _patched_tree(mutant, tree)
    env = os.environ | {"PYTHONPATH": str(tree)}
    sweep = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "sim", "--seeds", "200"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    found = re.search(r"^VIOLATION at seed (\d+): (.*)$", sweep.stdout, re.MULTILINE)
    assert found is not None, sweep.stdout[-2000:]
    seed, violation = int(found.group(1)), found.group(2)
    out = folder / f"seed-{seed}.html"
    run = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "sim", "--seed", str(seed), "--html", str(out)],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 1 and f"timeline: {out}" in run.stdout, run.stdout
    return out, seed, violation


def test_html_needs_one_seed() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "adapters.cli", "sim", "--seeds", "2", "--html", "x.html"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "--html draws one run" in run.stdout


needs_browser = pytest.mark.skipif(find_chromium() is None, reason=INSTALL_HINT)


def _screenshot(shot: Path, name: str) -> None:
    if os.environ.get("FENCEPOST_SCREENSHOTS") == "1":
        shutil.copy(shot, ROOT / "docs" / "images" / name)


_COUNT = """JSON.stringify({
  lanes: [...document.querySelectorAll('.lane')].map(e => e.dataset.lane),
  faults: [...document.querySelectorAll('.fault')].map(e => e.dataset.kind),
  arrows: document.querySelectorAll('.msg').length,
  fenced: document.querySelectorAll('.msg.fenced').length,
  violating: document.querySelectorAll('.msg.violating').length,
  line: !!document.getElementById('violation-line'),
  highlighted: [...document.querySelectorAll('.lane.hl')].map(e => e.dataset.lane),
  marked: [...document.querySelectorAll('.hl-item')].map(e => e.dataset.request),
  banner: document.getElementById('violation').textContent,
  result: document.getElementById('result').textContent,
  status: document.getElementById('status').textContent,
  elements: document.querySelectorAll('#chart *').length,
})"""


@needs_browser
def test_a_failing_seed_in_a_browser(tmp_path: Path) -> None:
    html, seed, violation = _failing_timeline(tmp_path)
    with chromium() as tab:
        tab.open(html.as_uri(), width=1400, height=800)
        shown = json.loads(tab.wait_for(_COUNT))
        assert shown["result"] == "FAILED"
        assert violation.removeprefix("safety: ") in shown["banner"]
        lanes = shown["lanes"]
        assert "router a" in lanes and {"w0", "w1", "w2"} <= set(lanes)
        assert any(lane.startswith("client") for lane in lanes)
        assert shown["line"]  # the violation's moment, across the lanes
        assert shown["violating"] == 1  # the delivery it was found after
        # the request the violation names: its client lane and its bars marked
        named = re.search(r"\b(r\d+)\b", violation)
        assert named is not None and named.group(1) in shown["marked"]
        assert any(lane.startswith("client") for lane in shown["highlighted"])
        assert shown["arrows"] > 0 and shown["fenced"] > 0
        # the faults the run drew, shaded on their lanes: each kind the data holds is drawn
        drawn = set(shown["faults"])
        data = tab.evaluate("window.fencepostTimeline.data.faults.map(f => f[3])")
        assert drawn and drawn <= set(data)
        # filtering by the violated request leaves only its own arrows
        tab.evaluate(
            f"document.getElementById('filter').value = {named.group(1)!r};"
            "document.getElementById('filter').dispatchEvent(new Event('input'))"
        )
        kept = tab.wait_for(
            "(() => { const d = window.fencepostTimeline.data;"
            " const arrows = [...document.querySelectorAll('.msg')];"
            " const about = arrows.map(a => d.keys[d.messages[Number(a.dataset.i)][5]]);"
            f" return about.length && about.every(k => k === {named.group(1)!r}) && about.length"
            " })()"
        )
        assert kept > 0
        assert tab.errors == []
        assert all(url.startswith("file://") for url in tab.requested), tab.requested
        shot = tmp_path / "timeline.png"
        tab.evaluate(
            "document.getElementById('filter').value = '';"
            "document.getElementById('filter').dispatchEvent(new Event('input'))"
        )
        tab.wait_for("document.querySelectorAll('.msg').length > 0")
        tab.screenshot(shot)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _screenshot(shot, "timeline.png")
    assert seed >= 0


@needs_browser
def test_a_long_run_stays_usable(tmp_path: Path) -> None:
    """700 requests over 100 s: the whole run is drawn as counts, not 100,000 nodes,
    and a zoomed-in second shows its arrows."""
    seed = next(s for s in range(40) if STANDARD.for_seed(s).requests == 700)
    timeline = Timeline()
    Simulation(seed, STANDARD, timeline=timeline).run()
    html = tmp_path / "long.html"
    size = page.write(timeline.data(), html)
    assert size < 20_000_000
    with chromium() as tab:
        tab.open(html.as_uri())
        whole = json.loads(tab.wait_for(_COUNT))
        assert whole["arrows"] == 0 and "counts per lane" in whole["status"]
        assert whole["elements"] < 20_000
        assert sum(lane.startswith("client") for lane in whole["lanes"]) < 60  # lanes in view
        tab.evaluate("window.fencepostTimeline.setView(50, 51)")
        tab.wait_for("document.querySelectorAll('.msg').length > 0")
        # zoomed in, the rows are the clients with a request in that second
        zoomed = json.loads(tab.evaluate(_COUNT))["lanes"]
        assert "client 0" not in zoomed and any(lane.startswith("client") for lane in zoomed)
        tab.evaluate("window.fencepostTimeline.setView(0, 1e9); window.fencepostTimeline.render()")
        tab.evaluate(
            "document.getElementById('scroll').scrollTop ="
            " window.fencepostTimeline.data.lanes.indexOf('client 400') * 22"
        )
        lanes = tab.wait_for(
            "(() => { const l = [...document.querySelectorAll('.lane')].map(e => e.dataset.lane);"
            " return l.includes('client 400') && l })()"
        )
        assert "w0" not in lanes  # scrolled away: only the lanes in view are drawn
        assert tab.errors == []
