"""The real peak memory of a training step: live tensor bytes on CPU, the allocator's on CUDA."""
from __future__ import annotations

import contextlib
import os
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile
from remat.planner.compat import tree_flatten

from remat.planner.storage import LiveBytes


def _tensors(things) -> list[torch.Tensor]:
    out = []
    for x in tree_flatten(list(things))[0]:
        if isinstance(x, torch.nn.Module):
            out += list(x.parameters()) + list(x.buffers())
            out += [p.grad for p in x.parameters() if p.grad is not None]
        elif isinstance(x, torch.Tensor):
            out.append(x)
    return out


def peak_memory(step_fn: Callable[[], object], *live, device: str | torch.device = "cpu",
                allocator: bool = False) -> int:
    """Peak bytes of live tensors while `step_fn()` runs.

    `live` names what exists before the step and counts toward its peak, as in the planner's
    budget: modules (their parameters, buffers and existing grads) and input tensors.
    On CPU, storages are tracked at the dispatcher (not RSS); on CUDA, the caching allocator's
    `max_memory_allocated` is used and `live` is already counted by it. With `allocator` on CPU,
    the allocator's own events are summed instead (`allocator_peak`): torch.compile'd code runs
    eagerly under a dispatcher mode, so compiled steps are metered that way.

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
    if allocator:
        return allocator_peak(step_fn, *live)
    with LiveBytes(baseline=_tensors(live)) as meter:
        step_fn()
    return meter.peak_bytes


def allocator_peak(step_fn: Callable[[], object], *live) -> int:
    """Peak CPU allocator bytes while `step_fn()` runs, plus the bytes of `live` (each storage once).

    Each profiler memory event carries the byte delta of one allocation or free; their running
    sum from the start of the step is what the step holds on top of what existed before it.
    """
    resident = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(live)}
    with _kineto_quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    held = peak = 0
    for e in events:
        held += e.nbytes()
        peak = max(peak, held)
    return sum(resident.values()) + peak


@contextlib.contextmanager
def _kineto_quiet():
    """Inside, KINETO_LOG_LEVEL is 6 unless the user set it: kineto's USDT start/stop lines off on
    stderr (it reads the level when the profiler is first used). After, the environment is as it
    was: a process (and the processes it starts) does not inherit the setting."""
    before = os.environ.get("KINETO_LOG_LEVEL")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("KINETO_LOG_LEVEL", None)
