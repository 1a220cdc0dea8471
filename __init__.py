"""remat: fit a PyTorch training step into a memory budget, at the least recompute.

    from remat import plan_and_wrap
    model = plan_and_wrap(model, budget_gb=24, example_inputs=(x,), loss_fn=loss_fn)

Installed, the project is this one package: `remat.planner` (capture, cost graph, ILP; its core
needs no torch: tests/test_solver.py's import contract) and `remat.runtime` (the rewrite, the
measures, the CLI), built from the repository's `planner/` and `runtime/` folders
(pyproject.toml's package-dir: the repository root is the package). Names are exported lazily,
so `import remat` imports neither torch nor the solver until a name is used.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

# absolute: pytest imports this file as a package named after the checkout's folder (its rootdir
# holds an __init__.py), and a relative import would load planner/ a second time under that name
from remat.planner.lazy import lazy_exports

if TYPE_CHECKING:   # the exports where they are defined, for type checkers and the API reference's griffe
    from .planner.api import analyze, plan
    from .planner.budget import parse_budget
    from .planner.costgraph import CostGraph
    from .planner.errors import (BudgetError, ForwardError, InfeasibleBudgetError, InputLayoutError, LossFnError,
                                 PlanMismatchError, RematError, SolverError, TraceError, UnsafePlanError)
    from .planner.options import PlanOptions, SolveOptions
    from .planner.result import Plan, Region
    from .runtime.api import Remat, apply, plan_and_wrap, remove
    from .runtime.measure.peak import peak_memory
    from .runtime.testing import assert_fits

__version__ = "0.1.0"

_EXPORTS = {
    **dict.fromkeys(("plan_and_wrap", "apply", "remove", "Remat", "peak_memory", "assert_fits"), "runtime"),
    **dict.fromkeys(("plan", "analyze", "PlanOptions", "SolveOptions", "Plan", "Region", "CostGraph",
                     "parse_budget", "RematError", "InfeasibleBudgetError", "TraceError", "SolverError",
                     "BudgetError", "ForwardError", "LossFnError", "InputLayoutError", "PlanMismatchError",
                     "UnsafePlanError"), "planner"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
