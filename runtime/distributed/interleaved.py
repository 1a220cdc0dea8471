"""A pipeline rank that runs several stages (torch's ScheduleInterleaved1F1B): all of them planned
together for the rank's one budget (NOTE [ several stages, one budget ]).

`plan_and_wrap(stage_module, budget, example_inputs=(one_microbatch,), schedule=schedule)` given any
one of the rank's stage modules reads the rank's order off the schedule
(runtime/distributed/pipeline.py `rank_stages`), takes the other stages' micro-batch inputs from
their PipelineStages' shapes (what their receive buffers are made from), and plans every stage
module of the rank here; runtime/api.py installs each plan in its own stage module.

NOTE [ several stages, one budget ]
A rank holding stages a and b runs a's and b's micro-batches in one order, so what a keeps while b
computes is b's problem too: the exact replay of the rank's whole step (`RankReplay`: every
stage's rewritten module in one fake step, pipeline.rank_step_peak) is the judge of every plan.
The solver plans one stage at a time with no change of its own: stage a's memory model is its
one-stage model (rank_graph: a's micro-batches in flight) plus, as fixed bytes, what the other
stages add under their current plans: the rank's replayed peak less a's replayed alone, both at
the current plans (`_others_bytes`). Each solve's candidates are replayed with the rank whole,
so the budget correction (planner/solve/fit.py) closes what that constant misses. Each stage's
plans are replayed once each, the rank's peak composed from them (NOTE [ a rank of several stages ]
in pipeline.py). Stages are planned in turn (a given b, b given a, ...) until a whole round
changes no plan (at most `MAX_ROUNDS`); a stage's new plan is taken while the rank does not fit,
and once it fits only when it recomputes less (`_descend`): from a start that fits, the rank's
extra compute never rises. A stage's solve can return a plan the rank's replay does not fit (its
least-peak plan, where its budget given the others is refused); the rounds go on from there,
which at times ends cheaper than any path that never leaves the budget (the benchmark's
interleaved rank 0: 82.6% against 84.5%), and at times over it: interleaved 1F1B under FSDP2
at the per-block policy's peak, both starts ended at 1,977,984 B over a 1,936,320 B budget the
per-block start fits. Rounds that end over the budget are run again from their start `strict`:
once the rank fits, a stage's plan is taken only where the rank still fits with it (there: 80.0%
extra compute, the per-block plans' 84.6%). The rounds start from two points, and the cheapest
end that fits is kept: no regions anywhere, and the per-block policy's plans (`uniform_regions`: every block of
every stage checkpointed), when the rank's replay fits them. Why the second: the in-turn rounds
reach a fixed point, not a joint optimum, and which one depends on the start. The constant is
taken at the stage's own current plan, so it counts the others' bytes at the phase where that
plan's peak falls, not where the new plan's will. The benchmark's interleaved rank 0 at
per-block's peak: stage 0 planned first takes 74.3% of its forward recomputed from either start;
then stage 2, from no regions, is given 895,488 B for stage 0 (its unplanned peak falls where
stage 0 holds the most), 147,712 B more than stage 0 adds at stage 2's plan reached from the
per-block start (747,776 B); the solve aims that much too low and the budget correction's rounds
stop at 97.9% (85.7% of the rank's, per-block's 84.5%). From the per-block plans the constant is
714,752 B, a little under, and the correction reaches 83.7% (78.8% of the rank's).
So wherever the per-block plans fit, remat's plans recompute no more than they do (by the
same cost model), and the exact replay of the whole rank judges every end. Every plan's
prediction is then the same replay of the rank under all of them.
A stage that fits without regions, given the others, gets none. A stage that no plan fits given
the others' current plans takes its least-peak plan for the round (its floor's), so that the
others are planned around it; if the rank still does not fit, InfeasibleBudgetError names the
rank's replayed peak under the plans reached (a budget that fits: those plans reach it exactly).
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable, NamedTuple

import torch

from remat.planner import PlanOptions, solve_plan
from remat.planner.api import Analysis, analyze_for
from remat.planner.compat import stage_input_metas
from remat.planner.errors import InfeasibleBudgetError
from remat.planner.facts import StepFacts
from remat.planner.costgraph import same_unit
from remat.planner.result import Plan, Region
from remat.planner.solve.baselines import every_block
from remat.planner.solve.fit import replay_margin, reuse_plan
from remat.planner.solve.simulate import timeline
from remat.planner.step.state import training_modes

from ..budget import StepBudget
from ..planning import PIPELINE_ROUNDS, ExactReplay
from ..rewrite import REGION_PROBE, rewrite
from .pipeline import (PipelineScheduleError, RankStages, StageStep, StageTrace, rank_graph, rank_step_peak,
                       received_grad_loss, stage_inputs, stage_trace)

log = logging.getLogger("remat.runtime")

MAX_ROUNDS = 4
FLOOR_SLACK = (1.0, 1.02, 1.05)
WHAT = "the exact replay of the rank's whole step on fake tensors"
REACHED = ("the rank's whole step replayed under the plans its stages reached: a budget that fits, not a searched "
           "floor")


class StageSetting(NamedTuple):
    """One stage of the rank as it is planned: its module, one micro-batch's inputs (a later
    stage's as its receive buffers are), its loss and its options (`PlanOptions.pipeline`: its part)."""
    module: torch.nn.Module
    args: tuple
    kwargs: dict
    loss_fn: Callable | None
    options: PlanOptions


def stage_settings(rs: RankStages, module: torch.nn.Module, example_inputs: tuple, example_kwargs: dict,
                   loss_fn, options: PlanOptions) -> list[StageSetting]:
    """Every stage of the rank: `module`'s inputs are the caller's, another stage's are zeros of
    its PipelineStage's input shapes; `loss_fn` is the last stage's, if the rank holds it."""
    out = []
    for st, rank in zip(rs.stages, rs.ranks):
        if st.submod is module:
            args, kwargs = tuple(example_inputs), dict(example_kwargs)
        else:
            metas = stage_input_metas(st)
            if metas is None:
                raise PipelineScheduleError(f"stage {st.stage_index}'s input shapes are not known yet: build its "
                                            "PipelineStage with input_args= (one micro-batch's inputs, meta tensors do)")
            args, kwargs = tuple(torch.zeros(shape, dtype=dtype) for shape, dtype in metas), {}
        rank = replace(rank, keeps_outputs=options.pipeline_outputs)
        args, kwargs = stage_inputs(args, kwargs, rank)
        out.append(StageSetting(st.submod, args, kwargs, loss_fn if rank.last else received_grad_loss,
                                replace(options, pipeline=rank, keep_output=True)))
    return out


class RankReplay:
    """The rank's whole step replayed on fake tensors under one plan per stage (a tuple of
    regions per stage, in `stages` order), the optimizer's state and step added: each stage's
    plan replayed once (pipeline.stage_trace), the rank's peak composed from them (NOTE [ a
    rank of several stages ]; a V's adjacent stages, `handovers`: NOTE [ a V's handover ]);
    `alone(i, regions)`, stage i's part alone."""

    def __init__(self, settings: list[StageSetting], analyses: list[Analysis], order: tuple, handovers: tuple = ()):
        self.stages = [ExactReplay(s.module, a, s.loss_fn, s.options.pipeline) for s, a in zip(settings, analyses)]
        self.order, self.handovers = order, handovers
        self.traces: dict[tuple, StageTrace] = {}     # (stage, regions) -> its trace
        self.seconds = 0.0

    def graph(self, i: int):
        """The solver's model of stage i alone (rank_graph: its micro-batches in flight)."""
        r = self.stages[i]
        return rank_graph(r.analysis.cost_graph, r.pipeline, r.analysis.example_inputs)

    def _step(self, i: int, gm) -> StageStep:
        r = self.stages[i]
        return StageStep(gm, r.analysis.example_inputs, r.loss_fn, r.pipeline, r.opaque, r.analysis.opaque_examples)

    def _optimizer(self, which: list[int]) -> tuple[int | None, int]:
        """(the rank's optimizer step's temporaries, None without one; what is held all step): each
        stage's analysis holds the one optimizer's whole state and step."""
        steps = [self.stages[i].analysis.cost_graph.optimizer_step_bytes for i in which]
        step = max(s or 0 for s in steps) if any(s is not None for s in steps) else None
        return step, max(self.stages[i].facts.held_throughout_bytes for i in which)

    def _trace(self, i: int, regions: tuple) -> StageTrace:
        if (i, regions) not in self.traces:
            t0 = time.perf_counter()
            r = self.stages[i]
            a = r.analysis
            with training_modes(r.model):       # the step planned is a training step (planner.step.state)
                gm = rewrite(r.model, a.traced.gm, regions, r.names, r.facts, r.opaque)
                self.traces[i, regions] = stage_trace(self._step(i, gm))
            self.seconds += time.perf_counter() - t0
        return self.traces[i, regions]

    def _peak(self, which: list[int], regions: tuple) -> int:
        traces = tuple(self._trace(i, tuple(regions[i])) for i in which)
        pos = {i: n for n, i in enumerate(which)}
        handovers = tuple((pos[a], pos[b]) for a, b in self.handovers if a in pos and b in pos)
        peak, end = rank_step_peak(traces, tuple((k, pos[i], m) for k, i, m in self.order if i in pos), handovers)
        step, held = self._optimizer(which)
        return max(peak, end + step if step is not None else end) + held

    def __call__(self, regions: tuple) -> int:
        return self._peak(list(range(len(self.stages))), regions)

    def alone(self, i: int, regions: tuple) -> int:
        return self._peak([i], {i: regions})


class StageMeasure:
    """planner.solve.fit's Measure for stage `i`: the rank's replay, the other stages at `regions`."""
    what = WHAT
    rounds = PIPELINE_ROUNDS

    def __init__(self, replay: RankReplay, i: int, regions: list):
        self.replay, self.i, self.regions = replay, i, list(regions)

    def __call__(self, regions) -> int:
        return self.replay(tuple(tuple(regions) if j == self.i else r for j, r in enumerate(self.regions)))


def _others_bytes(replay: RankReplay, i: int, regions: list) -> int:
    """What the rank's other stages add to stage i's step at the current plans (NOTE [ several
    stages, one budget ]): the rank's replayed peak less stage i's replayed alone."""
    return max(0, replay(tuple(regions)) - replay.alone(i, regions[i]))


def _stage_plan(replay: RankReplay, a: Analysis, s: StageSetting, i: int, regions: list,
                budget_bytes: int) -> Plan | None:
    """Stage i's plan given the others' current ones; when none fits, its plan at the floor the
    refusal names, so that the others are planned around its least (None if that does not fit)."""
    cg = replay.graph(i)
    cg = replace(cg, fixed_bytes=cg.fixed_bytes + _others_bytes(replay, i, regions))
    measure = StageMeasure(replay, i, regions)
    try:
        return solve_plan(cg, budget_bytes, s.options, a.traced.opaque, measure=measure, floor_if_needed=True)
    except InfeasibleBudgetError as e:
        floor = e.min_feasible_bytes
    for slack in FLOOR_SLACK:      # the floor is the least-peak search's; the budget correction may miss it by a hair
        try:
            return solve_plan(cg, int(floor * slack), replace(s.options, find_min_feasible=False), a.traced.opaque,
                              measure=measure)
        except InfeasibleBudgetError:
            pass
    return None


class Reached(NamedTuple):
    """Where the in-turn planning of a rank's stages stopped: each stage's regions and plan (None:
    its start's regions, never re-planned), the rounds it took, and the total extra compute."""
    regions: tuple
    plans: tuple
    rounds: int
    recompute_s: float


def uniform_regions(cg) -> tuple[Region, ...]:
    """The per-block policy's plan of a stage: every block checkpointed (`every_block`); a stage
    holding one block of the model's list (no second element to find a list by), that block whole
    (the nodes of the first numbered module on the path, when they can form one region)."""
    found = every_block(cg)
    if found:
        return found
    paths = [c.module.split(".") for c in cg.nodes]
    first = next((p[:k + 1] for p in paths for k, part in enumerate(p) if part.isdigit()), None)
    if first is None:
        return ()
    nodes = [i for i, p in enumerate(paths) if p[:len(first)] == first]
    a, b = nodes[0], nodes[-1]
    ok = all(c.recomputable for c in cg.nodes[a:b + 1]) and same_unit(cg, a, b)
    return (Region(a, b),) if ok else ()


def _recompute_s(graphs: list, regions) -> float:
    return sum(timeline(cg, tuple(r)).recompute_s for cg, r in zip(graphs, regions))


def _descend(replay: RankReplay, analyses: list, settings: list, graphs: list, start: tuple,
             budget_bytes: int, strict: bool = False) -> Reached:
    """NOTE [ several stages, one budget ]'s rounds from `start`: each stage solved given the
    others' current plans, its new plan taken while the rank does not fit yet, and once it fits
    only when cheaper (the extra compute never rises from a start that fits); `strict`, only when
    the rank still fits with it too (a stage's solve can return a plan the rank does not fit)."""
    regions, plans = list(start), [None] * len(start)
    given: list = [None] * len(start)        # the plans each stage was last solved given: none changed since, no solve
    for rounds in range(1, MAX_ROUNDS + 1):
        changed = False
        for i in range(len(start)):
            if given[i] == regions:
                continue
            given[i], p = list(regions), _stage_plan(replay, analyses[i], settings[i], i, regions, budget_bytes)
            if p is None or (replay(tuple(regions)) <= budget_bytes and not _taken(replay, graphs, regions, i, p,
                                                                                 budget_bytes, strict)):
                continue
            changed |= p.regions != regions[i]
            plans[i], regions[i] = p, tuple(p.regions)
            given[i][i] = regions[i]
        if not changed:
            break
    return Reached(tuple(regions), tuple(plans), rounds, _recompute_s(graphs, regions))


def _taken(replay: RankReplay, graphs: list, regions: list, i: int, p: Plan, budget_bytes: int, strict: bool) -> bool:
    """Whether stage i's new plan `p` replaces its current one on a rank that fits: it recomputes
    less, and (`strict`) the rank still fits with it."""
    if p.recompute_s >= timeline(graphs[i], tuple(regions[i])).recompute_s:
        return False
    return not strict or replay(tuple(tuple(p.regions) if j == i else r for j, r in enumerate(regions))) <= budget_bytes


def _kept(cg, regions: tuple, a: Analysis, s: StageSetting, measure, budget_bytes: int) -> Plan:
    """A stage's plan that kept its start's regions (the per-block policy's): as planner.solve.fit
    reuses a plan, predicted by the rank's replay."""
    tl = timeline(cg, regions)
    solver, status = ("every_block", "the per-block plan kept") if regions else ("none", "fits, given the others")
    base = Plan(regions=regions, budget_bytes=budget_bytes, predicted_peak_bytes=0, unplanned_peak_bytes=0,
                min_feasible_bytes=None, recompute_flops=tl.recompute_flops, total_flops=0,
                recompute_s=tl.recompute_s, forward_s=0.0, solver=solver, status=status,
                gap=float("nan"), solve_s=0.0, node_names=tuple(c.name for c in cg.nodes), opaque=a.traced.opaque)
    return reuse_plan(cg, base, budget_bytes, s.options, measure)


def plan_rank(settings: list[StageSetting], order: tuple, budget: StepBudget,
              optimizer: torch.optim.Optimizer | None = None, handovers: tuple = ()) -> list[Plan]:
    """A plan per stage of the rank, all of them together within `budget` (bytes, or '%' of the
    rank's whole step without checkpointing), by NOTE [ several stages, one budget ]. Every
    plan's prediction is the rank's replayed peak under all of them; `handovers`, a V-shaped
    schedule's adjacent stages (RankStages.handovers)."""
    analyses = [analyze_for(s.module, s.args, s.kwargs, s.loss_fn, s.options, optimizer, REGION_PROBE)
                for s in settings]
    return plan_replayed(RankReplay(settings, analyses, order, handovers), settings, budget)


def plan_replayed(replay: RankReplay, settings: list[StageSetting], budget: StepBudget) -> list[Plan]:
    """`plan_rank` on the stages' analyses as `replay` holds them (its replays kept and reused)."""
    analyses = [r.analysis for r in replay.stages]
    graphs = [replay.graph(i) for i in range(len(settings))]
    k = len(settings)
    budget_bytes = budget.resolve(replay(((),) * k))
    uniform = tuple(uniform_regions(a.cost_graph) for a in analyses)
    starts = [((),) * k] + ([uniform] if any(uniform) and replay(uniform) <= budget_bytes else [])
    reached = [_descend(replay, analyses, settings, graphs, start, budget_bytes) for start in starts]
    # rounds that ended over the budget, again, never leaving the budget once within it
    reached += [_descend(replay, analyses, settings, graphs, start, budget_bytes, strict=True)
                for start, r in zip(starts, list(reached)) if replay(r.regions) > budget_bytes]
    best = min(reached, key=lambda r: (replay(r.regions) > budget_bytes, r.recompute_s))
    peak = replay(best.regions)
    log.info("a rank of %d stages planned together from %d starts (%s rounds): %d stage replays (%.1f s), "
             "peak %d of %d bytes, extra compute %s s", k, len(starts), "/".join(str(r.rounds) for r in reached),
             len(replay.traces), replay.seconds, peak, budget_bytes, "/".join(f"{r.recompute_s:.3g}" for r in reached))
    if peak > budget_bytes:
        # the floor named: the rank's replayed peak under the plans reached (each refused stage at its own floor)
        raise InfeasibleBudgetError(budget_bytes, max(peak, budget_bytes + 1), REACHED)
    plans = [p or _kept(graphs[i], best.regions[i], analyses[i], settings[i],
                        StageMeasure(replay, i, list(best.regions)), budget_bytes) for i, p in enumerate(best.plans)]
    margin = 1.0 + replay_margin(settings[0].options, StepFacts.of(analyses[0].cost_graph.meta).device)
    return [replace(p, predicted_peak_bytes=int(peak * margin), budget_bytes=budget_bytes) for p in plans]
