"""The state of a user's model that planning must leave as it found it: modes, buffers, tensors.

Planning traces and profiles a *training* step: a model handed over in eval mode (as
`from_pretrained` returns it) is planned as `model.train()` would leave it, since a captured
graph bakes the mode in (fx reads `self.training` once; torch.export bakes eval dropout and
BatchNorm). Tracing may run real code on real tensors; whatever it changes is put back.
"""
from __future__ import annotations

import contextlib

import torch


def mode_key(model: torch.nn.Module) -> tuple[str, ...]:
    """The modules a training step of `model` runs in eval mode (a frozen BatchNorm), by name.
    A model in eval mode trains as `model.train()` leaves it: every module in train mode, ()."""
    if not model.training:
        return ()
    return tuple(name for name, m in model.named_modules() if not m.training)


@contextlib.contextmanager
def training_modes(model: torch.nn.Module):
    """`model` in the modes of its training step (see `mode_key`) for the block; restored after."""
    if model.training:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def state_preserved(model: torch.nn.Module):
    """Buffers keep their values, and plain tensor attributes their objects (a forward pre-hook
    such as spectral_norm's sets `module.weight`) and values, whatever a trace or profile runs."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    versions = [b._version for b, _ in buffers]
    attrs = [(m, k, v, v._version, v.detach().clone()) for m in model.modules() for k, v in vars(m).items()
             if isinstance(v, torch.Tensor)]
    try:
        yield
    finally:
        with torch.no_grad():
            for (b, saved), v in zip(buffers, versions):
                if b._version != v:
                    b.copy_(saved)
            for m, k, v, version, saved in attrs:
                m.__dict__[k] = v
                if v._version != version:
                    v.copy_(saved)
