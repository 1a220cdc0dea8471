"""remat's runtime: a Plan applied to the user's model, and the user's entry points.

Names are exported lazily (as in planner/__init__): `remat` (runtime.cli) sets up its warning
filters before torch is imported.
"""
from __future__ import annotations

import importlib

_EXPORTS = {"plan_and_wrap": "api", "apply": "api", "remove": "api", "Remat": "api", "peak_memory": "measure",
            "rewrite": "rewrite", "CheckpointRegion": "rewrite", "assert_fits": "testing"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'remat.runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
