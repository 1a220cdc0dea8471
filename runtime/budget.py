"""The user's budget on the runtime side, in one place: resolved to bytes once, and the planner's
InfeasibleBudgetError said back in the unit the user wrote it in.

`plan_and_wrap`, `apply`, `assert_fits`, the CLI and the data-parallel planning all hold a
`StepBudget`; none converts a budget or an error itself.

Examples:
    >>> b = StepBudget.of("40%")
    >>> b.resolve(1000), b.resolve(2000), b.budget
    (400, 400, Budget(kind='bytes', value=400.0, unit=None))
"""
from __future__ import annotations

import contextlib

from remat.planner.budget import Budget, as_budget
from remat.planner.errors import InfeasibleBudgetError
from remat.planner.units import size_text


class StepBudget:
    """A budget as the user wrote it (`asked`: a number of GB, '24GB', '8GiB', '40%' or a
    planner Budget), and its bytes once resolved: a '%' budget at the first unplanned peak it is
    given, fixed from then on (a run's later plans share it)."""

    def __init__(self, asked: Budget):
        self.asked = asked
        """The budget as written (its unit: the one sizes and errors print in)."""
        self.bytes: int | None = asked.bytes_of() if asked.kind == "bytes" else None
        """The budget in bytes; None until a '%' budget is resolved."""

    @classmethod
    def of(cls, budget) -> "StepBudget":
        """A StepBudget of any form `planner.budget.as_budget` takes (BudgetError otherwise)."""
        return budget if isinstance(budget, StepBudget) else cls(as_budget(budget))

    @property
    def budget(self) -> Budget:
        """The budget as `Remat.budget` shows it: as written, a '%' one as bytes once resolved."""
        if self.asked.kind == "bytes" or self.bytes is None:
            return self.asked
        return Budget("bytes", float(self.bytes), self.asked.unit)

    @property
    def unit(self) -> str | None:
        """The unit the budget was written in (None: a '%' budget, sizes print in the unit that suits)."""
        return self.asked.unit

    def resolve(self, unplanned_bytes: int | None = None) -> int:
        """The budget in bytes; a '%' budget is resolved by the first unplanned peak given."""
        if self.bytes is None:
            self.bytes = self.asked.bytes_of(unplanned_bytes)
        return self.bytes

    def size_text(self, n_bytes: float) -> str:
        """`n_bytes` in the budget's unit."""
        return size_text(n_bytes, self.asked.unit)

    def spelled(self, e: InfeasibleBudgetError) -> InfeasibleBudgetError:
        """`e` with its sizes (budget and smallest feasible, both kept in bytes) in the budget's unit,
        and a '%' budget as written beside its bytes."""
        return e.in_unit(self.asked.unit, f"{self.asked.value * 100:g}%" if self.asked.kind == "fraction" else "")

    @contextlib.contextmanager
    def errors_spelled(self):
        """An InfeasibleBudgetError raised inside comes out `spelled`."""
        try:
            yield
        except InfeasibleBudgetError as e:
            raise self.spelled(e) from None
