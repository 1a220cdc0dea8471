"""What a step's collectives hold, taken as freed where the step's own thread lets go of it
(NOTE [ frees on a collective's thread ]): for both meters of runtime/measure/peak.py."""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import weakref

import torch
import torch.distributed as dist
from torch.profiler import record_function

from remat.planner.compat import (TorchDispatchMode, disable_current_modes, storage_use_count, tensor_use_count,
                                  view_base)
from remat.planner.step.storage import storage_of, tensors_in

# NOTE [ frees on a collective's thread ]
# A gloo collective runs on one of the process group's worker threads; its work holds the tensors
# it was given (its future, once done, its outputs too) and its own staging copy of the input (a
# reduce-scatter's, read by a `split` and a `copy_` in `work.wait()`), until the worker drops it
# after the collective is done. When that reference is the last, the memory is freed on the worker
# whenever it runs again: it takes the GIL to free a storage Python has seen, which the step's
# thread hands over every few milliseconds at best. On the FSDP2 ranks of tests/meter_worker.py and
# tests/distributed_worker.py (torch 2.13.0, one OpenMP thread, a busy loop beside them) a layer's
# all-gather output or reduce-scatter input or staging copy was freed 10 to 50 ops after the step's
# thread let go of it, or after the step ended, in a few steps of a hundred: both meters then read
# a layer's or the root's parameters or gradients high (test_meter's fsdp-2 in CI: 36,958,728 B
# for the allocator's 34,795,016), never the same twice. Where the step's thread lets go is the
# program's, not the scheduler's, and had the worker dropped the work when it was done that is where
# the memory would be freed. So a storage a collective took (its tensor arguments), or that the
# step's thread reads inside a wait for one and is not watched yet (its staging copy), is watched
# with the tensors the step's thread is seen with on it (those, and ops' outputs on it: FSDP2's
# views of a reduce-scatter's output), and the collective's work is held meanwhile: the worker
# never drops the last reference. Before each op, before a storage is resized outside the
# dispatcher and when the step ends, a watched storage is taken as freed there once only the works
# hold it: no Python reference to a tensor on it (besides the one C++ keeps on a tensor it holds);
# no C++ reference to one beyond what the work took (counted around the collective; its future's
# on its outputs) and its watched views' (each holds its base); no tensor on it never seen (the
# storage's use count: DDP's buckets, its gradients' views); each of its collectives done (its
# future has its value). StorageMeter runs its frees of that storage then; allocator_peak
# (`ReleaseMarks`) leaves a profiler event there, where held_peak frees the allocation at that
# address (its own free, later, ignored), and it leaves out the frees other threads make of what
# the step did not allocate (a past step's). A collective never done before the step ends keeps
# what it holds counted to the end.


def held_besides(t: torch.Tensor, share: int | None, views: int) -> bool:
    """Whether `t` is held by more than a collective's work's `share` of its C++ references (None:
    all of them) and `views` watched views of it (each holds its base): by Python code (a
    reference besides the caller's and this function's two, its parameter and `getrefcount`'s
    argument, and the one C++ holds on a tensor held from C++), or by C++ beyond those (a
    module's or autograd's)."""
    held_in_cpp = tensor_use_count(t) - 1          # its Python object holds the one
    if sys.getrefcount(t) > 3 + (held_in_cpp > 0):
        return True
    return share is not None and held_in_cpp > share + views


class _Watch:
    """One watched storage: weak references to the tensors on it the step's thread was seen with,
    each with the share of its C++ references a collective's work holds (None: all of them), the
    works, held here until it is released, and how many more tensors on it they hold."""

    def __init__(self):
        self.shares: dict[weakref.ref, int | None] = {}
        self.works: list = []
        self.views = 0

    def add(self, t: torch.Tensor, share: int | None) -> None:
        ref = weakref.ref(t)                       # one per tensor: the shares of its collectives, summed
        had = self.shares.get(ref, 0)
        self.shares[ref] = None if share is None or had is None else had + share

    def held(self, st: torch.UntypedStorage) -> bool:
        """Held by anything besides the works: a tensor on it or a collective not done."""
        bases = _bases(self.shares)
        for ref, share in self.shares.items():
            t = ref()
            if t is not None and held_besides(t, share, bases.count(id(t))):
                return True
        if storage_use_count(st) > 1 + sum(ref() is not None for ref in self.shares) + self.views:
            return True                            # a tensor never seen on it (its Python object: the 1)
        return not all(map(_done, self.works))


def _bases(refs) -> list[int]:
    """The ids of the bases of the live views among `refs` (in a function of its own: no reference
    to a tensor outlives it)."""
    return [id(view_base(t)) for t in (ref() for ref in refs) if t is not None and view_base(t) is not None]


class Collectives:
    """The storages a step's collectives hold (NOTE [ frees on a collective's thread ]), each
    watched (`_Watch`) until the step's thread lets go of it; their works are held meanwhile, so
    that the worker's reference is never the last."""

    def __init__(self):
        self._watched: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> _Watch
        self._thread = threading.get_ident()
        self.waiting = 0                 # the step's thread is inside a Work.wait: > 0
        self.watching = False            # a storage may be watched (the meters' hot path reads it)

    def watch(self, t: torch.Tensor, share: int | None = 0) -> _Watch:
        w = self._watched.get(storage_of(t))
        if w is None:
            w = self._watched[storage_of(t)] = _Watch()
        w.add(t, share)
        self.watching = True
        return w

    def counts(self, args, kwargs) -> list:
        """Before a collective (a c10d op): its tensors' and their storages' reference counts (`saw`)."""
        return [(t, tensor_use_count(t), storage_use_count(storage_of(t))) for t in tensors_in((args, kwargs))]

    def saw(self, func, args, kwargs, out, before: list | None) -> None:
        """After an op: watch a collective's tensors (`before` its `counts`), with the references
        its work took, a storage read in a wait for one that is not watched (its staging copy),
        and an op's outputs on a watched storage."""
        if before is not None:
            works = [dist.Work.unbox(x) for x in _leaves(out) if isinstance(x, torch.ScriptObject)]
            pending = not all(map(_done, works))   # its future takes its outputs when done
            outputs = {id(t) for t in tensors_in(out)}
            counted = set()
            for t, refs, views in before:
                if id(t) in counted:                   # each tensor, and storage, once
                    continue
                w = self.watch(t, tensor_use_count(t) - refs + (pending and id(t) in outputs))
                if id(w) not in counted:
                    w.works += works
                    w.views += max(0, storage_use_count(storage_of(t)) - views)
                counted |= {id(t), id(w)}
        elif self.waiting:
            for t in tensors_in((args, kwargs)):
                if storage_of(t) not in self._watched:
                    self.watch(t, None)
        if self.watching:
            for t in tensors_in(out):
                if storage_of(t) in self._watched:
                    self.watch(t)

    def released(self) -> list[torch.UntypedStorage]:
        """The watched storages the step's thread no longer holds, whose collectives are done; no
        longer watched (nor their works held)."""
        gone = [st for st, w in list(self._watched.items()) if not w.held(st)]
        for st in gone:
            self._watched.pop(st, None)
        self.watching = bool(self._watched)
        return gone

    def in_wait(self, thread: int) -> contextlib.AbstractContextManager:
        """Counts a wait on the step's thread (others' waits are not the step's)."""
        if thread != self._thread:
            return contextlib.nullcontext()
        return _counted(self)


def _done(work: dist.Work) -> bool:
    """The collective is done: its future has its value (a waiter on the future returns then, before
    the worker runs the future's callbacks and marks the work itself completed), or, for a work
    without one (gloo's send and receive), the work is completed."""
    try:
        return work.get_future().done()
    except RuntimeError:
        return work.is_completed()


def _leaves(out) -> list:
    """An op's results, flat (a collective's: its tensors, or a list of them, and its work)."""
    return [y for x in (out if isinstance(out, (tuple, list)) else (out,))
            for y in (x if isinstance(x, (tuple, list)) else (x,))]


@contextlib.contextmanager
def _counted(c: Collectives):
    c.waiting += 1
    try:
        yield
    finally:
        c.waiting -= 1


@contextlib.contextmanager
def waits_seen(collectives: Collectives):
    """Inside, every `torch.distributed.Work.wait` is counted in `collectives.waiting` while it
    runs; after, the class is as it was. Without torch.distributed, nothing to see."""
    if not dist.is_available():
        yield
        return
    cls = dist.Work
    original = cls.wait

    @functools.wraps(original)
    def wait(work, *args, **kwargs):
        with collectives.in_wait(threading.get_ident()):
            return original(work, *args, **kwargs)

    cls.wait = wait
    try:
        yield
    finally:
        cls.wait = original


MARK = "remat::released "        # + a storage's address: a profiler event where it is taken as freed
STEP = "remat::step"             # a profiler event on the step's thread


def ranked() -> bool:
    """This process is a rank of a process group: its steps may run collectives."""
    return dist.is_available() and dist.is_initialized()


class Settling:
    """A dispatch mode (a base before it) watching the step's collectives: `collectives` and their
    waits seen while it is entered, and `settle()` (the subclass's: what it does with the storages
    only collectives still hold) run as it exits."""

    def watch_collectives(self) -> None:
        self.collectives = Collectives()
        self._waits = waits_seen(self.collectives)

    def __enter__(self):
        self._waits.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self.settle()
        try:
            return super().__exit__(*exc)
        finally:
            self._waits.__exit__(*exc)


class ReleaseMarks(Settling, TorchDispatchMode):
    """For `allocator_peak` on a rank: a profiler event `MARK` + address where NOTE [ frees on a
    collective's thread ] takes a storage a collective held as freed (the ops are watched, not
    changed), and one `STEP` on the step's thread as it starts."""

    def __init__(self):
        super().__init__()
        self.watch_collectives()

    def __enter__(self):
        with record_function(STEP):
            pass
        return super().__enter__()

    def settle(self) -> None:
        with disable_current_modes():
            for st in self.collectives.released():
                with record_function(MARK + str(st.data_ptr())):
                    pass

    def resized(self, st: torch.UntypedStorage, before: int) -> None:
        """A storage resized outside the dispatcher (`resizes_seen`): what was released first."""
        if self.collectives.watching:
            self.settle()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.collectives.watching:
            self.settle()
        before = self.collectives.counts(args, kwargs) if func.namespace == "c10d" else None
        out = func(*args, **(kwargs or {}))
        if self.collectives.waiting or self.collectives.watching or before is not None:
            self.collectives.saw(func, args, kwargs, out, before)
        return out
