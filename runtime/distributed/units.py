"""The graphs an FSDP2 model runs: the whole graph split at its fully_shard units (NOTE [ the
root's graph ]), each part with its share of the plan's regions, set as the forward of the module
that runs it, inside FSDP2's hooks (DDP's module runs the whole graph the same way).

NOTE [ the root's graph ]
The whole model is captured once (fx, or torch.export for Hugging Face models) on the plain
copy, and each node runs in one fully_shard unit (NodeCost.unit; "" the root), a unit's nodes one
contiguous span. `split` cuts that graph: each unit's span becomes a graph of its own (its inputs
the values it reads from outside, its outputs the values read after it; the parameters it reads
read inside, where FSDP2 has them unsharded), and the root's graph is the rest, each span
replaced by a call of the unit module itself (`unit(*inputs, remat_span=True)`, returning the
outputs as a tuple), so that FSDP2's pre- and post-forward hooks, and the pre-backward hooks it
puts on the outputs, run around it. The root's forward runs the root's graph, each unit's
forward its span's (`SpanForward`); a region of the plan becomes a region of the graph it lies
in (regions never span two units, the planner's `same_unit`), so a unit's region recomputes in
its backward, when FSDP2 has gathered its parameters again, and a root region (embedding, final
norm, head) while the root's are gathered (FSDP2 keeps the root's through backward). Every graph
is built against the sharded model itself (`rewrite` adopts its modules): a parameter is read
where and when the graph reads it, the unsharded one during forward and backward. The nodes a
part runs are the whole graph's, in the whole graph's order: what was profiled is what runs.
In eval mode or under no_grad every module runs its own forward.
"""
from __future__ import annotations

import functools
import operator
import types

import torch
import torch.fx as fx

from remat.planner.profile.graph import compute_nodes
from remat.planner.result import Plan, Region
from remat.planner.capture.trace import Traced

from ..rewrite import regions_of, rewrite, view_replay

SPAN = "remat_span"       # the keyword the root's graph calls a unit's span with


def _span_graph(body: list[fx.Node]) -> tuple[fx.Graph, list[fx.Node], list[fx.Node]]:
    """The graph of a unit's `body`: its inputs (values made outside it; attributes are read
    inside) and its outputs (values read outside it)."""
    inside = set(body)
    outside = dict.fromkeys(a for n in body for a in n.all_input_nodes if a not in inside)
    inputs = [a for a in outside if a.op != "get_attr"]
    g = fx.Graph()
    env = {a: g.placeholder(a.name) for a in inputs}
    env.update({a: g.get_attr(a.target) for a in outside if a.op == "get_attr"})
    for n in body:
        env[n] = g.node_copy(n, lambda a: env[a])
    outputs = [n for n in body if any(u not in inside for u in n.users)]
    g.output(tuple(env[n] for n in outputs))
    return g, inputs, outputs


def _module(graph: fx.Graph, gm: fx.GraphModule, model: torch.nn.Module, name: str) -> fx.GraphModule:
    """`graph` as a GraphModule whose modules and attributes are `model`'s (its sharded modules
    themselves), or `gm`'s where `model` has none (the capture's own: export's output rebuilder,
    its lifted constants)."""
    def find(target: str):
        try:
            return functools.reduce(getattr, target.split("."), model)
        except AttributeError:
            return functools.reduce(getattr, target.split("."), gm)
    own = {n.target: find(n.target) for n in graph.nodes if n.op in ("call_module", "get_attr")}
    return fx.GraphModule(own, graph, name)


def split(gm: fx.GraphModule, units: list[str], model: torch.nn.Module) -> tuple[fx.GraphModule, dict]:
    """`gm` (captured from a plain copy of `model`) cut at its units (NOTE [ the root's graph ]):
    the root's graph and each unit's span, both reading `model`'s modules. `units`: the unit
    running each compute node of `gm` ("" the root), a unit's nodes contiguous."""
    nodes = compute_nodes(gm)
    where = dict(zip(nodes, units))
    spans: dict[str, list[fx.Node]] = {}
    for n in nodes:
        if where[n]:
            spans.setdefault(where[n], []).append(n)
    root, env, parts = fx.Graph(), {}, {}

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:                    # attributes where the root reads them
            assert a.op == "get_attr", f"{a.name} is read before it is made"
            env[a] = root.get_attr(a.target)
        return env[a]
    for n in gm.graph.nodes:
        u = where.get(n, "")
        if n.op == "get_attr" or (u and n is not spans[u][0]):
            continue
        if u:
            sub, inputs, outputs = _span_graph(spans[u])
            parts[u] = _module(sub, gm, model, f"Span_{u.replace('.', '_')}")
            k = len(parts)
            call = root.create_node("call_module", u, tuple(arg(a) for a in inputs), {SPAN: True},
                                    name=f"remat_unit_{k}")
            for j, o in enumerate(outputs):
                env[o] = root.create_node("call_function", operator.getitem, (call, j), name=f"remat_unit_{k}_{j}")
            continue
        env[n] = root.node_copy(n, arg)
    return _module(root, gm, model, type(gm).__name__), parts


def _local(plan: Plan, gm: fx.GraphModule, flat_names: list[str]) -> tuple[tuple[Region, ...], tuple[str, ...]]:
    """The plan's regions whose nodes `gm` runs, as indices of its own nodes; its node names."""
    names = tuple(n.name for n in compute_nodes(gm))
    pos = {name: k for k, name in enumerate(names)}
    out = []
    for r in plan.regions:
        if flat_names[r.start] in pos:
            out.append(Region(pos[flat_names[r.start]], pos[flat_names[r.end]],
                              tuple(pos[flat_names[j]] for j in r.saved)))
    return tuple(out), names


class GraphForward:
    """A module's `forward`, set on the instance: its rewritten graph in training, its own forward
    otherwise. Being plain `forward`, it runs inside the module's hooks (FSDP2's, DDP's)."""

    def __init__(self, module: torch.nn.Module, gm: torch.fx.GraphModule, traced: Traced):
        self.module, self.gm, self.traced = module, gm, traced
        self.own = types.SimpleNamespace(forward=type(module).forward.__get__(module))   # binds the inputs

    def __call__(self, *args, **kwargs):
        m = self.module
        if not (m.training and torch.is_grad_enabled()):
            return type(m).forward(m, *args, **kwargs)
        _rebind(self.gm, m)
        with view_replay():
            return self.gm(**self.traced.inputs(self.own, args, kwargs))


class SpanForward:
    """A fully_shard unit's `forward`, set on the instance: called by the root's graph with its
    span's inputs (`remat_span=True`), it runs its span's rewritten graph; otherwise its own."""

    def __init__(self, module: torch.nn.Module, gm: torch.fx.GraphModule, root: torch.nn.Module):
        self.module, self.gm, self.root = module, gm, root

    def __call__(self, *args, **kwargs):
        if not kwargs.pop(SPAN, False):
            return type(self.module).forward(self.module, *args, **kwargs)
        _rebind(self.gm, self.root)
        with view_replay():
            return self.gm(*args)


def _rebind(gm: fx.GraphModule, model: torch.nn.Module) -> None:
    """The graph's own parameters (those `rewrite` registered on its top level: the module's own,
    adopted when built) are the ones the module has now (FSDP2 swaps in the unsharded ones)."""
    for name in list(gm._parameters):
        if name in model._parameters:
            gm._parameters[name] = model._parameters[name]


def install(model: torch.nn.Module, flat: fx.GraphModule, traced: Traced, plan: Plan, units: tuple[str, ...]) -> int:
    """The split graph (NOTE [ the root's graph ]) with the plan's regions, set as the forwards
    of `model` (the FSDP2 root) and its units; returns how many regions they run."""
    names = [n.name for n in compute_nodes(flat)]
    assert len(units) == len(names) + 1, "the plan is not of this graph (its nodes and the loss)"
    root_gm, parts = split(flat, units[:-1], model)
    facts = plan.facts
    n = 0
    for u, part in parts.items():
        regions, local = _local(plan, part, names)
        unit = model.get_submodule(u)
        object.__setattr__(unit, "forward", SpanForward(unit, rewrite(model, part, regions, local, facts), model))
        n += len(regions)
    regions, local = _local(plan, root_gm, names)
    gm = rewrite(model, root_gm, regions, local, facts)
    object.__setattr__(model, "forward", GraphForward(model, gm, traced))
    return n + len(regions)


def installed(module: torch.nn.Module):
    """The graph `module` runs as remat set it (GraphForward, SpanForward), else None."""
    f = module.__dict__.get("forward")
    return f.gm if isinstance(f, (GraphForward, SpanForward)) else None


def region_count(module: torch.nn.Module) -> int:
    gm = installed(module)
    return 0 if gm is None else len(regions_of(gm))


def _install(module: torch.nn.Module, gm, traced: Traced) -> None:
    object.__setattr__(module, "forward", GraphForward(module, gm, traced))
