"""Planning in one thread leaves other threads alone (issue 43, item 5): while a model is captured
(torch.export, a failing one among them), another thread trains a model whose forward applies a
custom autograd.Function and writes to stderr; its gradients are right, its lines all reach
stderr, and the failed export's partial graph does not. Before, the capture's watch on
Function.apply raised in every thread, and its quiet mode swapped stderr for every thread.
"""
from __future__ import annotations

import copy
import gc
import sys
import threading

import torch
import torch.nn as nn

from remat.planner.capture import fidelity, muted
from remat.runtime import plan_and_wrap

from helpers import FAST


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return 2 * x * g


class WithFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return Square.apply(self.fc(x)).sum()


class ValueBranch(nn.Module):
    """fx fails at its root, torch.export fails on the value branch (printing its partial graph):
    planned over its module tree."""

    def __init__(self, d=32):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.GELU()) for _ in range(4))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x * 2 if x.sum() > 0 else x


class SizeBranch(ValueBranch):
    """fx fails at its root, torch.export captures it."""

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x * 2 if x.shape[0] > 1 else x


def _trainer(stop: threading.Event, report: dict) -> None:
    torch.manual_seed(0)
    model, x = WithFunction(), torch.randn(4, 8)
    expected = torch.autograd.grad(((model.fc(x)) ** 2).sum(), model.fc.weight)[0]
    try:
        while not stop.is_set():
            watched = fidelity.watchers_installed()
            g = torch.autograd.grad(model(x), model.fc.weight)[0]
            report["steps"] += 1
            report["overlapped"] += watched
            report["wrong"] += not torch.allclose(g, expected)
            print(f"trainer line {report['steps']}", file=sys.stderr)
    except Exception as e:      # noqa: BLE001 - the test reports it
        report["error"] = repr(e)


def test_planning_in_one_thread_leaves_another_training_thread_alone(capfd):
    report = {"steps": 0, "overlapped": 0, "wrong": 0, "error": None}
    stop = threading.Event()
    worker = threading.Thread(target=_trainer, args=(stop, report))
    worker.start()
    try:
        for cls in (SizeBranch, ValueBranch):
            torch.manual_seed(0)
            model, x = cls(), torch.randn(16, 32)
            ref = copy.deepcopy(model)
            w = plan_and_wrap(model, 1.0, example_inputs=(x,), options=FAST)
            w(x).sum().backward()
            ref(x).sum().backward()
            assert all(torch.equal(a.grad, b.grad) for a, b in zip(ref.parameters(), w.parameters()))
    finally:
        stop.set()
        worker.join()
    err = capfd.readouterr().err
    assert report["error"] is None, report["error"]
    assert report["wrong"] == 0
    assert report["overlapped"] > 0, "no training step ran while a capture watched: the test saw nothing"
    assert all(f"trainer line {k}" in err for k in range(1, report["steps"] + 1))
    assert "def forward(" not in err, "the failed export's partial graph reached stderr"
    assert not fidelity.watchers_installed() and sys.stderr is not None
    assert not isinstance(sys.stderr, muted._ThreadStderr)


def test_the_collector_is_paused_only_in_a_process_of_one_thread():
    from remat.planner.solve.nogc import paused
    seen = paused(lambda: gc.isenabled())
    alone = threading.active_count() == 1      # a library's idle thread (tqdm's monitor) may be about
    assert seen() is not alone and gc.isenabled()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert seen() is True, "another thread runs: its garbage is collected as ever"
    finally:
        stop.set()
        other.join()
