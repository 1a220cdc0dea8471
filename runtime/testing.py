"""A pytest helper: fail a test when a model's training step does not fit a memory budget.

    from remat import assert_fits

    def test_decoder_fits_24gb():
        model, x, y = make_decoder()
        plan = assert_fits(model, (x,), 24, loss_fn=lambda out: F.cross_entropy(out, y))
        assert plan.extra_compute_pct < 25

It plans the way `remat check` does (fake-tensor profile, ILP, exact replay of the rewritten
step on fake tensors), so it needs no GPU and allocates no activation memory.
"""
from __future__ import annotations

from typing import Callable

import torch

from remat.planner import InfeasibleBudgetError, PlanOptions, SolveOptions, analyze
from remat.planner.solve.fit import unplanned_peak_bytes
from remat.planner.result import Plan
from remat.planner.units import size_text

from .budget import StepBudget
from .steps import Loaded, measure_peak_bytes, solve_budget, split_inputs

def assert_fits(model: torch.nn.Module, inputs, budget_gb, loss_fn: Callable | None = None,
                measure: bool = False, *, time_limit_s: float = SolveOptions.time_limit_s) -> Plan:
    """The Plan that fits one training step of `model(*inputs)` into `budget_gb`: a number of GB
    (10^9 bytes) or a string ('24GB', '8GiB', '40%' of the unplanned peak).

    `inputs` is a tuple (positional), a dict (keyword) or one tensor; `loss_fn(output) -> scalar`
    is optional (without it room is kept for a loss holding one tensor of the output's size).
    With `measure`, one real step also runs under the plan and its measured peak must fit too;
    gradients, buffers and the RNG state are restored afterwards. `time_limit_s` is the ILP's
    wall-clock limit per solve ([`SolveOptions.time_limit_s`][remat.SolveOptions.time_limit_s]).
    Raises AssertionError (one line, with the smallest feasible budget) when it does not fit;
    ValueError or TypeError for bad arguments; the planner's errors when the model cannot be traced.

    It plans the way `remat check` does (fake-tensor profile, ILP, exact replay of the rewritten
    step on fake tensors), so it needs no GPU and allocates no activation memory.

    Examples:
        ```python
        from remat import assert_fits

        def test_decoder_fits_24gb():
            model, x, y = make_decoder()
            plan = assert_fits(model, (x,), 24, loss_fn=lambda out: F.cross_entropy(out, y))
            assert plan.extra_compute_pct < 25
        ```
    """
    budget = StepBudget.of(budget_gb)
    args, kwargs = split_inputs(inputs)
    loaded = Loaded(model, args, kwargs, loss_fn, type(model).__name__)
    analysis = analyze(model, args, kwargs, loss_fn)
    options = PlanOptions(solve=SolveOptions(time_limit_s=time_limit_s))
    budget_bytes = budget.resolve(unplanned_peak_bytes(analysis.cost_graph, options))
    try:
        plan = solve_budget(loaded, analysis, budget_bytes, options)
    except InfeasibleBudgetError as e:
        raise AssertionError(f"{loaded.label} does not fit: {budget.spelled(e)}") from None
    if measure:
        measured_bytes = measure_peak_bytes(loaded, analysis, plan)
        if measured_bytes > budget_bytes:
            raise AssertionError(f"{loaded.label}: measured peak {size_text(measured_bytes)} is over the budget "
                                 f"{budget.size_text(budget_bytes)} (predicted "
                                 f"{budget.size_text(plan.predicted_peak_bytes)})")
    return plan
