"""The plan of a data-parallel step: profiled per rank on the plain copy, solved on rank 0 and
broadcast, installed into every unit (`wrap`), and taken out again (`DistributedRemat.remove`)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from remat.planner import PlanOptions, solve_plan
from remat.planner.api import analyze_for
from remat.planner.budget import Budget
from remat.planner.distributed import Sharding, per_rank
from remat.planner.solve.fit import unplanned_peak_bytes
from remat.planner.result import Plan

from ..budget import StepBudget
from ..rewrite import REGION_PROBE, rewrite
from .fsdp import _world, engine, fsdp_sharding, log, plain_copy
from .units import GraphForward, SpanForward, _install, install

# ---- the plan ------------------------------------------------------------------------------

def _agreed(solve: Callable[[], Plan | list[Plan]], group=None) -> Plan | list[Plan]:
    """The plan (or list of plans: a rank's stages) of `group`'s first rank (every rank's by
    default) on each of its ranks: it solves, and broadcasts the plans' JSON, or the error it
    raised (an infeasible budget), which every rank then raises. Without a process group, or a
    group of one, `solve()`."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return solve()
    box: list = [None]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    if dist.get_rank() == src:
        try:
            plans = solve()
            box = [[p.to_json() for p in plans] if isinstance(plans, list) else plans.to_json()]
        except Exception as e:          # every rank raises it, none waits for a plan
            box = [e]
    dist.broadcast_object_list(box, src=src, group=group)
    if isinstance(box[0], Exception):
        raise box[0]
    return [Plan.from_json(j) for j in box[0]] if isinstance(box[0], list) else Plan.from_json(box[0])


def _solve(cg, budget: Budget, options: PlanOptions, opaque) -> Plan:
    """The per-rank plan (the simulator's prediction); an infeasible budget in the budget's unit."""
    budget = StepBudget.of(budget)
    with budget.errors_spelled():
        return solve_plan(cg, budget.resolve(unplanned_peak_bytes(cg, options)), options, opaque)


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
    plan (per rank) and its cost graph. The regions live inside the root's and the units' forwards
    (GraphForward, SpanForward), so the model itself, with its hooks, runs them."""

    def __init__(self, model: torch.nn.Module, plan: Plan, cost_graph):
        self.model, self.plan, self.cost_graph = model, plan, cost_graph

    def remove(self) -> torch.nn.Module:
        """The units' own forwards back; returns the model as it was before plan_and_wrap."""
        _uninstall(self.model)
        self.model.__dict__.pop("remat", None)
        return self.model


def _uninstall(model: torch.nn.Module) -> None:
    for m in model.modules():                 # a model wrapped before is planned as it is without remat
        if isinstance(m.__dict__.get("forward"), (GraphForward, SpanForward)):
            del m.__dict__["forward"]


def wrap(model: torch.nn.Module, budget: Budget, args: tuple, kwargs: dict, loss_fn: Callable | None,
         options: PlanOptions, optimizer=None) -> torch.nn.Module:
    """plan_and_wrap for FSDP2 and DDP models (runtime.api delegates here)."""
    _uninstall(model)
    cg, _, a = plan_step(model, args, kwargs, loss_fn, options, optimizer)
    plan = Plan.from_json(_agreed(lambda: _solve(cg, budget, options, a.traced.opaque)).to_json())
    plan = plan.noting(units=[c.unit for c in cg.nodes])
    if engine(model) == "ddp":
        if plan.regions:
            inner = model.module
            names = tuple(c.name for c in cg.nodes)
            _install(inner, rewrite(inner, a.traced.gm, plan.regions, names, plan.facts), a.traced)
    elif plan.regions:                                  # NOTE [ the root's graph ]
        n = install(model, a.traced.gm, a.traced, plan, plan.facts.units)
        assert n == len(plan.regions), "a region was lost splitting the graph at its units"
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
