"""Replay a rewritten model's training step on fake tensors and measure its peak exactly.

The CostGraph simulator is a model of PyTorch's memory behaviour; this is the behaviour itself:
the rewritten GraphModule runs forward, loss and backward (with its checkpoint recomputes)
under FakeTensorMode, with the same dispatcher-level meter used for real CPU steps. Nothing
real is allocated, so a plan for a step larger than this machine can still be checked.
"""
from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import tree_flatten, tree_map

from planner.opaque import real_state, stand_in
from planner.profile import graph_state
from planner.rng import rng_preserved
from planner.storage import LiveBytes


@contextlib.contextmanager
def _standing_in(gm: torch.nn.Module, opaque: tuple[str, ...], examples: dict):
    """Opaque modules (fake tensors cannot run them) run as their measured stand-ins."""
    mods = [gm.get_submodule(m) for m in opaque]
    states = [real_state(m) for m in mods]              # taken before the model is made fake
    def patched(mod, state, example):
        def forward(*args, **kwargs):
            del mod.forward                  # the measurement runs the module's own forward
            try:
                return stand_in(mod, state, args, kwargs, example)[0]
            finally:
                mod.forward = forward
        return forward
    for name, mod, state in zip(opaque, mods, states):
        mod.forward = patched(mod, state, examples.get(name))
    try:
        yield
    finally:
        for mod in mods:
            del mod.forward


def training_loss(out, loss_fn=None) -> torch.Tensor:
    """`loss_fn(out)`; without one, a stand-in loss that keeps one tensor of each output's size
    (exp saves its result), as the profile assumes (planner.profile)."""
    if loss_fn is not None:
        return loss_fn(out)
    return sum(t.float().exp().sum() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad)


def dry_run_peak(gm: torch.nn.Module, kwargs: dict, loss_fn=None, opaque: tuple[str, ...] = (),
                 examples: dict | None = None, keep_output: bool = False) -> int:
    """Peak live bytes of `loss_fn(gm(**kwargs)).backward()` (parameters, buffers, inputs and
    every tensor the step reads, such as a loss target, included), the output released once the
    loss is computed unless `keep_output`. `opaque` modules are stood in for by their measured
    memory behaviour (planner.opaque)."""
    with _standing_in(gm, opaque, examples or {}), rng_preserved(), \
            FakeTensorMode(allow_non_fake_inputs=True) as fake:
        named = graph_state(gm)      # tensor constants too: a graph may write one in place
        state = {k: fake.from_tensor(v) for k, v in named.items()}
        fake_kwargs = tree_map(lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x, kwargs)
        baseline = list(state.values()) + [t for t in tree_flatten(fake_kwargs)[0] if isinstance(t, torch.Tensor)]
        real = list(named.values()) + [t for t in tree_flatten(kwargs)[0] if isinstance(t, torch.Tensor)]
        with _reparametrize_module(gm, state), LiveBytes(baseline=baseline, known=real) as meter:
            out = gm(**fake_kwargs)
            loss = training_loss(out, loss_fn)
            if not keep_output:
                del out
            loss.backward()
            del loss
    return meter.peak_bytes
