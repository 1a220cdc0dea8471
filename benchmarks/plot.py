"""Pareto plot of one model's rows: measured peak against step-time ratio, budgets as lines."""
from __future__ import annotations

from pathlib import Path

MARKERS = {"none": "o", "every_block": "s", "sqrt": "D", "sac_every_block": "P", "remat (ours)": "*",
           "torch.compile": "X"}


def family(strategy: str) -> str:
    """'torch.compile (0.6)' -> 'torch.compile'."""
    return strategy.split(" (")[0] if strategy.startswith("torch.compile") else strategy


def pareto(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib  # lazily: only the plot needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    budgets = sorted({r["budget"] for r in rows})
    colors = dict(zip(budgets, plt.cm.viridis([i / max(1, len(budgets)) for i in range(len(budgets))])))
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for b in budgets:
        ax.axvline(b / 1e6, color=colors[b], ls="--", lw=1)
    for r in rows:
        big = family(r["strategy"]) == "remat (ours)"
        ax.scatter(r["peak"] / 1e6, r["ratio"], marker=MARKERS[family(r["strategy"])], color=colors[r["budget"]],
                   s=140 if big else 60, edgecolors="black" if r["same"] else "red", linewidths=0.5 if r["same"] else 2,
                   zorder=3)
    handles = [Line2D([], [], ls="", marker=m, color="grey", label=k) for k, m in MARKERS.items()]
    handles.append(Line2D([], [], ls="", marker="o", color="white", markeredgecolor="red", markeredgewidth=2,
                          label="wrong loss/grads"))
    handles += [Line2D([], [], ls="--", color=colors[b], label=f"budget {b / 1e6:.1f} MB") for b in budgets]
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_xlabel("measured peak (MB)")
    ax.set_ylabel("step time vs no checkpointing")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
