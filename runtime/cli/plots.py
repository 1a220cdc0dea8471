"""PNG plots for `remat sweep`: the budget / extra-compute trade-off, and one step's memory over time.

matplotlib is optional (`pip install matplotlib`, or the `remat[plot]` extra); it is imported
only when a plot is drawn.

NOTE [ no pyplot ]: figures are `matplotlib.figure.Figure` objects saved straight to PNG, never
pyplot's: pyplot keeps every figure it makes and `matplotlib.use("Agg")` switches the process's
backend, so `main` called in a notebook would leave its inline plots on Agg. A Figure made by
itself is drawn by the PNG writer (Agg) for this one save and then dropped.
"""
from __future__ import annotations

from pathlib import Path

from remat.planner.result import Region
from remat.planner.solve.simulate import Timeline

FIGSIZE_IN = (9.0, 5.0)
DPI = 100


class PlotUnavailable(ImportError):
    """matplotlib is not installed."""

    def __init__(self):
        super().__init__("plots need matplotlib: pip install matplotlib (or remat[plot])")


def figure():
    """A new Figure of FIGSIZE_IN and its one Axes, outside pyplot (NOTE [ no pyplot ]);
    PlotUnavailable if matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotUnavailable() from e
    fig = Figure(figsize=FIGSIZE_IN)
    return fig, fig.subplots()


def _scale(max_bytes: float) -> tuple[float, str]:
    """(divisor, unit) that puts `max_bytes` between 1 and 1000."""
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if max_bytes >= div:
            return div, unit
    return 1.0, "B"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    return Path(path)


def tradeoff_png(path: Path, budget_bytes: list[int], extra_pct: list[float],
                 measured: list[tuple[int, float]], unplanned_bytes: int, min_feasible_bytes: int | None,
                 title: str) -> Path:
    """Predicted extra compute (% of the forward) against the budget; measured points as markers."""
    div, unit = _scale(unplanned_bytes)
    fig, ax = figure()
    ax.plot([b / div for b in budget_bytes], extra_pct, "o-", color="tab:blue", label="predicted")
    if measured:
        ax.plot([b / div for b, _ in measured], [m for _, m in measured], "s", color="tab:orange",
                label="measured (step time)")
    if min_feasible_bytes:
        ax.axvspan(0, min_feasible_bytes / div, color="0.85", label="does not fit")
        ax.axvline(min_feasible_bytes / div, color="0.4", ls=":", label="smallest feasible")
    ax.axvline(unplanned_bytes / div, color="tab:green", ls="--", label="unplanned peak")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(f"budget ({unit})")
    ax.set_ylabel("extra compute (% of the forward)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)


def memory_png(path: Path, unplanned: Timeline, planned: Timeline | None, budget_bytes: int,
               regions: tuple[Region, ...], title: str) -> Path:
    """Live bytes per node, forward then backward (nodes in reverse), without and with the plan."""
    n = len(unplanned.fwd)
    div, unit = _scale(max(unplanned.peak_bytes, budget_bytes))
    fig, ax = figure()
    steps = range(2 * n)
    for tl, name, color in ((unplanned, "without plan", "tab:red"), (planned, "with plan", "tab:blue")):
        if tl is not None:
            ax.step(steps, [b / div for b in tl.fwd + tl.bwd[::-1]], where="mid", color=color,
                    label=f"{name} (peak {tl.peak_bytes / div:.3g} {unit})")
    for k, r in enumerate(regions):
        for lo, hi in ((r.start, r.end), (2 * n - 1 - r.end, 2 * n - 1 - r.start)):
            ax.axvspan(lo - 0.5, hi + 0.5, color="tab:blue", alpha=0.08,
                       label="checkpoint regions" if k == 0 and lo == r.start else None)
    ax.axhline(budget_bytes / div, color="k", ls="--", label=f"budget {budget_bytes / div:.3g} {unit}")
    ax.axvline(n - 0.5, color="0.5", lw=0.8)
    ax.text(n - 0.5, 0, " backward \u2192", va="bottom", color="0.4")
    ax.set_xlim(-0.5, 2 * n - 0.5)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("node (forward, then backward in reverse order)")
    ax.set_ylabel(f"live memory ({unit})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return _save(fig, path)
