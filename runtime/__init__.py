"""remat's runtime: a Plan applied to the user's model, and the user's entry points.

Names are exported lazily (as in planner/__init__): `remat` (runtime.cli) sets up its warning
filters before torch is imported.
"""
from __future__ import annotations

if __name__ != "remat.runtime":      # the repository root on sys.path: a second copy of the package
    raise ImportError(f"remat's runtime is `remat.runtime`, not {__name__!r}: import remat.runtime (the repository "
                      "root is the package `remat`: pip install -e . from it); a second copy would have "
                      "classes of its own (its errors not caught as remat's)")

from remat.planner.lazy import lazy_exports

_EXPORTS = {"plan_and_wrap": "api", "apply": "api", "remove": "api", "Remat": "api", "peak_memory": "measure",
            "rewrite": "rewrite", "CheckpointRegion": "rewrite", "assert_fits": "testing"}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
