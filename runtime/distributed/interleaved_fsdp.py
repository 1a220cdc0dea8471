"""A pipeline rank of several stages, each under FSDP2 (PP x DP with ScheduleInterleaved1F1B; the
schedules that split backward into input and weight parts are refused under FSDP2: `wrap_rank`).
`plan_and_wrap(stage_module, budget, example_inputs=(one micro-batch,), schedule=schedule)` on one
of the rank's stage modules plans them all together for the rank's one budget, as a rank of
plain stages is (runtime/distributed/interleaved.py, NOTE [ several stages, one budget ]), each
stage on its plain copy (runtime/distributed/fsdp.py) with FSDP2's memory counted into its replay
(NOTE [ a stage under FSDP2 ] in pipeline_fsdp.py) and the runtime's own actions for it in place.

NOTE [ stages under FSDP2 on one rank ]
torch's multi-stage runtime (`_PipelineScheduleRuntime`) lowers its schedule with three more
actions for stages under FSDP2 (schedules.py `_add_unshard_reshard`, `_add_reduce_grad`), read
off the schedule with the rest of the rank's order (`RankStages.fsdp_order`):
- UNSHARD s: `unshard(async_op=True)` on each FSDP module of stage s, the root first: every unit
  not gathered is all-gathered at once, each flat output (P_U, through gloo's temporary) held until
  the stage's next computation waits for them (`_assert_unsharded`): then each is copied out (P_U)
  and its flat output freed at once (an explicit unshard: no forward's deferral);
- RESHARD s: every unit of s still gathered resharded;
- REDUCE_GRAD s, after s's last backward: perform_reduce_grad, which a stage alone on its rank
  runs at the step's end (the overlay's `finish`), here where the runtime runs it.
The runtime prefetches up to three stages (max_active_stages): with two stages a rank, both are
unsharded before the first computation and each is resharded after its REDUCE_GRAD. Between
them FSDP2's own hooks run as for one stage a rank: a unit resharded after its forward is
gathered again by the stage's next forward, whatever UNSHARD did (measured below). Each stage's
replay counts its own units (`FsdpStage.actions`: its part of the order, pipeline.stage_trace
runs it), and the rank's peak is composed from the stages' traces (NOTE [ a rank of several
stages ]). The plans are solved on the data-parallel group's first rank and broadcast.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from remat.planner.api import analyze_for

from ..budget import StepBudget
from ..rewrite import REGION_PROBE
from .fsdp import dp_group, log, plain_copy
from .interleaved import RankReplay, plan_replayed, stage_settings
from .pipeline import PipelineScheduleError, rank_stages
from .pipeline_fsdp import annotate, shard_optimizer, stage_graph, stage_of
from .plan import DistributedRemat, _agreed, _uninstall
from .units import install


class FsdpRankReplay(RankReplay):
    """The rank's replay (interleaved.RankReplay) with each stage's FSDP2 overlay (`stages`), the
    solver's model of each stage (pipeline_fsdp.stage_graph) and the optimizer's state and step
    those of the rank's shards (`opt`: pipeline_fsdp.shard_optimizer)."""

    def __init__(self, settings, analyses, order, handovers, stages: list, graphs: list, opt):
        super().__init__(settings, analyses, order, handovers)
        self.fsdp, self.graphs, self.opt = stages, graphs, opt

    def graph(self, i: int):
        return self.graphs[i]

    def _step(self, i: int, gm):
        return super()._step(i, gm)._replace(fsdp=self.fsdp[i])

    def _optimizer(self, which: list[int]) -> tuple[int | None, int]:
        held = max(self.stages[i].facts.held_throughout_bytes for i in which)
        opt = self.opt
        return (opt.step_bytes, held + opt.state_bytes) if opt is not None else (None, held)


def wrap_rank(model: torch.nn.Module, schedule, budget, example_inputs: tuple, example_kwargs: dict, loss_fn,
              options, optimizer=None) -> torch.nn.Module:
    """plan_and_wrap(stage_module, ..., schedule=) for a rank of several stages under FSDP2 (module
    doc); each plan installed into its stage's root and units; returns `model`."""
    rs = rank_stages(schedule, model)
    if any(kind in ("I", "W") for kind, _, _ in rs.order):
        raise PipelineScheduleError(
            f"{type(schedule).__name__} splits backward into input and weight parts, and under FSDP2 torch's runtime "
            "does not compute every weight gradient of a stage in the split backward (measured with torch 2.13 on "
            "gloo: a rank of ScheduleInterleavedZeroBubble holds 16 of its 28 gradients, ScheduleZBVZeroBubble's "
            "first rank 18 of 30), so there is no step to plan: under FSDP2 remat plans ScheduleInterleaved1F1B "
            "(and ScheduleGPipe, Schedule1F1B)")
    settings = stage_settings(rs, model, example_inputs, example_kwargs, loss_fn, options)
    for s in settings:
        _uninstall(s.module)
    plain = [s._replace(module=plain_copy(s.module)) for s in settings]
    analyses = [analyze_for(p.module, p.args, p.kwargs, p.loss_fn, p.options, None, REGION_PROBE) for p in plain]
    opt = shard_optimizer(optimizer, options.target_device)
    stages, wheres, graphs = [], [], []
    for i, (s, a) in enumerate(zip(settings, analyses)):
        stage, where = stage_of(s.module, a.cost_graph)
        stage = replace(stage, actions=tuple((kind, m) for kind, j, m in rs.fsdp_order if j == i))
        annotate(a.traced.gm, stage.where)
        stages.append(stage)
        wheres.append(where)
        graphs.append(stage_graph(a.cost_graph, stage, where, s.options.pipeline, a.example_inputs, opt))
    replay = FsdpRankReplay(plain, analyses, rs.fsdp_order, rs.handovers, stages, graphs, opt)
    step_budget = StepBudget.of(budget)
    with step_budget.errors_spelled():
        plans = _agreed(lambda: plan_replayed(replay, plain, step_budget), dp_group(model))
    for s, a, where, plan, cg in zip(settings, analyses, wheres, plans, graphs):
        plan = plan.noting(units=list(where))
        if plan.regions:
            n = install(s.module, a.traced.gm, a.traced, plan, plan.facts.units)
            assert n == len(plan.regions), "a region was lost splitting the graph at its units"
        s.module.__dict__["remat"] = DistributedRemat(s.module, plan, cg)
    log.info("a rank of %d stages under FSDP2: %s regions, predicted %.3f GB per rank", len(plans),
             "/".join(str(len(p.regions)) for p in plans), max(p.predicted_peak_bytes for p in plans) / 1e9)
    return model
