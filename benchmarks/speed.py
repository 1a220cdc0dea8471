"""The benchmark's speed checks at one model and budget (issue 14): does remat's plan run no
slower than the fastest strategy that fits, beyond the measured spread, and do predicted and
measured overheads rank the strategies the same way?

A row is one strategy's result (benchmarks/run.py): `ratio` (median per-round step time over
no checkpointing's), `low`/`high` (the per-round range), `fits`, `compiled`, and `predicted_s`
(the extra seconds planner.solve.simulate.timeline predicts for its regions under the plan's cost
model; None for strategies not expressed as regions: Hugging Face's own, torch.compile's).
"""
from __future__ import annotations

from itertools import combinations

OURS, OURS_COMPILED = "remat (ours)", "remat + torch.compile"
EAGER_BASELINES = ("every_block", "sqrt", "sac_every_block", "HF gradient_checkpointing_enable")


def _overlap(a: dict, b: dict) -> bool:
    return a["low"] <= b["high"] and b["low"] <= a["high"]


def versus(ours: dict | None, rivals: list[dict]) -> str:
    """Ours against the fastest rival that fits: fastest, tied (spreads overlap), or slower."""
    fitting = [r for r in rivals if r["fits"] and r.get("same", True)]
    if ours is None or not ours["fits"]:
        return "no plan of ours that fits"
    if not fitting:
        return f"{ours['ratio']:.2f}x; no other strategy fits"
    best = min(fitting, key=lambda r: r["ratio"])
    verdict = ("fastest" if ours["ratio"] <= best["ratio"] else
               "tied within the spread" if _overlap(ours, best) else "SLOWER beyond the spread")
    return (f"{verdict}: {ours['ratio']:.2f}x ({ours['low']:.2f}-{ours['high']:.2f}) vs {best['strategy']} "
            f"{best['ratio']:.2f}x ({best['low']:.2f}-{best['high']:.2f})")


def rank_agreement(rows: list[dict]) -> str:
    """Pairs of eager strategies with a prediction: how many the predicted and the measured
    overheads order alike, and each disagreement the measured spreads cannot explain. No
    checkpointing is the reference every ratio is taken to (its own is 1 with no spread by
    construction), so it is left out."""
    known = [r for r in rows if r.get("predicted_s") is not None and not r["compiled"] and r["strategy"] != "none"]
    pairs = list(combinations(known, 2))
    if not pairs:
        return "no two strategies with a prediction"
    agree, wrong = 0, []
    for a, b in pairs:
        same = (a["predicted_s"] - b["predicted_s"]) * (a["ratio"] - b["ratio"]) >= 0
        agree += same
        if not same and not _overlap(a, b):
            fast, slow = sorted((a, b), key=lambda r: r["predicted_s"])
            wrong.append(f"{fast['strategy']} predicted +{fast['predicted_s'] * 1e3:.1f} ms < {slow['strategy']} "
                         f"+{slow['predicted_s'] * 1e3:.1f} ms, measured {fast['ratio']:.2f}x > {slow['ratio']:.2f}x")
    return (f"predicted and measured overhead order {agree} of {len(pairs)} pairs alike; disagreeing beyond the "
            f"spread: {'; '.join(wrong) or 'none'}")


def checks(rows: list[dict]) -> list[str]:
    """The notes of one model and budget: eager and compiled targets, and the rank check."""
    by = {r["strategy"]: r for r in rows}
    eager = versus(by.get(OURS), [by[k] for k in EAGER_BASELINES if k in by])
    knob = [r for r in rows if r["strategy"].startswith("torch.compile")]
    out = [f"eager: remat {eager}"]
    if OURS_COMPILED in by or knob:
        out.append(f"compiled: remat + torch.compile {versus(by.get(OURS_COMPILED), knob)}")
    return out + [f"rank check: {rank_agreement(rows)}"]
