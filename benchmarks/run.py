"""Side-by-side: our plan vs what users do instead, same model, input and budget, one process.

    python benchmarks/run.py [--models gpt2,resnet] [--budgets 0.3,0.5,0.7] [--quick]

Budgets are fractions of the way from the smallest feasible peak to the unplanned peak. Per
model and budget, each strategy is checked to give the unplanned model's loss and gradients,
then measured: real peak (CPU live-tensor tracker), median step time (forward+backward) after
warm-up as a ratio to no checkpointing, recomputed FLOPs, planning time. Writes
benchmarks/results/<date>-<host>.md. Timings never gate tests; this prints and saves.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import platform
import socket
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner import PlanOptions, SolveOptions, analyze, solve_plan  # noqa: E402
from planner.baselines import BASELINES  # noqa: E402
from planner.simulate import timeline  # noqa: E402
from runtime import examples, peak_memory  # noqa: E402
from runtime.api import exact_replay  # noqa: E402
from planner.trace import trace  # noqa: E402
from runtime.rewrite import rewrite  # noqa: E402


def step(model, ex, seed=0):
    torch.manual_seed(seed)
    loss = ex.loss_fn(model(*ex.inputs))
    loss.backward()
    return loss.detach()


def median_step_s(model, ex, repeats: int) -> float:
    for _ in range(2):
        step(model, ex)
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step(model, ex)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_model(name: str, fractions, opts: PlanOptions, repeats: int) -> list[dict]:
    ex = examples.EXAMPLES[name]()
    a = analyze(ex.model, ex.inputs, None, ex.loss_fn)
    cg = a.cost_graph
    unplanned = solve_plan(cg, 10**18, opts).unplanned_peak_bytes
    floor = solve_plan(cg, unplanned - 1, opts).min_feasible_bytes
    ref = copy.deepcopy(ex.model)
    ref_loss = step(ref, ex)
    ref_grads = [p.grad.clone() for p in ref.parameters()]
    rows = []
    skeleton = solve_plan(cg, 10**18, opts)
    for f in fractions:
        budget = int(floor + f * (unplanned - floor))
        t0 = time.perf_counter()
        ours = solve_plan(cg, budget, opts, a.traced.opaque, measure=exact_replay(ex.model, a, ex.loss_fn))
        plan_s = time.perf_counter() - t0
        strategies = {k: (fn(cg), 0.0) for k, fn in BASELINES.items()}
        strategies["remat (ours)"] = (ours.regions, plan_s)
        base_s = None      # step time of "none", measured in this same loop
        for label, (regions, plan_time) in strategies.items():
            model = copy.deepcopy(ex.model)
            gm = rewrite(model, trace(model, ex.inputs, {}).gm, replace(skeleton, regions=regions))
            loss = step(gm, ex)
            same = torch.allclose(loss, ref_loss) and all(
                torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6) for p, g in zip(model.parameters(), ref_grads))
            model.zero_grad(set_to_none=True)
            peak = peak_memory(lambda: step(gm, ex), model, *ex.inputs)
            model.zero_grad(set_to_none=True)
            secs = median_step_s(gm, ex, repeats)
            base_s = base_s or secs
            rows.append(dict(model=name, fraction=f, budget=budget, strategy=label, peak=peak, fits=peak <= budget,
                             ratio=secs / base_s, gflop=timeline(cg, regions).recompute_flops / 1e9,
                             plan_s=plan_time, same=same))
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model | budget (MB) | strategy | measured peak (MB) | fits | step time vs none | recomputed GFLOP | planning s | same loss+grads |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['budget'] / 1e6:.2f} ({r['fraction']:.0%}) | {r['strategy']} | "
                   f"{r['peak'] / 1e6:.2f} | {'yes' if r['fits'] else 'no'} | {r['ratio']:.2f}x | {r['gflop']:.3f} | "
                   f"{r['plan_s']:.1f} | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,resnet,unet,mlp")
    ap.add_argument("--budgets", default="0.3,0.5,0.7")
    ap.add_argument("--quick", action="store_true", help="two models, one budget, few repeats")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args(argv)
    models, fractions, repeats = a.models.split(","), [float(x) for x in a.budgets.split(",")], a.repeats
    opts = PlanOptions(solve=SolveOptions(time_limit_s=10.0))
    if a.quick:
        models, fractions, repeats = ["gpt2", "resnet"], [0.5], 3
        opts = PlanOptions(solve=SolveOptions(time_limit_s=4.0))
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [r for m in models for r in bench_model(m, fractions, opts, repeats)]
    text = table(rows)
    print(text)
    host = socket.gethostname()
    stamp = datetime.date.today().isoformat()
    header = (f"# Benchmark {stamp} on {host}\n\n- command: `python benchmarks/run.py {' '.join(argv or sys.argv[1:])}`\n"
              f"- hardware: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, CPU only\n"
              f"- versions: torch {torch.__version__}, python {platform.python_version()}\n"
              f"- budgets: fraction of the way from the smallest feasible peak to the unplanned peak\n"
              f"- baselines (every block, sqrt(n) segments) run through the same rewriter as ours\n\n")
    out = Path(__file__).parent / "results" / f"{stamp}-{host}.md"
    out.write_text(header + text + "\n")
    print(f"\nwritten to {out}")
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
