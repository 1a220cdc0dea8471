"""The planner's errors: typed, carrying their numbers, with the next step in the message."""
from __future__ import annotations


class RematError(Exception):
    """Base class of every error remat raises on purpose."""


class InfeasibleBudgetError(RematError):
    """No plan fits the budget; `min_feasible_bytes` is the smallest budget that does."""

    def __init__(self, budget_bytes: int, min_feasible_bytes: int):
        self.budget_bytes = int(budget_bytes)
        self.min_feasible_bytes = int(min_feasible_bytes)
        super().__init__(
            f"budget {budget_bytes / 1e9:.3f} GB is below the smallest feasible peak "
            f"{min_feasible_bytes / 1e9:.3f} GB for this model and input; raise the budget to at "
            f"least {min_feasible_bytes / 1e9:.3f} GB, or shrink the batch/sequence"
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
