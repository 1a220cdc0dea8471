"""`remat report | check | sweep` as a user runs them (subprocesses), and the assert_fits helper."""
import json
import os
import re
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from remat.planner.budget import parse_budget, parse_budget_range, parse_percent
from remat.planner.errors import BudgetError
from remat.runtime.cli import main
from remat.runtime.testing import assert_fits

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--time-limit", "3"]

FACTORIES = '''
import torch
from torch import nn


def _mlp():
    return nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()) for _ in range(6)],
                         nn.Linear(64, 4))


def make():
    torch.manual_seed(0)
    model, x, y = _mlp(), torch.randn(512, 64), torch.randint(4, (512,))
    return model, (x,), lambda out: nn.functional.cross_entropy(out, y)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _mlp()

    def forward(self, x, scale=1.0):
        return self.net(x) * scale


def small():
    """Two blocks: compile mode's checks and compile are most of a --compile run's time."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()) for _ in range(2)],
                          nn.Linear(64, 4))
    x, y = torch.randn(512, 64), torch.randint(4, (512,))
    return model, (x,), lambda out: nn.functional.cross_entropy(out, y)


def make_kwargs():
    torch.manual_seed(0)
    return Scaled(), {"x": torch.randn(512, 64)}


def boom():
    raise RuntimeError("no weights here")


def wrong():
    return 42


def bad_shapes():
    return _mlp(), (torch.randn(512, 32),)
'''


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "models.py"
    path.write_text(FACTORIES)
    return path


def _env(extra_path: Path | None = None) -> dict:
    paths = ([str(extra_path)] if extra_path else []) + [str(ROOT)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def start(*args, extra_path: Path | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "remat", *map(str, args)], cwd=ROOT, env=_env(extra_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    out, err = proc.communicate(timeout=300)
    assert "Traceback" not in err, err
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def remat(*args, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    return finish(start(*args, extra_path=extra_path))


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


# ------------------------------------------------------------------ parsing (in process)
@pytest.mark.parametrize("text, expected", [
    ("24GB", ("bytes", 24e9)), ("8GiB", ("bytes", 8 * 2**30)), ("500MB", ("bytes", 5e8)),
    ("1.5 MiB", ("bytes", 1.5 * 2**20)), ("40%", ("fraction", 0.4)), ("150%", ("fraction", 1.5)),
])
def test_parse_budget(text, expected):
    kind, value, _ = parse_budget(text)
    assert kind == expected[0] and value == pytest.approx(expected[1])


@pytest.mark.parametrize("text", ["abc", "-5GB", "0GB", "12", "3TB", "GB", "1e400GB"])
def test_parse_budget_rejects(text):
    with pytest.raises(BudgetError):
        parse_budget(text)


def test_parse_ranges_and_percent():
    assert [b[:2] for b in parse_budget_range("20%..100%")] == [("fraction", 0.2), ("fraction", 1.0)]
    assert parse_percent("25%", "--max-overhead") == 25.0
    for bad in ("20%", "100%..20%", "1GB..2GB..3GB"):
        with pytest.raises(BudgetError):
            parse_budget_range(bad)
    with pytest.raises(BudgetError):
        parse_percent("-5%", "--max-overhead")


# ------------------------------------------------------------------ bad input: exit 2, one line
BAD = {   # run as subprocesses: what a user sees
    "budget abc": (["check", "gpt2", "--budget", "abc"], "is not a size"),
    "negative budget": (["check", "gpt2", "--budget", "-5GB"], "must be positive"),
    "unknown model file": (["check", "no/such/file.py:make", "--budget", "1GB"], "does not exist"),
    "factory raises": (["check", "{models}:boom", "--budget", "1GB"], "raised: RuntimeError: no weights here"),
    "forward fails": (["report", "{models}:bad_shapes", "--budget", "1GB"], "cannot profile"),
    "missing budget": (["check", "gpt2"], "required: --budget"),
}
MORE_BAD = {   # the same path, in process (main() returns the exit code)
    "negative percent": (["report", "--budget=-10%"], "must be positive"),
    "no unit": (["check", "gpt2", "--budget", "12"], "has no unit"),
    "unknown module": (["check", "no_such_pkg.models:make", "--budget", "1GB"], "No module named"),
    "unknown built-in": (["report", "gpt5", "--budget", "1GB"], "use a built-in"),
    "missing factory": (["check", "{models}:nope", "--budget", "1GB"], "has no attribute 'nope'"),
    "factory returns junk": (["check", "{models}:wrong", "--budget", "1GB"], "must return (model, inputs)"),
    "bad overhead": (["check", "gpt2", "--budget", "1GB", "--max-overhead", "lots"], "use a percentage"),
    "reversed range": (["sweep", "gpt2", "--budgets", "80%..20%"], "low end"),
    "one step": (["sweep", "gpt2", "--budgets", "20%..80%", "--steps", "1"], "at least 2 steps"),
    "zero time limit": (["report", "--budget", "1GB", "--time-limit", "0"], "must be positive"),
}


@pytest.fixture(scope="module")
def bad_runs(models, tmp_path_factory):
    """All bad-input commands, run concurrently (each pays for importing torch)."""
    no_mpl = tmp_path_factory.mktemp("no_matplotlib")
    (no_mpl / "matplotlib").mkdir()
    (no_mpl / "matplotlib" / "__init__.py").write_text("raise ImportError('matplotlib is hidden')\n")
    procs = {name: start(*(a.format(models=models) for a in args)) for name, (args, _) in BAD.items()}
    procs["no matplotlib"] = start("sweep", "gpt2", "--budgets", "50%..100%", extra_path=no_mpl)
    return {name: finish(p) for name, p in procs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input(bad_runs, name):
    r = bad_runs[name]
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert BAD[name][1] in r.stderr
    assert r.stdout == ""
    assert re.match(r"remat( \w+)?: error: ", r.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(MORE_BAD))
def test_bad_input_in_process(models, capsys, name):
    args, message = MORE_BAD[name]
    assert main([a.format(models=models) for a in args]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and "Traceback" not in err


@pytest.mark.slow
def test_sweep_without_matplotlib(bad_runs):
    r = bad_runs["no matplotlib"]
    assert r.returncode == 2
    assert "pip install matplotlib (or remat[plot])" in r.stderr and "--no-plot" in r.stderr


# ------------------------------------------------------------------ the slow lane's commands
# test -> {name: argv}: {models} is the factories' file, {tmp} a folder of the fixture's
SLOW_RUNS = {
    # README's own example's options: its ILPs are solved once (the solved-ILP store the suite shares)
    "test_report_builtin_table": {"table": ["report", "--budget", "40%", "--time-limit", "30"]},
    "test_report_json_kwargs_factory": {"kwargs": ["report", "{models}:make_kwargs", "--budget", "70%", "--json", *FAST]},
    "test_check_fits_and_measures": {"measure": ["check", "{models}:make", "--budget", "80%", "--measure", *FAST]},
    "test_check_compiled_measures_the_compiled_step": {
        "compiled check": ["check", "{models}:small", "--budget", "90%", "--compile", "--measure", "--json", *FAST]},
    "test_check_too_small": {"too small": ["check", "{models}:make", "--budget", "1%", *FAST],
                             "too small json": ["check", "{models}:make", "--budget", "1%", "--json", *FAST]},
    "test_check_overhead_cap": {"cap": ["check", "{models}:make", "--budget", "70%", "--max-overhead", "1%", "--json",
                                        *FAST]},
    "test_sweep_json_plots_measured": {"sweep json": ["sweep", "{models}:make", "--budgets", "60%..100%", "--steps", "2",
                                                      "--measure", "--out", "{tmp}/plots", "--json", *FAST]},
    "test_sweep_table": {"sweep table": ["sweep", "{models}:make", "--budgets", "0.5MB..3MB", "--steps", "2", "--no-plot",
                                         *FAST]},
    "test_report_names_the_graph_path_for_zoo_models": {
        "lstm": ["report", "benchmarks/zoo_models.py:lstm_lm", "--budget", "95%", *FAST],
        "early exit": ["report", "benchmarks/zoo_models.py:early_exit", "--budget", "95%", *FAST]},
    "test_report_plans_a_hugging_face_config_on_meta_with_its_optimizer": {
        "hf config": ["report", "--hf-config", "{tmp}/config.json", "--batch", "2", "--seq", "256", "--dtype", "bf16",
                      "--optimizer", "adamw", "--accumulation", "2", "--target-device", "cuda", "--budget", "85%",
                      *FAST],
        "hf lion": ["report", "--hf-config", "{tmp}/config.json", "--optimizer", "lion", "--budget", "60%", *FAST]},
}


@pytest.fixture(scope="module")
def slow_runs(request, models, tmp_path_factory):
    """name -> a future of its CompletedProcess: the commands of this module's selected slow tests,
    two at a time in the background from the first one's start (each pays for importing torch;
    the tests read each result as before)."""
    tmp = tmp_path_factory.mktemp("slow_runs")
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    runs = {name: [str(a).format(models=models, tmp=tmp) for a in argv]
            for test, cmds in SLOW_RUNS.items() if test in selected for name, argv in cmds.items()}
    if any(name.startswith("hf ") for name in runs):
        try:
            import transformers
        except ImportError:                  # the test skips itself
            runs = {name: argv for name, argv in runs.items() if not name.startswith("hf ")}
    if any(name.startswith("hf ") for name in runs):
        transformers.LlamaConfig(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=512).to_json_file(tmp / "config.json")
    pool = ThreadPoolExecutor(2)
    futures = {name: pool.submit(remat, *argv) for name, argv in runs.items()}
    futures["tmp"] = tmp
    yield futures
    pool.shutdown(cancel_futures=True)


# ------------------------------------------------------------------ report
@pytest.mark.slow
def test_report_builtin_table(slow_runs):
    r = slow_runs["table"].result()
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "built-in gpt2" in out and "40% of the unplanned peak" in out
    for column in ("nodes", "modules", "kept", "recomputed", "GFLOP", "est ms", "why chosen"):
        assert column in out
    assert "without a plan ->" in out and "extra compute" in out and "solver" in out
    assert "opaque modules: none" in out
    assert "over budget" in out                      # each region says why it is needed
    assert "tracing and profiling" in r.stderr       # progress on stderr


@pytest.mark.slow
def test_report_json_kwargs_factory(slow_runs):
    r = slow_runs["kwargs"].result()
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""                            # --json is quiet
    d = json.loads(r.stdout)
    assert d["fits"] is True and d["model"].endswith(":make_kwargs")
    plan = d["plan"]
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"] < plan["unplanned_peak_bytes"]
    assert len(d["segments"]) == len(plan["regions"]) > 0
    for s in d["segments"]:
        assert s["recomputed_bytes"] > 0 and s["recompute_flops"] > 0 and s["start"] <= s["end"]


# ------------------------------------------------------------------ check
@pytest.mark.slow
def test_check_fits_and_measures(slow_runs):
    r = slow_runs["measure"].result()
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.startswith("OK: predicted peak") and "measured peak" in r.stdout
    assert len(r.stdout.strip().splitlines()) == 1


@pytest.mark.slow
def test_check_compiled_measures_the_compiled_step(slow_runs):
    """--compile: regions planned against the compiled step's predicted peak; the chosen plan is
    compiled and its real step measured (--measure), within the budget. (The prediction against
    the allocator, plan by plan: tests/test_compiled_memory.py.)"""
    r = slow_runs["compiled check"].result()
    assert r.returncode == 0, r.stdout + r.stderr
    d = json.loads(r.stdout)
    assert d["fits"] and d["measured_peak_bytes"] <= d["budget_bytes"]
    assert d["predicted_peak_bytes"] <= d["budget_bytes"]
    regions = int(re.search(r"(\d+) regions", d["reason"]).group(1))
    assert regions > 0 and d["extra_compute_pct"] > 0


@pytest.mark.slow
def test_check_too_small(slow_runs):
    text, js = slow_runs["too small"].result(), slow_runs["too small json"].result()
    assert text.returncode == 1 and js.returncode == 1
    assert text.stdout.startswith("FAIL: ") and "smallest feasible peak" in text.stdout
    assert len(text.stdout.strip().splitlines()) == 1
    d = json.loads(js.stdout)
    assert d["fits"] is False and d["min_feasible_bytes"] > d["budget_bytes"]
    assert "raise the budget to at least" in text.stdout


@pytest.mark.slow
def test_check_overhead_cap(slow_runs):
    r = slow_runs["cap"].result()
    assert r.returncode == 1
    d = json.loads(r.stdout)
    assert d["fits"] is False and "cap 1%" in d["reason"] and d["extra_compute_pct"] > 1


# ------------------------------------------------------------------ sweep
@pytest.mark.slow
def test_sweep_json_plots_measured(slow_runs):
    out = slow_runs["tmp"] / "plots"
    r = slow_runs["sweep json"].result()
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    planned, unplanned = d["points"]
    assert [planned["budget_fraction"], unplanned["budget_fraction"]] == pytest.approx([0.6, 1.0], abs=0.01)
    assert planned["fits"] and planned["regions"] > 0 and planned["extra_compute_pct"] > 0
    assert unplanned["regions"] == 0 and unplanned["extra_compute_pct"] == 0
    assert d["min_feasible_bytes"] < planned["budget_bytes"] < d["unplanned_peak_bytes"]
    for p in d["points"]:
        assert p["measured_peak_bytes"] <= p["budget_bytes"] and p["measured_extra_pct"] is not None
    for name in ("tradeoff", "memory"):
        path = Path(d["plots"][name])
        assert path.parent == out and path.stat().st_size > 10_000
        assert png_size(path) == (900, 500)


@pytest.mark.slow
def test_sweep_table(slow_runs):
    r = slow_runs["sweep table"].result()
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "predicted peak" in lines[1] and "extra compute" in lines[1]
    assert "does not fit" in lines[3] and "0.0%" in lines[4]
    assert lines[5].startswith("smallest feasible budget: ")
    assert "[2/2] solving" in r.stderr


# ------------------------------------------------------------------ assert_fits
def _small_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(6)])
    return model, torch.randn(512, 64)


def test_assert_fits_generous_budget_returns_plan():
    model, x = _small_model()
    plan = assert_fits(model, (x,), 1.0, measure=True, time_limit_s=3)
    assert plan.regions == () and plan.predicted_peak_bytes <= plan.budget_bytes
    assert all(p.grad is None for p in model.parameters())    # the measured step leaves no trace


def test_assert_fits_tight_and_tiny_budgets():
    model, x = _small_model()
    unplanned = assert_fits(model, x, 1.0, time_limit_s=3).unplanned_peak_bytes
    plan = assert_fits(model, {"input": x}, 0.8 * unplanned / 1e9, loss_fn=lambda out: out.square().mean(),
                       time_limit_s=3)
    assert plan.regions
    with pytest.raises(AssertionError, match="smallest feasible peak"):
        assert_fits(model, (x,), 1e-5, time_limit_s=3)


@pytest.mark.slow
def test_report_names_the_graph_path_for_zoo_models(slow_runs):
    r = slow_runs["lstm"].result()
    assert r.returncode == 0, r.stderr
    assert re.search(r"^graph +fx with opaque leaves", r.stdout, re.M)
    assert re.search(r"^  lstm: its kernel's memory is not what fake tensors model", r.stdout, re.M)
    r = slow_runs["early exit"].result()
    assert r.returncode == 2 and "GuardOnDataDependentSymNode" in r.stderr and "module tree" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.hf
def test_report_plans_a_hugging_face_config_on_meta_with_its_optimizer(slow_runs):
    """`--hf-config`: a causal LM from a local config.json, on meta (no weights, no hub), bf16,
    the whole step with AdamW and gradient accumulation, for a CUDA target (slow_runs writes the
    LlamaConfig: hidden 128, 344 intermediate, 2 layers, 4 heads, 2 KV heads, vocab 512)."""
    pytest.importorskip("transformers")
    r = slow_runs["hf config"].result()
    assert r.returncode == 0, r.stderr
    assert "LlamaForCausalLM from" in r.stdout and "on meta" in r.stdout
    assert re.search(r"held by the (forward|backward|optimizer step)", r.stdout)
    assert "AdamW (foreach).step()" in r.stdout           # torch's default on the CUDA target
    assert "2-step gradient accumulation" in r.stdout
    bad = slow_runs["hf lion"].result()
    assert bad.returncode == 2 and "--optimizer 'lion'" in bad.stderr


def test_the_cli_leaves_no_process_state_behind(capsys):
    """`main` in a process (a test, a notebook) restores the `remat` logger and the environment."""
    import logging
    import os
    from remat.runtime.cli.main import main
    log = logging.getLogger("remat")
    before = (log.handlers[:], log.level, log.propagate, os.environ.get("KINETO_LOG_LEVEL"))
    main(["report", "mlp", "--budget", "not-a-budget"])
    assert (log.handlers[:], log.level, log.propagate, os.environ.get("KINETO_LOG_LEVEL")) == before
