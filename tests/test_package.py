"""The package as a user installs it (issue 24): one import name, `remat`.

The wheel and the sdist are built from this checkout; the wheel holds the package `remat` (its
`planner` and `runtime` subpackages) and nothing else at the top level; the sdist holds what its
tests import (benchmarks/, docs/); the wheel installed into a fresh virtual environment imports,
runs the `remat` command and the README's example. torch, pulp and networkx come from this
environment (a path entry, not an install: seconds, not minutes); the wheel is installed with
--no-deps, so its own metadata is checked separately.
"""
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(*cmd, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and the sdist, built from a copy of the checkout (a build in the checkout would
    leave build/ there, whose stale files a later wheel would pack)."""
    out, src = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("src") / "remat"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "site", ".pytest_cache"))
    build = ("import sys; from setuptools import build_meta as b; "
             "out = sys.argv[1]; b.build_wheel(out); b.build_sdist(out)")   # build_meta rewrites sys.argv
    _run(sys.executable, "-c", build, out, cwd=src)
    return out


def test_the_wheel_holds_one_package(dist):
    (wheel,) = dist.glob("remat-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"remat", next(t for t in tops if t.endswith(".dist-info"))}, sorted(tops)
    for must in ("remat/__init__.py", "remat/__main__.py", "remat/planner/solve/ilp.py", "remat/runtime/api.py",
                 "remat/runtime/cli/main.py", "remat/runtime/rewrite/__init__.py", "remat/runtime/measure/__init__.py"):
        assert must in names, must
    assert not [n for n in names if n.startswith(("remat/tests", "remat/benchmarks", "remat/docs"))]
    sources = {f"remat/{p.relative_to(ROOT).as_posix()}" for d in ("planner", "runtime") for p in (ROOT / d).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert sources <= set(names), f"not in the wheel (pyproject's packages): {sorted(sources - set(names))}"
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert re.search(r"^Requires-Dist: torch>=", meta, re.M) and "License-Expression: BSD-3-Clause" in meta
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "remat = remat.runtime.cli:main" in entry


def test_the_sdist_holds_what_its_tests_import(dist):
    (sdist,) = dist.glob("remat-*.tar.gz")
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for must in ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "mkdocs.yml", "__init__.py",
                 "planner/solve/ilp.py", "runtime/api.py", "tests/conftest.py", "tests/helpers.py", "tests/test_package.py",
                 "benchmarks/zoo_models.py", "benchmarks/docs.py", "docs/index.md", "docs/cli.md", ".ci/run"):
        assert must in names, must


def test_the_wheel_installs_and_runs_in_a_fresh_environment(dist, tmp_path):
    (wheel,) = dist.glob("remat-*.whl")
    env_dir = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", env_dir)
    bindir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    python = bindir / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    # torch, pulp and networkx from this environment: path entries (.pth files there, such as a
    # development checkout's editable finder, are not processed from them)
    import networkx, pulp, torch
    (site / "deps.pth").write_text("".join(sorted({str(Path(m.__file__).parents[1]) + "\n" for m in (torch, pulp, networkx)})))
    _run(python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel)
    assert {"planner", "runtime"}.isdisjoint(p.name for p in site.iterdir()), sorted(p.name for p in site.iterdir())
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"REMAT_CACHE": "0"}
    r = _run(python, "-c", "import remat, remat.planner, remat.runtime; print(remat.__file__); "
             "from remat import plan_and_wrap, plan, apply, assert_fits, PlanOptions, Plan, InfeasibleBudgetError",
             cwd=work, env=env)
    assert Path(r.stdout.strip()).is_relative_to(site), r.stdout
    r = _run(bindir / "remat", "check", "mlp", "--budget", "60%", "--quiet", cwd=work, env=env)
    assert r.stdout.startswith("OK"), r.stdout
    assert _run(python, "-m", "remat", "--help", cwd=work, env=env).stdout.startswith("usage: remat")
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"^<!-- remat-python-example -->\n```python\n(.*?)^```", readme, re.M | re.S)[1]
    (work / "example.py").write_text(code)
    assert "predicted peak" in _run(python, "example.py", cwd=work, env=env).stdout
