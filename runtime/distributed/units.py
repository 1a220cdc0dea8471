"""The graph a fully_shard unit (or DDP's module) runs: the unit's own capture, its share of the
plan's regions, and the forward that runs its rewritten graph inside FSDP2's hooks."""
from __future__ import annotations

import inspect
import types

import torch
from torch.distributed.fsdp import FSDPModule

from remat.planner.errors import PlanMismatchError
from remat.planner.profile import compute_nodes
from remat.planner.result import Plan, Region
from remat.planner.trace import OUTPUT, Traced, export, trace

from ..rewrite import rewrite, view_replay

# ---- the graph a unit runs ------------------------------------------------------------------

def _placeholders(module: torch.nn.Module) -> tuple[tuple, dict]:
    """Stand-in arguments for `module.forward`'s required parameters: fx traces them symbolically."""
    args, kwargs = [], {}
    for p in inspect.signature(type(module).forward.__get__(module)).parameters.values():
        if p.default is not inspect.Parameter.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        (kwargs.__setitem__(p.name, None) if p.kind == p.KEYWORD_ONLY else args.append(None))
    return tuple(args), kwargs


def _same_op(flat, local, prefix: str) -> bool:
    if flat.op != local.op:
        return False
    return flat.target == (f"{prefix}.{local.target}" if flat.op == "call_module" else local.target)


# an exported graph's own bookkeeping: its input guards, and the module rebuilding its output
_EXPORT_ONLY = ("_guards_fn", OUTPUT)


def local_regions(plan: Plan, flat_nodes: list, name: str, local: Traced) -> tuple[Region, ...]:
    """The plan's regions inside unit `name`, as node indices of the unit's own graph. Raises
    PlanMismatchError when the unit's graph is not the part of the whole graph it runs."""
    units = plan.meta.get("units", [])
    mine = [i for i, u in enumerate(units) if u == name]
    nodes = compute_nodes(local.gm)
    own = [k for k, n in enumerate(nodes) if not (local.path == "torch.export" and n.op == "call_module"
                                                  and n.target in _EXPORT_ONLY)]
    if len(mine) != len(own) or not all(_same_op(flat_nodes[i], nodes[k], name) for i, k in zip(mine, own)):
        raise PlanMismatchError(f"unit {name!r} captured alone ({len(own)} nodes) is not what it runs inside the "
                                f"model ({len(mine)} nodes): does its forward depend on optional arguments?")
    pos = dict(zip(mine, own))
    out = []
    for r in plan.regions:
        if units[r.start] == name:
            out.append(Region(pos[r.start], pos[r.end], tuple(pos[j] for j in r.saved)))
    return tuple(out)


class GraphForward:
    """A module's `forward`, set on the instance: its rewritten graph in training, its own forward
    otherwise. Being plain `forward`, it runs inside the module's hooks (FSDP2's, DDP's)."""

    def __init__(self, module: torch.nn.Module, gm: torch.fx.GraphModule, traced: Traced):
        self.module, self.gm, self.traced = module, gm, traced
        self.own = types.SimpleNamespace(forward=type(module).forward.__get__(module))   # its signature binds the inputs
        self.params = _param_attrs(gm)

    def __call__(self, *args, **kwargs):
        m = self.module
        if not (m.training and torch.is_grad_enabled()):
            return type(m).forward(m, *args, **kwargs)
        for owner, leaf in self.params:         # FSDP2 swaps in the unsharded ones on the modules
            self.gm.get_submodule(owner)._parameters[leaf] = m.get_submodule(owner)._parameters[leaf]
        with view_replay():
            return self.gm(**self.traced.inputs(self.own, args, kwargs))


class KeywordForward:
    """The root's own `forward`, set on the instance, called in training with the keyword inputs
    the whole model was captured with (`Traced.extra_kwargs`: use_cache=False, as Hugging Face
    calls itself under gradient checkpointing), so its units get the arguments they were
    exported with; otherwise as it is."""

    def __init__(self, module: torch.nn.Module, extra: dict):
        self.module, self.extra = module, extra

    def __call__(self, *args, **kwargs):
        m = self.module
        if m.training and torch.is_grad_enabled():
            kwargs = {**self.extra, **kwargs}
        return type(m).forward(m, *args, **kwargs)


def _param_attrs(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(owner module, name) of each parameter the graph reads by attribute: the unit's own (fx),
    or every one of them (an exported graph reads its submodules' parameters itself)."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            owner, _, leaf = n.target.rpartition(".")
            if leaf in gm.get_submodule(owner)._parameters:
                out.append((owner, leaf))
    return out


def _install(module: torch.nn.Module, gm, traced: Traced) -> None:
    object.__setattr__(module, "forward", GraphForward(module, gm, traced))


def unit_calls(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, tuple[tuple, dict]]:
    """Each fully_shard unit's (args, kwargs) in one forward of `model` under no_grad (a
    collective: every rank runs it): the real arguments a unit is exported with."""
    calls: dict[str, tuple[tuple, dict]] = {}

    def recorder(name: str):
        def record(module, a, kw):
            calls.setdefault(name, (a, kw))
        return record
    handles = [u.register_forward_pre_hook(recorder(name), with_kwargs=True)
               for name, u in model.named_modules() if isinstance(u, FSDPModule) and name]
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _unit_forward(name: str, unit: torch.nn.Module, plain: torch.nn.Module, plan: Plan, flat_nodes: list,
                  call: tuple[tuple, dict] | None) -> int:
    """Give `unit` the graph of its regions; returns how many it has. NOTE [ a unit's capture ]:
    a unit is captured as the whole model was: fx traces the unit itself (its graph calls its own
    submodules, its required arguments symbolic); where the whole model was exported (Hugging
    Face models: fx follows neither), the plain copy of the unit is exported with the arguments
    it was called with (`call`), its nodes the whole graph's ATen ops."""
    if call is None:
        args, kwargs = _placeholders(plain)
        local = trace(unit, args, kwargs)
    else:
        local = export(plain, *call)
    regions = local_regions(plan, flat_nodes, name, local)
    if regions:
        names = tuple(n.name for n in compute_nodes(local.gm))
        meta = {**plan.meta, "mutated_buffers": [b.removeprefix(name + ".") for b in plan.meta.get("mutated_buffers", [])
                                                 if b.startswith(name + ".")]}
        _install(unit, rewrite(unit, local.gm, regions, names, meta), local)
    return len(regions)
