"""Side-by-side: our plan vs what users do instead, same model, input and budget, one process.

    python benchmarks/run.py [--models gpt2,resnet] [--budgets 0.3,0.5,0.7] [--quick] [--repeats 7]
                             [--eager] [--costs measured|roofline] [--threads 1] [--clock wall|cpu] [--out STEM]

Budgets are fractions of the way from the smallest feasible peak to the unplanned peak. Per
model and budget, each strategy (no checkpointing, every block, sqrt(n), SAC every block, for
Hugging Face models their own `gradient_checkpointing_enable()`, ours, ours then torch.compile,
torch.compile with an activation memory budget) is checked to give the
unplanned model's loss and gradients, then measured: real peak, median step time
(forward+backward; the strategies timed in turn, round by round) as a ratio to no checkpointing,
recomputed FLOPs, planning time. Step times come from interleaved rounds: per round, each
strategy's step over no checkpointing's; the table gives the median and the range. Our plans are
made with measured costs (each op timed on this machine, planner/profile/costs.py; `--costs roofline`
for nominal rates), and per model and budget the notes say whether ours is the fastest strategy
that fits beyond the spread, and whether predicted and measured overheads rank the strategies
alike (benchmarks/speed.py). `--eager` leaves the compiled strategies out. `--clock cpu` (with
`--threads 1`) times each step by the calling thread's CPU time instead of the wall clock: on CPU
with one torch thread every kernel runs in that thread, and the time other jobs of a shared
machine take the core away is not in it.
Graphs of at most 90 nodes are also solved exactly, for our optimality gap. Writes
benchmarks/results/step-time.md (a --quick run: step-time-quick.md; --eager: step-time-eager.md)
and a Pareto plot per model beside it (step-time-<model>.png), replacing the current file: move
the old run's headline to benchmarks/results/HISTORY.md, and give a partial run its own --out.
Timings never gate tests.
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import exact, report, speed  # noqa: E402
from benchmarks.measure import reference, same_result, step, step_ratios  # noqa: E402
from benchmarks.models import MODELS  # noqa: E402
from benchmarks.strategies_compile import (GRID, QUICK_GRID, CompileSearch, compiled_at,  # noqa: E402
                                          dropout_recompute_error)
from benchmarks.strategies_remat_compile import Called, dropout_region_error, graphs_now, remat_compiled  # noqa: E402
from remat.planner import InfeasibleBudgetError, PlanOptions, RematError, SolveOptions, analyze, solve_plan  # noqa: E402
from remat.planner.solve.baselines import BASELINES  # noqa: E402
from remat.planner.result import Plan  # noqa: E402
from remat.planner.solve.simulate import timeline  # noqa: E402
from remat.planner.capture.trace import capture  # noqa: E402
from remat.runtime import peak_memory  # noqa: E402
from remat.runtime.api import ExactReplay  # noqa: E402
from remat.runtime.measure import allocator_peak  # noqa: E402
from remat.runtime.rewrite import REGION_PROBE, rewrite  # noqa: E402

RESULTS = Path(__file__).parent / "results"


@dataclass
class ModelResult:
    rows: list[dict] = field(default_factory=list)
    meter: dict | None = None
    exacts: list[dict] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Settings:
    fractions: tuple[float, ...]
    opts: PlanOptions
    repeats: int
    grid: tuple[float, ...]
    compile: bool = True        # also the compiled strategies (torch.compile's knob, ours compiled)
    clock: str = "wall"         # step times: wall time, or the thread's CPU time (benchmarks.measure.CLOCKS)


def budgets(cg, fractions, opts: PlanOptions) -> list[tuple[float, int]]:
    unplanned = solve_plan(cg, 10**18, opts).unplanned_peak_bytes
    floor = solve_plan(cg, unplanned - 1, opts).min_feasible_bytes
    return [(f, int(floor + f * (unplanned - floor))) for f in fractions]


def meter_check(name: str, ex) -> dict:
    """Peak of the eager unplanned step by both meters: the live-tensor tracker and the allocator."""
    model = copy.deepcopy(ex.model)
    step(model, ex)                              # warm-up: first-call allocations are not the step's
    model.zero_grad(set_to_none=True)
    live = peak_memory(lambda: step(model, ex), model, *ex.inputs)
    model.zero_grad(set_to_none=True)
    return dict(model=name, live=live, alloc=allocator_peak(lambda: step(model, ex), model, *ex.inputs))


def run_rewritten(ex, regions, names, ref) -> tuple[torch.nn.Module, int, bool]:
    """The model rewritten with `regions`, its peak, and whether it gives the reference result."""
    model = copy.deepcopy(ex.model)
    traced = capture(model, ex.inputs, {})
    rewritten = rewrite(model, traced.gm, regions, names)
    gm = Called(rewritten, lambda args: traced.inputs(model, args, {}))
    same = same_result(model, step(gm, ex), ref)
    model.zero_grad(set_to_none=True)
    peak = peak_memory(lambda: step(gm, ex), model, *ex.inputs)
    model.zero_grad(set_to_none=True)
    return gm, peak, same


def knob_label(run) -> str:
    return f"torch.compile ({run.fraction:g})"


def compile_row(run, search_s: float, budget: int, timed) -> dict:
    """The knob's row: the fraction its search chose for this budget, peak and check from the
    search, step time from this budget's rounds (`timed`, a Ratio) when it ran in them."""
    ratio = (run.ratio, run.ratio, run.ratio) if timed is None else (timed.median, timed.low, timed.high)
    return dict(strategy=knob_label(run), peak=run.peak, fits=run.peak <= budget, ratio=ratio[0], low=ratio[1],
                high=ratio[2], predicted_s=None, gflop=None, plan_s=search_s, same=run.same, compiled=True)


REMAT_COMPILE = "remat + torch.compile"
HF_GC = "HF gradient_checkpointing_enable"


def hf_checkpointed(ex, ref) -> tuple[torch.nn.Module, int, bool] | None:
    """A Hugging Face model's own per-block checkpointing, as its users turn it on
    (`gradient_checkpointing_enable`, non-reentrant), on a fresh copy: the model, its peak, and
    whether it gives the reference result; None for other models. Measured as run_rewritten is."""
    if not hasattr(ex.model, "gradient_checkpointing_enable"):
        return None
    model = copy.deepcopy(ex.model)
    with warnings.catch_warnings():    # transformers 5 calls it a deprecated alias of activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    same = same_result(model, step(model, ex), ref)
    model.zero_grad(set_to_none=True)
    peak = peak_memory(lambda: step(model, ex), model, *ex.inputs)
    model.zero_grad(set_to_none=True)
    return model, peak, same


def budget_rows(ex, a, budget: int, s: Settings, ref, search: CompileSearch):
    """Every strategy's row at one budget, our plan, and notes on the compiled plans."""
    cg = a.cost_graph
    t0 = time.perf_counter()
    ours = solve_plan(cg, budget, s.opts, a.traced.opaque, measure=ExactReplay(ex.model, a, ex.loss_fn))
    ours_s = a.analyze_s + time.perf_counter() - t0
    strategies = {k: (fn(cg), 0.0) for k, fn in BASELINES.items()}
    strategies["remat (ours)"] = (ours.regions, ours_s)
    names = tuple(c.name for c in cg.nodes)
    runs = {label: run_rewritten(ex, regions, names, ref) for label, (regions, _) in strategies.items()}
    hf = hf_checkpointed(ex, ref)
    if hf is not None:
        runs[HF_GC] = hf
    knob, knob_s = search.best(budget) if s.compile else (None, 0.0)   # compiles (and resets) as it searches
    torch._dynamo.reset()
    compiled, notes = {}, []
    try:
        c = remat_compiled(ex, budget, s.opts, ref) if s.compile else None
    except Exception as e:      # no C++ compiler, an Inductor bug, ...: report, don't crash
        notes.append(f"{REMAT_COMPILE} failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:300]}")
    else:
        if c is None:
            pass
        elif isinstance(c, InfeasibleBudgetError):
            notes.append(f"{REMAT_COMPILE}: no compiled plan fits; smallest compiled budget (measured) "
                         f"{c.min_feasible_bytes / 1e6:.2f} MB")
        else:
            compiled[REMAT_COMPILE] = c
    knobs = {}
    if knob is not None:    # compiled again, after ours (other code objects): timed in the same rounds
        knobs[knob_label(knob)] = compiled_at(ex, knob.fraction)[1]
    graphs = graphs_now()
    secs = step_ratios({label: gm for label, (gm, _, _) in runs.items()}
                       | {label: c.module for label, c in compiled.items()} | knobs, ex, s.repeats, clock=s.clock)
    rows = [dict(strategy=label, peak=peak, fits=peak <= budget, ratio=secs[label].median, low=secs[label].low,
                 high=secs[label].high,
                 predicted_s=timeline(cg, strategies[label][0]).recompute_s if label in strategies else None,
                 gflop=timeline(cg, strategies[label][0]).recompute_flops / 1e9 if label in strategies else None,
                 plan_s=strategies[label][1] if label in strategies else 0.0,
                 same=same, compiled=False, checked=True) for label, (_, peak, same) in runs.items()]
    for label, c in compiled.items():
        regions = c.plan.regions
        rows.append(dict(strategy=label, peak=c.peak, fits=c.peak <= budget, ratio=secs[label].median,
                         low=secs[label].low, high=secs[label].high, predicted_s=None,
                         gflop=timeline(cg, regions).recompute_flops / 1e9, plan_s=c.plan_s, same=c.same,
                         compiled=True, checked=True))
        notes.append(f"{label}: {len(regions)} region(s), planned peak {c.plan.predicted_peak_bytes / 1e6:.2f} MB"
                     f" (measured compiled, +1%); {c.graphs} graph(s) compiled while planning;"
                     f" graph breaks: {'; '.join(c.breaks) or 'none'};"
                     f" equal to the eager float32 step: {'yes' if c.exact else 'no'}"
                     + ("" if c.error64 is None else
                        f"; NOT as close to float64 as float32 eager; the plan compiled in float64 is {c.error64:.1g}"
                        f" from the float64 step, so {'float32 rounding' if c.same else 'WRONG'}"))
    if graphs_now() != graphs:
        notes.append("the timed steps of the compiled plans recompiled (more graphs than after their first step)")
    if knob is not None:
        rows.append(compile_row(knob, knob_s, budget, secs.get(knob_label(knob))) | dict(checked=False))
    return rows, ours, notes + speed.checks(rows)


def bench_model(name: str, s: Settings) -> ModelResult:
    try:
        ex = MODELS[name]()
        a = analyze(ex.model, ex.inputs, None, ex.loss_fn, cost_model=s.opts.cost_model, overheads=REGION_PROBE)
    except (ImportError, RematError) as e:     # transformers missing, or the planner cannot take it
        return ModelResult(notes=[f"{name}: not benchmarked: {type(e).__name__}: {e}"])
    out = ModelResult(meter=meter_check(name, ex))
    ref = reference(ex)
    search = CompileSearch(ex, ref, s.repeats, s.grid, s.clock)
    for f, budget in budgets(a.cost_graph, s.fractions, s.opts):
        rows, ours, notes = budget_rows(ex, a, budget, s, ref, search)
        out.rows += [dict(model=name, fraction=f, budget=budget) | r for r in rows]
        out.notes += [f"{name} at {f:.0%}: {n}" for n in notes]
        if len(a.cost_graph.nodes) <= exact.MAX_NODES:
            e = exact.exact_row(a.cost_graph, budget, ours, s.opts.safety_margin)
            out.exacts.append(dict(model=name, fraction=f, budget=budget) | e)
    out.notes += compile_notes(name, search) if s.compile else []
    out.notes.append(f"{name}: costs {a.cost_graph.meta['cost_model']}"
                     + (f" ({a.cost_graph.meta['costs']})" if "costs" in a.cost_graph.meta else "")
                     + f"; region {a.cost_graph.region_s * 1e6:.1f} us, SAC op {a.cost_graph.sac_op_s * 1e6:.1f} us")
    return out


def compile_notes(name: str, search: CompileSearch) -> list[str]:
    if search.error:
        return [f"{name}: torch.compile failed on this machine: {search.error}"]
    tried = ", ".join(f"{f:.1f}: {r.peak / 1e6:.2f} MB, {r.compile_s:.0f} s{'' if r.same else ', WRONG grads'}"
                      for f, r in sorted(search.runs.items(), reverse=True))
    return [f"{name}: torch.compile per activation_memory_budget tried (peak, compile s): {tried}"]


def dropout_note() -> str:
    try:
        errs = {f: dropout_recompute_error(f) for f in (1.0, 0.5)}
    except Exception as e:          # compiling fails on this machine: the model notes say why
        return f"dropout toy check not run: {type(e).__name__}"
    text = ("toy check, Linear-GELU-Dropout(0.5) compiled with Inductor's default RNG: largest error of the bias"
            " gradient against the one implied by the forward's own mask: "
            + ", ".join(f"{e:.2g} at activation_memory_budget {f:.1f}" for f, e in errs.items()))
    try:
        ours = {rng: dropout_region_error(rng) for rng in (False, True)}
    except Exception as e:
        return text + f"; the same toy as one of our regions, compiled: not run: {type(e).__name__}"
    return text + ("; the same toy as one of our regions (dropout recomputed in the backward), compiled: "
                   f"{ours[False]:.2g} with Inductor's default RNG, {ours[True]:.2g} with fallback_random")


def plots(results: dict[str, ModelResult], stem: str) -> tuple[list[Path], list[str]]:
    """A Pareto plot per benchmarked model; a note instead when matplotlib is missing."""
    from benchmarks.plot import MARKERS, pareto
    MARKERS.setdefault(REMAT_COMPILE, "p")              # plot.py's own markers are the other strategies'
    MARKERS.setdefault(HF_GC, "v")
    done = []
    for name, res in results.items():
        if res.rows:
            try:
                done.append(pareto(res.rows, RESULTS / f"{stem}-{name}.png", f"{name}: peak vs step time"))
            except ImportError as e:
                return done, [f"no plots: {e}"]
    return done, []


def settings(a) -> tuple[list[str], Settings]:
    if a.quick:
        return (a.models or "gpt2,resnet").split(","), Settings(
            tuple(float(x) for x in (a.budgets or "0.5").split(",")),
            PlanOptions(solve=SolveOptions(time_limit_s=4.0), cost_model=a.costs), a.repeats or 3, QUICK_GRID,
            not a.eager, a.clock)
    return (a.models or "gpt2,resnet,unet,mlp,gpt2-2l,gpt-512,hf-gpt2").split(","), Settings(
        tuple(float(x) for x in (a.budgets or "0.3,0.5,0.7").split(",")),
        PlanOptions(solve=SolveOptions(time_limit_s=10.0), cost_model=a.costs), a.repeats or 7, GRID, not a.eager,
        a.clock)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help=f"comma-separated, of {', '.join(MODELS)} (default: all)")
    ap.add_argument("--budgets", help="comma-separated fractions (default 0.3,0.5,0.7)")
    ap.add_argument("--quick", action="store_true",
                    help="defaults to gpt2,resnet at 0.5, 3 repeats, shorter ILP limit, coarser compile grid")
    ap.add_argument("--repeats", type=int, help="timed rounds, a step of each strategy per round (default 7)")
    ap.add_argument("--eager", action="store_true", help="leave out the compiled strategies (no compiles)")
    ap.add_argument("--threads", type=int, help="torch threads (default torch's; 1 is steadier on a shared machine)")
    ap.add_argument("--costs", choices=("measured", "roofline"), default="measured",
                    help="our plans' cost model (default measured: each op timed on this machine)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="step times: wall time (default), or the calling thread's CPU time, which a shared "
                         "machine's other jobs do not inflate (CPU with --threads 1 only: then every kernel runs "
                         "in that thread)")
    ap.add_argument("--out", help="results file stem under benchmarks/results (default step-time[-quick][-eager])")
    a = ap.parse_args(argv)
    if a.clock == "cpu" and a.threads != 1:
        ap.error("--clock cpu times the calling thread: pass --threads 1 (other threads' work would be missed)")
    if a.threads:
        torch.set_num_threads(a.threads)
    models, s = settings(a)
    if set(models) - set(MODELS):
        ap.error(f"unknown models {sorted(set(models) - set(MODELS))}; known: {', '.join(MODELS)}")
    results = {m: bench_model(m, s) for m in models}
    stem = a.out or report.stem(a.quick) + ("" if s.compile else "-eager")
    pngs, plot_notes = plots(results, stem)
    rows = [r for res in results.values() for r in res.rows]
    notes = [n for res in results.values() for n in res.notes] + plot_notes + ([dropout_note()] if s.compile else [])
    text = report.document(sys.argv[1:] if argv is None else argv, rows,
                           [res.meter for res in results.values() if res.meter],
                           [e for res in results.values() for e in res.exacts], notes, pngs)
    print(text)
    out = RESULTS / f"{stem}.md"
    out.write_text(text)
    print(f"written to {out}")
    return 0 if all(r["same"] for r in rows if r["checked"]) else 1     # torch.compile's own are not ours


if __name__ == "__main__":
    sys.exit(main())
