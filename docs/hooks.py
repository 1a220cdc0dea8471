"""mkdocs hooks of the docs site (mkdocs.yml's `hooks`; not a page: its `exclude_docs`).

The API reference documents the package as users import it (`::: remat.plan_and_wrap`), so
mkdocstrings' griffe looks the package `remat` up on sys.path. Run as the `mkdocs` console
script, sys.path starts with the scripts' folder, and that folder holds remat's own console
script, a file named `remat`: griffe would take it for the package (an empty namespace package)
and find none of its names. Such a folder holds no modules; without it griffe finds no `remat`
folder (the repository root is the package, installed under another name), imports `remat`
and reads the rest of the package (`remat.planner`, `remat.runtime`) from its source.
"""
import os
import sys

from mkdocs.plugins import event_priority


@event_priority(100)         # before mkdocstrings' own on_config, which reads sys.path
def on_config(config):
    """sys.path without the folders where `remat` is a file (a console script)."""
    sys.path[:] = [p for p in sys.path if not os.path.isfile(os.path.join(p or os.curdir, "remat"))]
    return config
