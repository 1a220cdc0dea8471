"""Byte sizes in the units people write them in: GB = 10^9 bytes, GiB = 2^30 (pure, no torch)."""
from __future__ import annotations

import math

UNITS = {"gb": 10**9, "gib": 2**30, "mb": 10**6, "mib": 2**20, "kb": 10**3, "kib": 2**10, "b": 1}
_FLOAT_SLACK = 1e-9   # a value that is exact in decimal is not rounded up by its binary error
SPELLING = {"gb": "GB", "gib": "GiB", "mb": "MB", "mib": "MiB", "kb": "kB", "kib": "KiB", "b": "B"}


def size_text(n_bytes: float, unit: str | None = None, round_up: bool = False) -> str:
    """Bytes in `unit` ('GB', 'MiB', ...) with four significant digits (at least two decimals), or
    without a unit in the decimal unit that suits, with two decimals ('17.98 MB', '262.14 kB');
    `round_up`: never below n_bytes when typed back in."""
    auto = unit is None
    if auto:
        unit = next((u for u, s in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)) if abs(n_bytes) >= s), "B")
    scale = UNITS[unit.lower()]
    value = n_bytes / scale
    if unit == "B":
        return f"{math.ceil(value) if round_up else round(value)} B"
    digits = 2 if auto or not value else max(2, 3 - math.floor(math.log10(abs(value))))
    if round_up:
        value = math.ceil(value * 10**digits - _FLOAT_SLACK) / 10**digits
    return f"{value:.{digits}f} {unit}"
