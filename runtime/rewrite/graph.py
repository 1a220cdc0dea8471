"""Apply a Plan to a traced model: each region becomes a call to a checkpointed sub-graph.

Mechanism only — the Plan says which nodes form each region and which of them keep their
outputs (SAC MUST_SAVE); this module decides nothing. The returned GraphModule has the original
model's children, parameters and buffers registered under their original names (the same
objects), so `state_dict()` keys and an optimizer built on the original keep working.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import threading
import time
from typing import Callable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

from remat.planner.compat import force_original_view_tracking
from remat.planner.errors import UnsafePlanError
from remat.planner.facts import StepFacts
from remat.planner.profile.graph import compute_nodes, draws_random, is_view
from remat.planner.result import Plan, Region
from remat.planner.step.state import Snapshot

from .sac import selective_contexts

_SAVE = threading.local()


def save_scope_enter(node: str = "") -> None:
    """Marks the start of a node whose ops the SAC policy saves (inserted by the rewriter)."""
    _SAVE.depth = getattr(_SAVE, "depth", 0) + 1
    _SAVE.node = node


def save_scope_exit() -> None:
    _SAVE.depth -= 1


def _policy(ctx, op, *args, deterministic_ops: frozenset[str] = frozenset(), **kwargs):
    """Save what the plan's saved nodes compute. Views are recomputed (they cost nothing, and a
    cached view would pin its base: often a tensor the plan drops); in-place ops stay cached so
    that a recompute never applies them twice.

    A kept node must not draw random numbers: the recompute replays the region's RNG stream from
    its start, so a cached draw would shift every later one (another dropout mask), and
    recomputing the draw alone would rewrite a cached buffer (attention's dropout mask is
    `empty_like` then `bernoulli_`). The planner never keeps such nodes
    (planner.solve.baselines.sac_keepable); a plan that does is refused here, before anything is wrong."""
    if getattr(_SAVE, "depth", 0) > 0 and not is_view(op):
        if draws_random(op, args, kwargs, deterministic_ops):
            raise UnsafePlanError(f"the plan keeps node {getattr(_SAVE, 'node', '?')!r}, which draws random numbers "
                                  f"({op}); its recompute could not replay them. Re-plan: remat's planner never "
                                  "keeps such nodes")
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.MUST_RECOMPUTE


class _Rewound:
    """Recompute context: the buffers a region reads or writes (BatchNorm statistics, a
    spectral norm's power-iteration vectors, a counter) are, while it recomputes, what its
    forward saw (`seen`, taken when the forward started), and afterwards again what the
    forward (and everything since) left: the recompute computes what the forward did, and
    updates nothing a second time."""

    def __init__(self, seen: Snapshot):
        self.seen = seen

    def __enter__(self):
        self.left = Snapshot(self.seen.tensors)
        self.seen.restore()

    def __exit__(self, *exc):
        self.left.restore()
        self.left = None
        return False


def view_replay():
    """Autograd replays views (as it always does for fake tensors) instead of tracking them as
    as_strided: an in-place op on a view (`linear(x3d).relu_()`) then backpropagates through the
    view itself, without the base-sized zeros and copies of AsStridedBackward that a fake-tensor
    replay does not see. Same gradients, bitwise; the wrapped step runs, and recomputes, this way."""
    return force_original_view_tracking(True)


def rewinding(tensors: list[torch.Tensor], recompute_ctx=None):
    """The recompute context of a region whose forward starts now, reading or writing `tensors`
    (see `_Rewound`); `recompute_ctx` (a SAC context) runs inside it. It can be entered again:
    a double backward recomputes a region once per backward (`Reusable`)."""
    if not tensors:
        return recompute_ctx or contextlib.nullcontext()
    seen = Snapshot(tensors)
    return Reusable(lambda: _rewound(recompute_ctx or contextlib.nullcontext(), seen))


class Reusable:
    """A context manager made anew by `make()` at each entry. torch's checkpoint enters a region's
    recompute context once per recompute, and a region recomputes once per backward that reads
    it: twice under a double backward (`autograd.grad(..., create_graph=True)` in the loss, then
    `loss.backward()`). A generator context cannot be entered twice."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]):
        self.make, self.entered = make, []

    def __enter__(self):
        cm = self.make()
        self.entered.append(cm)
        return cm.__enter__()

    def __exit__(self, *exc):
        return self.entered.pop().__exit__(*exc)


@contextlib.contextmanager
def _rewound(recompute_ctx, seen: Snapshot):
    with _Rewound(seen), recompute_ctx:
        yield


@contextlib.contextmanager
def _both(outer, inner):
    with outer, inner:
        yield


@contextlib.contextmanager
def _scoped(ctx):
    """Run a region's forward or recompute with a fresh save scope: a recompute that torch stops
    early (inside a saved node, between its markers) must not leave the scope open."""
    outer = getattr(_SAVE, "depth", 0)
    _SAVE.depth = 0
    try:
        with ctx:
            yield
    finally:
        _SAVE.depth = outer


class _Clock:
    """The times of one region's recomputes in backward, while `RecomputeTimes` is on: `now`'s
    (perf_counter) on CPU; on CUDA, events read once the steps are done."""

    def __init__(self, cuda: bool, now=time.perf_counter):
        self.cuda, self.now, self.spans = cuda, now, []

    @contextlib.contextmanager
    def span(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                yield
            finally:
                end.record()
                self.spans.append((start, end))
        else:
            t0 = self.now()
            try:
                yield
            finally:
                self.spans.append(self.now() - t0)

    def seconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in self.spans]
        return list(self.spans)


class RecomputeTimes:
    """While on (`with RecomputeTimes(gm, device) as t:`), each region of the rewritten `gm`
    records the wall time of its recompute in backward (the sub-graph rerun, from its first
    saved tensor unpacked to the end; checkpoint's frame around it is not in it). Off, regions
    time nothing. `fastest()`: per region, its fastest recompute (None: it never recomputed).
    On CPU, `now` is the clock (wall time; time.thread_time for the thread's CPU time)."""

    def __init__(self, gm: fx.GraphModule, device: torch.device | str = "cpu", now=time.perf_counter):
        self.regions = regions_of(gm)
        self.clocks = [_Clock(torch.device(device).type == "cuda", now) for _ in self.regions]

    def __enter__(self) -> "RecomputeTimes":
        for region, clock in zip(self.regions, self.clocks):
            region.clock = clock
        return self

    def __exit__(self, *exc):
        for region in self.regions:
            region.clock = None
        return False

    def fastest(self) -> tuple[float | None, ...]:
        return tuple(min(c.seconds(), default=None) for c in self.clocks)


def regions_of(gm: fx.GraphModule) -> list["CheckpointRegion"]:
    """The CheckpointRegion modules `rewrite` made, in the plan's order."""
    calls = [n.target for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("remat_region_")]
    return [gm.get_submodule(name) for name in calls]


class CheckpointRegion(torch.nn.Module):
    """Runs one region's sub-graph under torch.utils.checkpoint (non-reentrant).

    It owns no parameters: the sub-graph calls the model's own modules, which stay registered
    where they were. In eval mode or under no_grad it runs the sub-graph directly, at no cost.
    """

    def __init__(self, graph_module: fx.GraphModule, node_names: list[str], saved: list[str],
                 state: list[tuple[torch.nn.Module, str]], buffer_args: tuple[int, ...] = (),
                 rewound_args: tuple[int, ...] = (), deterministic_ops: frozenset[str] = frozenset()):
        super().__init__()
        self._gm = (graph_module,)        # a tuple: not a registered submodule
        self.node_names, self.saved = node_names, saved
        self._state = tuple(state)        # (module, buffer name): buffers the recompute rewinds
        self._buffer_args = buffer_args   # positions of inputs that are buffers (passed by closure)
        self._rewound_args = rewound_args  # those of them the recompute rewinds
        self._deterministic_ops = deterministic_ops
        self.clock: _Clock | None = None  # set while RecomputeTimes is on

    def extra_repr(self) -> str:
        return f"{self.node_names[0]}..{self.node_names[-1]} ({len(self.node_names)} nodes), saves {self.saved}"

    def _contexts(self, args: tuple):
        """Called by checkpoint as the region's forward starts: the buffers it will rewind to
        are snapshotted now."""
        policy = functools.partial(_policy, deterministic_ops=self._deterministic_ops)
        fwd, rec = (selective_contexts(policy, allow_cache_entry_mutation=True) if self.saved
                    else (contextlib.nullcontext(), contextlib.nullcontext()))
        tensors = [getattr(m, name) for m, name in self._state] + [args[i] for i in self._rewound_args]
        rec = rewinding(tensors, rec)
        clock = self.clock
        return _scoped(fwd), Reusable(lambda: _scoped(_both(view_replay(), rec) if clock is None
                                                      else _both(clock.span(), _both(view_replay(), rec))))

    def forward(self, *args):
        gm = self._gm[0]
        if not (self.training and torch.is_grad_enabled()):
            return gm(*args)
        # Buffers reach the sub-graph by closure, not as checkpoint inputs: checkpoint saves its
        # inputs, and a buffer updated in place inside the region would fail autograd's check.
        buffers = {i: args[i] for i in self._buffer_args}
        rest = [a for i, a in enumerate(args) if i not in buffers]

        def run(*rest_args):
            # gm.forward, not gm(...): checkpoint stops a recompute early by raising through it,
            # and a GraphModule's __call__ formats the traceback of every exception that passes
            # (reading source files: about 0.25 ms a region on a 2-core CPU)
            it = iter(rest_args)
            return gm.forward(*(buffers[i] if i in buffers else next(it) for i in range(len(args))))
        if not self.saved and torch.compiler.is_compiling():
            # Under torch.compile, a plain region becomes Dynamo's checkpoint op in the one graph:
            # AOTAutograd recomputes it in the backward graph, where buffer writes and RNG are
            # functional (nothing to restore), and Inductor fuses it. A SAC region's policy reads
            # scope markers Dynamo cannot trace: it graph-breaks and runs as in eager.
            return checkpoint(run, *rest, use_reentrant=False, preserve_rng_state=True)
        return checkpoint(run, *rest, use_reentrant=False, preserve_rng_state=True,
                          context_fn=functools.partial(self._contexts, args))


def _region_graph(nodes: list[fx.Node], saved: set[str]) -> tuple[fx.Graph, list[fx.Node], list[fx.Node]]:
    """Sub-graph of `nodes`; returns it with the outside nodes it reads and the nodes read outside."""
    inside = set(nodes)
    inputs: list[fx.Node] = []
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:        # attributes too: read by the caller, so they follow the model's
            inputs.append(a)    # current parameters (load_state_dict(assign=True), a fake replay)
            env[a] = g.placeholder(a.name)
        return env[a]

    for n in nodes:
        for a in n.all_input_nodes:
            if a not in inside:
                arg(a)
        if n.name in saved:
            g.call_function(save_scope_enter, (n.name,))
        env[n] = g.node_copy(n, lambda a: env[a])
        if n.name in saved:
            g.call_function(save_scope_exit)
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    g.output(tuple(env[n] for n in outputs))
    return g, inputs, outputs


def _region_state(gm: fx.GraphModule, nodes: list[fx.Node], rewind) -> list[tuple[torch.nn.Module, str]]:
    """(module, buffer name) of the buffers of the region's modules that `rewind(qualified name)`
    says the step writes."""
    out = []
    for n in nodes:
        if n.op == "call_module":
            for qual, _ in gm.get_submodule(n.target).named_buffers(prefix=n.target, remove_duplicate=False):
                owner, _, name = qual.rpartition(".")
                if rewind(qual):
                    out.append((gm.get_submodule(owner), name))
    return out


def _rewind_rule(facts: StepFacts):
    """Which buffers a region's recompute rewinds: those the profile saw the step write
    (`StepFacts.mutated_buffers`); every buffer of the region when it does not say."""
    mutated = facts.mutated_buffers
    return (lambda name: True) if mutated is None else mutated.__contains__


def rewrite_plan(model: torch.nn.Module, gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """`rewrite` with a Plan's regions, node names, facts and opaque modules."""
    return rewrite(model, gm, plan.regions, plan.node_names, plan.facts, tuple(m for m, _ in plan.opaque))


def rewrite(model: torch.nn.Module, gm: fx.GraphModule, regions: tuple[Region, ...], node_names: tuple[str, ...],
            meta: dict | StepFacts | None = None, opaque: tuple[str, ...] = ()) -> fx.GraphModule:
    """A GraphModule computing what `gm` (traced from `model`) does, with `regions` (over the
    CostGraph's nodes, named `node_names`) checkpointed. `meta` is the CostGraph's (or its
    StepFacts: which buffers the step writes, which custom ops are deterministic); `opaque`, the modules stood in for.
    Parameters, buffers and submodules are `model`'s own objects, by the same names.
    """
    facts = StepFacts.of(meta)
    regions = tuple(regions)
    nodes = compute_nodes(gm)
    names = [n.name for n in nodes]
    if list(node_names[:len(names)]) != names:
        raise ValueError("plan does not match this graph (was it made for another model or input shape?)")
    region_at = {r.start: (k, r) for k, r in enumerate(regions)}
    rewind = _rewind_rule(facts)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    region_modules: dict[str, CheckpointRegion] = {}
    skip_until = -1
    index = {n: i for i, n in enumerate(nodes)}
    for n in gm.graph.nodes:
        i = index.get(n, -1)
        if i != -1 and i <= skip_until:
            continue
        if i in region_at:
            k, r = region_at[i]
            name = f"remat_region_{k}"
            region_modules[name] = _region_call(graph, env, gm, nodes[r.start:r.end + 1], r, names, name, rewind,
                                                facts.deterministic_ops, opaque)
            skip_until = r.end
            continue
        if n not in env:
            env[n] = graph.node_copy(n, lambda a: env[a])
    out = _assembled(graph, gm, model, region_modules)
    _check(out, regions, node_names)
    return out


def _region_call(graph: fx.Graph, env: dict, gm: fx.GraphModule, body: list[fx.Node], r: Region, names: list[str],
                 name: str, rewind, deterministic_ops: frozenset[str], opaque: tuple[str, ...]) -> "CheckpointRegion":
    """Region `r` (its nodes `body`) as a CheckpointRegion called `name` from `graph`; its outputs
    are bound in `env`. Returns the region module."""
    saved = {names[j] for j in r.saved}
    sub, inputs, outputs = _region_graph(body, saved)
    sub_gm = fx.GraphModule(gm, sub, f"Region{name.rsplit('_', 1)[-1]}")
    buffers = {id(b) for b in gm.buffers()}
    buffer_args = tuple(j for j, a in enumerate(inputs) if a.op == "get_attr"
                        and id(functools.reduce(getattr, a.target.split("."), gm)) in buffers)
    rewound = tuple(j for j in buffer_args if rewind(inputs[j].target))
    _refuse_opaque_kept(opaque, body, saved)
    module = CheckpointRegion(sub_gm, [b.name for b in body], sorted(saved), _region_state(gm, body, rewind),
                              buffer_args, rewound, deterministic_ops)
    for a in inputs:
        if a.op == "get_attr" and a not in env:
            env[a] = graph.get_attr(a.target)
    call = graph.call_module(name, tuple(env[a] for a in inputs))
    for j, o in enumerate(outputs):
        env[o] = graph.call_function(operator.getitem, (call, j))
    return module


def _assembled(graph: fx.Graph, gm: fx.GraphModule, model: torch.nn.Module,
               region_modules: dict[str, "CheckpointRegion"]) -> fx.GraphModule:
    """The rewritten graph as a GraphModule holding `model`'s own children, the regions, and the
    graph-only modules of `gm`, in `model`'s mode."""
    _own_constants(graph, gm, model)
    graph.lint()
    root: dict = dict(region_modules)
    for n in graph.nodes:
        if n.op in ("call_module", "get_attr") and n.target not in root:
            root[n.target] = functools.reduce(getattr, n.target.split("."), gm)
    out = fx.GraphModule(root, graph, type(model).__name__ + "Remat")
    adopt(out, model)
    for name, mod in region_modules.items():
        out.add_module(name, mod)
    for name, mod in gm.named_children():      # graph-only modules (torch.export's output Unflatten)
        if not hasattr(out, name):
            out.add_module(name, mod)
    out.train(model.training)
    return out


def _refuse_opaque_kept(opaque: tuple[str, ...], body: list[fx.Node], saved: set[str]) -> None:
    """A SAC region must not keep an opaque module: its policy would cache every op inside it,
    which the memory model (the module's stand-in) does not hold. The planner never does."""
    for n in body:
        if n.name in saved and n.op == "call_module" and n.target in opaque:
            raise UnsafePlanError(f"the plan keeps node {n.name!r}, the opaque module {n.target!r}: a SAC policy "
                                  "would cache every op inside it. Re-plan: remat's planner never keeps opaque modules")


CONSTANT = "remat_constant_"


def _own_constants(graph: fx.Graph, gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """Tensor attributes the capture made that `model` does not have (the constants torch.export lifts
    onto a submodule: `attn.lifted_tensor_0`, from a list index) are read from the rewritten
    graph's own top level (`remat_constant_<k>`): it adopts the user's modules, which lack them,
    and the user's modules stay as they are."""
    for k, n in enumerate(n for n in graph.nodes if n.op == "get_attr"):
        try:
            functools.reduce(getattr, n.target.split("."), model)
        except AttributeError:
            value = functools.reduce(getattr, n.target.split("."), gm)
            if isinstance(value, torch.nn.Module):   # a graph-only module (export's sub-graphs): kept by rewrite
                continue
            n.target = f"{CONSTANT}{k}"
            setattr(gm, n.target, value)


def adopt(out: fx.GraphModule, model: torch.nn.Module) -> None:
    """Give `out` exactly `model`'s children, parameters and buffers (the same objects)."""
    for name in list(out._modules):
        delattr(out, name)
    for name, child in model.named_children():
        out.add_module(name, child)
    for name, p in model.named_parameters(recurse=False):
        out.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        out.register_buffer(name, b, persistent=name not in model._non_persistent_buffers_set)


def _check(out: fx.GraphModule, regions: tuple[Region, ...], node_names: tuple[str, ...]) -> None:
    """The rewritten graph has one region module per region, each with the region's nodes."""
    made = regions_of(out)
    assert len(made) == len(regions), "rewrite lost a region"
    for module, r in zip(made, regions):
        assert module.node_names == list(node_names[r.start:r.end + 1])
