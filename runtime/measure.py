"""The real peak memory of a training step: live tensor bytes on CPU, the allocator's on CUDA."""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from planner.storage import LiveBytes


def _tensors(things) -> list[torch.Tensor]:
    out = []
    for x in tree_flatten(list(things))[0]:
        if isinstance(x, torch.nn.Module):
            out += list(x.parameters()) + list(x.buffers())
            out += [p.grad for p in x.parameters() if p.grad is not None]
        elif isinstance(x, torch.Tensor):
            out.append(x)
    return out


def peak_memory(step_fn: Callable[[], object], *live, device: str | torch.device = "cpu") -> int:
    """Peak bytes of live tensors while `step_fn()` runs.

    `live` names what exists before the step and counts toward its peak, as in the planner's
    budget: modules (their parameters, buffers and existing grads) and input tensors.
    On CPU, storages are tracked at the dispatcher (not RSS); on CUDA, the caching allocator's
    `max_memory_allocated` is used and `live` is already counted by it.

    >>> lin = torch.nn.Linear(100, 100)
    >>> x = torch.randn(10, 100)
    >>> peak_memory(lambda: lin(x).sum().backward(), lin, x) >= 2 * 4 * (100 * 100 + 100)
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step_fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with LiveBytes(baseline=_tensors(live)) as meter:
        step_fn()
    return meter.peak_bytes


@contextlib.contextmanager
def preserved(model: torch.nn.Module):
    """Real steps leave no trace: gradients, buffers (BatchNorm statistics) and the CPU RNG are restored."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
        for p, g in grads.items():
            p.grad = g
