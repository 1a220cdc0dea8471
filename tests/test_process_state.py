"""`remat`'s entry points called in a process (a test, a notebook, a training script) leave it as
they found it: loggers, the environment, torch's global settings and RNG, the attention-kernel
override (planner.step.kernels), warning filters, the garbage collector (NOTE [ solving without the
cyclic GC ]), matplotlib's backend. A snapshot is taken before and
after each call and compared field by field.
"""
from __future__ import annotations

import gc
import logging
import os
import random
import sys
import warnings

import pytest
import torch

import remat.planner.step.kernels as kernels
from remat.planner import PlanOptions, SolveOptions
from remat.runtime import examples, plan_and_wrap
from remat.runtime.cli import plots
from remat.runtime.cli.main import main
from remat.runtime.measure import allocator_peak


@pytest.fixture(scope="module", autouse=True)
def torch_warmed():
    """NOTE [ torch's first time ]: some of what a first call changes is torch's, once a process:
    the first fake-tensor step imports torch._dynamo, whose import sets TORCHINDUCTOR_CACHE_DIR
    and registers torch's artifact loggers, and torch.export's first structured log removes its
    lazy trace handler from the `torch.__trace` logger (no TORCH_TRACE set). One export of a
    Linear does all of it before any snapshot, so a snapshot sees only what remat changes. The
    `remat` logger is made here too, so that every test compares it with what it was."""
    logging.getLogger("remat")
    with torch.random.fork_rng(devices=[]):
        torch.export.export(torch.nn.Linear(2, 2), (torch.zeros(1, 2),))


QUICK = PlanOptions(solve=SolveOptions(time_limit_s=2.0))
SDPA = "aten::scaled_dot_product_attention"


def _loggers() -> dict[str, tuple]:
    """The root logger and every `remat*` / `torch*` logger: handlers, level, propagate, disabled,
    filters. pytest's capture handlers are left out: pytest adds them to the root and to every
    non-propagating logger as each phase of a test starts, and takes them off as it ends."""
    named = {n: lg for n, lg in logging.root.manager.loggerDict.items()
             if isinstance(lg, logging.Logger) and n.split(".")[0] in ("remat", "torch")}
    return {n: (tuple(h for h in lg.handlers if not type(h).__module__.startswith("_pytest")),
                lg.level, lg.propagate, lg.disabled, tuple(lg.filters))
            for n, lg in {"": logging.root, **named}.items()}


def _torch_state() -> dict:
    cuda = torch.backends.cuda
    return {"threads": torch.get_num_threads(), "interop threads": torch.get_num_interop_threads(),
            "grad mode": torch.is_grad_enabled(), "inference mode": torch.is_inference_mode_enabled(),
            "default dtype": torch.get_default_dtype(), "default device": torch.get_default_device(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "matmul precision": torch.get_float32_matmul_precision(), "anomaly": torch.is_anomaly_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"), "mkldnn": torch.backends.mkldnn.enabled,
            "sdpa backends": (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()),
            "rng": torch.get_rng_state().tolist(),
            "modes": (len(torch.utils._python_dispatch._get_current_dispatch_mode_stack()),
                      len(torch.overrides._get_current_function_mode_stack())),
            "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
            "module hooks": {h: len(getattr(torch.nn.modules.module, h)) for h in dir(torch.nn.modules.module)
                             if h.startswith("_global_") and h.endswith("hooks")}}


def _python_state() -> dict:
    np = sys.modules.get("numpy")
    environ = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}     # pytest's, each phase
    return {"environ": environ, "warning filters": list(warnings.filters),
            "logging disabled": logging.root.manager.disable, "random": random.getstate(),
            "numpy random": repr(np.random.get_state()) if np else None, "cwd": os.getcwd(),
            "streams": (sys.stdout, sys.stderr), "sys.path": list(sys.path),
            "recursion limit": sys.getrecursionlimit(), "gc": (gc.isenabled(), gc.get_threshold())}


def _remat_state() -> dict:
    mpl = sys.modules.get("matplotlib")
    plt = sys.modules.get("matplotlib.pyplot")
    return {"kernels": (kernels._active, kernels._library),
            "sdpa meta kernel": torch._C._dispatch_has_kernel_for_dispatch_key(SDPA, "AutogradMeta"),
            "matplotlib backend": mpl.get_backend() if mpl else None,
            "pyplot figures": plt.get_fignums() if plt else None}


def snapshot() -> dict:
    return {"loggers": _loggers(), **_torch_state(), **_python_state(), **_remat_state()}


def changes(before: dict, after: dict) -> list[str]:
    """What differs, one line each. A logger made during the call is a change only if it is not
    in its default state (no handlers, NOTSET, propagating, enabled, no filters)."""
    out = [f"{k}: {before[k]!r:.200} -> {after[k]!r:.200}" for k in before
           if k not in ("loggers", "environ") and before[k] != after[k]]
    for name in sorted(set(before["environ"]) | set(after["environ"])):
        if before["environ"].get(name) != after["environ"].get(name):
            out.append(f"os.environ[{name!r}]: {before['environ'].get(name)!r} -> {after['environ'].get(name)!r}")
    for name, state in after["loggers"].items():
        old = before["loggers"].get(name)
        if (old or ((), logging.NOTSET, True, False, ())) != state:
            out.append(f"logger {name!r} (handlers, level, propagate, disabled, filters): {old} -> {state}")
    return out


@pytest.fixture
def unchanged():
    """Asserts at the end of the test that the process is as the test found it."""
    before = snapshot()
    yield
    assert changes(before, snapshot()) == []


CLI = {"check": (["check", "mlp", "--budget", "60%", "--time-limit", "2"], 0),
       "report quiet": (["report", "mlp", "--budget", "50%", "--quiet", "--time-limit", "2"], 0),
       "unknown model": (["report", "gpt5", "--budget", "1GB"], 2),
       "bad budget": (["check", "mlp", "--budget", "lots"], 2)}


@pytest.mark.parametrize("name", sorted(CLI))
def test_cli_leaves_the_process_as_it_was(unchanged, capsys, name):
    argv, code = CLI[name]
    assert main(argv) == code
    out, err = capsys.readouterr()
    assert ("OK: predicted peak" in out or "smallest feasible" in out) if code == 0 else "remat: error:" in err


MODELS = '''
import sys
import torch


class Exits(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        sys.exit(3)


def make():
    return Exits(), torch.randn(4, 8)


def make_exits():
    sys.exit(4)


class Lenny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * len(x)     # fx cannot trace len(): captured by torch.export


def make_len():
    return Lenny(), torch.randn(4, 8)
'''


@pytest.mark.parametrize("factory, code", [("make_exits", 4), ("make", 3)])
def test_cli_restores_the_process_when_model_code_exits(unchanged, tmp_path, capsys, factory, code):
    """SystemExit from the user's code (the factory, or the forward while being traced) goes
    through `main` and everything it set is put back on the way out, torch's RNG included (the
    factory drew from it: its Linear and its input)."""
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    with pytest.raises(SystemExit) as exc:
        main(["report", f"{path}:{factory}", "--budget", "1GB"])
    assert exc.value.code == code


def test_cli_through_torch_export_leaves_the_process_as_it_was(unchanged, tmp_path, capsys):
    """The export path: fx's failure and export's own logging silenced (planner.capture.trace._quiet)
    only while capturing."""
    path = tmp_path / "models.py"
    path.write_text(MODELS)
    assert main(["report", f"{path}:make_len", "--budget", "1GB", "--quiet", "--time-limit", "2"]) == 0
    assert "graph          torch.export" in capsys.readouterr().out


def test_plan_and_wrap_leaves_the_process_as_it_was(unchanged):
    ex = examples.EXAMPLES["mlp"]()
    model = plan_and_wrap(ex.model, "50%", example_inputs=ex.inputs, loss_fn=ex.loss_fn, options=QUICK)
    assert model is ex.model and model.remat.plan.regions


@pytest.fixture
def svg_backend():
    """matplotlib on the svg backend for the test (a notebook's inline backend stands for it)."""
    mpl = pytest.importorskip("matplotlib")
    backend = mpl.get_backend()
    mpl.use("svg")
    yield
    mpl.use(backend)


def test_plots_keep_the_users_matplotlib_backend(svg_backend, unchanged, tmp_path):
    """NOTE [ no pyplot ] in runtime/cli/plots.py: PNGs drawn without switching the backend."""
    png = plots.tradeoff_png(tmp_path / "tradeoff.png", [10**6, 2 * 10**6], [30.0, 10.0], [], 3 * 10**6,
                             5 * 10**5, "mlp")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_sweep_measured_with_plots_leaves_the_process_as_it_was(svg_backend, unchanged, tmp_path, capsys):
    """Every command's other half: plots drawn, plans run for real (runtime.measure), in one call."""
    argv = ["sweep", "mlp", "--budgets", "50%..100%", "--steps", "2", "--measure", "--out", str(tmp_path),
            "--time-limit", "2", "--quiet"]
    assert main(argv) == 0
    assert (tmp_path / "tradeoff.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "memory.png").is_file()


@pytest.mark.parametrize("kineto", [None, "3"])
def test_allocator_peak_leaves_kineto_log_level(monkeypatch, kineto):
    """runtime.measure quiets kineto only while it profiles; the user's own level is kept."""
    if kineto is None:
        monkeypatch.delenv("KINETO_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("KINETO_LOG_LEVEL", kineto)
    before = snapshot()
    x = torch.ones(1000)
    assert allocator_peak(lambda: (x * 2).sum(), x) >= x.nbytes
    assert changes(before, snapshot()) == []
    assert os.environ.get("KINETO_LOG_LEVEL") == kineto
