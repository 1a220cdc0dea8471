"""A pipeline stage under FSDP2 (PP x DP): `plan_and_wrap(stage_module, budget, example_inputs=(one
micro-batch,), schedule=schedule)` on a stage module sharded with fully_shard over a data-parallel
mesh dimension, one stage a rank (ScheduleGPipe, Schedule1F1B). Planned as a pipeline stage is
(runtime/distributed/pipeline.py: the rank's whole `schedule.step` replayed on fake tensors), on the
stage's plain copy (runtime/distributed/fsdp.py), with what FSDP2 holds of the stage's parameters
and gradients counted into the replay as the stage's schedule drives it (NOTE [ a stage under
FSDP2 ]); the plan is installed into the root and its units as for FSDP2 alone (plan.install).

NOTE [ a stage under FSDP2 ]
torch's PipelineStage runs every backward of a step with FSDP2's gradient sync and resharding
after backward off (stage.backward_maybe_with_nosync: set_requires_gradient_sync(False),
set_reshard_after_backward(False)), and at the step's end (perform_reduce_grad) runs every unit's
post-backward with both on: one reduce-scatter a unit, then the gradients scaled. So, per rank:
- the parameters are this rank's shards (S) but while gathered: the root's from its first forward
  to the step's end (FSDP2 does not reshard the root after forward), a unit's from its forward's
  all-gather to its post-forward (resharded after forward), and from its first backward's on to
  the next forward's post-forward, or the step's end: after a backward every unit stays gathered;
- a forward's all-gather: its flat output (P_U; gloo stages it through a temporary of its size),
  then the parameters copied out of it (P_U); FSDP2 keeps that flat output until the next
  all-gather's wait, or the root's post-forward; a unit already gathered is not gathered again;
- a backward starts at the root's pre-backward, which prefetches the last unit; each unit's
  pre-backward copies its prefetched parameters out (the flat output freed) and prefetches the
  unit before it (its flat output held until that unit's pre-backward): none once all are gathered.
  (Where the root's output is its last unit's, as on a first stage, torch runs that unit's
  pre-backward first, which gathers it itself, then the root's, which has nothing left to
  prefetch: the same bytes at every moment.)
- the gradients are unsharded (g) and accumulate across micro-batches as the unsharded step's do
  (the replay's own gradients), until the step's end: then for each unit in FSDP2's order (the
  root, then the units in module order) its parameters resharded, the previous reduce-scatter's
  input freed, its gradients copied into a reduce-scatter input (g_U) and freed, the output (the
  shard, s_U) and gloo's temporary (g_U) allocated; the last input freed after all.
The replay runs the stage's plain copy (every parameter unsharded: P); the overlay starts it at
S - P and moves the meter's live bytes by the amounts above at each event. The events come from
marks put into the replayed graph at each unit's boundary (`mark_units`): the unit's inputs pass
through a mark whose forward is the unit's pre-forward and whose backward its post-backward; its
outputs through one whose forward is its post-forward and backward its pre-backward (where FSDP2
hooks them: its pre-backward hook is on the unit's outputs); the root's at the graph's inputs and
outputs. Regions never span units, so a unit's recompute runs while it is gathered, as FSDP2 does.
"""
from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
from torch import fx

from remat.planner import PlanOptions, solve_plan
from remat.planner.api import analyze_for
from remat.planner.distributed import Unit, unit_of
from remat.planner.facts import StepFacts
from remat.planner.step.optimizer import optimizer_memory

from ..budget import StepBudget
from ..planning import ExactReplay
from ..rewrite import REGION_PROBE
from ..rewrite.graph import CheckpointRegion
from .fsdp import dp_group, fsdp_sharding, log, plain_copy
from .pipeline import PipelineScheduleError, rank_graph, rank_of, rank_peak, received_grad_loss, stage_inputs
from .plan import DistributedRemat, _agreed, _plain_optimizer, _uninstall
from .units import install


@dataclass(frozen=True)
class FsdpStage:
    """A stage's FSDP2 units as the replay's overlay needs them: each unit's sizes (the root ""),
    the units below the root in forward order, the unit of each graph node (by name), whether
    the collectives stage through a temporary of their full size (gloo), and on a rank of several
    stages, the stage's actions as the runtime runs them (its computations, "UNSHARD", "RESHARD",
    "REDUCE_GRAD": NOTE [ stages under FSDP2 on one rank ] in interleaved_fsdp.py)."""
    units: dict
    order: tuple[str, ...]
    where: dict
    staged: bool
    actions: tuple = ()

    def marked(self, gm: fx.GraphModule) -> "FsdpOverlay":
        """`gm` (the rewritten stage, changed in place) with the units' marks, and their overlay."""
        overlay = FsdpOverlay(self)
        mark_units(gm, self, overlay)
        return overlay


@dataclass
class FsdpOverlay:
    """FSDP2's memory of a stage through its rank's step, moved into the replay's meter event by
    event (NOTE [ a stage under FSDP2 ])."""
    stage: FsdpStage
    meter: object = None
    gathered: set = field(default_factory=set)
    pending: set = field(default_factory=set)      # prefetched: the all-gather's flat output, not copied out
    retained: int = 0                              # a forward all-gather's flat output, kept
    reduced: int = 0                               # the latest reduce-scatter's input, kept
    explicit: list = field(default_factory=list)   # all-gathered by the runtime's UNSHARD, not copied out yet

    def start(self, meter) -> None:
        """The step's start: every unit sharded (the replay counts them unsharded)."""
        self.meter, self.gathered, self.pending, self.retained, self.reduced = meter, set(), set(), 0, 0
        self.explicit = []
        units = self.stage.units.values()
        self._move(sum(u.shard_bytes - u.unsharded_bytes for u in units))

    def _move(self, n: int) -> None:
        m = self.meter
        m.live_bytes += n
        m._peak = max(m._peak, m.live_bytes)

    def _all_gather(self, u: Unit) -> None:
        """Its flat output (P_U), through gloo's temporary when staged."""
        self._move(u.unsharded_bytes)
        if self.stage.staged:
            self._move(u.unsharded_bytes)
            self._move(-u.unsharded_bytes)

    def event(self, name: str, what: str) -> None:
        if self.meter is None:          # not metered (the replay's shape probe)
            return
        u = self.stage.units[name]
        if what == "pre_forward" and name not in self.gathered:
            self._all_gather(u)
            self._move(-self.retained)              # the previous flat output, freed at this one's wait
            self._move(u.unsharded_bytes)           # copied out
            self.retained = u.unsharded_bytes
            self.gathered.add(name)
        elif what == "post_forward" and name:
            if name in self.gathered and u.reshard_after_forward:
                self._move(-u.unsharded_bytes)
                self.gathered.discard(name)
        elif what == "post_forward":                # the root's: the last flat output freed
            self._move(-self.retained)
            self.retained = 0
        elif what == "pre_backward":
            self._pre_backward(name, u)

    def _pre_backward(self, name: str, u: Unit) -> None:
        if name in self.pending:                    # copied out of the prefetched flat output
            self._move(u.unsharded_bytes)
            self._move(-u.unsharded_bytes)
            self.pending.discard(name)
            self.gathered.add(name)
        elif name not in self.gathered:
            self._all_gather(u)
            self._move(u.unsharded_bytes)
            self._move(-u.unsharded_bytes)
            self.gathered.add(name)
        order = ("",) + self.stage.order
        before = order[order.index(name) - 1]       # the root's pre-backward prefetches the last unit
        if before not in self.gathered and before not in self.pending:
            self._all_gather(self.stage.units[before])
            self.pending.add(before)

    def unshard(self) -> None:
        """The runtime's UNSHARD: every unit not gathered (the root first) all-gathered at once, its
        flat output held until the stage's next computation waits for it (`wait`)."""
        if self.meter is None:
            return
        for name in ("",) + self.stage.order:
            if name not in self.gathered and name not in self.pending:
                self._all_gather(self.stage.units[name])
                self.explicit.append(name)

    def wait(self) -> None:
        """Before the stage's computation (the runtime's `_assert_unsharded`): each unit an UNSHARD
        gathered copied out of its flat output, which is freed (not kept: no forward's deferral)."""
        for name in self.explicit:
            u = self.stage.units[name]
            self._move(u.unsharded_bytes)
            self._move(-u.unsharded_bytes)
            self.gathered.add(name)
        self.explicit = []

    def reshard(self) -> None:
        """The runtime's RESHARD: every gathered unit resharded."""
        if self.meter is None:
            return
        for name in list(self.gathered):
            self._move(-self.stage.units[name].unsharded_bytes)
        self.gathered = set()

    def finish(self) -> None:
        """The step's end (perform_reduce_grad): each unit resharded and its gradients reduce-scattered."""
        for name in ("",) + self.stage.order:
            u = self.stage.units.get(name)
            if u is None:
                continue
            if name in self.gathered:
                self._move(-u.unsharded_bytes)
            self._move(-self.reduced)
            self._move(u.grad_bytes)                # the input, the gradients copied in
            self._move(-u.grad_bytes)               # the unsharded gradients freed
            self._move(u.grad_shard_bytes)          # the output: the gradient shards
            if self.stage.staged:
                self._move(u.grad_bytes)
                self._move(-u.grad_bytes)
            self.reduced = u.grad_bytes
        self._move(-self.reduced)
        self.gathered, self.reduced = set(), 0


class _Mark(torch.autograd.Function):
    """Passes a unit's inputs or outputs through; its backward is the unit's post- or pre-backward."""

    @staticmethod
    def forward(ctx, overlay, name, backward, *xs):
        ctx.overlay, ctx.name, ctx.what = overlay, name, backward
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.overlay.event(ctx.name, ctx.what)
        return (None, None, None) + grads


def _fired(overlay: FsdpOverlay, name: str, what: str, grad) -> None:
    overlay.event(name, what)


class UnitMark(torch.nn.Module):
    """A mark in the replayed graph: `forward` and `backward` are the events it stands for. At a
    unit's outputs (backward: its pre-backward) the backward event is a hook on each output, as
    FSDP2's pre-backward is, not a view of it (a zero-bubble runtime detaches a stage's outputs in
    place); at its inputs an autograd Function, as FSDP2's post-backward is."""

    def __init__(self, overlay: FsdpOverlay, name: str, forward: str, backward: str):
        super().__init__()
        self._overlay = (overlay,)      # not a submodule
        self.unit, self.fwd, self.bwd = name, forward, backward

    def forward(self, *xs):
        overlay = self._overlay[0]
        overlay.event(self.unit, self.fwd)
        at = [i for i, x in enumerate(xs) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not at or not torch.is_grad_enabled():
            return xs
        if self.bwd == "pre_backward":
            for i in at:
                xs[i].register_hook(functools.partial(_fired, overlay, self.unit, self.bwd))
            return xs
        marked = _Mark.apply(overlay, self.unit, self.bwd, *(xs[i] for i in at))
        out = list(xs)
        for i, x in zip(at, marked):
            out[i] = x
        return tuple(out)


def _region(gm: fx.GraphModule, n) -> CheckpointRegion | None:
    if isinstance(n, fx.Node) and n.op == "call_module" and isinstance(gm.get_submodule(n.target), CheckpointRegion):
        return gm.get_submodule(n.target)
    return None


UNIT = "remat_fsdp_unit"      # the node meta key `annotate` sets, which the rewrite's copies keep


def annotate(gm: fx.GraphModule, where: dict) -> None:
    """Each compute node of the graph traced (`gm`) notes its unit (`where`: by node name) in its
    meta, which rewrite's copies of it keep: the rewritten graph renames nodes (a region's outputs
    take names), so its nodes are not found by name."""
    for n in gm.graph.nodes:
        if n.name in where:
            n.meta[UNIT] = where[n.name]


def _unit_of_node(gm: fx.GraphModule, n: fx.Node, where: dict) -> str | None:
    """The unit node `n` of the rewritten graph runs in: a region's, its first node's (by its name
    in the graph traced), and so an output of it taken apart; else as `annotate` noted; else None."""
    region = _region(gm, n) or (_region(gm, n.args[0]) if n.target is operator.getitem and n.args else None)
    return where.get(region.node_names[0]) if region is not None else n.meta.get(UNIT)


def _through(gm: fx.GraphModule, mark: UnitMark, values: list, after: fx.Node, uses) -> None:
    """`values` passed through `mark`, inserted after `after`; the uses `uses(node)` names take the marked ones."""
    name = f"remat_fsdp_mark_{len([m for m in gm.children() if isinstance(m, UnitMark)])}"
    gm.add_submodule(name, mark)
    with gm.graph.inserting_after(after):
        call = gm.graph.call_module(name, tuple(values))
    last = call
    for j, v in enumerate(values):
        with gm.graph.inserting_after(last):
            last = gm.graph.call_function(operator.getitem, (call, j))
        for user in list(v.users):
            if user is not call and uses(user):
                user.replace_input_with(v, last)


def mark_units(gm: fx.GraphModule, stage: FsdpStage, overlay: FsdpOverlay) -> None:
    """Marks at every unit's boundary in `gm`, and the root's at its inputs and outputs (NOTE [ a
    stage under FSDP2 ])."""
    graph = gm.graph
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    units, cur = [], ""
    for n in body:      # a node remat did not name (a region's outputs) runs in the unit before it
        u = _unit_of_node(gm, n, stage.where)
        cur = cur if u is None else u
        units.append(cur)
    for name in stage.order:
        at = [i for i, u in enumerate(units) if u == name]
        if not at:
            continue
        span = set(body[at[0]:at[-1] + 1])
        if any(units[i] != name for i in range(at[0], at[-1] + 1)):
            raise PipelineScheduleError(f"unit {name!r} does not run as one range of the stage's graph")
        ins = list(dict.fromkeys(a for n in span for a in n.all_input_nodes if a not in span and a.op != "get_attr"))
        outs = [n for n in body[at[0]:at[-1] + 1] if any(u not in span for u in n.users)]
        _through(gm, UnitMark(overlay, name, "pre_forward", "post_backward"), ins, body[at[0]].prev,
                 lambda user, s=span: user in s)
        _through(gm, UnitMark(overlay, name, "post_forward", "pre_backward"), outs, body[at[-1]],
                 lambda user, s=span: user not in s)
    places = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    _through(gm, UnitMark(overlay, "", "pre_forward", "post_backward"), [], places[-1] if places else
             next(iter(graph.nodes)), lambda user: False)
    _through(gm, UnitMark(overlay, "", "post_forward", "pre_backward"), list(output.all_input_nodes), output.prev,
             lambda user: user is output)
    graph.lint()
    gm.recompile()


# ---- planning a stage under FSDP2 ------------------------------------------------------------

class FsdpReplay(ExactReplay):
    """ExactReplay of a pipeline rank whose stage is under FSDP2: the rank's whole step replayed
    with the FSDP2 overlay (NOTE [ a stage under FSDP2 ]); the optimizer's state and step those of
    the rank's shards (`shard_optimizer`), not the unsharded plain copy's."""

    def __init__(self, model, analysis, loss_fn, pipeline, stage: FsdpStage, optimizer=None):
        super().__init__(model, analysis, loss_fn, pipeline)
        self.stage, self.optimizer = stage, optimizer

    def _rank(self, gm) -> int:
        a, facts, opt = self.analysis, self.facts, self.optimizer
        peak, end = rank_peak(gm, a.example_inputs, self.loss_fn, self.pipeline, self.opaque, a.opaque_examples,
                              self.stage)
        held = facts.held_throughout_bytes - facts.optimizer_state_bytes + (opt.state_bytes if opt else 0)
        return max(peak, end if opt is None else end + opt.step_bytes) + held


def shard_optimizer(optimizer, device: str | None = None):
    """The state and step temporaries (planner.step.optimizer.optimizer_memory) of `optimizer`
    (over a stage's FSDP2 parameters) as it steps this rank's shards: a parameter's state the
    size of its shard, a count per parameter (AdamW's step) whole; None without an optimizer."""
    if optimizer is None:
        return None
    local = {id(p): torch.nn.Parameter(p.to_local().detach() if hasattr(p, "to_local") else p.detach(),
                                       requires_grad=p.requires_grad)
             for g in optimizer.param_groups for p in g["params"]}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [local[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return optimizer_memory(type(optimizer)(groups), device)


def stage_of(model: torch.nn.Module, cg) -> tuple[FsdpStage, tuple[str, ...]]:
    """The stage's units (fsdp.fsdp_sharding) and, per node of `cg` (the loss last, in the root),
    the unit it runs in."""
    sharding = fsdp_sharding(model, dist.get_world_size(dp_group(model)) if dist.is_initialized() else 1)
    units = {u.name: u for u in sharding.units}
    where = tuple(unit_of(c.module, tuple(units)) for c in cg.nodes[:-1]) + ("",)
    order = tuple(dict.fromkeys(u for u in where if u))
    stage = FsdpStage(units, order, {c.name: u for c, u in zip(cg.nodes, where)}, sharding.staged)
    return stage, where


def stage_graph(cg, stage: FsdpStage, where: tuple[str, ...], rank, inputs, opt=None):
    """The solver's model of the rank (rank_graph: the other micro-batches in flight) on the plain
    copy's graph, its nodes in their units (regions never span two), its parameters counted
    unsharded throughout (as every unit is after the first backward) and their shards besides,
    the optimizer's state and step the shards' (`opt`): the replay (FsdpReplay) is what a plan is
    measured by."""
    shards = sum(u.shard_bytes for u in stage.units.values())
    nodes = tuple(replace(c, unit=u) for c, u in zip(cg.nodes, where))
    facts = StepFacts.of(cg.meta)
    state = opt.state_bytes if opt else 0
    cg = replace(cg, nodes=nodes, fixed_bytes=cg.fixed_bytes + shards - facts.optimizer_state_bytes + state,
                 optimizer_step_bytes=opt.step_bytes if opt else cg.optimizer_step_bytes,
                 meta=StepFacts.noted(cg.meta, optimizer_state_bytes=state,
                                      distributed={"engine": "fsdp", "units": list(stage.units), "pipeline": True}))
    return rank_graph(cg, rank, inputs)


def wrap_stage(model: torch.nn.Module, budget, schedule, example_inputs, example_kwargs, loss_fn,
               options: PlanOptions, optimizer=None) -> torch.nn.Module:
    """plan_and_wrap(stage_module, ..., schedule=) for a stage module under FSDP2 (module doc)."""
    rank = replace(rank_of(schedule, model), keeps_outputs=options.pipeline_outputs)
    args, kwargs = stage_inputs(tuple(example_inputs or ()), dict(example_kwargs or {}), rank)
    options = replace(options, pipeline=rank, keep_output=True)
    loss_fn = loss_fn if rank.last else received_grad_loss
    _uninstall(model)
    plain = plain_copy(model)
    a = analyze_for(plain, args, kwargs, loss_fn, options, _plain_optimizer(optimizer, model, plain), REGION_PROBE)
    stage, where = stage_of(model, a.cost_graph)
    annotate(a.traced.gm, stage.where)
    opt = shard_optimizer(optimizer, options.target_device)
    cg = stage_graph(a.cost_graph, stage, where, rank, a.example_inputs, opt)
    measure = FsdpReplay(plain, replace(a, cost_graph=cg), loss_fn, rank, stage, opt)
    budget = StepBudget.of(budget)
    with budget.errors_spelled():
        budget_bytes = budget.resolve(measure(()))

        def solve():
            return solve_plan(cg, budget_bytes, options, a.traced.opaque, measure=measure, floor_if_needed=True)
        plan = _agreed(solve, dp_group(model))
    plan = plan.noting(units=list(where))
    if plan.regions:
        n = install(model, a.traced.gm, a.traced, plan, plan.facts.units)
        assert n == len(plan.regions), "a region was lost splitting the graph at its units"
    log.info("%s (a pipeline stage under FSDP2): %d regions, predicted %.3f GB per rank", type(model).__name__,
             len(plan.regions), plan.predicted_peak_bytes / 1e9)
    model.__dict__["remat"] = DistributedRemat(model, plan, cg)
    return model
