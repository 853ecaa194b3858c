"""bench/gpu_check.py, the device check of issues 13 and 52, runs end to end on CPU with a
tiny shape.

The device run happens elsewhere (a machine with a GPU); this keeps the script
working between those runs: every section runs, the correctness rates come
out whole on CPU (fp32 everywhere: no kernel-shape numerics to differ), HF's
anchors are measured in processes other than the engine's, a fault in a
--repeat run is caught and named, the table and the goals print, and a
budget of zero skips everything and says so.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.py"
TINY = ["--device", "cpu", "--shapes", "tiny", "--tokens", "8", "--streams", "1,4", "--threads=1"]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_device_check_runs_on_cpu_and_reports_everything(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = _script().main(TINY)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fp32 greedy equals HF generate over 64 tokens: 4/4" in out
    assert out.count("alone = in a batch of 16: 4/4") == 2  # greedy and seeded sampling
    assert out.count("resumed from k = 1, 17, 45 (together): 12/12") == 2
    assert "decode static (gather attention) = eager decode, fp32 greedy: 4/4" in out
    for row in ("fencepost, 1 stream ", "fencepost, 4 streams", "HF generate, eager",
                "fencepost, eager decode, 1 stream", "transformers generate_batch, 4 requests",
                "HF generate, static cache", "first token p50, 64 at once"):  # fmt: skip
        assert f"| {row}" in out
    # Each anchor was measured by a process of its own: the pid it printed itself is the
    # one the engine's process (this one) reports, and none of them is this process.
    said = re.findall(r"anchor process pid (\d+): (\w+), tiny shape", out)
    reported = re.findall(r"measured in process (\d+), not the engine's (\d+)", out)
    assert sorted(kind for _, kind in said) == ["compiled", "eager", "generate_batch"]
    assert [pid for pid, _ in said] == [pid for pid, _ in reported]
    assert {int(engine) for _, engine in reported} == {os.getpid()}
    assert len({int(pid) for pid, _ in said} | {os.getpid()}) == 4
    assert "== goals (issue 13)" in out
    assert "sections failed: none" in out


def test_the_mixture_shape_runs_its_checks_and_speeds(capsys: pytest.CaptureFixture[str]) -> None:
    """The Qwen3-MoE shapes (a lent device runs --shapes tiny-moe,qwen3-30b-a3b): the
    experts' 3-D parameters built and read, fp32 greedy equal to HF's."""
    args = [*TINY, "--skip", "compile,eager,generate_batch,burst"]
    code = _script().main([*(a if a != "tiny" else "tiny-moe" for a in args)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fp32 greedy equals HF generate over 64 tokens: 4/4" in out
    assert "decode static (gather attention) = eager decode, fp32 greedy: 4/4" in out
    assert "| fencepost, 4 streams" in out and "tiny-moe shape" in out
    assert "sections failed: none" in out


def test_no_budget_skips_every_part_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code = _script().main([*TINY, "--budget-s", "0", "--repeat", "1", "--sanitize"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "skipped the fp32 check" in out
    assert "skipped the tiny shape" in out
    assert "skipped HF generate, static cache + compile, batch 1" in out
    assert "repeat: 0/0 runs faulted (1 of the 1 asked not run: the budget)" in out
    assert "sanitize: skipped (not a CUDA device)" in out
    assert "[not measured]" in out
    assert "sections failed: none" in out


def test_a_faulted_repeat_is_reported_with_its_index_and_fails_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two fresh processes of the largest batch (their indices checked), the second told
    to fail: the first's figure prints, the second is the one fault, named, and the run's
    status says so."""
    script = _script()
    monkeypatch.setenv(script.FAULT_ENV, "2")
    monkeypatch.delenv("FENCEPOST_CHECK_INDICES", raising=False)
    code = script.main([*TINY, "--skip", "checks,speed", "--repeat", "2", "--check-indices"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert re.search(r"repeat 1/2: [\d,.]+ tok/s, indices checked \(process \d+", out), out
    assert out.count("FAULT in ") == 1
    assert (
        "FAULT in repeat 2/2, tiny shape: fencepost, 4 streams, stage start: exit status 1" in out
    )
    assert f"RuntimeError: {script.FAULT_ENV}=2" in out  # the child's own stderr
    assert "\nrepeat: 1/2 runs faulted\n" in out
    assert "sections failed: repeat 2/2\n" in out


def test_a_child_that_hangs_or_crashes_is_a_fault_with_its_stderr() -> None:
    script = _script()
    hang = script.run_child([sys.executable, "-c", "import time; time.sleep(60)"], 1.0)
    assert hang.fault is not None and hang.fault.startswith("timed out after")
    assert hang.seconds < 30
    crash = "import sys; sys.stderr.write('the device said no'); sys.exit(3)"
    done = script.run_child([sys.executable, "-c", crash], 60.0)
    assert done.fault == "exit status 3"
    assert "the device said no" in done.tail()


def test_the_mixture_joins_the_default_shapes_on_a_large_device() -> None:
    default_shapes = _script().default_shapes
    keys, why = default_shapes(139.8)
    assert keys[-1] == "qwen3-30b-a3b" and why.startswith("qwen3-30b-a3b added: the device has 140")
    keys, why = default_shapes(79.2)
    assert "qwen3-30b-a3b" not in keys and "left out: the device has 79 GiB, < 100" in why
    keys, why = default_shapes(None)
    assert "qwen3-30b-a3b" not in keys and "not a CUDA device" in why


def test_bench_engine_takes_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.cli.main import main
    from bench import engine

    seen: dict[str, object] = {}

    def fake_main(**kwargs: object) -> int:
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(engine, "main", fake_main)
    assert main(["bench", "engine", "--device", "cuda", "--tokens", "4"]) == 0
    assert seen["device"] == "cuda"
    assert main(["bench", "engine"]) == 0
    assert seen["device"] == "auto"


def test_the_device_check_needs_nothing_of_the_server_stack() -> None:
    """The device image has torch and transformers, not trio or the HTTP stack: the
    script runs with them made unimportable (msgspec and llguidance travel as wheels)."""
    blocked = ("trio", "quart", "quart_trio", "hypercorn", "openai")
    engine_only = "checks,compile,eager,generate_batch,burst"  # the anchors run elsewhere
    program = (
        "import runpy, sys\n"
        f"sys.modules.update(dict.fromkeys({blocked!r}))\n"
        f"sys.argv = ['gpu_check', *{[*TINY, '--skip', engine_only]!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sections failed: none" in done.stdout
