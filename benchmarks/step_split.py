"""Where a plan's extra step time goes, against a baseline's: forward and backward CPU time of
the unplanned step, ours and the baselines, and each region's recompute, beside the estimates.

    PYTHONPATH=. python benchmarks/step_split.py gpt2-2l 0.5 [--rounds 30]

One torch thread; steps timed by the thread's CPU time (benchmarks.measure.CLOCKS["cpu"]: every
CPU kernel and the backward run in the calling thread), in interleaved rounds, the fastest of
each kept; a region's recompute by runtime.rewrite.RecomputeTimes (the recompute in backward, by
the same clock). The budget is a fraction of the way from the smallest feasible to the unplanned peak,
as in benchmarks/run.py; ours is planned as there (measured costs, the exact replay).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.measure import CLOCKS  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402
from benchmarks.run import budgets  # noqa: E402
from remat.planner import PlanOptions, SolveOptions, analyze, solve_plan  # noqa: E402
from remat.planner.solve.baselines import BASELINES  # noqa: E402
from remat.planner.solve.simulate import region_recompute, timeline  # noqa: E402
from remat.runtime.api import ExactReplay  # noqa: E402
from remat.runtime.rewrite import REGION_PROBE, RecomputeTimes, rewrite  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("fraction", type=float)
    ap.add_argument("--rounds", type=int, default=30)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    ex = MODELS[a.model]()
    an = analyze(ex.model, ex.inputs, None, ex.loss_fn, cost_model="measured", overheads=REGION_PROBE)
    cg, names = an.cost_graph, tuple(c.name for c in an.cost_graph.nodes)
    opts = PlanOptions(solve=SolveOptions(time_limit_s=10.0), cost_model="measured")
    (_, budget), = budgets(cg, (a.fraction,), opts)
    ours = solve_plan(cg, budget, opts, an.traced.opaque, measure=ExactReplay(ex.model, an, ex.loss_fn))
    cases = {"none": (), "remat (ours)": ours.regions} | {k: fn(cg) for k, fn in BASELINES.items()}
    gms = {k: rewrite(ex.model, an.traced.gm, r, names) for k, r in cases.items()}
    now = CLOCKS["cpu"]
    timers = {k: RecomputeTimes(gm, now=now) for k, gm in gms.items()}
    inputs = an.traced.inputs(ex.model, ex.inputs, {})
    best = {k: [float("inf"), float("inf")] for k in gms}
    for _ in range(a.rounds):
        for k, gm in gms.items():
            ex.model.zero_grad(set_to_none=True)
            with timers[k]:
                t0 = now()
                loss = ex.loss_fn(gm(**inputs))
                t1 = now()
                loss.backward()
                t2 = now()
            best[k] = [min(best[k][0], t1 - t0), min(best[k][1], t2 - t1)]
    fwd0, bwd0 = best["none"]
    print(f"{a.model} at {a.fraction:.0%} ({budget / 1e6:.2f} MB); CPU ms, fastest of {a.rounds} rounds")
    for k, regions in cases.items():
        f, b = best[k]
        print(f"{k}: forward {f * 1e3:.2f} ({(f - fwd0) * 1e3:+.2f}), backward {b * 1e3:.2f} ({(b - bwd0) * 1e3:+.2f}), "
              f"extra {(f + b - fwd0 - bwd0) * 1e3:+.2f}, estimated {timeline(cg, regions).recompute_s * 1e3:+.2f}")
        for r, s in zip(regions, timers[k].fastest()):
            rec = "-" if s is None else f"{s * 1e3:.2f}"
            print(f"    region {r.start}..{r.end}{' SAC' if r.saved else ''}: recompute measured {rec}, "
                  f"estimated {region_recompute(cg, r).seconds * 1e3:.2f} (with its fixed cost)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
