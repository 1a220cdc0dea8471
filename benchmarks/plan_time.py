"""Where a plan's time goes: every built-in and zoo model at three budgets.

    python benchmarks/plan_time.py                          # all models, u = 0.25 0.5 0.75
    python benchmarks/plan_time.py --models gpt2 hf-llama --fractions 0.5
    python benchmarks/plan_time.py --out /tmp/plan-time-mine    # /tmp/plan-time-mine.md and .json
    python benchmarks/plan_time.py --compare benchmarks/results/plan-time.json   # extra compute against the current run
    python benchmarks/plan_time.py --compare OLD.json --same-budgets        # ... at the older run's budgets

Each row is one `plan_and_wrap` of a fresh copy of the model (plan cache off) at budget =
floor + u x (unplanned - floor), where the floor and the unplanned peak come from one plan made
first (not timed). Columns: graph nodes; seconds of capture, capture check, fake profile, solve
(candidates, CBC, local search, everything in solve_plan but the replays), the ILPs CBC solved
(not those taken from planner/solve/cbc.py's store: a count that does not move with the machine's load)
and exact replays (how many); the wall-clock total and the CPU seconds of the process and its CBC
children; the plan's estimated extra compute (recompute over forward, roofline) and its regions. A last row per model
is the same call again with the plan cache on (a second run of the same script), and one more
the wrapped model's plan for half the batch (a shorter padded batch later in the run: the plan
of the larger call is kept, NOTE [ covered shapes ]; an exported graph is captured again). Each budget's
row is a cold plan (no ILP solved before in the process: planner/solve/cbc.py NOTE [ solved once ]);
the row "0.5 after 0.25" re-plans at u = 0.5 after a plan at u = 0.25 in the same process (the
segment ILPs the two share are solved once). With `--same-budgets` each row plans at the budget
in bytes of the --compare run's row (a planner that finds a lower floor moves u's budgets down:
compare plans at equal budgets), and each model's floor is listed under the table. Timings are of
this machine as it was: run it alone, on a quiet machine. Nothing here is a test.

Writes benchmarks/results/plan-time.md and plan-time.json (the current file: a rerun replaces
it; move the old run's headline to benchmarks/results/HISTORY.md). A run of some models or
budgets only: give it --out elsewhere, and compare against the current file with --compare.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import platform
import resource
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from remat.planner import InfeasibleBudgetError, PlanOptions  # noqa: E402
from remat.planner.solve.cbc import COUNTS, SOLVED  # noqa: E402
from remat.planner.compat import tree_leaves, tree_map  # noqa: E402
from remat.runtime import plan_and_wrap  # noqa: E402
from remat.runtime.examples import EXAMPLES  # noqa: E402

BUILT_IN = ("gpt2", "mlp", "resnet", "unet")
ZOO = ("hf-gpt2", "hf-bert", "hf-llama", "hf-t5", "hf-vit", "hf-moe")
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def example(name: str):
    if name in EXAMPLES:
        return EXAMPLES[name]()
    from zoo_models import ZOO as zoo
    return zoo[name]()


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _wrap(ex, budget, options):
    kw = dict(example_kwargs=ex.kwargs) if ex.kwargs else dict(example_inputs=ex.inputs)
    return plan_and_wrap(copy.deepcopy(ex.model), budget, loss_fn=ex.loss_fn, options=options, **kw)


def bounds(ex, options) -> tuple[int, int]:
    """(floor, unplanned peak) in bytes: the refusal of a budget of one byte names the floor."""
    try:
        _wrap(ex, 1e-9, options)
    except InfeasibleBudgetError as e:
        floor = e.min_feasible_bytes
    else:
        raise RuntimeError("a budget of one byte was met")
    return floor, _wrap(ex, 1e3, options).remat.plan.unplanned_peak_bytes


def row(name: str, ex, u: float | str, budget: int, options) -> dict:
    t0, c0, n0 = time.perf_counter(), _cpu(), COUNTS["solved"]
    w = _wrap(ex, budget / 1e9, options)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    p = w.remat.plan
    spent = {} if p.meta.get("cached") else p.meta.get("plan_time", {})
    return {"model": name, "u": u, "budget": budget, "nodes": len(p.node_names), "wall": wall, "cpu": cpu,
            **{k: spent.get(k) for k in ("capture", "check", "profile", "solve", "replay", "replays")},
            "ilps": COUNTS["solved"] - n0,
            "extra": p.recompute_s / p.forward_s if p.forward_s else 0.0, "regions": len(p.regions),
            "predicted": p.predicted_peak_bytes, "cached": bool(p.meta.get("cached"))}


def shorter(name: str, ex, budget: int, options) -> dict | None:
    """The row of `plan_for` on half the batch, on a model wrapped for the whole one (with the
    plan cache on, the wrap is the cache's hit); None when the batch is 1."""
    w = _wrap(ex, budget / 1e9, options)
    args, kwargs = (ex.inputs, ex.kwargs or {})
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0 or tensors[0].shape[0] < 2:
        return None
    n = tensors[0].shape[0]
    half_args, half_kwargs = tree_map(
        lambda t: t[: n // 2] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == n else t, (args, kwargs))
    t0, c0 = time.perf_counter(), _cpu()
    p = w.remat.plan_for(*half_args, **half_kwargs)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    return {"model": name, "u": "half batch", "budget": budget, "nodes": len(p.node_names), "wall": wall,
            "cpu": cpu, **dict.fromkeys(("capture", "check", "profile", "solve", "replay", "replays", "ilps")),
            "extra": p.recompute_s / p.forward_s if p.forward_s else 0.0, "regions": len(p.regions),
            "predicted": p.predicted_peak_bytes, "cached": False}


def _s(x) -> str:
    return "" if x is None else f"{x:.2f}"


def table(rows: list[dict], old: dict | None = None) -> str:
    head = ("| model | u | nodes | capture s | check s | profile s | solve s | ILPs | replay s (n) | total s | CPU s "
            "| extra compute | regions |" + (" extra before |" if old else ""))
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        before = old.get((r["model"], str(r["u"]))) if old else None
        lines.append(f"| {r['model']} | {r['u']} | {r['nodes']} | {_s(r['capture'])} | {_s(r['check'])} | "
                     f"{_s(r['profile'])} | {_s(r['solve'])} | {'' if r.get('ilps') is None else r['ilps']} | "
                     f"{_s(r['replay'])} ({r['replays'] or 0}) | "
                     f"{r['wall']:.2f} | {r['cpu']:.2f} | {r['extra']:.1%} | {r['regions']} |"
                     + (f" {before:.1%} |" if before is not None else (" |" if old else "")))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="+", default=list(BUILT_IN + ZOO))
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.25, 0.5, 0.75])
    ap.add_argument("--out", default="plan-time",
                    help="name of the results files (benchmarks/results/NAME.md and .json; default plan-time)")
    ap.add_argument("--compare", help="an older run's .json: its extra compute beside each row")
    ap.add_argument("--same-budgets", action="store_true", help="plan at the --compare run's budgets (bytes)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.environ["REMAT_CACHE"] = "0"
    options = PlanOptions()
    rows, floors = [], []
    before = {(r["model"], str(r["u"])): r for r in json.loads(pathlib.Path(args.compare).read_text())} \
        if args.compare else {}
    for name in args.models:
        ex = example(name)
        floor, unplanned = bounds(ex, options)
        floors.append(f"{name} {floor}")

        def at(u, floor=floor, unplanned=unplanned, name=name) -> int:
            if args.same_budgets and (name, str(u)) in before:
                return before[(name, str(u))]["budget"]
            return int(floor + u * (unplanned - floor))
        for u in args.fractions:
            SOLVED.clear()              # a cold plan: no ILP this process solved before (NOTE [ solved once ])
            rows.append(row(name, ex, u, at(u), options))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        # a re-plan at another budget in the same process: u = 0.5 after a plan at u = 0.25
        SOLVED.clear()
        _wrap(ex, at(0.25) / 1e9, options)
        rows.append(row(name, ex, "0.5 after 0.25", at(0.5), options))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
        with tempfile.TemporaryDirectory() as cache:     # the same call in a second run: from the cache
            os.environ.update(REMAT_CACHE="1", REMAT_CACHE_DIR=cache)
            row(name, ex, "cache: first", at(0.5), options)
            rows.append(row(name, ex, "cache: again", at(0.5), options))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            half = shorter(name, ex, at(0.5), options)    # wrapped from the cache: no plan made again
            os.environ["REMAT_CACHE"] = "0"
        if half is not None:
            rows.append(half)
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    old = {k: r["extra"] for k, r in before.items()} or None
    text = table(rows, old) + "\n\nfloors (bytes): " + ", ".join(floors)
    print(text)
    if args.out:
        meta = (f"torch {torch.__version__}, {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                f"one torch thread; `python benchmarks/plan_time.py {' '.join(argv or sys.argv[1:])}`")
        (RESULTS / f"{args.out}.md").write_text(f"# Plan time\n\n{meta}\n\n{text}\n")
        (RESULTS / f"{args.out}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
