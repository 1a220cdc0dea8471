"""A model and its example inputs under planning (`Loaded`): solving for a budget, and real
training steps under a plan to measure their peak and extra time. The library code
`runtime.testing.assert_fits` and the CLI (runtime/cli/session.py) build on.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, NamedTuple

import torch
from remat.planner.compat import tree_flatten

from remat.planner import Analysis, PlanOptions, solve_plan
from remat.planner.result import Plan

from .measure import peak_memory, preserved, training_loss
from .measure.timing import StepTiming, interleaved_times, step_timing
from .planning import ExactReplay, compiled_measure, solve_compiled
from .rewrite import CompiledReplay, RecomputeTimes, rewrite_plan


class Loaded(NamedTuple):
    """A model, its example call and loss, and what to call it in messages."""
    model: torch.nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable | None
    label: str


def split_inputs(inputs) -> tuple[tuple, dict]:
    """A factory's inputs as (args, kwargs): a dict is keyword, a tensor one positional argument."""
    if isinstance(inputs, dict):
        return (), dict(inputs)
    if isinstance(inputs, torch.Tensor):
        return (inputs,), {}
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    raise TypeError(f"inputs must be a tuple, a dict or a tensor, got {type(inputs).__name__}")


def compiled_step_measure(loaded: Loaded, analysis: Analysis):
    """The measure of compiled plans for `loaded` (runtime.planning `compiled_measure`): its call on
    no regions is the compiled step's unplanned peak, what a '%' budget is a fraction of."""
    return compiled_measure(ExactReplay(loaded.model, analysis, loaded.loss_fn), {})


def solve_budget(loaded: Loaded, analysis: Analysis, budget_bytes: int, options: PlanOptions,
                 compiled=None) -> Plan:
    """The least-recompute plan for the budget, every candidate replayed exactly on fake tensors
    (with opaque modules, the larger of that and the simulator); with `compiled` (True, or a
    `compiled_step_measure`), the compiled step's partition replayed (runtime.rewrite.compiled).
    Raises InfeasibleBudgetError."""
    if compiled:
        measure = compiled if not isinstance(compiled, bool) else compiled_step_measure(loaded, analysis)
        return solve_compiled(analysis.cost_graph, budget_bytes, options, analysis.traced.opaque, measure)
    measure = ExactReplay(loaded.model, analysis, loaded.loss_fn)
    return solve_plan(analysis.cost_graph, budget_bytes, options, analysis.traced.opaque, measure=measure)


# ----------------------------------------------------------------------------- real steps
def _device(loaded: Loaded) -> torch.device:
    tensors = [t for t in tree_flatten((loaded.args, loaded.kwargs))[0] if isinstance(t, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def _forward_fn(loaded: Loaded, analysis: Analysis, plan: Plan | None) -> Callable:
    """The model's forward, or the plan's rewritten forward, on the example inputs."""
    if plan is None or not plan.regions:
        return lambda: loaded.model(*loaded.args, **loaded.kwargs)
    gm = rewrite_plan(loaded.model, analysis.traced.gm, plan)
    return lambda: gm(**analysis.example_inputs)


def _step_fn(loaded: Loaded, forward: Callable) -> Callable:
    params = list(loaded.model.parameters())

    def step():
        for p in params:
            p.grad = None
        training_loss(forward(), loaded.loss_fn).backward()
    return step


def measure_peak_bytes(loaded: Loaded, analysis: Analysis, plan: Plan | None, compiled: bool = False) -> int:
    """Peak live bytes of one real training step under the plan (None: without one); `compiled`:
    the rewritten model compiled afresh, its second step metered at the allocator."""
    if compiled:
        return CompiledReplay(loaded.model, analysis, loaded.loss_fn, {})(plan.regions if plan else ())
    step = _step_fn(loaded, _forward_fn(loaded, analysis, plan))
    with preserved(loaded.model):
        return peak_memory(step, loaded.model, *loaded.args, *loaded.kwargs.values(), device=_device(loaded))


def _best_times_s(fns: list[Callable], device: torch.device, repeats: int = 5) -> list[float]:
    """Best wall time of each function, after one warm-up each; run interleaved so drift hits all alike."""
    return [min(ts) for ts in interleaved_times(fns, device, rounds=repeats, warmup=1)]


def measure_extra_pct(loaded: Loaded, analysis: Analysis, plan: Plan) -> float:
    """Real extra step time under the plan, as % of the real forward: the unit of Plan.extra_compute_pct."""
    forward = _forward_fn(loaded, analysis, None)
    fns = [_step_fn(loaded, forward), _step_fn(loaded, _forward_fn(loaded, analysis, plan)), forward]
    with preserved(loaded.model):
        base_s, planned_s, forward_s = _best_times_s(fns, _device(loaded))
    return 100.0 * (planned_s - base_s) / forward_s


def time_plan(loaded: Loaded, analysis: Analysis, plan: Plan) -> StepTiming:
    """The plan's real step against the unplanned step on the example inputs, timed in
    interleaved rounds (runtime.measure.timing), beside the plan's own estimate, with each
    region's recompute timed in backward."""
    device = _device(loaded)
    gm = rewrite_plan(loaded.model, analysis.traced.gm, plan)
    fns = [_step_fn(loaded, _forward_fn(loaded, analysis, None)), _step_fn(loaded, lambda: gm(**analysis.example_inputs))]
    with preserved(loaded.model), RecomputeTimes(gm, device) as regions:
        timing = step_timing(*fns, plan.recompute_s, plan.cost_model, device)
    return replace(timing, region_recompute_s=regions.fastest())
