"""Capture a model as a torch.fx GraphModule: fx with opaque leaves, else torch.export.

`capture` tries, in order:
1. `symbolic_trace`. It stops at the first thing it cannot follow (data-dependent control flow,
   unsupported Python); we retrace with the innermost module being traced at that moment turned
   into a leaf node, and repeat. Each opaque module is recorded with the tracer's own error.
2. `torch.export` (non-strict) when fx needed opaque leaves or failed at the top: it follows
   Python by running it, so it sees through what fx cannot (Hugging Face models), at the aten
   level. Data-dependent control flow makes it fail loudly rather than specialise.
Whichever graph is taken, `Traced.attempts` says what the others did. When neither captures
the model, `capture` raises TraceError, and runtime.api plans over the module tree instead
(planner.profile.modules, runtime/rewrite/module_tree.py); when the forward itself raises, ForwardError.
A forward that stores a tensor on a submodule (an auxiliary loss) is captured by fx with the
store as a graph node; where no graph keeps the store (torch.export, inside an opaque leaf, on the
root module) capture raises AssignsAttributes, a TraceError (NOTE [ tensor attributes assigned in
forward ]). An input
that is not a strided tensor (sparse) raises InputLayoutError up front: no plan measures it.
Each attempt leaves the model's attributes as it found them (state.attributes_restored).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import warnings
from dataclasses import dataclass, replace

import torch
import torch.fx as fx

from remat.planner.errors import ForwardError, InputLayoutError, TraceError
from remat.planner.compat import fake_cache_off, fx_pytree, keystr, pytree, tree_flatten_with_path
from remat.planner.capture.muted import muted
from remat.planner.capture.fidelity import Modes, Unfaithful, hooked_modules, in_grad_mode, watching
from remat.planner.step.rng import host_rng_moved, host_rng_state, rng_preserved
from remat.planner.step.state import assign_attribute, attributes_restored, instance_forwards, state_preserved, tensor_assignments

log = logging.getLogger("remat.planner")
OUTPUT = "remat_output"   # the module that gives an exported graph's output its structure back
# Modules whose CPU kernels hold memory that fake tensors do not see (the RNNs' fused kernels keep
# per-step workspaces): planned as opaque nodes, their memory measured by running them for real.
MEASURED_FOR_REAL = (torch.nn.RNNBase,)
MEASURED_WHY = "its kernel's memory is not what fake tensors model: measured by running it for real"


@dataclass(frozen=True)
class Traced:
    gm: fx.GraphModule
    input_names: tuple[str, ...]            # the graph's placeholders that take inputs (by name)
    opaque: tuple[tuple[str, str], ...]     # (module qualified name, tracer error) per opaque leaf
    path: str = "fx"                        # "fx", "fx with opaque leaves" or "torch.export"
    in_spec: pytree.TreeSpec | None = None  # torch.export: how (args, kwargs) flatten onto inputs
    attempts: tuple[tuple[str, str], ...] = ()  # (path, why it was not taken) for the paths tried
    extra_kwargs: dict | None = None        # keyword inputs the graph was captured with (use_cache)
    fixed: tuple[tuple[str, str], ...] = ()  # leaves never recomputed (their own checkpoint, hooks), and why
    shapes: Shapes | None = None            # torch.export with dynamic sizes: the inputs it takes
    stores: tuple[tuple[str, str], ...] = ()  # (module, attribute) the graph assigns (`assign_attribute`)

    def inputs(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
        """The graph's inputs, by placeholder name, for the call `model(*args, **kwargs)`."""
        if self.in_spec is None:
            return {k: v for k, v in bind_inputs(model, args, kwargs).items() if k in self.input_names}
        a, kw = as_keywords(model, args, {**(self.extra_kwargs or {}), **kwargs})
        flat = fx_pytree.tree_flatten_spec((a, kw), self.in_spec)
        return dict(zip(self.input_names, flat))


@dataclass(frozen=True)
class Shapes:
    """The input sizes a graph exported with dynamic dimensions runs for (NOTE [ one graph for
    every length ]): per graph input, each dimension a fixed size or a symbol; each symbol's
    range. `admits(named)` says whether a call's inputs are among them."""
    dims: tuple[tuple[str, tuple], ...]          # input name -> per dimension an int or a symbol's name
    ranges: tuple[tuple[str, int, float], ...]   # symbol -> (lowest, highest) size it may take

    def admits(self, named: dict) -> bool:
        bound: dict[str, int] = {}
        ranges = {s: (lo, hi) for s, lo, hi in self.ranges}
        for name, dims in self.dims:
            x = named.get(name)
            if not isinstance(x, torch.Tensor) or x.dim() != len(dims):
                return False
            for want, got in zip(dims, x.shape):
                if isinstance(want, int):
                    if want != got:
                        return False
                elif bound.setdefault(want, got) != got or not ranges[want][0] <= got <= ranges[want][1]:
                    return False
        return True

    @property
    def dynamic(self) -> bool:
        return bool(self.ranges)


def _shapes(ep, names: tuple[str, ...]) -> Shapes | None:
    """The `Shapes` of an exported program's user inputs (by our placeholder names), or None when
    a size is an expression rather than one symbol (then the graph is used at its example sizes)."""
    vals = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
    dims, used = [], set()
    for name, node_name in zip(names, ep.graph_signature.user_inputs):
        v = vals.get(node_name)
        if not isinstance(v, torch.Tensor):
            continue
        row = []
        for d in v.shape:
            if isinstance(d, int):
                row.append(d)
                continue
            expr = d.node.expr
            if not expr.is_Symbol:
                return None
            row.append(str(expr))
            used.add(expr)
        dims.append((name, tuple(row)))
    ranges = tuple((str(s), int(r.lower), float(r.upper)) for s, r in ep.range_constraints.items() if s in used)
    return Shapes(tuple(dims), tuple(sorted(ranges)))


def _named_forward(model: torch.nn.Module, kwargs: dict):
    """`model.forward` with a signature that names each keyword `kwargs` passes through its
    `**kwargs` (Trainer's num_items_in_batch): torch.export takes dynamic sizes by parameter name,
    and none inside `**kwargs`. The forward itself, when the signature has no `**kwargs`."""
    forward = model.forward
    sig = inspect.signature(forward)
    params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    if len(params) == len(sig.parameters):
        return forward
    named = {p.name for p in params}
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in kwargs if k not in named]

    def call(*args, **kw):
        return forward(*args, **kw)
    call.__signature__ = sig.replace(parameters=params + extra)
    return call


def _dynamic(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """torch.export's `dynamic_shapes` for `model(*args, **kwargs)`, by the forward's parameter
    names as export binds them: every tensor dimension Dim.AUTO (export keeps a size dynamic
    unless the program fixes it)."""
    auto = lambda x: {d: torch.export.Dim.AUTO for d in range(x.dim())} \
        if isinstance(x, torch.Tensor) and x.dim() else None   # noqa: E731  ({} would read as a container)
    bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    return {name: pytree.tree_map(auto, value) for name, value in bound.items()}


class Unflatten(torch.nn.Module):
    """Rebuilds an exported graph's structured output (tuple, dict, ModelOutput) from its leaves."""

    def __init__(self, spec: pytree.TreeSpec):
        super().__init__()
        self.spec = spec

    def forward(self, *leaves):
        return pytree.tree_unflatten(list(leaves), self.spec)


class FrozenRandomness(RuntimeError):
    """Tracing drew random numbers: the graph would replay that one draw on every step."""


class FrozenState(RuntimeError):
    """Tracing wrote a real tensor: the graph would hold the write's result as a constant."""


def _tensor_versions(m: torch.nn.Module) -> list[int]:
    """Version counters of the tensors a module's forward can reach as attributes, its own and
    its submodules' (parameters, buffers, plain tensor attributes): tracing runs no real op on
    them unless it is about to freeze one into the graph."""
    out = []
    for sub in m.modules():
        out += [t._version for t in vars(sub).values() if isinstance(t, torch.Tensor)]
        out += [t._version for t in sub._buffers.values() if t is not None]
        out += [t._version for t in sub._parameters.values() if t is not None]
    return out


def _rng_state() -> tuple:
    """Every global RNG a forward may draw from while being traced: torch's CPU generator, and
    Python's and numpy's (planner.step.rng)."""
    return torch.random.get_rng_state(), host_rng_state()


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and not host_rng_moved(a[1])


class _LeafTracer(fx.Tracer):
    """fx.Tracer that treats `extra_leaves` as leaves and remembers where tracing went wrong.

    torch.nn's own modules are leaves only when they have no children (Linear, LSTM, ...):
    composites (nn.Transformer, its layers) are traced through, so that they can be planned.
    A module whose tracing draws random numbers (`if torch.rand(()) < p: skip`, `random.random()`
    in forward) fails like an untraceable one: fx would freeze the draw into the graph.

    fx's trace puts its wrappers on `torch.nn.Module.__call__` and `__getattr__` for the whole
    process; in any other thread than the tracing one they run the module as it is (a model
    training in another thread while this one traces: tests/test_threads.py).
    """

    def __init__(self, extra_leaves: frozenset[str] = frozenset()):
        super().__init__()
        self.thread = threading.get_ident()
        self.modes = Modes()    # grad-mode changes kept per node; inference mode, torch.func: Unfaithful
        # buffers become graph attributes, as parameters do: a read of `self.scale` is read at
        # run time, and an in-place update is a node of the graph (not run once, at trace time)
        self.proxy_buffer_attributes = True
        self.extra_leaves = extra_leaves
        self.failed_in: str | None = None

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        if qualname in self.extra_leaves:
            return True
        return super().is_leaf_module(m, qualname) and next(m.children(), None) is None

    def create_proxy(self, kind, target, args, kwargs, *rest, **kw):
        grad = self.modes.check() if kind.startswith("call_") else None
        if grad is None:
            return super().create_proxy(kind, target, args, kwargs, *rest, **kw)
        # traced in another grad mode (`with torch.no_grad():`): the node runs in it too
        if kind == "call_module":
            args = (super().create_proxy("get_attr", target, (), {}),) + tuple(args)
        return super().create_proxy("call_function", in_grad_mode(grad, target, kind), args, kwargs, *rest, **kw)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if threading.get_ident() != self.thread:
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if threading.get_ident() != self.thread:
            return forward(*args, **kwargs)
        qualname = self.path_of_module(m)
        if self.is_leaf_module(m, qualname):
            return super().call_module(m, forward, args, kwargs)
        before, versions = _rng_state(), _tensor_versions(m)
        try:
            out = super().call_module(m, forward, args, kwargs)
            if not _same(before, _rng_state()):
                raise FrozenRandomness(f"{type(m).__name__}.forward draws random numbers in Python while "
                                       "traced (e.g. torch.rand(()) < p deciding a branch); a trace would freeze them")
            if versions != _tensor_versions(m):
                raise FrozenState(f"{type(m).__name__}.forward writes a tensor attribute in place while traced "
                                  "(one that is not a registered buffer); a trace would run the write once")
        except Exception:
            if self.failed_in is None:
                self.failed_in = qualname
            raise
        return out


def bind_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """Map example inputs onto `model.forward`'s parameter names (positional then keyword)."""
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"example inputs do not match {type(model).__name__}.forward{sig}: {e}") from e
    return dict(bound.arguments)


def as_keywords(model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call as keywords where the signature allows, so that its flattening does not depend
    on whether an input was passed by position or by name."""
    params = inspect.signature(model.forward).parameters.values()
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return tuple(args), dict(kwargs)
    bound = bind_inputs(model, args, kwargs)
    var_kw = [p.name for p in params if p.kind == p.VAR_KEYWORD]
    extra = bound.pop(var_kw[0], {}) if var_kw else {}
    return (), {**bound, **extra}


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def export(model: torch.nn.Module, args: tuple, kwargs: dict, extra_kwargs: dict | None = None) -> Traced:
    """torch.export (non-strict) of `model(*args, **kwargs)` as a Traced graph.

    The graph's placeholders are the flattened inputs (by name) and its output is rebuilt into
    the model's own structure by an `Unflatten` module, so the graph is called like fx's. Its
    parameters and buffers are the model's own objects. `extra_kwargs` are passed too, and on
    every call of the graph (`Traced.inputs`).
    """
    hooked = hooked_modules(model)
    if hooked:
        name, why = next(iter(hooked.items()))
        raise Unfaithful(f"{len(hooked)} hooked submodule(s)", f"{name} {why}")
    a, kw = as_keywords(model, args, {**(extra_kwargs or {}), **kwargs})
    before = _rng_state()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ep = _export(model, a, kw)
    if any(_EXPORT_ASSIGNED in str(w.message) for w in seen):   # export restored them and warned
        _refuse_assignments(model, args, kwargs)
    if not _same(before, _rng_state()):   # torch ops are traced; Python's random and numpy are not
        raise FrozenRandomness("forward draws Python (random/numpy) random numbers; an export would freeze them")
    return _as_traced(ep, extra_kwargs)


_EXPORT_ASSIGNED = "assigned during export"     # torch.export's words for tensor attributes a forward assigned


# NOTE [ one graph for every length ]
# A run calls the model at many sizes (every padded length and batch of a Trainer run): every input
# dimension is exported as Dim.AUTO, so export keeps a size symbolic unless the program fixes it,
# and `Traced.shapes` says which later calls the one graph (and its plan) serves with no capture.
# An export that fails with dynamic sizes is made again at the example sizes. A model on `meta` is
# planned, never run (a 70B job from one process, `remat report` on meta): it is exported at the
# example sizes only, the one shape it is planned for (an export with dynamic sizes takes 3-5x
# the CPU time: the 70B pipeline job's three stages 11 -> 7 s of capture).


def _export(model: torch.nn.Module, a: tuple, kw: dict):
    """torch.export (non-strict) with every input size dynamic where the program allows it, else
    at the example sizes (NOTE [ one graph for every length ]). With dynamic sizes fake tensors
    cache no op's output (`fake_cache_off`): a cached output's symbolic sizes and strides were
    rebuilt at every hit, dearer than the op (a 2-layer Mamba2 6.9 -> 3.5 CPU s, hf-bert 1.7 ->
    0.8; the same graph, but for the numbers in its `sym_size` nodes' names)."""
    try:
        if not _on_meta(model, a, kw):      # on meta: at the example sizes only
            with _exporting(model), instance_forwards({model: _named_forward(model, kw)}), fake_cache_off():
                return torch.export.export(model, a, kw, dynamic_shapes=_dynamic(model, a, kw), strict=False)
    except Exception as e:    # a size the program cannot take symbolically: the sizes as given
        if _NOT_A_PYTREE in str(e):
            raise                 # an output no export can return (a key/value cache object): see `capture`
        log.info("%s: no export with dynamic sizes (%s); exporting at the example sizes",
                 type(model).__name__, _first_line(e))
    with _exporting(model):
        return torch.export.export(model, a, kw, strict=False)


def _on_meta(model: torch.nn.Module, a: tuple, kw: dict) -> bool:
    """Whether the model or an input is on `meta` (planned, never run)."""
    leaves = [*model.parameters(), *pytree.tree_leaves((a, kw))]
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in leaves)


@contextlib.contextmanager
def _exporting(model: torch.nn.Module):
    """Around one torch.export: the model's attributes as found after it, its log quiet, custom
    Functions watched."""
    with attributes_restored(model), muted(), watching(proxies_only=False):
        yield


def _as_traced(ep, extra_kwargs: dict | None) -> Traced:
    """An exported program as a Traced graph, called like fx's (see `export`)."""
    gm = ep.module()
    names = tuple(n.target for n in gm.graph.nodes if n.op == "placeholder")
    info = gm.graph._codegen.pytree_info
    gm._forward_pre_hooks.clear()          # export's input-spec check: we flatten by our own spec
    gm.graph._codegen = fx.graph.CodeGen()
    gm.add_module(OUTPUT, Unflatten(info.out_spec))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    with gm.graph.inserting_before(out):
        structured = gm.graph.call_module(OUTPUT, tuple(out.args[0]))
    out.args = (structured,)
    gm.recompile()
    return Traced(gm, names, (), "torch.export", info.in_spec, extra_kwargs=extra_kwargs, shapes=_shapes(ep, names))


def cache_off(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """{"use_cache": False} when the model's forward takes `use_cache` and this call does not set
    it (a Hugging Face model), else {}: the key/value cache is never read in training, and Hugging
    Face turns it off under gradient checkpointing; the module-tree plan does the same."""
    params = inspect.signature(model.forward).parameters
    if "use_cache" not in params or "use_cache" in kwargs:
        return {}
    try:
        given = bind_inputs(model, args, kwargs)
    except TypeError:
        return {}
    return {} if "use_cache" in given else {"use_cache": False}


_NOT_A_PYTREE = "not a known type"     # torch.export's words for an output it cannot flatten
_CACHE_OFF = ("its output holds a key/value cache object (not a pytree); captured with use_cache=False, as "
              "Hugging Face does under gradient checkpointing: the output carries no cache")


def _cache_output(model: torch.nn.Module, kwargs: dict, e: Exception) -> bool:
    """Export failed on a cache object in the output, and use_cache is ours to turn off."""
    return ("Cache" in str(e) and _NOT_A_PYTREE in str(e) and "use_cache" not in kwargs
            and "use_cache" in inspect.signature(model.forward).parameters)


def _returns_cache(model: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """A Hugging Face model whose config turns its key/value cache on, called without use_cache."""
    return bool(getattr(getattr(model, "config", None), "use_cache", False)) and cache_off(model, args, kwargs) != {}


def _refuse_unstrided(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Raises InputLayoutError naming the first input that is not a strided tensor."""
    for name, value in bind_inputs(model, args, kwargs).items():
        for path, x in tree_flatten_with_path(value)[0]:
            if isinstance(x, torch.Tensor) and x.layout != torch.strided:
                raise InputLayoutError(name + keystr(path), str(x.layout).removeprefix("torch."))


def _raise_if_forward_fails(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """No tracer captured the model: if its forward raises when simply run (without grad; the
    caller restores RNG and state), that is the model's own error, raised as ForwardError."""
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as e:
        raise ForwardError(type(model).__name__, e) from e


def capture(model: torch.nn.Module, args: tuple, kwargs: dict, opaque: dict[str, str] | None = None,
            skip: dict[str, str] | None = None) -> Traced:
    """The best graph of `model(*args, **kwargs)`: fx if it needs no opaque leaves, else
    torch.export if it succeeds, else fx with opaque leaves. `opaque`: submodules that must be
    opaque leaves (the profile found they need tensor values), by name -> why; torch.export,
    which has no leaves, is then not tried. `skip`: paths ("fx", "torch.export") not to take, by
    name -> why (the capture check found their graph wrong). Raises TraceError if none works
    (AssignsAttributes when the forward stores tensors on modules), ForwardError when the model's
    forward raises when run plainly, InputLayoutError for a sparse input."""
    _refuse_unstrided(model, args, kwargs)
    skip = skip or {}
    attempts: list[tuple[str, str]] = list(skip.items())
    if "fx" in skip:
        traced = None
    else:
        try:
            traced = trace(model, args, kwargs, opaque=opaque)
        except AssignsAttributes:     # torch.export's graph drops the assignment too
            raise
        except TraceError as e:
            traced = None
            attempts.append(("fx", str(e)))
        else:
            if opaque or "torch.export" in skip:
                return _with_leaves(model, args, kwargs, replace(traced, attempts=tuple(attempts)))
            if all(why == MEASURED_WHY for _, why in traced.opaque):
                return traced
            attempts.append(("fx", f"{len(traced.opaque)} submodule(s) only as opaque leaves"))
    if "torch.export" in skip or opaque:
        return _last_resort(model, args, kwargs, traced, attempts)
    # Hugging Face returns a key/value cache object when use_cache is on; nothing reads it in
    # training, and HF itself turns use_cache off under gradient checkpointing: so do we. With
    # use_cache on in its config it is off from the first export (as called, one fails at that
    # output, not a pytree, after tracing everything); else only once an export as called fails there.
    first = {"use_cache": False} if _returns_cache(model, args, kwargs) else None
    try:
        exported = export(model, args, kwargs, first)
        if first:
            attempts.append(("torch.export as called", _CACHE_OFF))
        return replace(exported, attempts=tuple(attempts))
    except Exception as e:  # export raises many types (guards, unsupported ops, pytree)
        _reraise_assignments(e)
        attempts.append(("torch.export with use_cache=False" if first else "torch.export", _first_line(e)))
        if not first and _cache_output(model, kwargs, e):
            try:
                exported = export(model, args, kwargs, {"use_cache": False})
                attempts[-1] = ("torch.export as called", _CACHE_OFF)
                return replace(exported, attempts=tuple(attempts))
            except Exception as e2:
                _reraise_assignments(e2)
                attempts.append(("torch.export with use_cache=False", _first_line(e2)))
    return _last_resort(model, args, kwargs, traced, attempts)


def _reraise_assignments(e: Exception) -> None:
    """torch.export found the forward assigning tensor attributes: no other graph keeps them."""
    if isinstance(e, AssignsAttributes):
        raise e


def _with_leaves(model: torch.nn.Module, args: tuple, kwargs: dict, traced: Traced) -> Traced:
    """`traced`, once no opaque leaf of it (fx did not see inside them) assigns tensor attributes
    (NOTE [ tensor attributes assigned in forward ])."""
    if any(why != MEASURED_WHY for _, why in traced.opaque):
        _refuse_assignments(model, args, kwargs, traced.stores)
    return traced


def _last_resort(model, args, kwargs, traced: Traced | None, attempts: list) -> Traced:
    """fx with opaque leaves when fx traced at all; else ForwardError when the forward itself
    raises, else TraceError naming what each path said."""
    if traced is not None:
        return _with_leaves(model, args, kwargs, replace(traced, attempts=tuple(attempts)))
    _raise_if_forward_fails(model, args, kwargs)
    raise TraceError(f"{type(model).__name__}.forward",
                     "; ".join(f"{p}: {why}" for p, why in attempts))


def trace(model: torch.nn.Module, args: tuple, kwargs: dict, max_opaque: int = 64,
          opaque: dict[str, str] | None = None) -> Traced:
    """Trace `model` called as `model(*args, **kwargs)`.

    Parameters of `forward` that are not given are fixed to their defaults (fx concrete_args).
    A forward that binds a tensor to a submodule's attribute (`self.aux_loss = ...`) stores it
    in the graph too (`_store`); one the graph cannot store raises AssignsAttributes.
    >>> t = trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), (torch.ones(1, 2),), {})
    >>> [n.op for n in t.gm.graph.nodes]
    ['placeholder', 'call_module', 'call_module', 'output']
    """
    bound = bind_inputs(model, args, kwargs)
    sig = inspect.signature(model.forward)
    concrete = {
        name: p.default for name, p in sig.parameters.items()
        if name not in bound and p.default is not inspect.Parameter.empty
    }
    opaque = dict(opaque or {})
    fixed: dict[str, str] = {}          # opaque because of their own checkpoint: not recomputed
    hooked = hooked_modules(model)      # leaves, so that their hooks run when they run
    tracer, graph, assigned, stored = _trace_leaves(model, concrete, opaque, fixed, frozenset(hooked), max_opaque)
    stores: tuple[tuple[str, str], ...] = ()
    if [k for _, k in assigned if not k.startswith("_tensor_constant")]:    # fx's own constants do not count
        stores = _store(graph, stored)
        _refuse_assignments(model, args, kwargs, stores)
    for n in graph.nodes:     # modules whose real kernels fake tensors do not model: measured for real
        if n.op == "call_module" and isinstance(tracer.root.get_submodule(n.target), MEASURED_FOR_REAL):
            opaque.setdefault(n.target, MEASURED_WHY)
    # a module inside an opaque one is opaque with it: name only the outermost
    opaque = {m: why for m, why in opaque.items() if not any(m.startswith(o + ".") for o in opaque)}
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    names = tuple(n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target in bound)
    fixed = {m: why for m, why in fixed.items() if m in opaque}
    # a hooked submodule runs once per step, as it does without remat: its hooks' side effects (a
    # list of features, a counter) would happen again in a recompute
    fixed.update({m: "has hooks, which a recompute would run again" for m in hooked})
    return Traced(gm, names, tuple(sorted(opaque.items())), "fx with opaque leaves" if opaque else "fx",
                  fixed=tuple(sorted(fixed.items())), stores=stores)


def _trace_leaves(model: torch.nn.Module, concrete: dict, opaque: dict[str, str], fixed: dict[str, str],
                  hooked: frozenset[str], max_opaque: int) -> tuple[_LeafTracer, fx.Graph, list, dict]:
    """fx's trace of `model`, each submodule it cannot follow made an opaque leaf (added to
    `opaque`, and to `fixed` when it holds its own checkpoint) and traced again. Returns the
    tracer, its graph, (module, attribute) of each plain attribute the trace bound to a tensor,
    and (module name, attribute) -> graph node of each it bound to a Proxy; every attribute is as
    it was before (`attributes_restored`)."""
    while True:
        tracer = _LeafTracer(frozenset(opaque) | hooked)
        try:
            before, versions = _rng_state(), _tensor_versions(model)
            with attributes_restored(model) as assigned, watching(proxies_only=True):   # no Proxy left in the model
                graph = tracer.trace(model, concrete_args=concrete or None)
                stored = _proxies_bound(model)
            if not _same(before, _rng_state()):
                raise FrozenRandomness(f"{type(model).__name__}.forward draws random numbers in Python "
                                       "while traced; a trace would freeze them")
            if versions != _tensor_versions(model):
                raise FrozenState(f"{type(model).__name__}.forward writes a tensor attribute in place while "
                                  "traced; a trace would run the write once")
            return tracer, graph, assigned, stored
        except Exception as e:  # fx raises many types; we classify by where, not by message
            where = tracer.failed_in
            if not where or where in opaque or len(opaque) >= max_opaque:
                raise TraceError(where or f"{type(model).__name__}.forward", f"{type(e).__name__}: {e}") from e
            opaque[where] = _first_line(e)
            if isinstance(e, Unfaithful) and not e.recomputable:
                fixed[where] = f"holds its own checkpoint ({e.construct}); remat does not checkpoint it again"


# NOTE [ tensor attributes assigned in forward ]
# A forward may store a tensor on a module (`self.aux_loss = ...` per layer, summed by the loss, as
# MoE load-balancing losses are): no graph keeps the assignment (fx records the ops and drops the
# store; torch.export warns and drops it), so a planned step would train without the aux loss,
# and the profile's loss would read a tensor of an earlier run. A trace that binds a tensor (or a
# Proxy) to a plain attribute, an export that warns of one, or fx's opaque leaves (it cannot see
# inside them) make the forward run once for real, without grad (`_refuse_assignments`): when that binds
# a new tensor to an attribute, capture raises AssignsAttributes naming the module and the
# attribute, and the runtime plans over the module tree, whose units run the modules as
# themselves. A rebinding to the same object, or to a copy of its values (`self.freqs_cis =
# self.freqs_cis.to(h.device)`: state.copy_of), is none: the graph computes the copy each step.
# The capture check compares the attributes each run assigns too (planner/capture/check.py), for what a
# trace did not show (torch.export restores attributes before we see them).
# fx's trace binds the Proxy of the assigned value to the attribute: the store is put back into
# the graph as a node, `assign_attribute(module, name, value)` before the output (`_store`), and
# the step computes the aux loss in the graph and stores it where the loss reads it (the fake step
# stores fake values there, and `fake_step` binds every attribute back afterwards). The node is
# never recomputed (profile: not recomputable), so a recompute in backward stores nothing. What
# fx binds on the root module (not the user's object in the graph module) or an opaque leaf binds
# (fx did not see inside it), and an export's assignments, still raise AssignsAttributes.


class AssignsAttributes(TraceError):
    """A forward binds a tensor to a module's attribute (an auxiliary loss): no graph keeps the
    assignment (NOTE [ tensor attributes assigned in forward ])."""


def _proxies_bound(model: torch.nn.Module) -> dict[tuple[str, str], fx.Node]:
    """(module name, attribute) -> node, for each plain attribute an fx trace bound to a Proxy."""
    return {(name, k): v.node for name, m in model.named_modules() for k, v in vars(m).items()
            if isinstance(v, fx.Proxy)}


def _store(graph: fx.Graph, stored: dict[tuple[str, str], fx.Node]) -> tuple[tuple[str, str], ...]:
    """The stores of `stored` (a submodule's attribute bound to a graph value) as `assign_attribute`
    nodes before the graph's output (NOTE [ tensor attributes assigned in forward ]); returns them."""
    kept = sorted(k for k, node in stored.items() if k[0] and node.graph is graph)
    out = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(out):
        for module, name in kept:
            graph.call_function(assign_attribute, (graph.get_attr(module), name, stored[module, name]))
    return tuple(kept)


def _refuse_assignments(model: torch.nn.Module, args: tuple, kwargs: dict,
                        stored: tuple[tuple[str, str], ...] = ()) -> None:
    """Raises AssignsAttributes when `model`'s forward, run once for real, binds a new tensor to a
    module's attribute the graph does not store (`stored`). Run only where a capture saw or could
    not see such a binding: fx bound a tensor or Proxy to an attribute, torch.export warned of
    one, or fx left opaque leaves."""
    found = [x for x in _assigned_for_real(model, args, kwargs) if x not in stored]
    if found:
        names = [f"{m}.{k}" if m else k for m, k in found]
        raise AssignsAttributes(found[0][0] or f"{type(model).__name__}.forward",
                                f"its forward assigns tensor attribute{'s' if len(names) > 1 else ''} "
                                f"{', '.join(names)} (an auxiliary loss stored on a module?), which a graph drops; "
                                "plan_and_wrap plans it over its module tree, whose units run as themselves")


def _assigned_for_real(model: torch.nn.Module, args: tuple, kwargs: dict) -> list[tuple[str, str]]:
    """(module name, attribute) of each plain attribute `model`'s forward binds to a new tensor
    when run for real (without grad; buffers, RNG and the attributes restored). A rebinding to
    the same object or a copy of it (`self.freqs = self.freqs.to(x.device)`) is none. [] when the
    forward raises."""
    try:
        with torch.no_grad(), rng_preserved(), state_preserved(model), tensor_assignments(model) as assigned:
            model(*args, **kwargs)
    except Exception:       # the model's own error: reported where no tracer captures it
        return []
    return sorted(assigned)


def placeholder_values(gm: fx.GraphModule, named: dict) -> list:
    """Positional arguments for `gm` from named inputs; parameters not given take their defaults."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            out.append(named[n.target] if n.target in named else (n.args[0] if n.args else None))
    return out
