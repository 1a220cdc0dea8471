"""remat's planner: trace -> profile -> CostGraph -> solve -> simulate. Never imports runtime/.

The pure core needs no torch: `costgraph`, `simulate` (the one liveness kernel), `candidates`,
`baselines`, `improve`, `solve`, `fit` (solve_plan), `result`, `budget`, `units`, `rates`,
`errors` (tests/test_solver.py imports them in a process where torch cannot be imported). The
torch side captures and profiles a model: `trace`, `profile`, `opaque`, `modules`, `step`, `storage`,
`state`, `rng`, and `api` (analyze, plan). Names are exported lazily, so importing the core
does not import the torch side.
"""
from __future__ import annotations

if __name__ != "remat.planner":      # the repository root on sys.path: a second copy of the package
    raise ImportError(f"remat's planner is `remat.planner`, not {__name__!r}: import remat.planner (the repository "
                      "root is the package `remat`: pip install -e . from it); a second copy would have "
                      "classes of its own (its errors not caught as remat's)")

from .lazy import lazy_exports

_EXPORTS = {
    "plan": "api", "analyze": "api", "Analysis": "api",
    "solve_plan": "fit", "PlanOptions": "options", "Measure": "fit",
    "budget_to_bytes": "budget", "parse_budget": "budget", "Budget": "budget",
    "CostGraph": "costgraph", "Plan": "result", "Region": "result", "SolveOptions": "options",
    "DeviceRates": "rates",
    "RematError": "errors", "InfeasibleBudgetError": "errors", "TraceError": "errors", "SolverError": "errors",
    "BudgetError": "errors", "ForwardError": "errors", "PlanMismatchError": "errors", "UnsafePlanError": "errors",
    "LossFnError": "errors", "InputLayoutError": "errors",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
