"""Cold plan time of a 2-layer Hugging Face Mamba2 (issue 42, item 6): prints and saves its numbers.

    python benchmarks/plan_time_ssm.py                 # -> benchmarks/results/plan-time-ssm.md
    python benchmarks/plan_time_ssm.py --before        # the lower DP without its dominance across states,
                                                       # the dynamic-size export with the fake-tensor cache

Each row is one `plan_and_wrap` of a fresh model (plan cache off, no ILP solved before in the process) at
60% and 75% of the unplanned peak, on two captures: torch.export with dynamic sizes (the default:
the two blocks differ by the symbolic sizes the first computes, the flat ILP plans) and at the
example sizes (`trace._dynamic` off: one family of blocks, the hierarchical solver). Columns: the
stages' seconds (plan_time), CPU s of the process and its CBC children, the CBC runs, predicted and
measured (one real step, runtime.measure.peak_memory) peaks. Timings are this machine's as it was:
nothing here is a test.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
os.environ["REMAT_CACHE"] = "0"

from remat.planner.capture import trace  # noqa: E402
from remat.planner.solve import lower  # noqa: E402
from remat.planner.solve.cbc import COUNTS, SOLVED  # noqa: E402
from remat.runtime import plan_and_wrap  # noqa: E402
from remat.runtime.measure import peak_memory, preserved  # noqa: E402

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def mamba2(seed: int = 0):
    from transformers import Mamba2Config, Mamba2ForCausalLM
    torch.manual_seed(seed)
    cfg = Mamba2Config(vocab_size=128, hidden_size=128, expand=2, num_heads=8, head_dim=32, n_groups=1,
                       state_size=32, conv_kernel=4, chunk_size=32, num_hidden_layers=2, use_cache=False)
    ids = torch.randint(128, (2, 64))
    return Mamba2ForCausalLM(cfg), dict(input_ids=ids, labels=ids)


def _cpu() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def row(capture: str, budget: str) -> dict:
    model, kw = mamba2()
    loss = lambda out: out.loss  # noqa: E731
    SOLVED.clear()
    n0, t0, c0 = COUNTS["solved"], time.perf_counter(), _cpu()
    w = plan_and_wrap(model, budget, example_kwargs=kw, loss_fn=loss)
    wall, cpu = time.perf_counter() - t0, _cpu() - c0
    p = w.remat.plan
    with preserved(w):
        step = lambda: loss(w(**kw)).backward()  # noqa: E731
        step()
        for q in w.parameters():
            q.grad = None
        measured = peak_memory(step, w, (), kw)
    return {"export": capture, "budget": budget, "nodes": len(p.node_names), "wall": wall, "cpu": cpu,
            **p.meta.get("plan_time", {}), "ilps": COUNTS["solved"] - n0, "predicted": p.predicted_peak_bytes,
            "measured": measured, "extra": p.recompute_s / p.forward_s, "solver": p.solver.split(",")[0]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", action="store_true", help="the lower DP without dominance across states, the "
                    "dynamic-size export with the fake-tensor cache")
    ap.add_argument("--budgets", nargs="+", default=["60%", "75%"])
    ap.add_argument("--exports", nargs="+", default=["dynamic", "example"], choices=["dynamic", "example"],
                    help="the captures to plan (each row cold in its process only when one is asked, at one budget)")
    ap.add_argument("--out", default="plan-time-ssm", help="results/NAME.md (appended)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.before:
        lower.undominated = lambda states, wa, wk: states
        trace.fake_cache_off = contextlib.nullcontext
    dynamic = trace._dynamic
    rows = []
    for capture in (f"{e} sizes" for e in args.exports):
        trace._dynamic = dynamic if capture == "dynamic sizes" else (lambda *a: None)
        for b in args.budgets:
            rows.append(row(capture, b))
            print(_line(rows[-1]), flush=True)
    head = ("| export | budget | nodes | capture s | check s | profile s | solve s | replay s (n) | wall s | CPU s "
            "| CBC runs | predicted B | measured B | extra compute | solver |")
    text = "\n".join([head, "|" + "---|" * (head.count("|") - 1)] + [_line(r) for r in rows])
    title = ("before (lower DP without dominance across states, export with the fake-tensor cache)" if args.before
             else "after")
    cmd = f"`REMAT_CACHE=0 python benchmarks/plan_time_ssm.py {' '.join(argv or sys.argv[1:])}`"
    print(text)
    path = RESULTS / f"{args.out}.md"
    old = path.read_text() if path.exists() else "# Plan time: a 2-layer Hugging Face Mamba2, cold\n"
    path.write_text(f"{old}\n## {title}\n\ntorch {torch.__version__}, {os.cpu_count()} shared cores, one torch "
                    f"thread; {cmd}\n\n{text}\n")
    return 0


def _t(r: dict, k: str) -> str:
    return "" if r.get(k) is None else f"{r[k]:.2f}"


def _line(r: dict) -> str:
    return (f"| {r['export']} | {r['budget']} | {r['nodes']} | {_t(r, 'capture')} | {_t(r, 'check')} | "
            f"{_t(r, 'profile')} | {_t(r, 'solve')} | {_t(r, 'replay')} ({r.get('replays')}) | {r['wall']:.1f} | "
            f"{r['cpu']:.1f} | {r['ilps']} | {r['predicted']} | {r['measured']} | {r['extra']:.1%} | {r['solver']} |")


if __name__ == "__main__":
    raise SystemExit(main())
