"""The real peak memory of a training step: live tensor bytes on CPU, the allocator's on CUDA."""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Callable

import torch
from remat.planner.compat import allocation_events, tree_flatten

from remat.planner.step.storage import LiveBytes, storage_of, tensors_in


def _tensors(things) -> list[torch.Tensor]:
    """The plain tensors `things` hold (see `plain`)."""
    return [p for t in _given(things) for p in plain(t)]


def _given(things) -> list[torch.Tensor]:
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
    budget: modules (their parameters, buffers and existing grads) and input tensors; a DTensor
    (FSDP2's sharded parameters) counts the shard this rank holds.
    On CPU, storages are tracked at the dispatcher (not RSS), each at its size as it changes (FSDP2
    frees and reallocates its gathered parameters with `untyped_storage().resize_`, which no
    dispatch mode sees: `StorageMeter`); on CUDA, the caching allocator's
    `max_memory_allocated` is used and `live` is already counted by it. With `allocator` on CPU,
    the allocator's own events are summed instead (`allocator_peak`): torch.compile'd code runs
    eagerly under a dispatcher mode, so compiled steps are metered that way.

    Examples:
        >>> import torch
        >>> from remat import peak_memory
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
    with StorageMeter(baseline=_tensors(live)) as meter, resizes_seen(meter):
        step_fn()
    return meter.peak_bytes


def plain(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold `t`'s data: `t` itself, or for a wrapper subclass (a
    DTensor, FSDP2's sharded parameters and gradients) its inner tensors, recursively. A wrapper's
    own storage holds no memory: its size is the wrapper's, a DTensor's global one (its local shard
    is what the rank holds)."""
    if not hasattr(type(t), "__tensor_flatten__"):
        return [t]
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
    return [p for x in inner if isinstance(x, torch.Tensor) for p in plain(x)]


# NOTE [ storages resized outside the dispatcher ]
# `UntypedStorage.resize_` changes a storage's bytes in place and no dispatch mode sees it (it calls
# the CPU allocator directly, torch 2.13). FSDP2 frees each gathered parameter's storage that way
# once it is used (`free_storage`: resize_(0), torch/distributed/fsdp/_fully_shard/_fsdp_param.py)
# and allocates it again before an all-gather copies into it (`alloc_storage`: resize_ to its full
# size), the same tensors and storages step after step. LiveBytes counts a storage once, at the
# size it has when first seen: each gathered parameter all step (first seen by its copy-in, after
# it was resized up; its frees unseen): 3.2 MB too many on tests/meter_worker.py's FSDP2 GPT, of
# 5.3 MB of parameters. While metering, `resizes_seen` reports each call of
# `UntypedStorage.resize_` (a TypedStorage's `_resize_` calls it too), and the meter counts the
# storage at its new size at once; one that existed before the step is first counted at its size
# from before (NOTE [ storages no op made ]), its change on top. Polling every live storage's size
# after each op would find the same changes an op later, at 0.4 us a storage an op (10x the
# meter's own cost with a few hundred live storages). Resizes the dispatcher sees (aten.resize_,
# an out= op growing its output, inductor.resize_storage_bytes_) are read back after each op that
# mutates its arguments.

# NOTE [ storages no op made ]
# A storage an op reads that no op made, LiveBytes counts from the start of the step to its end, as
# a constant the step closes over. Not all of them are: gloo's reduce-scatter clones its input
# inside the collective (out of the meter's sight: the mode is off while it runs an op), and the
# clone is read by a `split` in `work.wait()` and freed once the collective is done. LiveBytes held
# every unit's full gradients from the start (5.3 MB too many on tests/meter_worker.py's 2-rank
# FSDP2 GPT). Here such a storage is counted from its first read until it is freed; one still held
# when the peak is read is counted from the start, as LiveBytes does: each first read begins a
# segment of the step, and the peak is the largest of a segment's own peak plus the bytes of the
# held storages first read after it began.

class StorageMeter(LiveBytes):
    """LiveBytes for a step on real tensors (the fake replay's is LiveBytes): a storage is counted
    at its size when it is resized (NOTE [ storages resized outside the dispatcher ]), one no op
    made from its first read until it is freed (NOTE [ storages no op made ]), and a wrapper
    subclass by its inner tensors (`plain`)."""

    def __init__(self, baseline=()):
        self._grown: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> [bytes since counted]
        self._reads: list[list[int]] = []         # per storage no op made, in order: [its bytes, 0 once freed]
        self._segment_peaks: list[int] = []       # the peak before each of those was first read
        super().__init__(baseline=baseline, host=True)

    def add(self, t: torch.Tensor, nbytes: int | None = None) -> bool:
        parts = plain(t)
        if len(parts) == 1 and parts[0] is t:
            return super().add(t, nbytes)
        added = False
        for p in parts:
            added = super().add(p) or added
        return added

    def read(self, t: torch.Tensor) -> bool:
        first = False
        for st in map(storage_of, plain(t)):
            if not self._counted(st):
                self._first_read(st, st.nbytes())
                first = True
        return first

    def _first_read(self, st: torch.UntypedStorage, nbytes: int) -> None:
        """Count `st`, which no op made, from now on (NOTE [ storages no op made ]): a new segment
        of the step begins."""
        self._segment_peaks.append(self._peak)
        self._read_sizes[st] = nbytes
        cell = [nbytes]
        self._reads.append(cell)
        weakref.finalize(st, self._unread, cell)
        self.live_bytes += nbytes
        self._peak = self.live_bytes

    def _unread(self, cell: list[int]) -> None:
        self.live_bytes -= cell[0]
        cell[0] = 0                     # freed in the step: not counted before its first read

    @property
    def peak_bytes(self) -> int:
        """The largest of each segment's peak plus the storages first read after it that are
        still held (NOTE [ storages no op made ])."""
        peaks = self._segment_peaks + [self._peak]
        best = later = 0
        for k in range(len(peaks) - 1, -1, -1):
            best = max(best, peaks[k] + later)
            later += self._reads[k - 1][0] if k else 0
        return best

    def resized(self, st: torch.UntypedStorage, before: int) -> None:
        """`st` was resized from `before` bytes (outside the dispatcher)."""
        if not self._counted(st):                  # no op made it, none read it yet
            self._first_read(st, before)
        self._sync(st)

    def _counted(self, st: torch.UntypedStorage) -> bool:
        return st in self._sizes or st in self._read_sizes

    def _sync(self, st: torch.UntypedStorage) -> None:
        """Count `st` (a counted storage) at its size now: the change since it was first counted
        is held in `_grown` and uncounted when the storage is freed."""
        cell = self._grown.get(st)
        first = self._sizes[st] if st in self._sizes else self._read_sizes[st]
        delta = st.nbytes() - first - (cell[0] if cell else 0)
        if not delta:
            return
        if cell is None:
            cell = self._grown[st] = [0]
            weakref.finalize(st, self._drop, cell)
        cell[0] += delta
        self.live_bytes += delta
        self._peak = max(self._peak, self.live_bytes)

    def _drop(self, cell: list[int]) -> None:
        self.live_bytes -= cell[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if func._schema.is_mutable:          # out= and in-place ops, resize_: a size may have changed
            for t in tensors_in((args, kwargs)):
                for st in map(storage_of, plain(t)):
                    if self._counted(st):
                        self._sync(st)
        return out


@contextlib.contextmanager
def resizes_seen(meter: StorageMeter):
    """Inside, every `torch.UntypedStorage.resize_` is reported to `meter` (NOTE [ storages
    resized outside the dispatcher ]); after, the class is as it was."""
    cls = torch.UntypedStorage
    had, original = "resize_" in vars(cls), cls.resize_

    @functools.wraps(original)
    def resize_(storage, size):
        before = storage.nbytes()
        out = original(storage, size)
        meter.resized(storage, before)
        return out

    cls.resize_ = resize_
    try:
        yield
    finally:
        if had:
            cls.resize_ = original
        else:
            del cls.resize_


def allocator_peak(step_fn: Callable[[], object], *live) -> int:
    """Peak CPU allocator bytes while `step_fn()` runs, plus the bytes of `live` (each storage once;
    a DTensor's, its local shard's).

    Each profiler memory event carries the byte delta of one allocation or free; their running
    sum from the start of the step is what the step holds on top of what existed before it,
    with the frees the profiler cannot see put back (NOTE [ unseen frees ]).
    """
    resident = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(live)}
    _, events = allocation_events(step_fn)
    return sum(resident.values()) + held_peak(events)


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
