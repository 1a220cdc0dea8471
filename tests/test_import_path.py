"""One import path (issue 43, item 1): the planner and the runtime load only as `remat.planner` and
`remat.runtime`. With the repository root on sys.path (as `python -m pytest` and scripts arrange),
`import planner` used to load a second copy, whose errors the first did not catch."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["planner", "runtime", "planner.errors", "runtime.api"])
def test_the_packages_load_only_under_remat(name):
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {name}"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode != 0
    assert f"import remat.{name.split('.')[0]}" in r.stderr.strip().splitlines()[-1], r.stderr


def test_one_class_for_one_error():
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
            "import remat\nfrom remat.planner.errors import InfeasibleBudgetError\n"
            "assert remat.InfeasibleBudgetError is InfeasibleBudgetError\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('planner', 'runtime')]\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
