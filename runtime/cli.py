"""`remat report | check`: read plans in a terminal, gate merges on memory in CI.

MODEL is a built-in example (gpt2, mlp, resnet, unet), `path/to/file.py:factory` or
`package.module:factory`. The factory takes no arguments and returns `(model, inputs)` or
`(model, inputs, loss_fn)`, where inputs is a tuple (positional) or a dict (keyword).
Exit codes: 0 fits, 1 does not fit (or over the overhead cap), 2 usage or model errors.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import re
import sys
from pathlib import Path

from planner import InfeasibleBudgetError, PlanOptions, RematError, SolveOptions, analyze, solve_plan
from planner.errors import gb
from planner.result import Plan

from . import examples

_UNITS = {"gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "b": 1}


class UsageError(Exception):
    """Bad command-line input: exit code 2, one line, no traceback."""


def parse_budget(text: str) -> tuple[str, float]:
    """'24GB' -> ('bytes', 24e9); '50%' -> ('fraction', 0.5). GB = 10^9 bytes, GiB = 2^30."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(%|[a-zA-Z]*)\s*", text)
    if not m:
        raise UsageError(f"budget {text!r} is not a size: use e.g. 24GB, 8GiB, 500MB or 50%")
    value, unit = float(m.group(1)), m.group(2).lower()
    if value <= 0:
        raise UsageError(f"budget {text!r} must be positive")
    if unit == "%":
        return "fraction", value / 100
    if unit not in _UNITS:
        raise UsageError(f"budget unit {m.group(2)!r} unknown: use GB, GiB, MB, MiB or %")
    return "bytes", value * _UNITS[unit]


def load_model(spec: str | None):
    """(model, args, kwargs, loss_fn, label) from a MODEL spec (see the module docstring)."""
    if spec is None or spec in examples.EXAMPLES:
        name = spec or "gpt2"
        ex = examples.EXAMPLES[name]()
        return ex.model, ex.inputs, {}, ex.loss_fn, f"built-in {name}"
    if ":" not in spec:
        raise UsageError(f"MODEL {spec!r}: use a built-in ({', '.join(examples.EXAMPLES)}), "
                         "path/to/file.py:factory or package.module:factory")
    where, factory_name = spec.rsplit(":", 1)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise UsageError(f"MODEL file {where!r} does not exist")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        factory = getattr(module, factory_name)
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(f"cannot load {spec!r}: {type(e).__name__}: {e}") from e
    try:
        made = factory()
    except Exception as e:
        raise UsageError(f"factory {spec!r} raised {type(e).__name__}: {e}") from e
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise UsageError(f"factory {spec!r} must return (model, inputs) or (model, inputs, loss_fn)")
    model, inputs, loss_fn = made[0], made[1], made[2] if len(made) == 3 else None
    args, kwargs = ((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {})
    return model, args, kwargs, loss_fn, spec


def _options(a) -> PlanOptions:
    return PlanOptions(solve=SolveOptions(time_limit_s=a.time_limit))


def _plan(a, say) -> tuple[Plan, object]:
    model, args, kwargs, loss_fn, label = load_model(a.model)
    kind, value = parse_budget(a.budget)
    say(f"tracing and profiling {label} on fake tensors ...")
    try:
        analysis = analyze(model, args, kwargs, loss_fn)
    except (RematError, ValueError, TypeError) as e:
        raise UsageError(str(e)) from e
    cg = analysis.cost_graph
    if kind == "fraction":
        unplanned = solve_plan(cg, 10**18, _options(a)).unplanned_peak_bytes
        value = value * unplanned
    say(f"{len(cg.nodes)} nodes profiled in {analysis.analyze_s:.1f} s; solving for {gb(int(value))} ...")
    from .api import exact_replay
    p = solve_plan(cg, int(value), _options(a), analysis.traced.opaque,
                   measure=exact_replay(model, analysis, loss_fn))
    return p, (model, args, kwargs, loss_fn)


def _report_text(p: Plan) -> str:
    return p.summary()


def cmd_report(a, say) -> int:
    try:
        p, _ = _plan(a, say)
    except InfeasibleBudgetError as e:
        print(json.dumps({"fits": False, "error": str(e), "min_feasible_bytes": e.min_feasible_bytes})
              if a.json else f"does not fit: {e}")
        return 1
    print(p.to_json() if a.json else _report_text(p))
    return 0


def cmd_check(a, say) -> int:
    cap = None
    if a.max_overhead is not None:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*%?\s*", a.max_overhead)
        if not m:
            raise UsageError(f"--max-overhead {a.max_overhead!r}: use a percentage like 25%")
        cap = float(m.group(1))
    try:
        p, (model, args, kwargs, loss_fn) = _plan(a, say)
    except InfeasibleBudgetError as e:
        print(f"FAIL: {e}")
        return 1
    if cap is not None and p.extra_compute_pct > cap:
        print(f"FAIL: fits {gb(p.budget_bytes)} only at {p.extra_compute_pct:.1f}% extra compute (cap {cap:g}%)")
        return 1
    line = f"OK: predicted peak {gb(p.predicted_peak_bytes)} <= budget {gb(p.budget_bytes)}, " \
           f"{len(p.regions)} regions, extra compute {p.extra_compute_pct:.1f}%"
    if a.measure:
        from .api import plan_and_wrap
        from .measure import peak_memory
        say("running one real training step to measure it ...")
        wrapped = plan_and_wrap(model, p.budget_bytes / 1e9, example_inputs=args, example_kwargs=kwargs,
                                loss_fn=loss_fn, options=_options(a))

        def step():
            out = wrapped(*args, **kwargs)
            loss = loss_fn(out) if loss_fn else sum(t.float().sum() for t in _tensors(out))
            loss.backward()
        measured = peak_memory(step, model, *args, *kwargs.values())
        if measured > p.budget_bytes:
            print(f"FAIL: measured peak {gb(measured)} > budget {gb(p.budget_bytes)}")
            return 1
        line += f"; measured {gb(measured)}"
    print(line)
    return 0


def _tensors(out):
    import torch
    from torch.utils._pytree import tree_flatten
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="remat", description="Plan activation checkpointing to fit a memory budget.")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, helptext in (("report", "print the plan for a budget"), ("check", "exit 0 if the model fits")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("model", nargs="?" if name == "report" else None,
                       help="gpt2|mlp|resnet|unet, path/to/file.py:factory or package.module:factory")
        p.add_argument("--budget", required=True, help="e.g. 24GB, 8GiB, 500MB, 50%% (of the unplanned peak)")
        p.add_argument("--time-limit", type=float, default=10.0, help="ILP time limit per solve, seconds")
        p.add_argument("--quiet", action="store_true", help="no progress on stderr")
        if name == "report":
            p.add_argument("--json", action="store_true", help="the Plan as JSON on stdout")
        else:
            p.add_argument("--max-overhead", help="fail if the estimated extra compute exceeds this, e.g. 25%%")
            p.add_argument("--measure", action="store_true", help="also run one real step and measure its peak")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    quiet = a.quiet or getattr(a, "json", False)
    say = (lambda msg: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        return {"report": cmd_report, "check": cmd_check}[a.command](a, say)
    except UsageError as e:
        print(f"remat: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
