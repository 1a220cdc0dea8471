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

import functools
import sys
import weakref
from typing import Iterable

import torch
from remat.planner.compat import TorchDispatchMode, current_fake_mode, suggest_memory_format
from remat.planner.compat import disable_current_modes as _disable_current_modes


# ATen kernels that return a reduced loss (mean or sum) as a 0-dim view of their unreduced,
# input-sized buffer: the real output pins a storage as large as the input until the loss is
# freed, where the fake (meta) output holds one element. tests/test_storage.py checks this
# table against the real kernels, and that torch's other losses do not do it.
PINNING_LOSSES = frozenset({"aten::mse_loss", "aten::smooth_l1_loss", "aten::soft_margin_loss",
                            "aten::binary_cross_entropy"})


def output_storage_bytes(func, args, kwargs, t: torch.Tensor) -> int:
    """The bytes of the storage the real kernel of `func` gives its output `t` (for a fake or
    meta `t`, what the real kernel would allocate; for a real one, what it did)."""
    n = t.untyped_storage().nbytes()
    if func._schema.name not in PINNING_LOSSES or not (t.is_meta or type(t).__name__ == "FakeTensor"):
        return n
    names = [a.name for a in func._schema.arguments]
    reduction = (kwargs or {}).get("reduction", args[names.index("reduction")] if len(args) > names.index("reduction") else 1)
    if reduction == 0:                      # 'none': the output is the unreduced buffer already
        return n
    shape = torch.broadcast_shapes(args[0].shape, args[1].shape)
    return max(n, shape.numel() * t.element_size())


# CPU kernels that give their first output the suggested memory format of an input (contiguous
# for a transposed (N, C, L) tensor) where their meta kernels keep that input's strides: name ->
# the input's position. A later reshape then copies for real but not on fake tensors.
# tests/test_trust.py checks each against its real kernel.
SUGGESTED_LAYOUT = {"aten::native_batch_norm": 0, "aten::native_batch_norm_backward": 1}
# CPU norms whose saved statistics (outputs 1 and 2) are float32 for a bfloat16/float16 input with
# float32 parameters (autocast's mixed dtypes), where the meta kernels' follow the input: name ->
# the positions of the parameters (a weight, a bias or running statistics; any may be None).
MIXED_STATISTICS = {"aten::native_batch_norm": (1, 3), "aten::native_layer_norm": (2, 3),
                    "aten::native_group_norm": (1, 2)}
# CPU norm backwards whose input gradient (output 0) has the input's dtype, where the meta kernel's
# is float32: name -> the input's position.
INPUT_GRAD_DTYPE = {"aten::native_group_norm_backward": 1}


def real_layout(func, args, out):
    """`out` as the real kernel lays it out, where the meta kernel differs: layouts
    (SUGGESTED_LAYOUT) and dtypes (MIXED_STATISTICS, INPUT_GRAD_DTYPE) of CPU kernels."""
    name = func._schema.name
    if name not in SUGGESTED_LAYOUT and name not in MIXED_STATISTICS and name not in INPUT_GRAD_DTYPE:
        return out
    y = out[0]
    if not isinstance(y, torch.Tensor) or type(y).__name__ != "FakeTensor" or y.device.type != "cpu":
        return out
    out = tuple(out)
    if name in SUGGESTED_LAYOUT:
        fmt = suggest_memory_format(args[SUGGESTED_LAYOUT[name]])
        if not y.is_contiguous(memory_format=fmt):
            out = (torch.empty(y.shape, dtype=y.dtype, device=y.device, memory_format=fmt),) + out[1:]
    params = [args[i] for i in MIXED_STATISTICS.get(name, ()) if i < len(args) and isinstance(args[i], torch.Tensor)]
    if params and params[0].dtype == torch.float32 and out[1].dtype != torch.float32:
        out = out[:1] + tuple(torch.empty(t.shape, dtype=torch.float32, device=t.device) for t in out[1:3]) + out[3:]
    source = INPUT_GRAD_DTYPE.get(name)
    if source is not None and y.dtype != args[source].dtype:
        out = (torch.empty_like(y, dtype=args[source].dtype),) + out[1:]
    return out


def fake_twin(t: torch.Tensor) -> torch.Tensor | None:
    """Under a FakeTensorMode, the fake tensor it makes of the real `t` when an op reads `t`
    (memoized: the same one every time), else None. Its storage is `t`'s, not new memory."""
    if type(t).__name__ == "FakeTensor":
        return None
    mode = current_fake_mode()
    return mode.from_tensor(t) if mode is not None else None


def fake_copy(mode, t: torch.Tensor) -> torch.Tensor:
    """`mode.from_tensor(t)`, except that a tensor whose storage was freed (resized to 0: FSDP2's
    gathered parameters between uses, the planning copy of runtime/distributed/fsdp.py) becomes a fake
    tensor with a storage of its full size, as it is when it computes."""
    if t.untyped_storage().nbytes() or not t.numel() or t.device.type == "meta":
        return mode.from_tensor(t)
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)


def unlinked(t: torch.Tensor) -> torch.Tensor:
    """What a saved-tensor pack hook returns: `t` detached (same storage, same version counter),
    seen by no dispatch mode. Returning `t` itself would make every saved *output* a reference
    cycle (its node holds it, it holds its node) that autograd frees only for unhooked saves, so a
    branch that dies in forward (`delta.norm() < tol` saves delta and the norm) would stay alive."""
    with _disable_current_modes():
        return t.detach()


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    return t.untyped_storage()


class LiveBytes(TorchDispatchMode):
    """Dispatch mode that tracks live storage bytes, their running peak, and who made them.

    `baseline` tensors (parameters, buffers, inputs) are counted from the start and tracked for
    frees like everything else. `on_alloc(storage, nbytes)` is called for each new storage.

    A tensor an op reads that no op made and the baseline does not hold (a loss target, a mask
    or a constant the step closes over) existed before the step and outlives it: it is counted
    once, as if it had been in the baseline from the start (`read_bytes`, included in
    `peak_bytes`). `known` tensors are counted elsewhere already (the real tensors a fake
    baseline was made from) and are never counted again.
    """

    def __init__(self, baseline: Iterable[torch.Tensor] = (), on_alloc=None, known: Iterable[torch.Tensor] = (),
                 host: bool | None = None):
        super().__init__()
        baseline = list(baseline)
        # whether the step's memory is the host's: its RNG states count (NOTE [ host RNG states ])
        self.host = host if host is not None else all(t.device.type in ("cpu", "meta") for t in baseline)
        self._sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._read_sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # storage -> bytes
        for t in known:
            self._read_sizes[storage_of(t)] = 0
        self.live_bytes = 0
        self.read_bytes = 0        # storages read but made before the step (see class doc)
        self._twins: list[torch.Tensor] = []     # the fake copies of those (`read`), kept
        self._peak = 0
        self._on_alloc = on_alloc
        for t in baseline:
            self.add(t)
        self._peak = self.live_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak + self.read_bytes

    def add(self, t: torch.Tensor, nbytes: int | None = None) -> bool:
        """Count `t`'s storage (`nbytes`, default its size) if it is new; return whether it was."""
        st = storage_of(t)
        if st in self._sizes or st in self._read_sizes:     # new, not one read before the step
            return False
        n = st.nbytes() if nbytes is None else nbytes
        self._sizes[st] = n
        self.live_bytes += n
        if self.live_bytes > self._peak:
            self._peak = self.live_bytes
        weakref.finalize(st, self._free, n)
        if self._on_alloc is not None:
            self._on_alloc(st, n)
        return True

    def _free(self, n: int) -> None:
        self.live_bytes -= n

    def reset_peak(self) -> None:
        self._peak = self.live_bytes

    def read(self, t: torch.Tensor) -> bool:
        """Count `t`'s storage if no op made it and it is not counted yet; return whether it was."""
        st = storage_of(t)
        if st in self._sizes or st in self._read_sizes:
            return False
        self._read_sizes[st] = st.nbytes()
        self.read_bytes += st.nbytes()
        twin = fake_twin(t)
        if twin is not None:            # the fake copy the fake mode will compute on: not new memory
            self._read_sizes[storage_of(twin)] = 0
            # held, so that the fake mode's memo gives the op this copy: dropped, the op made another
            # on a storage of its own, counted as new (fuzz seed 40274: a loss target's chunks, twice)
            self._twins.append(twin)
        return True

    def __enter__(self):
        out = super().__enter__()
        _rng_states_seen(self, True)
        return out

    def __exit__(self, *exc):
        _rng_states_seen(self, False)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tensors_in((args, kwargs)):
            self.read(t)
        out = real_layout(func, args, func(*args, **(kwargs or {})))
        for t in tensors_in(out):
            self.add(t, output_storage_bytes(func, args, kwargs, t))
        return out


# NOTE [ host RNG states ]
# torch.utils.checkpoint with preserve_rng_state (every region remat inserts) keeps the CPU
# generator's state, a 5,056 B tensor on torch 2.13, from the region's forward until its
# recompute, and the recompute's fork_rng holds one more while it runs. `torch.get_rng_state`
# makes them outside the dispatcher: the CPU allocator saw them and no meter did (a 4-block GPT's
# planned step 0.6% over its metered peak; a pipeline rank keeping several micro-batches'
# regions in flight, up to 3.3% over its budget). While a meter runs, `torch.get_rng_state` is
# wrapped and each state it returns is counted by every running meter of a host step, until it
# is freed: on real tensors and in the fake replay alike (the replay runs the same checkpoint
# code, and its states are real host tensors). Not counted: the states of a reentrant checkpoint
# (the user's own, `use_reentrant=True`), which the replay does not run but stands in for as an
# opaque module's measured memory, not exact around its RNG state (fuzz seed 20158: 3 kB under
# inside a region under autocast); as before, the allocator sees them. A CUDA step's states are host memory, outside
# the device's allocator: its meters do not count them; a meta step (planned for no device in
# particular) counts them as the CPU's, which errs high for a device by a few kB a region. The
# solver's model counts them too (`CostGraph.region_state_bytes`, NOTE [ liveness ]).
_meters: list[LiveBytes] = []
_unwrapped = [torch.get_rng_state]      # torch's, while a meter runs


def _get_rng_state() -> torch.Tensor:
    state = _unwrapped[0]()
    counting = [meter for meter in _meters if meter.host]
    if counting and not _in_reentrant_checkpoint():
        for meter in counting:
            meter.add(state)
    return state


@functools.lru_cache(maxsize=None)
def _reentrant_codes() -> tuple:
    from torch.utils.checkpoint import CheckpointFunction
    return CheckpointFunction.forward.__code__, CheckpointFunction.backward.__code__


def _in_reentrant_checkpoint(depth: int = 6) -> bool:
    """Whether torch's reentrant checkpoint (`CheckpointFunction`, the user's own: remat's regions
    are non-reentrant) is asking, within `depth` frames of `_get_rng_state`'s caller."""
    codes, frame = _reentrant_codes(), sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in codes:
            return True
        frame = frame.f_back
    return False


def _rng_states_seen(meter: LiveBytes, on: bool) -> None:
    """`meter` starts (`on`) or stops counting the host RNG states made while it runs."""
    if on:
        if not _meters:
            _unwrapped[0], torch.get_rng_state = torch.get_rng_state, _get_rng_state
        _meters.append(meter)
    elif meter in _meters:
        _meters.remove(meter)
        if not _meters:
            torch.get_rng_state = _unwrapped[0]


@functools.lru_cache(maxsize=None)
def _host_state_bytes() -> int:
    return torch.random.default_generator.get_state().untyped_storage().nbytes()


def region_state_bytes(device: torch.device) -> int:
    """The host RNG state a checkpoint region keeps, as a step on `device` counts it (NOTE [ host
    RNG states ]): a CPU step's (and a meta step's, planned as the CPU's) memory holds it, a
    device step's allocator does not."""
    return _host_state_bytes() if device.type in ("cpu", "meta") else 0


def tensors_in(tree, out: list | None = None) -> list:
    """The tensors in an op's arguments or results (tuples, lists and dicts of them, nested), in
    pytree's order: the dispatch modes' hot path (pytree's tree_flatten took 11 us a call here, 1.8
    this; two calls an op, 27 k ops a Llama-2-7B step)."""
    out = [] if out is None else out
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            tensors_in(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            tensors_in(x, out)
    return out
