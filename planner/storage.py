"""Live tensor bytes, tracked at the dispatcher by storage.

One mechanism serves both the profiler (on fake tensors) and the runtime's measurement (on real
CPU tensors): every storage that an op's output lives in is counted once, when it is first seen,
and uncounted when it is freed (a weakref finalizer on the storage object, which torch keeps alive
exactly as long as the storage itself). Views and in-place ops create no storage and cost nothing.

>>> import torch
>>> with LiveBytes() as live:
...     x = torch.ones(1000)
...     y = x * 2
>>> live.peak_bytes
8000
"""
from __future__ import annotations

import weakref
from typing import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


class LiveBytes(TorchDispatchMode):
    """Dispatch mode that tracks live storage bytes, their running peak, and who made them.

    `baseline` tensors (parameters, buffers, inputs) are counted from the start and tracked for
    frees like everything else. `on_alloc(storage, nbytes)` is called for each new storage.
    """

    def __init__(self, baseline: Iterable[torch.Tensor] = (), on_alloc=None):
        super().__init__()
        self._sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._on_alloc = on_alloc
        for t in baseline:
            self.add(t)
        self.peak_bytes = self.live_bytes

    def add(self, t: torch.Tensor) -> bool:
        """Count `t`'s storage if it is new; return whether it was."""
        st = storage_of(t)
        if st in self._sizes:
            return False
        n = st.nbytes()
        self._sizes[st] = n
        self.live_bytes += n
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        weakref.finalize(st, self._free, n)
        if self._on_alloc is not None:
            self._on_alloc(st, n)
        return True

    def _free(self, n: int) -> None:
        self.live_bytes -= n

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out
