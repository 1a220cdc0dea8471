"""Plans for data-parallel models: a model sharded with FSDP2 `fully_shard`, or wrapped in DDP.

The step is planned per rank (planner/distributed.py, NOTE [ per-rank memory ]) on one process's
view: the unsharded model on the local batch, profiled on fake tensors. Regions are rewritten
*inside* the engine's modules, so its hooks fire as without remat:
- FSDP2: each fully_shard unit below the root keeps its pre/post-forward hooks (all-gather,
  reshard, the pre-backward all-gather registered on its outputs); its `forward` runs the unit's
  own rewritten graph, whose regions recompute during the unit's backward, when FSDP2 has
  gathered its parameters again. Regions never span two units, nor run in the root's own forward.
- DDP: `module.forward` runs the rewritten graph; DDP's forward and its reducer are untouched.
Every rank runs the same plan: it is solved on rank 0 and broadcast.
"""
from __future__ import annotations

import inspect
import logging
import types
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from remat.planner import PlanOptions, solve_plan
from remat.planner.api import analyze_for
from remat.planner.budget import Budget
from remat.planner.distributed import Sharding, Unit, per_rank
from remat.planner.errors import InfeasibleBudgetError, PlanMismatchError
from remat.planner.fit import unplanned_peak_bytes
from remat.planner.profile import compute_nodes
from remat.planner.result import Plan, Region
from remat.planner.trace import OUTPUT, Traced, export, trace

from .rewrite import REGION_PROBE, rewrite, view_replay

log = logging.getLogger("remat.runtime")
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def engine(model: torch.nn.Module) -> str | None:
    """"fsdp" for a model sharded with fully_shard (root included), "ddp" for a DDP wrapper, else
    None. A model with fully_shard units but an unsharded root is refused (TypeError)."""
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if isinstance(model, FSDPModule):
        return "fsdp"
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise TypeError(f"{type(model).__name__} has fully_shard units but its root is not sharded: call "
                        "fully_shard(model) after its blocks (torchtitan's order), then plan_and_wrap")
    return None


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# ---- FSDP2: what a rank holds, and a plain copy to profile ----------------------------------

def _original_class(m: torch.nn.Module) -> type:
    """The class fully_shard swapped out (it makes `FSDP<cls>(FSDPModule, cls)`)."""
    cls = type(m)
    return cls.__bases__[1] if isinstance(m, FSDPModule) and cls.__bases__[0] is FSDPModule else cls


def _groups(unit: FSDPModule) -> list:
    """FSDP2's parameter groups of one unit (its private state: sizes, dtypes, resharding)."""
    return list(unit._get_fsdp_state()._fsdp_param_groups)


def _compute_dtype(group, p: torch.Tensor) -> torch.dtype:
    return group.mp_policy.param_dtype or p.dtype


def unit_sizes(name: str, unit: FSDPModule, world: int) -> Unit:
    """What one rank holds of `unit`: unsharded and sharded parameter bytes, and gradients."""
    full = shard = grad = grad_shard = 0
    reshard = name != ""
    for g in _groups(unit):
        reshard = reshard and g.post_forward_mesh_info is not None
        for fp in g.fsdp_params:
            p = fp.sharded_param
            numel = fp._orig_size.numel()
            local = fp.padded_sharded_param_size.numel()
            cdt = _compute_dtype(g, p).itemsize
            rdt = (g.mp_policy.reduce_dtype or _compute_dtype(g, p)).itemsize
            full += numel * cdt
            shard += local * p.dtype.itemsize
            if p.requires_grad:
                grad += numel * cdt
                grad_shard += local * rdt
    return Unit(name, full, shard, grad, grad_shard, reshard)


def fsdp_sharding(model: FSDPModule, world: int | None = None) -> Sharding:
    world = world or _world()
    units = tuple(unit_sizes(n, m, world) for n, m in model.named_modules() if isinstance(m, FSDPModule))
    nested = [u.name for u in units if u.name and any(v.name and u.name.startswith(v.name + ".") for v in units)]
    if nested:
        raise TypeError(f"fully_shard units inside other units ({nested[:3]}): remat plans one level of units "
                        "below the root (torchtitan's per-block wrapping)")
    return Sharding("fsdp", world, units)


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` that holds no memory (its storage freed): fake tensors made from it
    have its shape, dtype and device."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The module tree as it computes in forward, for planning: the original classes, no hooks,
    each fully_shard parameter as an unsharded, storage-less tensor in the dtype forward computes
    in; buffers and unsharded parameters are the model's own objects. Tied parameters stay tied."""
    dtypes = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in _groups(m):
                for fp in g.fsdp_params:
                    dtypes[id(fp.sharded_param)] = (fp._orig_size, _compute_dtype(g, fp.sharded_param))
    made: dict[int, torch.nn.Module | torch.nn.Parameter] = {}

    def param(p):
        if id(p) not in made:
            if id(p) in dtypes:
                shape, dt = dtypes[id(p)]
                made[id(p)] = torch.nn.Parameter(_empty(shape, dt, p.to_local().device), requires_grad=p.requires_grad)
            else:
                made[id(p)] = p
        return made[id(p)]

    def clone(m):
        if id(m) in made:
            return made[id(m)]
        cls = _original_class(m)
        c = cls.__new__(cls)
        c.__dict__.update(m.__dict__)
        for k in _HOOKS:
            if k in c.__dict__:
                c.__dict__[k] = type(m.__dict__[k])()
        c._parameters = {k: None if p is None else param(p) for k, p in m._parameters.items()}
        c._buffers = dict(m._buffers)
        made[id(m)] = c
        c._modules = {k: None if s is None else clone(s) for k, s in m._modules.items()}
        return c
    return clone(model)


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


# ---- the plan ------------------------------------------------------------------------------

def _agreed(solve: Callable[[], Plan]) -> Plan:
    """Rank 0's plan on every rank: it solves, and broadcasts the plan's JSON, or the error it
    raised (an infeasible budget), which every rank then raises. Without a group, `solve()`."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return solve()
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [solve().to_json()]
        except Exception as e:          # every rank raises it, none waits for a plan
            box = [e]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    return Plan.from_json(box[0])


def _solve(cg, budget: Budget, options: PlanOptions, opaque) -> Plan:
    """The per-rank plan (the simulator's prediction); an infeasible budget in the budget's unit."""
    budget_bytes = budget.bytes_of(unplanned_peak_bytes(cg, options))
    try:
        return solve_plan(cg, budget_bytes, options, opaque)
    except InfeasibleBudgetError as e:
        raise e.in_unit(budget.unit) from None


def plan_step(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn: Callable | None,
              options: PlanOptions, optimizer=None, world: int | None = None):
    """(the per-rank cost graph, the module profiled, its Analysis) for one rank of `model`: the
    plain copy (FSDP2) or the inner module (DDP), on this rank's batch."""
    kind = engine(model)
    world = world or _world()
    if kind == "ddp":
        inner = model.module
        a = analyze_for(inner, args, kwargs, loss_fn, options, optimizer, REGION_PROBE)
        buckets = sum(p.numel() * p.element_size() for p in inner.parameters() if p.requires_grad)
        return per_rank(a.cost_graph, Sharding("ddp", world, bucket_bytes=buckets)), inner, a
    plain = plain_copy(model)
    a = analyze_for(plain, args, kwargs, loss_fn, options, _plain_optimizer(optimizer, model, plain), REGION_PROBE)
    return per_rank(a.cost_graph, fsdp_sharding(model, world)), plain, a


def _plain_optimizer(optimizer, model, plain):
    """The same optimizer (class, hyperparameters) over the plain copy's parameters: its state and
    step are measured there, unsharded, and scaled to the shard (planner.distributed.per_rank)."""
    if optimizer is None:
        return None
    to_plain = dict(zip((id(p) for p in model.parameters()), plain.parameters()))
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [to_plain[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return type(optimizer)(groups)       # each group carries every hyperparameter


class DistributedRemat:
    """remat's state on a model sharded with fully_shard, or a DDP wrapper, as `model.remat`: the
    plan (per rank) and its cost graph. The regions live inside the units' forwards (GraphForward),
    so the model itself, with its hooks, runs them."""

    def __init__(self, model: torch.nn.Module, plan: Plan, cost_graph):
        self.model, self.plan, self.cost_graph = model, plan, cost_graph

    def remove(self) -> torch.nn.Module:
        """The units' own forwards back; returns the model as it was before plan_and_wrap."""
        _uninstall(self.model)
        self.model.__dict__.pop("remat", None)
        return self.model


def _uninstall(model: torch.nn.Module) -> None:
    for m in model.modules():                 # a model wrapped before is planned as it is without remat
        if isinstance(m.__dict__.get("forward"), (GraphForward, KeywordForward)):
            del m.__dict__["forward"]


def wrap(model: torch.nn.Module, budget: Budget, args: tuple, kwargs: dict, loss_fn: Callable | None,
         options: PlanOptions, optimizer=None) -> torch.nn.Module:
    """plan_and_wrap for FSDP2 and DDP models (runtime.api delegates here)."""
    _uninstall(model)
    cg, plain, a = plan_step(model, args, kwargs, loss_fn, options, optimizer)
    plan = Plan.from_json(_agreed(lambda: _solve(cg, budget, options, a.traced.opaque)).to_json())
    plan.meta["units"] = [c.unit for c in cg.nodes]
    flat = compute_nodes(a.traced.gm)
    if engine(model) == "ddp":
        if plan.regions:
            inner = model.module
            names = tuple(c.name for c in cg.nodes)
            _install(inner, rewrite(inner, a.traced.gm, plan.regions, names, plan.meta), a.traced)
    else:
        plains = dict(plain.named_modules())
        units = [(name, unit) for name, unit in model.named_modules() if isinstance(unit, FSDPModule) and name]
        if a.traced.path == "torch.export":         # NOTE [ a unit's capture ]
            calls = unit_calls(model, args, {**(a.traced.extra_kwargs or {}), **kwargs})
            if a.traced.extra_kwargs:
                object.__setattr__(model, "forward", KeywordForward(model, a.traced.extra_kwargs))
            n = sum(_unit_forward(name, unit, plains[name], plan, flat, calls[name]) for name, unit in units
                    if name in calls)
        else:
            n = sum(_unit_forward(name, unit, plains[name], plan, flat, None) for name, unit in units)
        assert n == len(plan.regions), "a region runs outside the fully_shard units"
    log.info("%s (%s, %d ranks): %d regions, predicted %.3f GB per rank", type(model).__name__, engine(model),
             _world(), len(plan.regions), plan.predicted_peak_bytes / 1e9)
    model.__dict__["remat"] = DistributedRemat(model, plan, cg)
    return model


def wrap_model(model, budget: Budget, example_inputs, example_kwargs, loss_fn, options: PlanOptions,
               compile, optimizer) -> torch.nn.Module:
    """`runtime.plan_and_wrap` for an FSDP2 or DDP model: planned now, on the local batch."""
    if example_inputs is None and example_kwargs is None:
        raise ValueError(f"{type(model).__name__} is data-parallel ({engine(model)}): pass example_inputs (this "
                         "rank's local batch) so that every rank plans the same step now")
    if compile:
        raise NotImplementedError("compile=True with FSDP2 or DDP is not planned yet: wrap without compile")
    return wrap(model, budget, tuple(example_inputs or ()), dict(example_kwargs or {}), loss_fn, options, optimizer)


# ---- planning a job of any size from one process ---------------------------------------------

def fake_world(world_size: int) -> None:
    """A process group of `world_size` ranks in this process whose collectives do nothing (torch's
    `fake` backend): fully_shard shards as it would on that job, so one process plans it."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is already initialized; "
                               f"cannot plan for {world_size}")
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def blocks_of(model: torch.nn.Module) -> list[str]:
    """The repeated blocks torchtitan shards one by one: the children of the ModuleList of
    same-typed modules that holds the most parameters (a transformer's layers)."""
    best, most = [], 0
    for name, m in model.named_modules():
        kids = list(m.children())
        if isinstance(m, torch.nn.ModuleList) and len(kids) > 1 and len({type(k) for k in kids}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if size > most:
                best, most = [f"{name}.{k}" if name else str(k) for k in range(len(kids))], size
    return best


def shard_per_block(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """`model` sharded as torchtitan does (each block, then the root) over a fake group of
    `world_size` ranks, for planning (`python -m remat report ... --world-size N --fsdp`)."""
    from torch.distributed.fsdp import fully_shard
    blocks = blocks_of(model)
    if not blocks:
        raise TypeError(f"{type(model).__name__} has no ModuleList of repeated blocks to shard one by one")
    fake_world(world_size)
    for name in blocks:
        fully_shard(model.get_submodule(name))
    return fully_shard(model)


def per_rank_analysis(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn, options: PlanOptions,
                      optimizer_of: Callable, engine_name: str, world_size: int):
    """The Analysis of one rank of a `world_size`-rank job of `model` (unsharded, unwrapped) under
    `engine_name` ("fsdp": sharded per block here, on a fake group; "ddp"), its cost graph per rank.
    `optimizer_of(model)` makes the optimizer (or None) over the model as it will train."""
    from dataclasses import replace
    if engine_name == "ddp":
        a = analyze_for(model, args, kwargs, loss_fn, options, optimizer_of(model), REGION_PROBE)
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return replace(a, cost_graph=per_rank(a.cost_graph, Sharding("ddp", world_size, bucket_bytes=buckets)))
    model = shard_per_block(model, world_size)
    cg, _, a = plan_step(model, args, kwargs, loss_fn, options, optimizer_of(model), world_size)
    return replace(a, cost_graph=cg)
