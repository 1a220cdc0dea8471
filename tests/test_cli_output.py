"""What `remat` prints besides its results: nothing. Each case printed noise into the terminal
before its fix; run as a user runs the CLI (subprocesses)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FACTORIES = '''
import torch
from torch import nn


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4)), (torch.randn(64, 32),)


def wrong_width():
    """The first Linear takes 64 features, the inputs have 32."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 4))
    return model, (torch.randn(512, 32),)
'''

# the CLI entered as the `remat` script and `python -m remat` enter it: main.py imported straight
# (the `remat` and `remat.runtime` packages' __init__s import nothing: their names are lazy), so
# what runtime/cli/main.py does before torch is imported is all that runs first
_MAIN_ONLY = """
import sys
from remat.runtime.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

@pytest.fixture(scope="module")
def factories(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("factories") / "factories.py"
    path.write_text(FACTORIES)
    return path


@pytest.fixture(scope="module")
def no_numpy(tmp_path_factory) -> Path:
    """A folder that, first on PYTHONPATH, makes `import numpy` fail as on the minimal install."""
    folder = tmp_path_factory.mktemp("no_numpy")
    (folder / "numpy").mkdir()
    (folder / "numpy" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    return folder


def start(*argv, path=(), code: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in path] + [str(ROOT)])
    cmd = [sys.executable] + (["-c", code] if code is not None else ["-m", "remat"]) + [str(a) for a in argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run(*argv, path=(), code: str | None = None) -> subprocess.CompletedProcess:
    return finish(start(*argv, path=path, code=code))


@pytest.fixture(scope="module")
def quick_runs(no_numpy, factories):
    """The quick lane's commands, run at once (each pays for importing torch), each as its test ran it."""
    procs = {"bare torch": start(path=[no_numpy], code="import torch"),
             "main only": start(ROOT / "runtime", "report", "mlp", "--budget", "1GB", "--quiet", path=[no_numpy],
                                code=_MAIN_ONLY),
             "remat": start("report", "mlp", "--budget", "1GB", "--quiet", path=[no_numpy]),
             "wrong width": start("report", f"{factories}:wrong_width", "--budget", "1GB", "--quiet")}
    return {name: finish(p) for name, p in procs.items()}


def test_no_numpy_warning_from_the_cli_module(quick_runs):
    """Without numpy, `import torch` warns 'Failed to initialize NumPy'; main.py filters it before
    its imports bring torch in."""
    bare = quick_runs["bare torch"]
    assert "Failed to initialize NumPy" in bare.stderr, "the fake missing numpy no longer reproduces the warning"
    r = quick_runs["main only"]
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("model          built-in mlp")
    assert r.stderr == ""


def test_no_numpy_warning_from_remat(quick_runs):
    r = quick_runs["remat"]
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""


def test_wrong_input_shape_is_one_line(factories, quick_runs):
    """A forward that fails under fake tensors: one line, not torch's logged traceback first."""
    r = quick_runs["wrong width"]
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"remat: error: cannot profile {factories}:wrong_width: RuntimeError: ")
    assert "[512, 32]" in lines[0]


@pytest.mark.slow
def test_compile_quiet_prints_no_profiler_lines(factories):
    """--compile --quiet prints nothing on stderr: not kineto's `USDT: ... profiler_start` lines (its
    steps were metered with torch's profiler), nor the FutureWarning torch's pytree gave when Dynamo
    deep-copied Inductor's config holding the joint-graph partitioner (now copied as itself), nor
    anything from the check's code generation (NOTE [ the compiled check ])."""
    r = run("check", f"{factories}:tiny", "--budget", "100%", "--compile", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK: predicted peak")
    assert r.stderr == ""
