"""`remat report | check | sweep`: read plans in a terminal, gate merges on memory in CI, and see
the budget / recompute trade-off.

MODEL is a built-in example (gpt2, mlp, resnet, unet), `path/to/file.py:factory` or
`package.module:factory` (runtime/cli/session.py says what a factory returns;
docs/example_model.py is one, benchmarks/zoo_models.py has real architectures).
Exit codes: 0 fits (report, check) or sweep done, 1 does not fit (or over the overhead cap),
2 usage or model errors. Progress goes to stderr; `--quiet` and `--json` keep it off.
See docs/cli.md.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

# torch warns when it first looks for numpy and finds none (the minimal install: torch + pulp);
# remat needs no numpy. The filter holds while these imports first import torch (as long as the
# `runtime` package's own __init__ does not import torch first), and is gone after them: a
# process that imports the CLI keeps the warning filters it had.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    from remat.planner import Analysis, CostGraph, InfeasibleBudgetError, PlanOptions, SolveOptions, solve_plan
    from remat.planner.budget import parse_budget, parse_budget_range, parse_percent, size_text
    from remat.planner.errors import BudgetError
    from remat.planner.result import Plan
    from remat.planner.step.rng import rng_preserved
    from remat.planner.solve.simulate import timeline

    from . import plots
    from ..distributed import per_rank_analysis
    from ..distributed.pipeline_job import job_table, plan_job
    from .report import report_text, segments, table
    from remat.planner.solve.fit import unplanned_peak_bytes

    from ..budget import StepBudget
    from ..planning import compiled_unplanned
    from ..steps import Loaded, compiled_step_measure, measure_extra_pct, measure_peak_bytes, solve_budget, time_plan
    from .session import UsageError, hf_config_model, load_model, make_optimizer, model_code, profile_model

_VALUE_FLAGS = ("--budget", "--budgets", "--max-overhead")   # may take values that start with '-'


@dataclass(frozen=True)
class SweepPoint:
    budget_bytes: int
    plan: Plan | None                      # None: does not fit
    min_feasible_bytes: int | None
    measured_peak_bytes: int | None = None
    measured_extra_pct: float | None = None   # real extra step time as % of the real forward

    def row(self, unplanned_bytes: int) -> dict:
        p = self.plan
        return {"budget_bytes": self.budget_bytes, "budget_fraction": self.budget_bytes / unplanned_bytes,
                "fits": p is not None, "min_feasible_bytes": self.min_feasible_bytes,
                "predicted_peak_bytes": p and p.predicted_peak_bytes, "regions": p and len(p.regions),
                "recompute_flops": p and p.recompute_flops, "extra_compute_pct": p and p.extra_compute_pct,
                "solver": p and p.solver, "measured_peak_bytes": self.measured_peak_bytes,
                "measured_extra_pct": self.measured_extra_pct}


# ----------------------------------------------------------------------------- JSON
def _finite(x):
    """JSON has no NaN: None instead."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _json(obj) -> str:
    return json.dumps(_finite(obj), indent=1, sort_keys=True)


# ----------------------------------------------------------------------------- commands
def _options(a) -> PlanOptions:
    return PlanOptions(solve=SolveOptions(time_limit_s=a.time_limit),
                       accumulation_steps=a.accumulation, target_device=a.target_device, cost_model=a.costs)


def _load(a) -> Loaded:
    """MODEL, or --hf-config with --batch/--seq/--dtype (a model on meta)."""
    if a.hf_config:
        if a.model:
            raise UsageError("give MODEL or --hf-config, not both")
        return hf_config_model(a.hf_config, a.batch, a.seq, a.dtype)
    if a.model is None and a.command != "report":
        raise UsageError("MODEL is required (or --hf-config)")
    return load_model(a.model)


def _profile(a, say) -> tuple[Loaded, Analysis]:
    loaded = _load(a)
    if a.optimizer and (getattr(a, "measure", False) or getattr(a, "compile", False)):
        raise UsageError("--measure and --compile run real forward and backward steps only: drop --optimizer "
                         "to run them")
    if a.fsdp or a.ddp:
        return loaded, _per_rank(a, loaded, say)
    return loaded, profile_model(loaded, say, _options(a), make_optimizer(a.optimizer, loaded.model))


def _per_rank(a, loaded: Loaded, say) -> Analysis:
    """--fsdp / --ddp: one rank's step, planned from this process (runtime/distributed/)."""
    if a.command == "sweep" or getattr(a, "measure", False) or getattr(a, "compile", False):
        raise UsageError("--fsdp and --ddp plan one rank from one process (report, check): sweep, --measure and "
                         "--compile need the job itself")
    kind = "fsdp" if a.fsdp else "ddp"
    say(f"profiling one rank of {a.world_size} ({kind}) of {loaded.label} on fake tensors ...")
    with model_code(f"cannot profile {loaded.label} under {kind}"):
        return per_rank_analysis(loaded.model, loaded.args, loaded.kwargs, loaded.loss_fn, _options(a),
                                 lambda m: make_optimizer(a.optimizer, m), kind, a.world_size)


def _prepare(a, say) -> tuple[Loaded, Analysis, int]:
    budget = StepBudget(parse_budget(a.budget))
    loaded, analysis = _profile(a, say)
    if getattr(a, "compile", False):       # '%' of the compiled step without checkpointing, predicted
        say("capturing the compiled step's joint graph on fake tensors ...")
        a.compiled_measure = compiled_step_measure(loaded, analysis)
        budget_bytes = budget.resolve(compiled_unplanned(a.compiled_measure))
    else:
        budget_bytes = budget.resolve(unplanned_peak_bytes(analysis.cost_graph, _options(a)))
    given = budget.asked.text()
    size = budget.size_text(budget_bytes)
    say(f"solving for {size}{'' if given == size else f' ({given})'} ...")
    return loaded, analysis, budget_bytes


def _does_not_fit(a, e: InfeasibleBudgetError, label: str) -> None:
    e = StepBudget(parse_budget(a.budget)).spelled(e)     # the floor in the unit the budget was written in
    print(_json({"fits": False, "model": label, "budget_bytes": e.budget_bytes,
                 "min_feasible_bytes": e.min_feasible_bytes, "reason": str(e)})
          if a.json else f"FAIL: does not fit: {e}")


def _solve(a, say):
    """(loaded, analysis, plan), or None after saying why the budget does not fit."""
    loaded, analysis, budget_bytes = _prepare(a, say)
    try:
        with model_code(f"cannot plan {loaded.label}"):
            if a.fsdp or a.ddp:         # the simulator's per-rank prediction (a replay would run one process)
                return loaded, analysis, solve_plan(analysis.cost_graph, budget_bytes, _options(a),
                                                    analysis.traced.opaque)
            return loaded, analysis, solve_budget(loaded, analysis, budget_bytes, _options(a),
                                                  getattr(a, "compiled_measure", None))
    except InfeasibleBudgetError as e:
        _does_not_fit(a, e, loaded.label)
        return None


def cmd_pipeline(a, say) -> int:
    """report --pipeline N: every stage of a Hugging Face causal LM (--hf-config, on meta) planned for
    its rank of an N-stage pipeline (runtime/distributed/pipeline_job.py), beside every block
    checkpointed on every stage; the budget is per rank ('%': of the largest rank's step)."""
    if not a.hf_config or a.fsdp or a.ddp or a.compile or a.time or a.optimizer:
        raise UsageError("--pipeline plans a Hugging Face causal LM's stages from --hf-config (no --fsdp, --ddp, "
                         "--compile, --time or --optimizer)")
    loaded = _load(a)
    say(f"planning {a.pipeline} stages ({a.schedule}, {a.microbatches} micro-batches) of {loaded.label} ...")
    with model_code(f"cannot plan the stages of {loaded.label}"):
        rows, budget_bytes, seconds = plan_job(loaded.model, a.pipeline, a.schedule, a.microbatches, a.batch, a.seq,
                                               parse_budget(a.budget), _options(a))
    if a.json:
        print(_json({"model": loaded.label, "budget_bytes": budget_bytes, "seconds": round(seconds, 1),
                     "stages": [asdict(r) for r in rows]}))
    else:
        print(f"{loaded.label}: {a.pipeline} stages, {a.schedule}, {a.microbatches} micro-batches of {a.batch}\n"
              f"{job_table(rows, budget_bytes)}\nplanned in {seconds:.1f} s (the simulator's per-rank predictions)")
    return 0 if all(r.planned_bytes is not None for r in rows) else 1


def cmd_report(a, say) -> int:
    if getattr(a, "pipeline", None):
        return cmd_pipeline(a, say)
    if a.time and a.compile:
        raise UsageError("--time times the eager step: drop --compile to time the plan")
    solved = _solve(a, say)
    if solved is None:
        return 1
    loaded, analysis, plan = solved
    if a.time:
        say("timing the planned step against the unplanned one ...")
        plan = plan.noting(timing=time_plan(loaded, analysis, plan).to_dict())
    segs = segments(analysis.cost_graph, plan, _options(a))
    if a.json:
        print(_json({"fits": True, "model": loaded.label, "plan": asdict(plan),
                     "segments": [asdict(s) for s in segs]}))
    else:
        budget = parse_budget(a.budget)
        print(report_text(plan, segs, loaded.label, budget.text() if budget.kind == "fraction" else ""))
    return 0


def _check_verdict(plan: Plan, cap_pct: float | None, measured_bytes: int | None) -> tuple[bool, str]:
    if measured_bytes is not None and measured_bytes > plan.budget_bytes:
        return False, f"measured peak {size_text(measured_bytes)} > budget {size_text(plan.budget_bytes)}"
    if cap_pct is not None and plan.extra_compute_pct > cap_pct:
        return False, (f"fits {size_text(plan.budget_bytes)} only at {plan.extra_compute_pct:.1f}% extra compute "
                       f"(cap {cap_pct:g}%): raise the budget or the cap")
    line = (f"predicted peak {size_text(plan.predicted_peak_bytes)} <= budget {size_text(plan.budget_bytes)}, "
            f"{len(plan.regions)} regions, extra compute {plan.extra_compute_pct:.1f}%")
    return True, line + (f"; measured peak {size_text(measured_bytes)}" if measured_bytes is not None else "")


def cmd_check(a, say) -> int:
    cap_pct = parse_percent(a.max_overhead, "--max-overhead") if a.max_overhead is not None else None
    solved = _solve(a, say)
    if solved is None:
        return 1
    loaded, analysis, plan = solved
    measured_bytes = None
    if a.measure:
        say("running one real training step to measure its peak ...")
        with model_code(f"the real training step of {loaded.label} failed"):
            measured_bytes = measure_peak_bytes(loaded, analysis, plan, a.compile)
    fits, reason = _check_verdict(plan, cap_pct, measured_bytes)
    if a.json:
        print(_json({"fits": fits, "model": loaded.label, "reason": reason, "budget_bytes": plan.budget_bytes,
                     "predicted_peak_bytes": plan.predicted_peak_bytes, "min_feasible_bytes": plan.min_feasible_bytes,
                     "extra_compute_pct": plan.extra_compute_pct, "measured_peak_bytes": measured_bytes}))
    else:
        print(("OK: " if fits else "FAIL: ") + reason)
    return 0 if fits else 1


def _sweep_point(a, loaded: Loaded, analysis: Analysis, budget_bytes: int) -> SweepPoint:
    try:
        with model_code(f"cannot plan {loaded.label}"):
            plan = solve_budget(loaded, analysis, budget_bytes, _options(a))
    except InfeasibleBudgetError as e:
        return SweepPoint(budget_bytes, None, e.min_feasible_bytes)
    if not a.measure:
        return SweepPoint(budget_bytes, plan, plan.min_feasible_bytes)
    with model_code(f"the real training step of {loaded.label} failed"):
        peak_bytes = measure_peak_bytes(loaded, analysis, plan)
        extra_pct = measure_extra_pct(loaded, analysis, plan)
    return SweepPoint(budget_bytes, plan, plan.min_feasible_bytes, peak_bytes, extra_pct)


def _sweep_table(points: list[SweepPoint], unplanned_bytes: int, measured: bool) -> str:
    rows = []
    for pt in points:
        p = pt.plan
        row = [size_text(pt.budget_bytes), f"{100 * pt.budget_bytes / unplanned_bytes:.0f}%"]
        if p is None:
            row += ["does not fit", "", "", ""] + (["", ""] if measured else [])
        else:
            row += [size_text(p.predicted_peak_bytes), str(len(p.regions)), f"{p.recompute_flops / 1e9:.3f}",
                    f"{p.extra_compute_pct:.1f}%"]
            if measured:
                row += [size_text(pt.measured_peak_bytes), f"{pt.measured_extra_pct:.1f}%"]
        rows.append(row)
    headers = ["budget", "of peak", "predicted peak", "regions", "recompute GFLOP", "extra compute"]
    return table(headers + (["measured peak", "measured extra"] if measured else []), rows, "r" * len(rows[0]))


def _sweep_budgets(a, unplanned_bytes: int) -> list[int]:
    lo, hi = (StepBudget(b).resolve(unplanned_bytes) for b in parse_budget_range(a.budgets))
    if lo >= hi:
        raise UsageError(f"--budgets {a.budgets!r}: the low end {size_text(lo)} must be below "
                         f"the high end {size_text(hi)}")
    return [round(lo + (hi - lo) * i / (a.steps - 1)) for i in range(a.steps)]


def _sweep_plots(a, cg: CostGraph, points: list[SweepPoint], unplanned_bytes: int, label: str) -> dict:
    """tradeoff.png over all fitting points; memory.png at the tightest budget that fits."""
    fitting = [pt for pt in points if pt.plan is not None]
    out = Path(a.out)
    tradeoff = plots.tradeoff_png(
        out / "tradeoff.png", [pt.budget_bytes for pt in fitting], [pt.plan.extra_compute_pct for pt in fitting],
        [(pt.budget_bytes, pt.measured_extra_pct) for pt in fitting if pt.measured_extra_pct is not None],
        unplanned_bytes, _min_feasible(points), f"{label}: budget vs extra compute")
    if fitting:
        tight = fitting[0]
        memory = plots.memory_png(out / "memory.png", timeline(cg, ()), timeline(cg, tight.plan.regions),
                                  tight.budget_bytes, tight.plan.regions,
                                  f"{label}: one step at budget {size_text(tight.budget_bytes)}")
    else:
        memory = plots.memory_png(out / "memory.png", timeline(cg, ()), None, points[0].budget_bytes, (),
                                  f"{label}: one step; no budget of the sweep fits")
    return {"tradeoff": str(tradeoff), "memory": str(memory)}


def _min_feasible(points: list[SweepPoint]) -> int | None:
    return min((pt.min_feasible_bytes for pt in points if pt.min_feasible_bytes), default=None)


def _require_plots(out: str) -> None:
    """Fail now, not after the long work, if matplotlib is missing or `out` is not writable."""
    try:
        plots.figure()
    except plots.PlotUnavailable as e:
        raise UsageError(f"{e}; or pass --no-plot") from e
    try:
        Path(out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {out!r}: {e.strerror or e}") from e


def cmd_sweep(a, say) -> int:
    parse_budget_range(a.budgets)
    if not a.no_plot:
        _require_plots(a.out)
    loaded, analysis = _profile(a, say)
    unplanned_bytes = unplanned_peak_bytes(analysis.cost_graph, _options(a))
    budgets = _sweep_budgets(a, unplanned_bytes)
    points = []
    for k, b in enumerate(budgets):
        say(f"[{k + 1}/{len(budgets)}] solving for {size_text(b)} ({100 * b / unplanned_bytes:.0f}%)"
            + (" and measuring ..." if a.measure else " ..."))
        points.append(_sweep_point(a, loaded, analysis, b))
    files = {} if a.no_plot else _sweep_plots(a, analysis.cost_graph, points, unplanned_bytes, loaded.label)
    if a.json:
        print(_json({"model": loaded.label, "unplanned_peak_bytes": unplanned_bytes,
                     "min_feasible_bytes": _min_feasible(points),
                     "points": [p.row(unplanned_bytes) for p in points], "plots": files}))
        return 0
    print(f"{loaded.label}: unplanned peak {size_text(unplanned_bytes)}; extra compute is % of the forward")
    print(_sweep_table(points, unplanned_bytes, a.measure))
    if _min_feasible(points):
        print(f"smallest feasible budget: {size_text(_min_feasible(points))}")
    for name, path in files.items():
        print(f"{name} plot: {path}")
    return 0


# ----------------------------------------------------------------------------- argv
def _positive(kind: type) -> Callable:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be positive")
        return value
    return parse


def _steps(text: str) -> int:
    value = _positive(int)(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: a sweep needs at least 2 steps")
    return value


_MODEL_HELP = "gpt2|mlp|resnet|unet, path/to/file.py:factory or package.module:factory"
_BUDGET_HELP = "GB, GiB, MB, MiB or %% of the unplanned peak, e.g. 24GB, 500MiB, 40%%"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--time-limit", type=_positive(float), default=SolveOptions.time_limit_s, metavar="S",
                   help="ILP time limit per solve, seconds (default %(default)g)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout (implies --quiet)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--optimizer", metavar="NAME", help="the step ends with this optimizer's step (its state and "
                   "temporaries in the budget): adamw, adam, sgd, sgd-momentum")
    p.add_argument("--accumulation", type=_positive(int), default=1, metavar="K",
                   help="gradient accumulation over K micro-steps (every gradient live from a micro-step's start)")
    p.add_argument("--target-device", metavar="DEV", help="the device the step trains on, when planning elsewhere "
                   "(cuda: its rates and margin)")
    p.add_argument("--hf-config", metavar="JSON", help="instead of MODEL: a Hugging Face causal LM from a local "
                   "config.json, built on meta (no weights)")
    p.add_argument("--batch", type=_positive(int), default=1, help="with --hf-config: batch size (default 1)")
    p.add_argument("--seq", type=_positive(int), default=2048, help="with --hf-config: sequence length (default 2048)")
    p.add_argument("--dtype", default="bf16", help="with --hf-config: fp32, bf16 or fp16 (default bf16)")
    p.add_argument("--world-size", type=_positive(int), default=1, metavar="N",
                   help="with --fsdp or --ddp: plan one rank of an N-rank job (the budget is per rank)")
    engine = p.add_mutually_exclusive_group()
    engine.add_argument("--fsdp", action="store_true", help="FSDP2: the model's blocks, then its root, sharded "
                        "with fully_shard over --world-size ranks (a fake process group; MODEL's inputs are one "
                        "rank's batch)")
    engine.add_argument("--ddp", action="store_true", help="DDP over --world-size ranks (its gradient buckets "
                        "in the budget)")


def _costs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", choices=("auto", "measured", "roofline"), default="auto",
                   help="recompute cost model: each op timed on the device (measured, cached), nominal rates "
                        "(roofline), or auto: measured on a CUDA device, roofline elsewhere (default auto)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="remat", description="Plan activation checkpointing to fit a memory budget.",
                                 epilog="exit codes: 0 fits, 1 does not fit, 2 usage or model error")
    sub = ap.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="print the plan for a budget, region by region")
    report.add_argument("model", nargs="?", help=_MODEL_HELP + " (default gpt2)")
    report.add_argument("--budget", required=True, help=_BUDGET_HELP)
    report.add_argument("--time", action="store_true", help="also time the planned step against the unplanned "
                        "one on the example inputs: measured and predicted overhead side by side")
    report.add_argument("--pipeline", type=_positive(int), metavar="N", help="with --hf-config: plan every stage "
                        "of an N-stage pipeline for its rank (--schedule, --microbatches; --batch: a micro-batch)")
    report.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b", help="with --pipeline (default 1f1b)")
    report.add_argument("--microbatches", type=_positive(int), default=8, metavar="M",
                        help="with --pipeline: micro-batches per step (default 8)")
    check = sub.add_parser("check", help="exit 0 if the model's training step fits the budget, 1 if not")
    check.add_argument("model", nargs="?", help=_MODEL_HELP)
    check.add_argument("--budget", required=True, help=_BUDGET_HELP)
    check.add_argument("--max-overhead", metavar="PCT",
                       help="fail if the estimated extra compute exceeds this, e.g. 25%%")
    check.add_argument("--measure", action="store_true", help="also run one real step and check its measured peak")
    sweep = sub.add_parser("sweep", help="the budget / extra-compute trade-off, as a table and PNG plots")
    sweep.add_argument("model", nargs="?", help=_MODEL_HELP)
    sweep.add_argument("--budgets", required=True, metavar="LOW..HIGH", help="e.g. 20%%..100%% or 8GB..24GB")
    sweep.add_argument("--steps", type=_steps, default=6, help="budgets in the range, ends included (default 6)")
    sweep.add_argument("--out", default="remat-sweep", help="folder for tradeoff.png and memory.png")
    sweep.add_argument("--measure", action="store_true", help="also run each plan for real: peak and step time")
    sweep.add_argument("--no-plot", action="store_true", help="the table only (no matplotlib needed)")
    for p in (report, check, sweep):
        _common(p)
        _costs(p)
    for p in (report, check):
        p.add_argument("--compile", action="store_true",
                       help="plan for the torch.compile'd step: each plan tried is partitioned as Inductor "
                            "will and replayed on fake tensors (with --measure, the chosen plan is compiled and "
                            "its real step measured)")
    return ap


def _glue_values(argv: list[str]) -> list[str]:
    """'--budget -5GB' -> '--budget=-5GB', so argparse passes it on instead of taking it for an option."""
    out: list[str] = []
    for tok in argv:
        if out and out[-1] in _VALUE_FLAGS and re.match(r"-[0-9.]", tok):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


class _Say(logging.Handler):
    def __init__(self, say):
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


@contextlib.contextmanager
def _say_logs(say):
    """Inside: the library's log (the `remat` logger: fallbacks, opaque modules) as progress lines
    on stderr (none with --quiet or --json), and a failing op under fake tensors not logged with
    its traceback (we report it in one line). Afterwards both loggers are as they were, however
    the block ends (a return, an error, SystemExit): `main` called in a process (a test, a
    notebook) leaves no trace. The profiler's quiet environment is planner.compat's (kineto_quiet)."""
    log, fake = logging.getLogger("remat"), logging.getLogger("torch._subclasses.fake_tensor")
    before = (log.handlers[:], log.level, log.propagate, fake.level)
    log.handlers[:] = [_Say(say)]
    log.setLevel(logging.INFO)
    log.propagate = False
    fake.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.handlers[:], level, log.propagate, fake_level = before
        log.setLevel(level)
        fake.setLevel(fake_level)


# NOTE [ main leaves no trace ]: `main` called in a process (a test, a notebook) leaves it as a
# separate `remat` process would: the loggers as they were (_say_logs), and every RNG, so that
# a user factory's draws (its weights, its inputs) do not move the caller's random stream and a
# second call builds the same model. Both hold however a command ends, SystemExit included.
# What the planner and runtime.measure change they put back themselves (planner.step.kernels,
# planner.capture.muted, planner.compat.kineto_quiet); tests/test_process_state.py holds
# them all to a snapshot of the process.
def main(argv: list[str] | None = None) -> int:
    try:
        a = parser().parse_args(_glue_values(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:
        return int(e.code or 0)
    quiet = a.quiet or a.json
    say = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        with _say_logs(say), rng_preserved():    # NOTE [ main leaves no trace ]
            return {"report": cmd_report, "check": cmd_check, "sweep": cmd_sweep}[a.command](a, say)
    except (UsageError, BudgetError) as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("remat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:               # `remat report ... | head`: stop quietly, as shell tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
