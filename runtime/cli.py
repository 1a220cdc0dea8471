"""`remat report | check | sweep`: read plans in a terminal, gate merges on memory in CI, and see
the budget / recompute trade-off.

MODEL is a built-in example (gpt2, mlp, resnet, unet), `path/to/file.py:factory` or
`package.module:factory`. The factory takes no arguments and returns `(model, inputs)` or
`(model, inputs, loss_fn)`, where inputs is a tuple (positional), a dict (keyword) or one tensor.
Exit codes: 0 fits (report, check) or sweep done, 1 does not fit (or over the overhead cap),
2 usage or model errors. Progress goes to stderr; `--quiet` and `--json` keep it off.
See docs/CLI.md.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import math
import os
import re
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch.utils._pytree import tree_flatten

from planner import Analysis, CostGraph, InfeasibleBudgetError, PlanOptions, SolveOptions, analyze, solve_plan
from planner.result import Plan, Region
from planner.simulate import keep_release, region_index, region_recompute, timeline

from . import examples

_UNITS = {"gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "b": 1}
_VALUE_FLAGS = ("--budget", "--budgets", "--max-overhead")   # may take values that start with '-'


class UsageError(Exception):
    """Bad command-line input: exit code 2, one line, no traceback."""


class ModelError(UsageError):
    """The model, its factory or its training step failed: exit code 2, one line."""


class Loaded(NamedTuple):
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable | None
    label: str


@dataclass(frozen=True)
class Segment:
    """One checkpoint region of a plan, in numbers a person can judge."""
    index: int
    start: int
    end: int
    first_node: str
    last_node: str
    modules: str              # the modules it spans
    saved_nodes: int          # nodes whose outputs SAC keeps (0: everything is recomputed)
    kept_bytes: int           # activations made in the region still kept for backward
    recomputed_bytes: int     # activations the unplanned step keeps and this region drops
    recompute_flops: int
    recompute_s: float        # estimated (roofline) time of its recompute
    peak_without_bytes: int   # predicted peak of the plan without this region (safety margin included)
    needed: bool              # without it the plan is over budget


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


# ----------------------------------------------------------------------------- parsing
def size_text(n_bytes: float) -> str:
    """Bytes in decimal units, three or four significant digits: '17.98 MB', '24.00 GB'."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def parse_budget(text: str) -> tuple[str, float]:
    """'24GB' -> ('bytes', 24e9); '50%' -> ('fraction', 0.5). GB = 10^9 bytes, GiB = 2^30."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(%|[a-zA-Z]*)\s*", text)
    if not m:
        raise UsageError(f"budget {text!r} is not a size: use e.g. 24GB, 8GiB, 500MB or 50%")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not 0 < value < math.inf:
        raise UsageError(f"budget {text!r} must be positive and finite")
    if unit == "%":
        return "fraction", value / 100
    if not unit:
        raise UsageError(f"budget {text!r} has no unit: use GB, GiB, MB, MiB or %")
    if unit not in _UNITS:
        raise UsageError(f"budget unit {m.group(2)!r} unknown: use GB, GiB, MB, MiB or %")
    return "bytes", value * _UNITS[unit]


def parse_budget_range(text: str) -> tuple[tuple[str, float], tuple[str, float]]:
    """'20%..100%' -> the two ends, each as parse_budget gives it."""
    ends = text.split("..")
    if len(ends) != 2:
        raise UsageError(f"--budgets {text!r}: use LOW..HIGH, e.g. 20%..100% or 8GB..24GB")
    lo, hi = parse_budget(ends[0]), parse_budget(ends[1])
    if lo[0] == hi[0] and lo[1] >= hi[1]:
        raise UsageError(f"--budgets {text!r}: the low end must come first and be below the high end")
    return lo, hi


def parse_percent(text: str, flag: str) -> float:
    """'25%' or '25' -> 25.0."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*%?\s*", text)
    if not m:
        raise UsageError(f"{flag} {text!r}: use a percentage like 25%")
    value = float(m.group(1))
    if value < 0:
        raise UsageError(f"{flag} {text!r} must not be negative")
    return value


def to_bytes(budget: tuple[str, float], unplanned_bytes: int) -> int:
    kind, value = budget
    return int(value * unplanned_bytes) if kind == "fraction" else int(value)


# ----------------------------------------------------------------------------- the model
def split_inputs(inputs) -> tuple[tuple, dict]:
    """A factory's inputs as (args, kwargs): a dict is keyword, a tensor one positional argument."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise TypeError(f"inputs must be a tuple, a dict or a tensor, got {type(inputs).__name__}")


def _import(where: str):
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where)
    if not path.is_file():
        raise UsageError(f"MODEL file {where!r} does not exist")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_model(spec: str | None) -> Loaded:
    """The model, its inputs and loss from a MODEL spec (see the module docstring)."""
    if spec is None or spec in examples.EXAMPLES:
        name = spec or "gpt2"
        ex = examples.EXAMPLES[name]()
        return Loaded(ex.model, ex.inputs, {}, ex.loss_fn, f"built-in {name}")
    if ":" not in spec:
        raise UsageError(f"MODEL {spec!r}: use a built-in ({', '.join(examples.EXAMPLES)}), "
                         "path/to/file.py:factory or package.module:factory")
    where, factory_name = spec.rsplit(":", 1)
    with _model_code(f"cannot load {spec!r}"):
        factory = getattr(_import(where), factory_name)
    with _model_code(f"factory {spec!r} raised"):
        made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ModelError(f"factory {spec!r} must return (model, inputs) or (model, inputs, loss_fn), "
                         f"not {type(made).__name__}")
    with _model_code(f"factory {spec!r}"):
        args, kwargs = split_inputs(made[1])
    return Loaded(made[0], args, kwargs, made[2] if len(made) == 3 else None, spec)


@contextmanager
def _model_code(what: str):
    """Errors from the user's code (or from running it) become one-line ModelErrors."""
    try:
        yield
    except (UsageError, InfeasibleBudgetError):
        raise
    except Exception as e:
        first_line = next((line for line in str(e).splitlines() if line.strip()), "")
        raise ModelError(f"{what}: {type(e).__name__}: {first_line}") from e


def profile_model(loaded: Loaded, say) -> Analysis:
    say(f"tracing and profiling {loaded.label} on fake tensors ...")
    with _model_code(f"cannot profile {loaded.label}"):
        analysis = analyze(loaded.model, loaded.args, loaded.kwargs, loaded.loss_fn)
    say(f"{len(analysis.cost_graph.nodes)} nodes profiled in {analysis.analyze_s:.1f} s")
    return analysis


def unplanned_peak_bytes(cg: CostGraph, options: PlanOptions) -> int:
    return solve_plan(cg, 10**18, options).unplanned_peak_bytes


def solve_budget(loaded: Loaded, analysis: Analysis, budget_bytes: int, options: PlanOptions) -> Plan:
    """The least-recompute plan for the budget, every candidate replayed exactly on fake tensors
    (simulated only when the graph has opaque modules). Raises InfeasibleBudgetError."""
    from .api import exact_replay
    return solve_plan(analysis.cost_graph, budget_bytes, options, analysis.traced.opaque,
                      measure=exact_replay(loaded.model, analysis, loaded.loss_fn))


# ----------------------------------------------------------------------------- real steps
def _loss(out, loss_fn):
    """The user's loss, or the planner's stand-in: one tensor of the output's size is kept."""
    if loss_fn is not None:
        return loss_fn(out)
    return sum(t.float().exp().sum() for t in tree_flatten(out)[0]
               if isinstance(t, torch.Tensor) and t.requires_grad)


def _device(loaded: Loaded) -> torch.device:
    tensors = [t for t in tree_flatten((loaded.args, loaded.kwargs))[0] if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


@contextmanager
def preserved(model: torch.nn.Module):
    """Real steps leave no trace: gradients, buffers (BatchNorm statistics) and the CPU RNG are restored."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads.items():
            p.grad = g


def _forward_fn(loaded: Loaded, analysis: Analysis, plan: Plan | None) -> Callable:
    """The model's forward, or the plan's rewritten forward, on the example inputs."""
    if plan is None or not plan.regions:
        return lambda: loaded.model(*loaded.args, **loaded.kwargs)
    from .rewrite import rewrite
    gm = rewrite(loaded.model, analysis.traced.gm, plan)
    return lambda: gm(**analysis.example_inputs)


def _step_fn(loaded: Loaded, forward: Callable) -> Callable:
    params = list(loaded.model.parameters())

    def step():
        for p in params:
            p.grad = None
        _loss(forward(), loaded.loss_fn).backward()
    return step


def measure_peak_bytes(loaded: Loaded, analysis: Analysis, plan: Plan | None) -> int:
    """Peak live bytes of one real training step under the plan (None: without one)."""
    from .measure import peak_memory
    step = _step_fn(loaded, _forward_fn(loaded, analysis, plan))
    with preserved(loaded.model):
        return peak_memory(step, loaded.model, *loaded.args, *loaded.kwargs.values(), device=_device(loaded))


def _best_times_s(fns: list[Callable], device: torch.device, repeats: int = 5) -> list[float]:
    """Best wall time of each function, after one warm-up each; run interleaved so drift hits all alike."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:
        fn()
    best_s = [math.inf] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            best_s[k] = min(best_s[k], time.perf_counter() - t0)
    return best_s


def measure_extra_pct(loaded: Loaded, analysis: Analysis, plan: Plan) -> float:
    """Real extra step time under the plan, as % of the real forward: the unit of Plan.extra_compute_pct."""
    forward = _forward_fn(loaded, analysis, None)
    fns = [_step_fn(loaded, forward), _step_fn(loaded, _forward_fn(loaded, analysis, plan)), forward]
    with preserved(loaded.model):
        base_s, planned_s, forward_s = _best_times_s(fns, _device(loaded))
    return 100.0 * (planned_s - base_s) / forward_s


# ----------------------------------------------------------------------------- segments
def _common_module(modules: list[str]) -> str:
    parts = [m.split(".") for m in modules]
    common = []
    for level in zip(*parts):
        if len(set(level)) > 1:
            break
        common.append(level[0])
    return ".".join(common)


def _modules_label(cg: CostGraph, r: Region) -> str:
    """The modules a region spans: 'h.0 .. h.1', 'h.1.ln_1 .. h.1.attn', 'drop .. h.0.attn.c_proj'."""
    nodes = cg.nodes[r.start:r.end + 1]
    common = _common_module([c.module for c in nodes]) if all(c.module for c in nodes) else ""
    depth = len(common.split(".")) + 1 if common else None
    first, last = (".".join(c.module.split(".")[:depth]) or c.name for c in (nodes[0], nodes[-1]))
    return first if first == last else f"{first} .. {last}"


def segments(cg: CostGraph, plan: Plan, options: PlanOptions) -> list[Segment]:
    """Per region: what it keeps and drops, what its recompute costs, and whether the plan needs it."""
    n = len(cg.nodes)
    recomputes = [region_recompute(cg, r) for r in plan.regions]
    kept = keep_release(cg, plan.regions, region_index(n, plan.regions), [rc[1] for rc in recomputes])
    kept_unplanned = keep_release(cg, (), [-1] * n, [])
    margin = 1.0 + options.safety_margin
    out = []
    for k, (r, (_, _, _, flops, secs)) in enumerate(zip(plan.regions, recomputes)):
        made = [i for i, s in enumerate(cg.storages) if s.producer in r]
        others = plan.regions[:k] + plan.regions[k + 1:]
        without = math.ceil(timeline(cg, others).peak_bytes * margin)
        out.append(Segment(
            index=k, start=r.start, end=r.end, first_node=cg.nodes[r.start].name, last_node=cg.nodes[r.end].name,
            modules=_modules_label(cg, r), saved_nodes=len(r.saved),
            kept_bytes=sum(cg.storages[i].bytes for i in made if kept[i] is not None),
            recomputed_bytes=sum(cg.storages[i].bytes for i in made
                                 if kept[i] is None and kept_unplanned[i] is not None),
            recompute_flops=flops, recompute_s=secs, peak_without_bytes=without,
            needed=without > plan.budget_bytes))
    return out


def _why(s: Segment, plan: Plan) -> str:
    if s.needed:
        over = 100.0 * (s.peak_without_bytes - plan.budget_bytes) / plan.budget_bytes
        return f"without it peak {size_text(s.peak_without_bytes)}, {over:.0f}% over budget"
    return f"without it peak {size_text(s.peak_without_bytes)} fits; kept by the {plan.solver} solver"


# ----------------------------------------------------------------------------- text output
def table(headers: list[str], rows: list[list[str]], align: str) -> str:
    """Columns padded to their widest cell; align has one 'l' or 'r' per column."""
    widths = [max(len(x) for x in col) for col in zip(headers, *rows)]

    def line(cells):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(cells, widths, align)).rstrip()
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _mode(s: Segment) -> str:
    return f"SAC keeps {s.saved_nodes}" if s.saved_nodes else "full"


def report_text(plan: Plan, segs: list[Segment], label: str, budget_text: str) -> str:
    pct = 100.0 * (plan.unplanned_peak_bytes - plan.predicted_peak_bytes) / plan.unplanned_peak_bytes
    smallest = f", smallest feasible {size_text(plan.min_feasible_bytes)}" if plan.min_feasible_bytes else ""
    lines = [
        f"model          {label}: {len(plan.node_names)} nodes",
        f"budget         {size_text(plan.budget_bytes)} ({budget_text})",
        f"peak           {size_text(plan.unplanned_peak_bytes)} without a plan -> "
        f"{size_text(plan.predicted_peak_bytes)} with it (-{pct:.1f}%){smallest}",
        f"extra compute  {plan.extra_compute_pct:.1f}% of the forward: recompute "
        f"{plan.recompute_flops / 1e9:.3g} of {plan.total_flops / 1e9:.3g} GFLOP, "
        f"est. {plan.recompute_s * 1e3:.1f} ms",
        f"solver         {plan.solver}: {plan.status}, gap {plan.gap:.1%}, {plan.solve_s:.2f} s",
        "",
    ]
    if segs:
        rows = [[str(s.index), f"{s.start}..{s.end}", s.modules, _mode(s), size_text(s.kept_bytes),
                 size_text(s.recomputed_bytes), f"{s.recompute_flops / 1e9:.3f}", f"{s.recompute_s * 1e3:.2f}",
                 _why(s, plan)] for s in segs]
        lines.append(table(["#", "nodes", "modules", "mode", "kept", "recomputed", "GFLOP", "est ms",
                            "why chosen"], rows, "rrllrrrrl"))
    else:
        lines.append("no checkpoint regions: the step fits the budget as it is")
    lines.append("opaque modules:" + ("" if plan.opaque else " none"))
    lines.extend(f"  {mod}: {why}" for mod, why in plan.opaque)
    lines.extend(f"note: {n}" for n in plan.notes)
    return "\n".join(lines)


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
    return PlanOptions(solve=SolveOptions(time_limit_s=a.time_limit))


def _budget_text(text: str, budget: tuple[str, float]) -> str:
    return f"{budget[1] * 100:g}% of the unplanned peak" if budget[0] == "fraction" else text.strip()


def _prepare(a, say) -> tuple[Loaded, Analysis, int]:
    budget = parse_budget(a.budget)
    loaded = load_model(a.model)
    analysis = profile_model(loaded, say)
    budget_bytes = to_bytes(budget, unplanned_peak_bytes(analysis.cost_graph, _options(a)))
    say(f"solving for {size_text(budget_bytes)} ({_budget_text(a.budget, budget)}) ...")
    return loaded, analysis, budget_bytes


def _does_not_fit(a, e: InfeasibleBudgetError, label: str) -> int:
    print(_json({"fits": False, "model": label, "budget_bytes": e.budget_bytes,
                 "min_feasible_bytes": e.min_feasible_bytes, "reason": str(e)})
          if a.json else f"FAIL: does not fit: {e}")
    return 1


def cmd_report(a, say) -> int:
    loaded, analysis, budget_bytes = _prepare(a, say)
    try:
        with _model_code(f"cannot plan {loaded.label}"):
            plan = solve_budget(loaded, analysis, budget_bytes, _options(a))
    except InfeasibleBudgetError as e:
        return _does_not_fit(a, e, loaded.label)
    segs = segments(analysis.cost_graph, plan, _options(a))
    if a.json:
        print(_json({"fits": True, "model": loaded.label, "plan": asdict(plan),
                     "segments": [asdict(s) for s in segs]}))
    else:
        print(report_text(plan, segs, loaded.label, _budget_text(a.budget, parse_budget(a.budget))))
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
    loaded, analysis, budget_bytes = _prepare(a, say)
    try:
        with _model_code(f"cannot plan {loaded.label}"):
            plan = solve_budget(loaded, analysis, budget_bytes, _options(a))
    except InfeasibleBudgetError as e:
        return _does_not_fit(a, e, loaded.label)
    measured_bytes = None
    if a.measure:
        say("running one real training step to measure its peak ...")
        with _model_code(f"the real training step of {loaded.label} failed"):
            measured_bytes = measure_peak_bytes(loaded, analysis, plan)
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
        with _model_code(f"cannot plan {loaded.label}"):
            plan = solve_budget(loaded, analysis, budget_bytes, _options(a))
    except InfeasibleBudgetError as e:
        return SweepPoint(budget_bytes, None, e.min_feasible_bytes)
    if not a.measure:
        return SweepPoint(budget_bytes, plan, plan.min_feasible_bytes)
    with _model_code(f"the real training step of {loaded.label} failed"):
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
    lo, hi = (to_bytes(b, unplanned_bytes) for b in parse_budget_range(a.budgets))
    if lo >= hi:
        raise UsageError(f"--budgets {a.budgets!r}: the low end {size_text(lo)} must be below "
                         f"the high end {size_text(hi)}")
    return [round(lo + (hi - lo) * i / (a.steps - 1)) for i in range(a.steps)]


def _sweep_plots(a, cg: CostGraph, points: list[SweepPoint], unplanned_bytes: int, label: str) -> dict:
    """tradeoff.png over all fitting points; memory.png at the tightest budget that fits."""
    from . import plots
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
    from . import plots
    try:
        plots.pyplot()
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
    loaded = load_model(a.model)
    analysis = profile_model(loaded, say)
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
    p.add_argument("--time-limit", type=_positive(float), default=10.0, metavar="S",
                   help="ILP time limit per solve, seconds (default 10)")
    p.add_argument("--json", action="store_true", help="machine-readable JSON on stdout (implies --quiet)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="remat", description="Plan activation checkpointing to fit a memory budget.",
                                 epilog="exit codes: 0 fits, 1 does not fit, 2 usage or model error")
    sub = ap.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="print the plan for a budget, region by region")
    report.add_argument("model", nargs="?", help=_MODEL_HELP + " (default gpt2)")
    report.add_argument("--budget", required=True, help=_BUDGET_HELP)
    check = sub.add_parser("check", help="exit 0 if the model's training step fits the budget, 1 if not")
    check.add_argument("model", help=_MODEL_HELP)
    check.add_argument("--budget", required=True, help=_BUDGET_HELP)
    check.add_argument("--max-overhead", metavar="PCT",
                       help="fail if the estimated extra compute exceeds this, e.g. 25%%")
    check.add_argument("--measure", action="store_true", help="also run one real step and check its measured peak")
    sweep = sub.add_parser("sweep", help="the budget / extra-compute trade-off, as a table and PNG plots")
    sweep.add_argument("model", help=_MODEL_HELP)
    sweep.add_argument("--budgets", required=True, metavar="LOW..HIGH", help="e.g. 20%%..100%% or 8GB..24GB")
    sweep.add_argument("--steps", type=_steps, default=6, help="budgets in the range, ends included (default 6)")
    sweep.add_argument("--out", default="remat-sweep", help="folder for tradeoff.png and memory.png")
    sweep.add_argument("--measure", action="store_true", help="also run each plan for real: peak and step time")
    sweep.add_argument("--no-plot", action="store_true", help="the table only (no matplotlib needed)")
    for p in (report, check, sweep):
        _common(p)
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


def main(argv: list[str] | None = None) -> int:
    # a failing op under fake tensors is logged with a traceback before it is raised; we report it in one line
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
    try:
        a = parser().parse_args(_glue_values(sys.argv[1:] if argv is None else list(argv)))
    except SystemExit as e:
        return int(e.code or 0)
    quiet = a.quiet or a.json
    say = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        return {"report": cmd_report, "check": cmd_check, "sweep": cmd_sweep}[a.command](a, say)
    except UsageError as e:
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
