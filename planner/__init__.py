"""remat's planner: capture -> profile -> CostGraph -> solve. Never imports runtime/.

By stage, each subpackage's docstring says what it owns:
- `capture/`: the model's step as a graph (trace), what a graph loses (fidelity), the capture
  check (check);
- `step/`: the model of a training step (fake: the step and its fake run; state, storage, rng,
  kernels, optimizer, workspace);
- `profile/`: the graph run on fake tensors into a CostGraph (graph), opaque modules (opaque),
  recompute costs (costs, rates), the module tree's profile (modules);
- `solve/`: pure plans from a CostGraph (simulate, candidates, baselines, ilp, cbc, improve, the
  hierarchical solver: hierarchy, blocks, segment, front, lower, chain; fit: solve_plan).
At the top: the entry points (`api`: analyze, plan), what crosses the seams (`costgraph`,
`result`, `facts`, `options`, `budget`, `units`, `errors`), planning per rank (`distributed`),
and `compat` (every private torch API). The pure core needs no torch: `costgraph`, `solve/`,
`result`, `facts`, `budget`, `units`, `profile.rates`, `options`, `errors`, `distributed`
(tests/test_solver.py imports them in a process where torch cannot be imported). Names are
exported lazily, so importing the core does not import the torch side.
"""
from __future__ import annotations

if __name__ != "remat.planner":      # the repository root on sys.path: a second copy of the package
    raise ImportError(f"remat's planner is `remat.planner`, not {__name__!r}: import remat.planner (the repository "
                      "root is the package `remat`: pip install -e . from it); a second copy would have "
                      "classes of its own (its errors not caught as remat's)")

from remat.planner.lazy import lazy_exports

_EXPORTS = {
    "plan": "api", "analyze": "api", "Analysis": "api",
    "solve_plan": "solve.fit", "PlanOptions": "options", "Measure": "solve.fit",
    "budget_to_bytes": "budget", "parse_budget": "budget", "Budget": "budget",
    "CostGraph": "costgraph", "Plan": "result", "Region": "result", "SolveOptions": "options",
    "DeviceRates": "profile.rates",
    "RematError": "errors", "InfeasibleBudgetError": "errors", "TraceError": "errors", "SolverError": "errors",
    "BudgetError": "errors", "ForwardError": "errors", "PlanMismatchError": "errors", "UnsafePlanError": "errors",
    "LossFnError": "errors", "InputLayoutError": "errors",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
