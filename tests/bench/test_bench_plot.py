"""`fencepost bench serve --plot`: the run's rows become a PNG, and a missing
matplotlib stops the command before any benchmark starts, with the install line."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

from adapters.cli.main import main
from bench import plot, serve
from bench.loadgen import StreamResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def level(label: str, concurrency: int, ttft_s: float, gap_s: float) -> serve.Level:
    results = [
        StreamResult(200, ttft_s * (1 + i / 10), [gap_s * (1 + j / 20) for j in range(30)], 31)
        for i in range(concurrency)
    ]
    return serve.Level(label, concurrency, results, wall_s=2.0)


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk, the first after the signature."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC and head[12:16] == b"IHDR"
    width, height = struct.unpack(">II", head[16:24])
    return width, height


def test_ours_and_a_peers_rows_make_a_png(tmp_path: Path) -> None:
    rows = [level("fencepost", c, 0.1 * c, 0.02) for c in (1, 8, 16)]
    rows += [level("llama-cpp-python (4 thr)", c, 0.2 * c, 0.05) for c in (1, 8, 16)]
    rows.append(level("fencepost + 4 slow, 4 hang-up", 16, 2.0, 0.03))
    out = tmp_path / "bench.png"
    plot.write_plot(rows, out)
    assert out.stat().st_size > 10_000  # three charts, not an empty canvas
    inches_w, inches_h = plot.FIGURE_INCHES
    assert png_size(out) == (inches_w * plot.DPI, inches_h * plot.DPI)
    import matplotlib.image

    pixels = matplotlib.image.imread(out)
    assert pixels.shape[:2] == (inches_h * plot.DPI, inches_w * plot.DPI)
    assert pixels.std() > 0.05  # lines and text drawn, not a blank canvas


def test_a_row_with_no_results_still_plots(tmp_path: Path) -> None:
    rows = [serve.Level("fencepost", 1), level("fencepost", 4, 0.3, 0.02)]
    out = tmp_path / "sparse.png"
    plot.write_plot(rows, out)
    assert out.read_bytes()[:8] == PNG_MAGIC


@pytest.fixture
def no_matplotlib(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every matplotlib import fails, as in an environment without the extra."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_without_matplotlib_the_plot_says_how_to_install_it(no_matplotlib: None) -> None:
    with pytest.raises(plot.PlotUnavailable, match=r"pip install 'fencepost\[plot\]'"):
        plot.require()


def test_without_matplotlib_the_bench_exits_2_before_it_runs(
    no_matplotlib: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    def must_not_run(load: serve.ServeLoad) -> int:
        raise AssertionError("the benchmark started")

    monkeypatch.setattr(serve, "main", must_not_run)
    code = main(["bench", "serve", "--fake", "--plot", str(tmp_path / "out.png")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [f"fencepost bench serve: {plot.INSTALL}"]


def test_a_plot_into_a_missing_folder_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(serve, "main", lambda load: pytest.fail("the benchmark started"))
    code = main(["bench", "serve", "--fake", "--plot", str(tmp_path / "nowhere" / "out.png")])
    assert code == 2
    assert "does not exist" in capsys.readouterr().err


def test_the_flag_reaches_the_bench(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: list[serve.ServeLoad] = []

    def record(load: serve.ServeLoad) -> int:
        seen.append(load)
        return 0

    monkeypatch.setattr(serve, "main", record)
    assert main(["bench", "serve", "--fake", "--plot", str(tmp_path / "out.png")]) == 0
    assert seen[0].plot == tmp_path / "out.png"


def test_the_bench_writes_its_rows_when_asked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rows = [level("fencepost", c, 0.1, 0.01) for c in (1, 4)]
    out = tmp_path / "run.png"
    load = serve.ServeLoad(None, True, (1, 4), 30, 1, 60.0, False, False, None, plot=out)
    serve.plot(load, rows)
    assert out.read_bytes()[:8] == PNG_MAGIC
