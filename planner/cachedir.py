"""Where remat keeps what it remembers between runs, and the switches that turn it off (no torch).

One directory: `REMAT_CACHE_DIR`, else `$XDG_CACHE_HOME/remat`, else `~/.cache/remat`. It holds the
plan cache (runtime/plan_cache.py), the measured op timings (planner/profile/costs.py) and the solved
ILPs (planner/solve/cbc.py, under `solves/`). `REMAT_CACHE=0` turns every store off; `REMAT_SOLVE_CACHE`
(0 or 1) decides for the solved ILPs alone, and `REMAT_SOLVE_CACHE_DIR` moves them.
"""
from __future__ import annotations

import os
from pathlib import Path

_OFF = ("0", "off", "false", "no", "")


def root() -> Path:
    if os.environ.get("REMAT_CACHE_DIR"):
        return Path(os.environ["REMAT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "remat"


def on(variable: str = "REMAT_CACHE") -> bool:
    """Whether the store `variable` switches is on: `variable` if set, else REMAT_CACHE (default on)."""
    value = os.environ.get(variable)
    if value is None and variable != "REMAT_CACHE":
        value = os.environ.get("REMAT_CACHE")
    return (value if value is not None else "1").strip().lower() not in _OFF


def solves() -> Path | None:
    """The solved ILPs' directory, or None when that store is off."""
    if not on("REMAT_SOLVE_CACHE"):
        return None
    return Path(os.environ["REMAT_SOLVE_CACHE_DIR"]) if os.environ.get("REMAT_SOLVE_CACHE_DIR") else root() / "solves"
