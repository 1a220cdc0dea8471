"""Profiling an opaque module: one whose code fake tensors cannot run (it branches on values).

The module runs once for real, alone, on synthetic inputs of the right shapes (random floats,
zero integers) with detached copies of its parameters and buffers, so the user's model is not
touched. That run is measured with the same instruments as the fake profile (live bytes, saved
tensors, FLOPs, a backward). In the fake graph the node is then stood in for by two autograd
Functions that allocate, save and free those amounts, keep the gradient path to its inputs and
parameters, and produce outputs of the real shapes: `StandIn` (its outputs; in backward, its
input and parameter grads) inside `_Held` (what it still holds once it returned; in backward,
its measured peak on top of that, released before the grads are made). Only the module's own
activations are ever allocated, one opaque module at a time.
"""
from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, replace

import torch
from remat.planner.compat import (TorchDispatchMode, reparametrize_module, compute_required_storage_length, make_contiguous_strides_for, tree_flatten,
                     tree_map, tree_unflatten)
from remat.planner.compat import disable_current_modes as _disable_current_modes
from remat.planner.compat import TotalFlops, held_elsewhere

from remat.planner.step.kernels import FLOP_FORMULAS
from remat.planner.step.rng import host_rng_restored, rng_preserved
from remat.planner.step.state import buffers_restored
from remat.planner.step.storage import LiveBytes, unlinked


@dataclass(frozen=True)
class OpaqueCost:
    flops: int
    saved_input_positions: tuple[int, ...]   # which tensor inputs autograd still holds once it returned
    internal_saved_bytes: int                # saved storages made inside the module
    fwd_extra_bytes: int                     # forward peak above its inputs, outputs excluded
    bwd_extra_bytes: int                     # backward peak above what it starts with (saved, outputs' grads)
                                             # (its grads handed over by autograd, freed as they are used)
    host_random: bool = False                # drew Python or numpy random numbers
    writes_state: bool = False               # wrote a tensor attribute of its own in place
    saved_output_positions: tuple[int, ...] = ()   # which tensor outputs autograd still holds inside it
    cast_bytes: int = 0                      # autocast's cached weight casts it made: held to the step's end
    input_grad_strides: tuple = ()           # the layout of each tensor input's grad it made (None: none)
    unpack_extra_bytes: int = 0              # live in its backward when it first unpacks a saved tensor,
                                             # above what it starts with (`_Unpacks`)
    outliving: "Outliving" = None            # what its backward leaves alive to the step's end (`_outliving`)
    save_extra_bytes: int = 0                # forward peak above its inputs up to its last save, whatever was
                                             # alive then (outputs too): where a recompute may stop (`_Outs`)


@dataclass(frozen=True)
class Outliving:
    """What outlives a module's backward, held by something outside it until the step ends: the
    user's reentrant checkpoint under autocast recomputes from a detached copy of its input (a
    leaf), whose cast autocast caches until it exits; the cast's graph holds the copy, so the
    input's storage and the grad it gets (the one handed upstream) live as long as the cast."""
    bytes: int = 0                           # storages its backward made, its input grads aside
    inputs: tuple[int, ...] = ()             # inputs whose storage it holds
    grads: tuple[int, ...] = ()              # inputs whose grad (as it hands it on) it holds


@dataclass(frozen=True)
class TensorSpec:
    shape: torch.Size
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None    # the real output's layout: a later reshape may copy
    device: torch.device | None = None       # where it was made (meta, for a model planned on meta)


@dataclass(frozen=True)
class _Arg:
    """A fake input as the real runs need it (holding the fake tensor would keep it alive in the step)."""
    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool


def _spec_of(x):
    return _Arg(x.shape, x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else x


def _strided(shape, stride, dtype, device, value: float = 0.0) -> torch.Tensor:
    """A tensor of `value` with exactly this layout (overlapping ones, as an expanded grad, too); a
    dense one owns its storage (autograd may add a gradient into it in place, not into a view)."""
    size = compute_required_storage_length(shape, stride, 0)
    if size == math.prod(shape):
        return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(value)
    return torch.full((size,), value, dtype=dtype, device=device).as_strided(shape, stride)


def _real_like(t) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        x = torch.randn(t.shape, dtype=t.dtype)
    else:
        x = torch.zeros(t.shape, dtype=t.dtype)
    return x.requires_grad_(t.requires_grad)


def attribute_versions(module: torch.nn.Module) -> list[int]:
    """Version counters of the plain tensor attributes (neither parameters nor buffers) of a
    module and its submodules: a forward that bumps one writes state a recompute would write again."""
    return [t._version for m in module.modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]


def real_inputs(gm: torch.nn.Module, inputs: dict, names: tuple[str, ...]) -> dict[str, list]:
    """The real tensor inputs each opaque module gets in a no-grad forward of `gm(**inputs)`.

    Value-dependent code (a loop until convergence) runs as often on these as in the step, which
    it would not on random stand-ins. A no-grad forward keeps no activations; the RNG state and
    the buffers (BatchNorm statistics) are restored."""
    found: dict[str, list] = {}

    def hook(name):
        def pre(_m, args, kwargs):
            if name not in found:
                found[name] = [x.detach().clone() if isinstance(x, torch.Tensor) else x
                               for x in tree_flatten((args, kwargs))[0]]
        return pre
    handles = [gm.get_submodule(n).register_forward_pre_hook(hook(n), with_kwargs=True) for n in names]
    try:
        with buffers_restored(gm), torch.no_grad(), rng_preserved():
            gm(**inputs)
    finally:
        for h in handles:
            h.remove()
    return found


RANDOM_DRAWS = 8    # a module whose forward draws from torch's RNG is measured under this many seeds more


def _memory(cost: "OpaqueCost") -> int:
    return cost.internal_saved_bytes + cost.fwd_extra_bytes + cost.bwd_extra_bytes


def measure_opaque(module: torch.nn.Module, real_state: dict[str, torch.Tensor], args, kwargs, example=None,
                   grad_strides=None, held_grads=None):
    """Run `module` for real on `example` (its real inputs, see `real_inputs`), else on
    random inputs shaped like the fake `args`; returns (cost, fake-able outputs).

    A module whose forward draws from torch's RNG (`if torch.rand(()) < p: skip`) may take
    another branch in every step: it is measured again under RANDOM_DRAWS fixed seeds and the
    draw that holds the most memory is kept (the inputs any draw saves, all saved), so the plan
    does not depend on the draw that planning happened to see. `grad_strides`: the layout of each
    output's grad (default contiguous), as the step's backward hands them over; `held_grads`: whether
    the step holds each through the module's backward (default all: `_Seeds`)."""
    cost, shapes, drew = _measure_once(module, real_state, args, kwargs, example, grad_strides, held_grads)
    if not drew:
        return cost, shapes
    runs = [(cost, shapes)]
    for seed in range(RANDOM_DRAWS):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            runs.append(_measure_once(module, real_state, args, kwargs, example, grad_strides, held_grads)[:2])
    worst, worst_shapes = max(runs, key=lambda r: _memory(r[0]))
    saved = tuple(sorted(set().union(*(c.saved_input_positions for c, _ in runs))))
    return replace(worst, saved_input_positions=saved, flops=max(c.flops for c, _ in runs)), worst_shapes


def _measure_once(module: torch.nn.Module, real_state: dict[str, torch.Tensor], args, kwargs, example=None,
                  grad_strides=None, held_grads=None):
    """One real run of `measure_opaque`: (cost, fake-able outputs, whether it drew from torch's RNG)."""
    # the profile's own modes (fake tensors, its meters) must not see this real run
    with _disable_current_modes(), rng_preserved():
        r_args, r_kwargs, inputs = _real_call(args, kwargs, example)
        state = {k: (v.detach().clone().requires_grad_(v.requires_grad)) for k, v in real_state.items()}
        in_strides, in_grads = _grad_layouts(inputs)
        made: list[tuple[weakref.ref, int]] = []       # the storages made while metered, in order
        saves, unpacks = _Saves(), _Unpacks()
        # the copies stand in for the module's tensors through backward too: a checkpoint inside it
        # recomputes there, and must use (and give gradients to) the copies, not the user's tensors
        # FlopCounterMode outside the meter: it decomposes ops it has no formula for (silu_backward),
        # and the meter must see the ops the step runs, not their decompositions' temporaries
        with reparametrize_module(module, state, tie_weights=True), \
                TotalFlops(display=False, custom_mapping=FLOP_FORMULAS) as fc, \
                LiveBytes(baseline=inputs + list(state.values()),
                          on_alloc=lambda st, n: made.append((weakref.ref(st), n))) as live, \
                _Casts(state.values(), live) as casts:
            start, saves.casts = live.live_bytes, casts
            drawn: list[bool] = []
            versions = attribute_versions(module)
            torch_rng = torch.random.get_rng_state()
            unpacks.live = live
            with torch.autograd.graph.saved_tensors_hooks(saves, unpacks), host_rng_restored(drawn):
                out = module(*r_args, **r_kwargs)
            torch_rng = (torch_rng, torch.random.get_rng_state())   # compared after the meter: it would count them
            writes_state = versions != attribute_versions(module)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            out_bytes = sum(t.untyped_storage().nbytes() for t in outs)
            # What its graph still holds now that it returned, its outputs aside (a branch that died
            # in forward, `delta.norm() < tol`, held its saved tensors only while it ran); the inputs
            # and outputs it still saves, the stand-in holds (saved by it)
            held = max(0, live.live_bytes - start - out_bytes)
            saved_inputs, saved_outputs = _still_saved(saves.packed, inputs, outs)
            fwd_extra = max(0, live.peak_bytes - start - out_bytes)
            in_backward = len(made)
            bwd_extra, bwd_start = _backward_extra(live, [t for t in outs if t.requires_grad], grad_strides, held_grads)
            # the casts of its weights that autocast caches (and a recompute reuses) live until autocast
            # exits, after the step's backward: the stand-in makes them first and holds them to the
            # step's end (`step_held`), apart from what it holds until its backward
            cast_bytes = casts.alive_bytes()
            held, fwd_extra = max(0, held - cast_bytes), max(0, fwd_extra - cast_bytes)
        shapes = tree_map(lambda t: TensorSpec(t.shape, t.dtype, t.stride(), t.device) if isinstance(t, torch.Tensor)
                          else t, out)
        in_storages = [weakref.ref(x.untyped_storage()) for x in inputs]
        for t in state.values():
            t.grad = None
        del out, outs, r_args, r_kwargs, inputs, state       # what the measurement holds: now only weakly
        outliving = _outliving(made[in_backward:], in_storages, in_grads, casts)
        cost = OpaqueCost(fc.get_total_flops(), saved_inputs, held, fwd_extra, bwd_extra, drawn[0], writes_state,
                          saved_outputs, cast_bytes, tuple(in_strides), unpacks.extra(bwd_start), outliving,
                          max(0, saves.peak_bytes - start))
        drew_torch = not torch.equal(*torch_rng)
    return cost, shapes, drew_torch


def _real_call(args, kwargs, example) -> tuple[tuple, dict, list[torch.Tensor]]:
    """Real (args, kwargs) for a call like (args, kwargs), made from `example` (the module's real
    inputs, cloned) or synthetic; and its tensor inputs."""
    flat, spec = tree_flatten((args, kwargs))
    is_tensor = [isinstance(x, (torch.Tensor, _Arg)) for x in flat]
    if example is not None and len(example) == len(flat):
        real = [e.detach().clone().requires_grad_(x.requires_grad) if t else x
                for e, x, t in zip(example, flat, is_tensor)]
    else:
        real = [_real_like(x) if t else x for x, t in zip(flat, is_tensor)]
    # in a step its inputs come out of other ops: their gradients from several uses are summed by
    # autograd into a new tensor, not accumulated into a leaf's .grad in place; so are these
    real = [x.view_as(x) if isinstance(x, torch.Tensor) and x.requires_grad else x for x in real]
    r_args, r_kwargs = tree_unflatten(real, spec)
    return r_args, r_kwargs, [x for x, t in zip(real, is_tensor) if t]


def _grad_layouts(inputs: list[torch.Tensor]) -> tuple[list, list]:
    """Filled in backward: the layout (strides) of the grad the module makes for each input (None:
    none), which the step hands on upstream; and its storage (a weak reference)."""
    strides: list = [None] * len(inputs)
    storages: list = [None] * len(inputs)

    def seen(g, k):
        strides[k], storages[k] = tuple(g.stride()), weakref.ref(g.untyped_storage())
    for k, x in enumerate(inputs):
        if x.requires_grad:
            x.register_hook(lambda g, k=k: seen(g, k))
    return strides, storages


def _outliving(made: list, inputs: list, grads: list, casts: "_Casts") -> Outliving:
    """What is still alive of the storages a backward made (`made`) and of its inputs' (weak
    references), once the measurement dropped its own references: held by something else to the
    step's end (autocast's cache: `Outliving`). The casts of its weights are `cast_bytes`."""
    cast_ids = {id(st) for st in (ref() for ref in casts.made) if st is not None}
    grad_ids = {id(st): k for k, st in enumerate(ref() if ref is not None else None for ref in grads)
                if st is not None}
    alive = {id(st): n for st, n in ((ref(), n) for ref, n in made) if st is not None and id(st) not in cast_ids}
    held_grads = tuple(sorted(grad_ids[i] for i in alive if i in grad_ids))
    return Outliving(sum(n for i, n in alive.items() if i not in grad_ids),
                     tuple(k for k, ref in enumerate(inputs) if ref() is not None), held_grads)


def _still_saved(packed: list, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[tuple, tuple]:
    """Positions of the inputs and of the outputs whose storage autograd still saves."""
    saved = [st() for ref, st in packed if ref() is not None]
    ins = tuple(i for i, x in enumerate(inputs) if any(x.untyped_storage() is st for st in saved))
    outs_saved = tuple(k for k, t in enumerate(outs) if any(t.untyped_storage() is st for st in saved))
    return ins, outs_saved


def _backward_extra(live: LiveBytes, grads: list[torch.Tensor], grad_strides, held_grads=None) -> tuple[int, int]:
    """The backward's peak above what it starts with (saved tensors and the outputs' grads, which
    autograd makes (_Seeds) and frees once used, as the step's backward hands them over), and that start."""
    strides = list(grad_strides) if grad_strides is not None else [make_contiguous_strides_for(t.shape) for t in grads]
    seed, held = torch.zeros(()), []
    hold = list(held_grads) if held_grads is not None else [True] * len(grads)
    root = _Seeds.apply(strides, hold, held, *grads) if grads else None
    live.reset_peak()
    before = live.live_bytes + sum(compute_required_storage_length(t.shape, st, 0) * t.element_size()
                                   for t, st in zip(grads, strides))
    if grads:
        torch.autograd.backward(root, seed)
    del root, held
    return max(0, live.peak_bytes - before), before


class _Saves:
    """The pack hook of a measured forward: what autograd saved (and its storage), held weakly
    (`packed`), and the forward's peak up to its last save, its weights' casts aside (`peak_bytes`;
    NOTE [ a recompute stops at the last save ])."""

    def __init__(self):
        self.packed: list[tuple[weakref.ref, weakref.ref]] = []
        self.casts: _Casts | None = None
        self.peak_bytes = 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        p = unlinked(t)
        self.packed.append((weakref.ref(p), weakref.ref(t.untyped_storage())))
        self.peak_bytes = self.casts.peak_bytes
        return p


class _Unpacks:
    """An unpack hook that records the live bytes when a module's backward first unpacks a tensor
    it saved: a checkpoint region around the module recomputes right then, on top of what the
    module's backward holds at that moment (the grads it made so far: fuzz seed 40132, a Linear
    after a `-h` unpacks its input once the negated grad exists, one activation more than at the
    start of the module's backward). `extra(start)`: that above `start`, 0 when nothing was unpacked."""

    def __init__(self):
        self.live: LiveBytes | None = None
        self.first: int | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if self.live is not None and self.first is None:
            self.first = self.live.live_bytes
        return t

    def extra(self, start: int) -> int:
        return 0 if self.first is None else max(0, self.first - start)


class _Casts(TorchDispatchMode):
    """Remembers the copies made of `tensors` (autocast's casts of a module's weights, which its
    cache keeps until autocast exits); `alive_bytes` are those still alive; `peak_bytes`, the
    running peak of `live`'s bytes (a meter below this mode) less those alive after each op.
    Autocast caches the casts of leaves that require grad only: a frozen weight's cast is made
    again in each use, and in a recompute (fuzz seed 41711: held to the step's end as a cached
    one, the stand-in's recompute was two frozen weights' casts under the measured peak)."""

    def __init__(self, tensors, live: LiveBytes):
        super().__init__()
        self.ids = {id(t) for t in tensors if t.requires_grad}
        self.made: list[weakref.ref] = []
        self.live, self.peak_bytes = live, live.live_bytes + live.read_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and id(args[0]) in self.ids:
            self.made.append(weakref.ref(out.untyped_storage()))
        self.peak_bytes = max(self.peak_bytes, self.live.live_bytes + self.live.read_bytes - self.alive_bytes())
        return out

    def alive_bytes(self) -> int:
        alive = {id(st): st.nbytes() for st in (ref() for ref in self.made) if st is not None}
        return sum(alive.values())


class _Seeds(torch.autograd.Function):
    """A scalar whose backward gives each of its inputs a gradient of ones, laid out as given,
    and keeps those `hold` names in `held` until the measurement drops it: in a step the grad of a
    module's output may be another node's too (a residual `x + f(x)` hands the same grad to both
    branches: autograd keeps it for the other), so it lives through the module's whole backward
    (fuzz seed 40596: freed at its first use inside the module, an opaque block's backward peak
    missed one activation, 18% under the measured peak); one the step does not share is freed
    at its first use, or added into in place by autograd (fuzz seed 40501: a held one cost the
    module's residual sum a new tensor, 5% over). The step's backward tells which (`grads_held`)."""

    @staticmethod
    def forward(ctx, strides, hold: list, held: list, *outs):
        ctx.specs = [(t.shape, st, t.dtype, t.device) for t, st in zip(outs, strides)]
        ctx.hold, ctx.held = hold, held
        return torch.zeros(())

    @staticmethod
    def backward(ctx, grad):
        grads = tuple(_strided(shape, st, dtype, device, 1.0) for shape, st, dtype, device in ctx.specs)
        ctx.held.extend(g for g, h in zip(grads, ctx.hold) if h)
        return (None, None, None) + grads


_STEP_HELD: dict[int, torch.Tensor] = {}   # what stand-ins hold to the end of the step (autocast's casts), by module
_HELD_TO_END: list[torch.Tensor] = []      # what their backwards leave alive to the step's end (`Outliving`)


@contextlib.contextmanager
def step_held():
    """Around a fake step: what its stand-ins hold to the step's end is released at the end."""
    try:
        yield
    finally:
        _STEP_HELD.clear()
        _HELD_TO_END.clear()


def _outliving_of(cost: OpaqueCost) -> Outliving:
    return cost.outliving if cost.outliving is not None else Outliving()


class _Measured:
    """One stand-in's measurement, shared by its StandIn and _Held: the cost as measured with
    contiguous output grads, all held through its backward, and again (once per kind) with the
    grads the step hands over."""

    def __init__(self, cost: OpaqueCost, rerun):
        self.cost, self._rerun, self._by_layout = cost, rerun, {}

    def for_grads(self, strides: tuple, held: tuple) -> OpaqueCost:
        """The cost with output grads of these layouts, held through its backward or not: a
        non-contiguous one (the backward of a transpose after it) may be copied by the module, or
        be passed on as it is."""
        if (strides, held) not in self._by_layout:
            self._by_layout[strides, held] = self._rerun(strides, held)
        self.cost = self._by_layout[strides, held]
        return self.cost


class StandIn(torch.autograd.Function):
    """Fake-tensor stand-in for an opaque module, with its measured memory behaviour: its
    outputs, and in backward the gradients of its inputs (in the layouts the module made them)
    and parameters. What the module saves inside itself, and its backward's peak, are `_Held`'s,
    around it."""

    @staticmethod
    def forward(ctx, measured: _Measured, out_specs: list, n_inputs: int, *tensors):
        cost = measured.cost
        inputs, params = tensors[:n_inputs], tensors[n_inputs:]
        for p in params:
            p.view(-1)          # records that the node reads its parameters
        if _outputs_late(cost):     # its forward up to its last save; `_Outs` makes the outputs
            outs = tuple(_placeholder(o) for o in out_specs)
            small = sum(t.untyped_storage().nbytes() for t in outs)
            tmp = torch.empty(max(0, cost.save_extra_bytes - small), dtype=torch.uint8)
        else:
            outs = _outputs(out_specs)
            # its forward's working memory on top of its outputs: a module's peak is often as it makes
            # its output, while the temporaries Python still holds are alive (an earlier peak is met too)
            tmp = torch.empty(cost.fwd_extra_bytes, dtype=torch.uint8)
        del tmp
        # an input its backward leaves alive (`Outliving`) it holds until then (a reentrant checkpoint saves it)
        ctx.saved_inputs = sorted(set(cost.saved_input_positions) | set(_outliving_of(cost).inputs))
        ctx.save_for_backward(*[inputs[i] for i in ctx.saved_inputs],
                              *[outs[i] for i in cost.saved_output_positions])
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors]
        ctx.measured, ctx.n_inputs = measured, n_inputs
        return outs

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors      # held while the grads are made (recomputed, only this holds them)
        layouts = ctx.measured.cost.input_grad_strides
        made = []
        for k, (shape, dtype, device) in enumerate(ctx.shapes):
            stride = layouts[k] if k < ctx.n_inputs else None      # one per input, None: no grad
            made.append(None if not dtype.is_floating_point else
                        _strided(shape, stride, dtype, device) if stride is not None else
                        torch.zeros(shape, dtype=dtype, device=device))
        outliving = _outliving_of(ctx.measured.cost)
        _HELD_TO_END.extend([saved[ctx.saved_inputs.index(i)] for i in outliving.inputs if i in ctx.saved_inputs]
                            + [made[k] for k in outliving.grads if made[k] is not None]
                            + [torch.empty(outliving.bytes, dtype=torch.uint8)])
        del saved
        return (None, None, None) + tuple(made)


class _Held(torch.autograd.Function):
    """What an opaque module saves inside itself, held from its forward to its backward, where
    the backward's measured peak is reached on top of it and of the outputs' grads; released when
    this node's backward returns, before StandIn's makes the input and parameter grads: as a real
    module's backward ends, its saved tensors and the grads it was given are freed and its grads
    made (StandIn gets grads of the right shapes that hold one element each)."""

    @staticmethod
    def forward(ctx, measured: _Measured, *outs):
        ctx.save_for_backward(torch.empty(measured.cost.internal_saved_bytes, dtype=torch.uint8))
        ctx.measured = measured
        ctx.outs = [(o.shape, o.requires_grad) for o in outs]
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        cost = ctx.measured.cost
        given = [(g, shape) for g, (shape, needs) in zip(grads, ctx.outs) if needs]
        held = tuple(g is None or held_elsewhere(g) for g, _ in given)
        if not all(held) or any(g is not None and not g.is_contiguous() for g, _ in given):  # measured so
            cost = ctx.measured.for_grads(tuple(tuple(g.stride()) if g is not None else make_contiguous_strides_for(shape)
                                                for g, shape in given), held)
        # this is the module's first unpack: a checkpoint region around it recomputes now, on top of
        # the grads the module's backward made before its first unpack (`_Unpacks`); the saved
        # tensors are held through the peak: when a region recomputed them, the unpacked tensors are
        # the only reference left (checkpoint's storage drops each as it is unpacked)
        made = torch.empty(cost.unpack_extra_bytes, dtype=torch.uint8)
        saved = ctx.saved_tensors
        del made
        tmp = torch.empty(cost.bwd_extra_bytes, dtype=torch.uint8)
        del tmp, saved
        return (None,) + tuple(g.new_zeros(()).expand_as(g) if g is not None else None for g in grads)


# NOTE [ a recompute stops at the last save ]
# torch's non-reentrant checkpoint stops a region's recompute as soon as it has remade the last
# tensor the region's forward saved (early stop, on by default): the module that saved it runs only
# up to that save, and its outputs and what it did after are never made again. An opaque module
# alone in a region (or the last in it to save) is recomputed on top of what the backward holds at
# its first unpack, and its stand-in made its outputs and its whole forward peak before its saves:
# over by its outputs and more (fuzz seeds 41383, 41711, 20724: 5-7%, at that recompute). Unless it
# saves one of its outputs (made before its last save, then), the stand-in runs in the order the
# module does: StandIn reaches the forward's peak up to its last save (`save_extra_bytes`, with
# what was alive then, outputs made by then too; the one-element placeholders it gives for its
# outputs within it); `_Held` makes and saves what the module still holds (its last save: the
# recompute of a region that ends here stops there); `_Outs` after it makes the outputs and the
# rest of the forward's peak. Where the forward goes on, its peak is the whole forward's, as before.

def _outputs_late(cost: OpaqueCost) -> bool:
    return not cost.saved_output_positions


def _outputs(out_specs: list) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_strided(o.shape, o.stride, dtype=o.dtype, device=o.device) if o.stride is not None
                 else torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in out_specs)


def _placeholder(o: TensorSpec) -> torch.Tensor:
    """An output's shape and dtype on one element (NOTE [ a recompute stops at the last save ])."""
    return torch.empty_strided(o.shape, (0,) * len(o.shape), dtype=o.dtype, device=o.device)


class _Outs(torch.autograd.Function):
    """An opaque module's outputs, made after its last save, and the rest of its forward's peak on
    top of what it holds (NOTE [ a recompute stops at the last save ]); in backward, their grads
    passed on as they are."""

    @staticmethod
    def forward(ctx, measured: _Measured, out_specs: list, *placeholders):
        cost = measured.cost
        outs = _outputs(out_specs)
        small = sum(t.untyped_storage().nbytes() for t in placeholders)
        tmp = torch.empty(max(0, cost.fwd_extra_bytes - cost.internal_saved_bytes - small), dtype=torch.uint8)
        del tmp
        return outs

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + grads


def _autocast_now() -> list[tuple[str, torch.dtype, bool]]:
    return [(d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
            for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]


@contextlib.contextmanager
def _autocast(states: list[tuple[str, torch.dtype, bool]]):
    with contextlib.ExitStack() as stack:
        for device, dtype, cache in states:
            stack.enter_context(torch.autocast(device, dtype=dtype, cache_enabled=cache))
        yield


# NOTE [ one measurement a planning ]
# Every exact replay of a plan (runtime.planning.ExactReplay) stands in for each opaque module with
# a real run of it (`measure_opaque`: nine runs where it draws random numbers), and a plan's search
# replays up to a dozen plans and every known plan for its floor: the same module, on the same
# example, with the same input shapes and output-grad layouts, measured again and again (fuzz seed
# 41711: 16 of a check's 28 s). The replay's `memo` keeps each measurement for the planning:
# keyed by the module, its inputs' specs, its example, the autocast state and the grads' layout;
# a key that cannot be hashed (an argument of a type without a hash) is measured every time.
# Within one planning nothing a measurement reads changes (the example, the module's state), so the
# stand-in is the same as measured again, and a module that draws random numbers stands in the same
# way in every plan's replay (before, its first run drew from wherever the RNG stood).

def _memo_key(module, specs, example, autocast, layout):
    leaves, spec = tree_flatten(specs)
    key = (id(module), id(example), tuple(autocast), layout, tuple(leaves), str(spec))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def stand_in(module: torch.nn.Module, real_state: dict[str, torch.Tensor], args, kwargs, example=None,
             around=contextlib.nullcontext, memo: dict | None = None):
    """`module(*args, **kwargs)` on fake tensors: measured for real, stood in for by StandIn.
    Returns (outputs, cost); the module's parameters, as they are now (fake), get the grads.
    `around()`: what every real run of the module is inside (its own forward and hooks). `memo`:
    the measurements of earlier steps of one planning (NOTE [ one measurement a planning ])."""
    specs = tree_map(_spec_of, (args, kwargs))
    autocast = _autocast_now()

    def measure(*layout):
        key = _memo_key(module, specs, example, autocast, layout) if memo is not None else None
        if key is None:
            return measure_opaque(module, real_state, *specs, example, *layout)
        if key not in memo:
            memo[key] = measure_opaque(module, real_state, *specs, example, *layout)
        return memo[key]

    def rerun(grad_strides, held_grads):        # in the step's backward: as in its forward
        with around(), torch.enable_grad(), _autocast(autocast):
            return measure(grad_strides, held_grads)[0]
    with around():
        cost, out_spec = measure()
    if cost.cast_bytes and id(module) not in _STEP_HELD:   # a recompute finds them in autocast's cache
        _STEP_HELD[id(module)] = torch.empty(cost.cast_bytes, dtype=torch.uint8)
    flat_spec, spec = tree_flatten(out_spec)
    tensor_specs = [x for x in flat_spec if isinstance(x, TensorSpec)]
    inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    for t in _plain_tensors(module):       # read for real out of the meters' sight: counted here, once
        torch.ops.aten.alias.default(t)
    measured = _Measured(cost, rerun)
    outs = _Held.apply(measured, *StandIn.apply(measured, tensor_specs, len(inputs), *inputs, *module.parameters()))
    if _outputs_late(cost):         # NOTE [ a recompute stops at the last save ]
        outs = _Outs.apply(measured, tensor_specs, *outs)
    outs = iter(outs)
    return tree_unflatten([next(outs) if isinstance(x, TensorSpec) else x for x in flat_spec], spec), cost


def _plain_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """The plain tensor attributes of `module` and its submodules (not parameters or buffers: a
    rotary table `self.freqs`), which its real runs read and a step's meter counts as live from its
    first read (fuzz seed 40044: a rebound `freqs` in an opaque block, 16 B under the measured peak)."""
    return [v for m in module.modules() for v in vars(m).values()
            if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]


class _Loss(torch.nn.Module):
    """A loss function as a module, so that it is measured and stood in for as opaque modules are."""

    def __init__(self, loss_fn):
        super().__init__()
        self.loss_fn = loss_fn

    def forward(self, out):
        return self.loss_fn(out)


class _Reads(TorchDispatchMode):
    """The tensors ops read that no op in the block made (a loss's targets, closed over)."""

    def __init__(self):
        super().__init__()
        self.made: set[int] = set()
        self.read: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in self.made:
                self.read.setdefault(id(t.untyped_storage()), t)
        out = func(*args, **(kwargs or {}))
        self.made |= {id(t.untyped_storage()) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
        return out


def measured_loss(loss_fn, output: list):
    """`loss_fn` as the fake step runs it when fake tensors cannot (no fake kernel: `ctc_loss`; a
    value-dependent shape): run for real once per call on `output` (the model's real output,
    flattened), stood in for by its measured memory behaviour. The tensors it reads besides the
    output (its targets) are read by the fake step too, so that the step's meter counts them."""
    module = _Loss(loss_fn)
    targets: list[torch.Tensor] = []

    def loss(out):
        if not targets:
            spec = tree_flatten(((out,), {}))[1]
            real_out = tree_unflatten(output, spec)[0][0]
            mine = {id(t.untyped_storage()) for t in output if isinstance(t, torch.Tensor)}
            with _disable_current_modes(), torch.no_grad(), _Reads() as reads:
                loss_fn(real_out)
            targets.extend(t for k, t in reads.read.items() if k not in mine)
            targets.append(torch.empty(0))       # found: not looked for again
        for t in targets:
            torch.ops.aten.alias.default(t)
        return stand_in(module, {}, (out,), {}, output)[0]
    return loss
