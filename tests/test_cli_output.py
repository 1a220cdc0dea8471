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

# the CLI entered as the `remat` script and `python -m runtime` enter it, except that the `runtime`
# package's __init__ is not run: what runtime/cli/main.py does before torch is imported
_MAIN_ONLY = """
import sys, types
pkg = types.ModuleType("runtime")
pkg.__path__ = [sys.argv[1]]
sys.modules["runtime"] = pkg
from runtime.cli.main import main
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


def run(*argv, path=(), code: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "PYTHONWARNINGS")}
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in path] + [str(ROOT)])
    cmd = [sys.executable] + (["-c", code] if code is not None else ["-m", "runtime"]) + [str(a) for a in argv]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_no_numpy_warning_from_the_cli_module(no_numpy):
    """Without numpy, `import torch` warns 'Failed to initialize NumPy'; main.py filters it before
    its imports bring torch in."""
    bare = run(path=[no_numpy], code="import torch")
    assert "Failed to initialize NumPy" in bare.stderr, "the fake missing numpy no longer reproduces the warning"
    r = run(ROOT / "runtime", "report", "mlp", "--budget", "50%", "--quiet", path=[no_numpy], code=_MAIN_ONLY)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("model          built-in mlp")
    assert r.stderr == ""


def test_no_numpy_warning_from_remat(no_numpy):
    r = run("report", "mlp", "--budget", "50%", "--quiet", path=[no_numpy])
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""


def test_wrong_input_shape_is_one_line(factories):
    """A forward that fails under fake tensors: one line, not torch's logged traceback first."""
    r = run("report", f"{factories}:wrong_width", "--budget", "1GB", "--quiet")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"remat: error: cannot profile {factories}:wrong_width: RuntimeError: ")
    assert "[512, 32]" in lines[0]


@pytest.mark.slow
def test_compile_quiet_prints_no_profiler_lines(factories):
    """--compile meters each compiled step with torch's profiler, whose kineto printed
    `USDT: ... profiler_start` / `profiler_stop` lines on stderr at every step."""
    r = run("check", f"{factories}:tiny", "--budget", "100%", "--compile", "--quiet")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("OK: predicted peak")
    assert r.stderr == ""
