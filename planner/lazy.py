"""Names a package exports lazily (remat, remat.planner, remat.runtime): importing the package
imports none of its modules, so the torch-free core stays torch-free and the CLI sets up its
warning filters before torch is imported."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, namespace: dict, exports: dict[str, str]):
    """(__getattr__, __dir__) for `package`: `exports` maps each name to the submodule (relative
    to `package`) it is imported from, on first use, then kept in `namespace`."""
    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{exports[name]}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))
    return __getattr__, __dir__
