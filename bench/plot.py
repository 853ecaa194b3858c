"""`fencepost bench serve --plot FILE.png`: a run's figures as one picture.

Three charts against concurrency, one line per system the run measured
(fencepost, and beside it whichever peers ran: the naive server, transformers
serve, llama-cpp-python): completion tokens/s, then time to first token and
inter-token latency at p50 / p90 / p99. It draws the bench's own rows
(serve.Level), so the picture and the printed table come from the same numbers.

matplotlib is an optional extra (`fencepost[plot]`), imported only here and
drawn through the Agg canvas directly, so no pyplot state or display backend is
involved. `require()` runs before the benchmark: a missing install costs a
second, not a finished run.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from bench.serve import Level

INSTALL = "--plot needs matplotlib, which is not installed: pip install 'fencepost[plot]'"
FIGURE_INCHES = (15.0, 5.0)
DPI = 100  # with FIGURE_INCHES: a 1500 x 500 pixel PNG
LineStyle = Literal["-", "--", ":"]
QUANTILES: tuple[tuple[int, LineStyle], ...] = ((50, "-"), (90, "--"), (99, ":"))  # percentile


class PlotUnavailable(Exception):
    """matplotlib cannot be imported; the message says how to install it."""


def require() -> None:
    """Raise PlotUnavailable unless a plot can be drawn."""
    _new_figure()


def write_plot(rows: Sequence[Level], path: Path, title: str = "fencepost bench serve") -> None:
    """Draw rows (any systems, any concurrency levels) into a PNG at path."""
    figure = _new_figure()
    throughput, ttft, itl = figure.subplots(1, 3)
    systems = _by_system(rows)
    for colour, (label, levels) in enumerate(systems.items()):
        style = {"color": f"C{colour % 10}", "marker": "o"}
        x = [level.concurrency for level in levels]
        throughput.plot(x, [level.rate for level in levels], label=label, **style)
        for q, dash in QUANTILES:
            ttft.plot(x, [level.ttft(q) for level in levels], linestyle=dash, **style)
            itl.plot(x, [level.itl(q) * 1000 for level in levels], linestyle=dash, **style)
    levels_seen = sorted({row.concurrency for row in rows})
    _axes(throughput, "completion tokens/s (all clients)", "tokens/s", levels_seen)
    _axes(ttft, "time to first token", "seconds", levels_seen, log=True)
    _axes(itl, "inter-token latency", "milliseconds", levels_seen, log=True)
    if systems:  # colour names the system (under the charts), line style the percentile
        from matplotlib.lines import Line2D

        figure.legend(loc="outside lower center", ncols=len(systems), frameon=False)
        styles = [Line2D([], [], color="grey", linestyle=dash) for _, dash in QUANTILES]
        ttft.legend(styles, [f"p{q}" for q, _ in QUANTILES], title="percentile")
    figure.suptitle(title)
    figure.savefig(path, format="png", dpi=DPI)


def _new_figure() -> Figure:
    try:
        import matplotlib  # noqa: F401  (first, so that a missing install fails here)
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise PlotUnavailable(INSTALL) from error
    # constrained: it makes room for the legend placed "outside" the charts
    figure = Figure(figsize=FIGURE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    return figure


def _by_system(rows: Sequence[Level]) -> dict[str, list[Level]]:
    """Rows grouped by label, in the order the run measured them, each by concurrency."""
    systems: dict[str, list[Level]] = {}
    for row in rows:
        systems.setdefault(row.label, []).append(row)
    return {label: sorted(levels, key=lambda r: r.concurrency) for label, levels in systems.items()}


def _axes(axes: Axes, title: str, unit: str, levels: list[int], log: bool = False) -> None:
    axes.set_title(title)
    axes.set_xlabel("concurrent clients")
    axes.set_ylabel(unit)
    axes.set_xticks(levels)
    if log:  # peers differ by orders of magnitude (naive TTFT at 4 clients: ~20 s)
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

        axes.set_yscale("log")
        # Labels at 1, 2 and 5 of each decade, as plain numbers (0.2, not 2 x 10^-1).
        axes.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        axes.yaxis.set_minor_formatter(NullFormatter())
    axes.grid(True, alpha=0.3)
