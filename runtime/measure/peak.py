"""The real peak memory of a training step: live tensor bytes on CPU, the allocator's on CUDA."""
from __future__ import annotations

import contextlib
import math
import os
from typing import Callable

import torch
from torch._C._profiler import _EventType
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
    sum from the start of the step is what the step holds on top of what existed before it,
    with the frees the profiler cannot see put back (NOTE [ unseen frees ]).
    """
    resident = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(live)}
    with _kineto_quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step_fn()
    return sum(resident.values()) + held_peak(_memory_events(prof.profiler.kineto_results.experimental_event_tree()))


# NOTE [ unseen frees ]
# The profiler records an allocation or free in a thread it traces. gloo runs a collective in its
# worker thread under the caller's trace, but the worker drops its reference to the collective's
# work after that; when it drops the last one, what the work holds (the reduce-scatter's staging
# copy of its input, made in the caller's thread) is freed unseen, and a running sum of the
# events would hold it for the rest of the step (FSDP2 over gloo, torch 2.13.0, the tests' HF
# GPT-2 at 65%, 8 runs of 2 ranks x 3 steps: 10 of 48 steps ended a staging copy high, and 5
# steps' peaks were a layer's gradients high, in 4 of the 8 runs).
# Two facts bound such a free: the allocator hands out no address in use, so a new allocation
# at an address still held means the earlier one was freed before it; and a collective is
# waited for inside the node that issued it, so what it allocated is freed once that node ends
# (the wait returns when the work is done; only the worker's own release can come after). An
# allocation is taken as freed at its unseen free's bound: the reuse of its address, or the end
# of its top-level event (the autograd node or op that made it) when that comes first; one made
# inside a c10d collective and still held at the step's end, at the end of its top-level event.

def _memory_events(tree) -> list[tuple[int, int, int, float, bool]]:
    """(time, address, bytes, end of the top-level event around it, made inside a c10d op) per
    profiler memory event, in time order; an allocation outside any event has no such end (inf:
    its unseen free is bounded by the reuse of its address only)."""
    out, stack = [], [(root, None, False) for root in tree]
    while stack:
        ev, top_end, c10d = stack.pop()
        if ev.tag == _EventType.Allocation:
            out.append((ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size,
                        math.inf if top_end is None else top_end, c10d))
        c10d = c10d or ev.name.startswith("c10d::")
        stack += [(c, ev.end_time_ns if top_end is None else top_end, c10d) for c in ev.children]
    return sorted(out, key=lambda e: e[0])


def held_peak(events: list[tuple[int, int, int, float, bool]]) -> int:
    """The peak of the running sum of `events` ((time, address, bytes, top-level end, in a c10d
    op), time-ordered; bytes < 0 a free), each free the profiler missed put back at its bound
    (NOTE [ unseen frees ])."""
    deltas, held = [], {}
    for t, ptr, nbytes, end, c10d in events:
        if nbytes > 0 and ptr in held:                 # the earlier allocation here was freed unseen
            before, before_end, _ = held.pop(ptr)
            deltas.append((min(before_end, t), -before))
        if nbytes > 0:
            held[ptr] = (nbytes, end, c10d)
        else:
            held.pop(ptr, None)
        deltas.append((t, nbytes))
    deltas += [(end, -nbytes) for nbytes, end, c10d in held.values() if c10d]
    running = peak = 0
    for _, d in sorted(deltas, key=lambda d: d[0]):
        running += d
        peak = max(peak, running)
    return peak


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
