"""bench/gpu_check.py, the device check of issue 13, runs end to end on CPU with a tiny shape.

The device run happens elsewhere (a machine with a GPU); this keeps the script
working between those runs: every section runs, the correctness rates come
out whole on CPU (fp32 everywhere: no kernel-shape numerics to differ), the
table and the goals print, and a budget of zero skips everything and says so.
"""

from __future__ import annotations

import importlib.util
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
    code = _script().main([*TINY, "--skip", "generate_batch"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fp32 greedy equals HF generate over 64 tokens: 4/4" in out
    assert out.count("alone = in a batch of 16: 4/4") == 2  # greedy and seeded sampling
    assert out.count("resumed from k = 1, 17, 45 (together): 12/12") == 2
    assert "decode static (gather attention) = eager decode, fp32 greedy: 4/4" in out
    for row in ("fencepost, 1 stream ", "fencepost, 4 streams", "HF generate, eager",
                "fencepost, eager decode, 1 stream",
                "HF generate, static cache", "first token p50, 64 at once"):  # fmt: skip
        assert f"| {row}" in out
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
    code = _script().main([*TINY, "--budget-s", "0"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "skipped the fp32 check" in out
    assert "skipped the tiny shape" in out
    assert "[not measured]" in out
    assert "sections failed: none" in out


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
    program = (
        "import runpy, sys\n"
        f"sys.modules.update(dict.fromkeys({blocked!r}))\n"
        f"sys.argv = ['gpu_check', *{[*TINY, '--skip', 'checks,compile,generate_batch,burst']!r}]\n"
        f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sections failed: none" in done.stdout
