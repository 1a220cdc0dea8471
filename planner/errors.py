"""The planner's errors: typed, carrying their numbers, with the next step in the message."""
from __future__ import annotations


def gb(n_bytes: int) -> str:
    """Bytes as GB (10^9) with four significant digits: '0.01734 GB', '13.69 GB'."""
    return f"{n_bytes / 1e9:.4g} GB"


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class InfeasibleBudgetError(RematError):
    """No plan fits the budget; `min_feasible_bytes` is the smallest budget that does."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = int(min_feasible_bytes)
        super().__init__(
            f"budget {gb(budget_bytes)} is below the smallest feasible peak {gb(min_feasible_bytes)} "
            f"for this model and input; raise the budget to at least {gb(min_feasible_bytes)}, "
            f"or shrink the batch/sequence"
        )


class TraceError(RematError):
    """The model could not be captured as a graph, even with opaque submodules."""

    def __init__(self, where: str, cause: str):
        self.where = where
        self.cause = cause
        super().__init__(f"cannot trace {where}: {cause}")


class SolverError(RematError):
    """The ILP solver failed without a usable plan."""

    def __init__(self, status: str, detail: str = ""):
        self.status = status
        super().__init__(f"ILP solver returned status {status!r}. {detail}".strip())


class UnsafePlanError(RematError):
    """A plan asks for something the runtime cannot do correctly (not one the planner makes)."""
