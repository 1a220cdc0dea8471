"""The persistent plan cache (runtime/plan_cache.py): a call planned before, in any process, takes
its plan from disk (no profile, no solve) and trains exactly as the plan made anew; anything the
plan depends on that changed misses; a corrupt or stale entry is ignored, logged, and replaced."""
import copy
import json
import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from remat.runtime import plan_and_wrap
from remat.runtime.measure import training_loss

from helpers import FAST


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("REMAT_CACHE", "1")
    monkeypatch.setenv("REMAT_CACHE_DIR", str(tmp_path))
    return tmp_path


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Other(Block):
    def forward(self, x):                       # same parameters, other code
        return x + self.fc2(F.relu(self.fc1(x)))


def _model(block=Block, d=32, n=4):
    torch.manual_seed(0)
    return nn.Sequential(*[block(d) for _ in range(n)], nn.Linear(d, 8))


def _x(b=16, t=24, d=32):
    return torch.randn(b, t, d, generator=torch.Generator().manual_seed(1))


def _wrap(model=None, x=None, budget="75%", loss_fn=None, options=FAST):
    return plan_and_wrap(model if model is not None else _model(), budget,
                         example_inputs=(x if x is not None else _x(),), loss_fn=loss_fn, options=options)


def _grads(model, x, loss_fn=None):
    for p in model.parameters():
        p.grad = None
    training_loss(model(x), loss_fn).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_a_call_planned_before_takes_its_plan_from_the_cache(cache_dir, caplog):
    first = _wrap()
    assert first.remat.solves == 1 and first.remat.plan.regions
    assert len(list(cache_dir.glob("*.json"))) == 1
    with caplog.at_level(logging.INFO, logger="remat"):
        second = _wrap()
    assert second.remat.solves == 0 and "plan cache" in caplog.text
    assert second.remat.plan.meta.pop("cached") and second.remat.plan == first.remat.plan
    assert second.remat.budget.kind == "bytes" and second.remat.budget.value == first.remat.plan.budget_bytes
    x, ref = _x(), _model()
    want = _grads(ref, x)
    assert all(torch.equal(a, b) for a, b in zip(want, _grads(second, x)))


@pytest.mark.parametrize("change", ["budget", "shape", "loss", "code", "dtype", "options"])
def test_anything_the_plan_depends_on_misses(cache_dir, change):
    _wrap()
    x, model, kw = _x(), _model(), {}
    if change == "budget":
        kw["budget"] = "90%"
    elif change == "shape":
        x = _x(t=20)
    elif change == "loss":
        kw["loss_fn"] = lambda out: out.float().pow(2).mean()
    elif change == "code":
        model = _model(Other)
    elif change == "dtype":
        model, x = model.double(), x.double()
    else:
        kw["options"] = copy.replace(FAST, keep_output=True) if hasattr(copy, "replace") else \
            __import__("dataclasses").replace(FAST, keep_output=True)
    w = _wrap(model, x, **kw)
    assert w.remat.solves == 1
    assert len(list(cache_dir.glob("*.json"))) == 2


@pytest.mark.parametrize("damage", ["garbage", "other key", "other graph", "truncated plan"])
def test_a_corrupt_or_stale_entry_is_ignored_and_replaced(cache_dir, caplog, damage):
    first = _wrap()
    path, = cache_dir.glob("*.json")
    entry = json.loads(path.read_text())
    if damage == "garbage":
        path.write_text("{not json")
    elif damage == "other key":
        entry["key"]["torch"] = "0.0"
        path.write_text(json.dumps(entry))
    elif damage == "other graph":
        entry["graph"] = "0" * 32
        path.write_text(json.dumps(entry))
    else:
        entry["plan"] = entry["plan"][: len(entry["plan"]) // 2]
        path.write_text(json.dumps(entry))
    with caplog.at_level(logging.WARNING, logger="remat"):
        again = _wrap()
    assert again.remat.solves == 1, "a bad entry was trusted"
    assert "plan cache" in caplog.text and "planning anew" in caplog.text
    assert (again.remat.plan.regions, again.remat.plan.predicted_peak_bytes) == \
        (first.remat.plan.regions, first.remat.plan.predicted_peak_bytes)
    assert _wrap().remat.solves == 0        # the entry was replaced by a good one


@pytest.mark.parametrize("how", ["env", "options"])
def test_the_cache_can_be_turned_off(cache_dir, monkeypatch, how):
    options = FAST
    if how == "env":
        monkeypatch.setenv("REMAT_CACHE", "0")
    else:
        options = __import__("dataclasses").replace(FAST, cache=False)
    _wrap(options=options)
    assert _wrap(options=options).remat.solves == 1
    assert not list(cache_dir.glob("*.json"))


class _Round(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class Rooted(nn.Module):
    """A custom Function in the root's own code: planned over the module tree."""

    def __init__(self, d=32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = _Round.apply(b(x))
        return x


def test_a_module_tree_plan_is_cached_too(cache_dir):
    torch.manual_seed(0)
    model = Rooted()
    first = _wrap(copy.deepcopy(model))
    assert first.remat.plan.trace_path == "module tree"
    again = _wrap(copy.deepcopy(model))
    assert again.remat.solves == 0 and again.remat.plan.regions == first.remat.plan.regions
    x = _x()
    assert all(torch.equal(a, b) for a, b in zip(_grads(copy.deepcopy(model), x), _grads(again, x)))


SCRIPT = """
import time
from remat.planner import PlanOptions, SolveOptions
from remat.runtime import examples, plan_and_wrap
ex = examples.mlp(depth=8, width=256, batch=256, in_features=64)
t = time.perf_counter()
w = plan_and_wrap(ex.model, "80%", example_inputs=ex.inputs, loss_fn=ex.loss_fn,
                  options=PlanOptions(solve=SolveOptions(time_limit_s=4.0)))
print(w.remat.solves, w.remat.plan.regions, time.perf_counter() - t)
"""


@pytest.mark.slow
def test_a_second_process_takes_the_plan_from_the_cache(cache_dir):
    env = {**os.environ, "REMAT_CACHE": "1", "REMAT_CACHE_DIR": str(cache_dir)}
    script = SCRIPT
    runs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout.split(maxsplit=1)
            for _ in range(2)]
    assert [r[0] for r in runs] == ["1", "0"], runs
    assert runs[0][1].rsplit(maxsplit=1)[0] == runs[1][1].rsplit(maxsplit=1)[0]
