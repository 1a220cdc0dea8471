"""Replay a rewritten model's training step on fake tensors and measure its peak exactly.

The CostGraph simulator is a model of PyTorch's memory behaviour; this is the behaviour itself:
the rewritten GraphModule runs forward, loss and backward (with its checkpoint recomputes)
under FakeTensorMode (on meta copies without it where the step is all on meta: planner/step/fake.py,
NOTE [ meta step ]), with the same dispatcher-level meter used for real CPU steps. Nothing
real is allocated, so a plan for a step larger than this machine can still be checked.
"""
from __future__ import annotations

import contextlib

import torch

from remat.planner.profile.opaque import stand_in, step_held
from remat.planner.step.state import hooks_set, instance_forwards, named_tensors
from remat.planner.step.fake import fake_step, meta_first, run_step, training_loss
from remat.planner.step.storage import LiveBytes


@contextlib.contextmanager
def _own(mod: torch.nn.Module, hooks: dict):
    with instance_forwards({mod: None}), hooks_set({mod: hooks}):
        yield


@contextlib.contextmanager
def _standing_in(gm: torch.nn.Module, opaque: tuple[str, ...], examples: dict, memo: dict | None = None):
    """Opaque modules (fake tensors cannot run them) run as their measured stand-ins (`memo`: NOTE
    [ one measurement a planning ] in planner/profile/opaque.py)."""
    mods = [gm.get_submodule(m) for m in opaque]
    states = [named_tensors(m) for m in mods]              # taken before the model is made fake

    def stood_in(mod, state, example):
        def own():      # the measurement runs the module's own forward, with its hooks, for real
            return _own(mod, hooks[mod])

        def forward(*args, **kwargs):
            return stand_in(mod, state, args, kwargs, example, own, memo)[0]
        return forward
    # on fake tensors its hooks do not run around the stand-in (a hook may read values)
    with instance_forwards({mod: stood_in(mod, state, examples.get(name))
                            for name, mod, state in zip(opaque, mods, states)}), \
            hooks_set({mod: {} for mod in mods}) as hooks:
        yield


def dry_run_peak(gm: torch.nn.Module, kwargs: dict, loss_fn=None, opaque: tuple[str, ...] = (),
                 examples: dict | None = None, keep_output: bool = False, grads: bool = False,
                 memo: dict | None = None) -> int:
    """Peak live bytes of `loss_fn(gm(**kwargs)).backward()` (parameters, buffers, inputs and
    every tensor the step reads, such as a loss target, included), the output released once the
    loss is computed unless `keep_output`; `grads`: every parameter gradient exists from the
    start (gradient accumulation). `opaque` modules are stood in for by their measured memory
    behaviour (planner.profile.opaque), each measured once per `memo`."""
    def run(meta: bool) -> int:
        with _standing_in(gm, opaque, examples or {}, memo), fake_step(gm, kwargs, grads, meta) as fake, \
                LiveBytes(baseline=fake.fixed, known=fake.made_from) as meter:
            with step_held():
                run_step(lambda: gm(**fake.inputs), lambda out: training_loss(out, loss_fn), keep_output=keep_output,
                         reads=fake.reads)
        return meter.peak_bytes
    return meta_first(gm, kwargs, run)
