"""remat's planner: trace -> profile -> CostGraph -> solve -> simulate. Never imports runtime/."""
from .api import Analysis, PlanOptions, analyze, budget_to_bytes, plan, solve_plan
from .costgraph import CostGraph
from .errors import InfeasibleBudgetError, RematError, SolverError, TraceError
from .result import Plan, Region
from .solve import SolveOptions

__all__ = ["plan", "analyze", "solve_plan", "budget_to_bytes", "Analysis", "Plan", "PlanOptions", "Region",
           "CostGraph", "SolveOptions", "RematError", "InfeasibleBudgetError", "TraceError", "SolverError"]
