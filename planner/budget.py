"""Memory budgets as people write them, one parser for the library and the CLI (pure, no torch).

A budget is a number of GB (10^9 bytes), or a string: '24GB', '8GiB', '500MB', '40%' (of the
unplanned peak: resolved once the step is profiled), or a range '20%..100%' (the CLI's sweep).
GB = 10^9 bytes, GiB = 2^30. Sizes print back in the unit the user wrote (`size_text`), rounded
up where the number is a floor to follow (`round_up=True`): a floor printed lower than it is
would fail when typed back in.
"""
from __future__ import annotations

import math
import numbers
import re
from typing import NamedTuple

from remat.planner.errors import BudgetError
from remat.planner.units import SPELLING, UNITS, size_text

_NUMBER = r"[-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?"


class Budget(NamedTuple):
    kind: str          # "bytes" or "fraction" (of the unplanned peak)
    value: float       # bytes, or a fraction (0.5 for '50%')
    unit: str | None = None   # the unit it was written in, sizes print back in it (None: as suits)

    def bytes_of(self, unplanned_bytes: int | None = None) -> int:
        """The budget in bytes; a fraction needs the step's unplanned peak."""
        if self.kind == "bytes":
            return int(self.value)
        if unplanned_bytes is None:
            raise BudgetError(f"budget {self.value:.0%} is a fraction of the unplanned peak, which is "
                              "known only once the step is profiled")
        return int(self.value * unplanned_bytes)

    def text(self, unplanned_bytes: int | None = None) -> str:
        if self.kind == "fraction":
            return f"{self.value * 100:g}% of the unplanned peak" + (
                f" ({size_text(self.bytes_of(unplanned_bytes), self.unit)})" if unplanned_bytes else "")
        return size_text(self.value, self.unit)


def parse_budget(text: str) -> Budget:
    """'24GB' -> Budget('bytes', 24e9, 'GB'); '50%' -> Budget('fraction', 0.5)."""
    m = re.fullmatch(rf"\s*({_NUMBER})\s*(%|[a-zA-Z]*)\s*", str(text))
    if not m:
        raise BudgetError(f"budget {text!r} is not a size: use e.g. 24GB, 8GiB, 500MB or 50%")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not 0 < value < math.inf:
        raise BudgetError(f"budget {text!r} must be positive and finite")
    if unit == "%":
        return Budget("fraction", value / 100)
    if not unit:
        raise BudgetError(f"budget {text!r} has no unit: use GB, GiB, MB, MiB or %")
    if unit not in UNITS:
        raise BudgetError(f"budget unit {m.group(2)!r} unknown: use GB, GiB, MB, MiB or %")
    return Budget("bytes", value * UNITS[unit], SPELLING[unit])


def as_budget(budget) -> Budget:
    """A budget as the library takes it: a number of GB, a string (parse_budget) or a Budget."""
    if isinstance(budget, Budget):
        return budget
    if isinstance(budget, str):
        return parse_budget(budget)
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise BudgetError(f"budget must be a number of GB or a string like '24GB' or '40%', got {budget!r}")
    if math.isnan(budget) or math.isinf(budget) or budget <= 0:
        raise BudgetError(f"budget must be a positive, finite number of GB, got {budget!r}")
    return Budget("bytes", float(round(budget * UNITS["gb"])), "GB")


def budget_to_bytes(budget, unplanned_bytes: int | None = None) -> int:
    """A budget (as_budget's forms) in bytes; '40%' needs the unplanned peak."""
    return as_budget(budget).bytes_of(unplanned_bytes)


def parse_budget_range(text: str) -> tuple[Budget, Budget]:
    """'20%..100%' -> the two ends, each as parse_budget gives it."""
    ends = text.split("..")
    if len(ends) != 2:
        raise BudgetError(f"--budgets {text!r}: use LOW..HIGH, e.g. 20%..100% or 8GB..24GB")
    lo, hi = parse_budget(ends[0]), parse_budget(ends[1])
    if lo.kind == hi.kind and lo.value >= hi.value:
        raise BudgetError(f"--budgets {text!r}: the low end must come first and be below the high end")
    return lo, hi


def parse_percent(text: str, flag: str) -> float:
    """'25%' or '25' -> 25.0."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*%?\s*", text)
    if not m:
        raise BudgetError(f"{flag} {text!r}: use a percentage like 25%")
    value = float(m.group(1))
    if value < 0:
        raise BudgetError(f"{flag} {text!r} must not be negative")
    return value


def to_bytes(budget: Budget, unplanned_bytes: int) -> int:
    return Budget(*budget).bytes_of(unplanned_bytes)
