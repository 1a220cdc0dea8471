"""Memory budgets as people write them: parse '24GB', '500MiB', '40%', '20%..100%' and '25%',
and print byte counts back in decimal units. GB = 10^9 bytes, GiB = 2^30.
"""
from __future__ import annotations

import math
import re

_UNITS = {"gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "b": 1}


class UsageError(Exception):
    """Bad command-line input: exit code 2, one line, no traceback."""


def size_text(n_bytes: float) -> str:
    """Bytes in decimal units, three or four significant digits: '17.98 MB', '24.00 GB'."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n_bytes) >= scale:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes:.0f} B"


def parse_budget(text: str) -> tuple[str, float]:
    """'24GB' -> ('bytes', 24e9); '50%' -> ('fraction', 0.5). GB = 10^9 bytes, GiB = 2^30."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(%|[a-zA-Z]*)\s*", text)
    if not m:
        raise UsageError(f"budget {text!r} is not a size: use e.g. 24GB, 8GiB, 500MB or 50%")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not 0 < value < math.inf:
        raise UsageError(f"budget {text!r} must be positive and finite")
    if unit == "%":
        return "fraction", value / 100
    if not unit:
        raise UsageError(f"budget {text!r} has no unit: use GB, GiB, MB, MiB or %")
    if unit not in _UNITS:
        raise UsageError(f"budget unit {m.group(2)!r} unknown: use GB, GiB, MB, MiB or %")
    return "bytes", value * _UNITS[unit]


def parse_budget_range(text: str) -> tuple[tuple[str, float], tuple[str, float]]:
    """'20%..100%' -> the two ends, each as parse_budget gives it."""
    ends = text.split("..")
    if len(ends) != 2:
        raise UsageError(f"--budgets {text!r}: use LOW..HIGH, e.g. 20%..100% or 8GB..24GB")
    lo, hi = parse_budget(ends[0]), parse_budget(ends[1])
    if lo[0] == hi[0] and lo[1] >= hi[1]:
        raise UsageError(f"--budgets {text!r}: the low end must come first and be below the high end")
    return lo, hi


def parse_percent(text: str, flag: str) -> float:
    """'25%' or '25' -> 25.0."""
    m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*%?\s*", text)
    if not m:
        raise UsageError(f"{flag} {text!r}: use a percentage like 25%")
    value = float(m.group(1))
    if value < 0:
        raise UsageError(f"{flag} {text!r} must not be negative")
    return value


def to_bytes(budget: tuple[str, float], unplanned_bytes: int) -> int:
    kind, value = budget
    return int(value * unplanned_bytes) if kind == "fraction" else int(value)
