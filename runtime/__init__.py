"""remat's runtime: a Plan applied to the user's model, and the user's entry points.

Names are exported lazily (as in planner/__init__): `remat` (runtime.cli) sets up its warning
filters before torch is imported.
"""
from __future__ import annotations

from remat.planner.lazy import lazy_exports

_EXPORTS = {"plan_and_wrap": "api", "apply": "api", "remove": "api", "Remat": "api", "peak_memory": "measure",
            "rewrite": "rewrite", "CheckpointRegion": "rewrite", "assert_fits": "testing"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
