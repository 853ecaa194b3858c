"""The load and drill harnesses run end to end on the fake model and report cleanly.

These check that the commands work and what they count, not how fast
anything is: figures come from running the benches (docs/benchmarks.md).
"""

from __future__ import annotations

import re
import subprocess
import sys


def fencepost(*args: str, timeout_s: float = 900) -> str:
    command = [sys.executable, "-m", "adapters.cli", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_bench_serve_mixed_run_reports_every_figure_and_leaves_nothing() -> None:
    out = fencepost("bench", "serve", "--fake", "--concurrency", "1,4", "--tokens", "30",
                    "--mixed", "--time-limit", "120")  # fmt: skip
    rows = [line for line in out.splitlines() if re.match(r"\s+fencepost\b.*\d+\s*$", line)]
    assert len(rows) >= 3  # 1, 4, and the mixed run (each printed twice: live and summary)
    assert all(line.split()[-1] == "0" for line in rows)  # no errors
    assert "left behind after the mixed run: 0.0 requests, 0.0 slots" in out
    assert re.search(r"fencepost server peak RSS: \d+ MB", out)


def test_the_worker_loss_drill_loses_only_started_streams_and_leaks_nothing() -> None:
    out = fencepost("bench", "drill", "--clients", "6", "--duration", "6", "--kill-at", "2",
                    "--tokens", "60")  # fmt: skip
    kinds = dict(re.findall(r"^\s{4}(\S.*?)\s{2,}(\d+)$", out, re.MULTILINE))
    assert set(kinds) <= {"completed", "error: worker_lost"}, out  # nothing hung, nothing else
    assert int(kinds["completed"]) > 0
    assert "killed worker w1" in out
    assert "afterwards: 0 open requests, 0 slots held, 1 healthy worker(s)" in out


def test_the_router_loss_drill_leaves_the_surviving_routers_clients_untouched() -> None:
    out = fencepost("bench", "drill", "--routers", "2", "--clients", "6", "--duration", "5",
                    "--kill-at", "2", "--tokens", "40")  # fmt: skip
    assert "killed router r1" in out
    survivor = out.split("router r2 (survived)", 1)[1]
    kinds = dict(re.findall(r"^\s{4}(\S.*?)\s{2,}(\d+)", survivor, re.MULTILINE))
    assert int(kinds["completed"]) > 0 and "cut mid-stream" not in kinds, out
    assert "afterwards: 0 open requests, 0 slots held, 2 healthy worker(s)" in out
    assert "the surviving routers' clients saw no error" in out


def test_the_rolling_restart_drill_hands_streams_off_and_keeps_every_text() -> None:
    out = fencepost("bench", "drill", "--rolling", "--workers", "2", "--streams", "4",
                    "--tokens", "200", "--steady", "1", "--steady-tokens", "8",
                    "--step-ms", "10")  # fmt: skip
    restarted = re.findall(r"^\s{2}(w\d): SIGTERM -> exit \S+ \((\d+) streams held\)", out, re.M)
    assert [name for name, _ in restarted] == ["w1", "w2"], out
    handed = int(re.search(r"streams handed off: (\d+)", out)[1])  # type: ignore[index]
    assert handed > 0 and int(restarted[0][1]) > 0, out  # w1 held streams, and gave them up
    assert re.search(r"texts equal to the undisturbed run: long 4/4, steady (\d+)/\1; "
                     r"failed requests: 0", out), out  # fmt: skip


def test_bench_quality_reports_the_formats_asked_for_against_fp32() -> None:
    # Two formats (every format's gate is scored in tests/engine/test_default_model.py).
    out = fencepost("bench", "quality", "--tokens", "64", "--generate", "3", "--formats", "bf16")
    rows = dict(re.findall(r"^\s{2}(fp32|bf16|int8|int4|w4a16)\s+(\S+)", out, re.MULTILINE))
    assert "fp32" in rows and float(rows["fp32"]) > 1.0  # a perplexity
    assert set(rows) == {"fp32", "bf16"} or "not run: bf16" in out
    assert re.search(r"^\s{2}fp32 .* pass ", out, re.MULTILINE)
    assert "gate: perplexity within 2% of fp32" in out


def test_long_prompts_differ_from_the_first_word_and_the_warm_up_reuses_none() -> None:
    from bench.serve import ServeLoad

    load = ServeLoad(model_path=None, fake=True, concurrency=(1, 4), tokens=8, rounds=2,
                     time_limit_s=60, mixed=False, baselines=False, threads=None,
                     prompt_tokens=4000)  # fmt: skip
    measured = [load.prompt(i) for i in range(8)]
    warm = [load.warm_up().prompt(i) for i in range(4)]
    assert len(set(measured + warm)) == 12
    assert len({p.split()[1] for p in measured + warm}) == 12  # apart from the first words
    assert all(3900 < len(p.split()) < 4100 for p in measured)
    assert load.context >= 4000 + 8 and load.context % 256 == 0
    short = ServeLoad(model_path=None, fake=True, concurrency=(1,), tokens=128, rounds=1,
                      time_limit_s=60, mixed=False, baselines=False, threads=None)  # fmt: skip
    assert short.context == 2048 and short.prompt(0) != short.prompt(1)
