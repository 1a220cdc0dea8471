"""A pipeline-parallel job planned from one process: every stage of a model built on `meta`, each
for its rank's whole schedule.step (runtime/distributed/pipeline.py), beside the uniform policy
every framework applies (every block of every stage checkpointed).

A Hugging Face decoder-only causal LM (`model.model.embed_tokens / layers / norm / rotary_emb`,
`model.lm_head`: Llama, Mistral, Qwen2 and their kin) is split by its decoder layers into
`DecoderStage`s as torchtitan splits it: the first stage embeds, the last normalizes and applies
the head. Each stage is profiled on fake tensors for one micro-batch (identical middle stages once)
and solved with the simulator, as a rank of an FSDP2 job is (`remat report --world-size`): the
prediction is the simulator's, the replay of a schedule runs on the rank itself.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from remat.planner import PlanOptions, solve_plan
from remat.planner.api import analyze_for
from remat.planner.errors import InfeasibleBudgetError
from remat.planner.options import PipelineRank
from remat.planner.solve.baselines import every_block
from remat.planner.solve.simulate import timeline
from remat.planner.workers import at_once

from ..budget import StepBudget
from ..rewrite import REGION_PROBE
from .pipeline import rank_graph, received_grad_loss


class DecoderStage(torch.nn.Module):
    """Decoder layers `layers` of a Hugging Face causal LM; the first stage also embeds the token
    ids, the last also normalizes and applies lm_head. Each stage computes the rotary embedding
    (no parameters) from the positions; the causal mask is attention's own (no padding)."""

    def __init__(self, model: torch.nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary_emb = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        pe = self.rotary_emb(x, pos)
        for layer in self.layers:
            out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=pe)
            x = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Layer indices per stage, as even as can be (earlier stages take the extra ones)."""
    q, r = divmod(n_layers, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + q + (s < r))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def decoder_stages(model: torch.nn.Module, n_stages: int) -> list[DecoderStage]:
    n = len(model.model.layers)
    if n < n_stages:
        raise ValueError(f"{n} decoder layers cannot make {n_stages} stages")
    return [DecoderStage(model, idx, s == 0, s == n_stages - 1) for s, idx in enumerate(split_layers(n, n_stages))]


@dataclass(frozen=True)
class StageRow:
    """One stage of the job, planned for its rank."""
    stage: int
    layers: int
    in_flight: int              # the most micro-batches between their forward and backward at once
    unplanned_bytes: int        # the rank's step without checkpointing (simulated)
    uniform_bytes: int          # every block checkpointed
    uniform_extra_pct: float
    planned_bytes: int | None   # remat's plan at the job's budget (None: no plan fits)
    planned_extra_pct: float | None
    regions: int | None


def _row(s: int, cg, rank: PipelineRank, layers: int, budget: int, options: PlanOptions) -> StageRow:
    forward_s = sum(n.cost_s for n in cg.nodes) or 1.0
    margin = 1.0 + options.safety_margin
    uni = timeline(cg, every_block(cg))
    try:
        plan = solve_plan(cg, budget, replace(options, find_min_feasible=False))
        planned, regions = plan.predicted_peak_bytes, len(plan.regions)
        extra = 100.0 * timeline(cg, plan.regions).recompute_s / forward_s      # as the uniform policy's
    except InfeasibleBudgetError:
        planned = extra = regions = None
    return StageRow(s, layers, rank.in_flight(), math.ceil(timeline(cg, ()).peak_bytes * margin),
                    math.ceil(uni.peak_bytes * margin),
                    100.0 * uni.recompute_s / forward_s, planned, extra, regions)


def plan_job(model: torch.nn.Module, n_stages: int, schedule: str, n_microbatches: int, microbatch: int, seq: int,
             budget=None, options: PlanOptions = PlanOptions()) -> tuple[list[StageRow], int, float]:
    """Every stage of `model` (a Hugging Face causal LM, on meta) for its rank: (rows, the per-rank
    budget in bytes, seconds). `budget`: as plan_and_wrap takes it ('40%': of the largest rank's
    step without checkpointing); None: the uniform policy's largest per-rank peak."""
    t0 = time.perf_counter()
    graphs, ranks, stages = _rank_graphs(model, n_stages, schedule, n_microbatches, microbatch, seq, options)
    margin = 1.0 + options.safety_margin     # as solve_plan predicts a plan
    if budget is None:
        budget_bytes = max(math.ceil(timeline(g, every_block(g)).peak_bytes * margin) for g in graphs)
    else:
        budget_bytes = StepBudget.of(budget).resolve(max(math.ceil(timeline(g, ()).peak_bytes * margin) for g in graphs))
    rows = at_once(_row, [(s, graphs[s], ranks[s], len(stages[s].layers), budget_bytes, options)
                           for s in range(n_stages)])
    return rows, budget_bytes, time.perf_counter() - t0


# The distinct stages' profiles, then the stages' solves, run in forked workers, one per core
# (NOTE [ forked workers ] in planner/workers.py): the 70B job on 2 cores, its three distinct
# stages' profiles 13 -> 7 s, its eight solves 12.3 -> 6.5 s.
def _profiled(stage: DecoderStage, x: torch.Tensor, last: bool, options: PlanOptions) -> tuple:
    """A stage's cost graph for one micro-batch, and its named example inputs."""
    a = analyze_for(stage, (x,), {}, None if last else received_grad_loss, replace(options, keep_output=True),
                    None, REGION_PROBE)
    return a.cost_graph, a.example_inputs


def _rank_graphs(model, n_stages: int, schedule: str, n_microbatches: int, microbatch: int, seq: int,
                 options: PlanOptions):
    """Each stage's cost graph as its rank's step (identical middle stages profiled once)."""
    stages = decoder_stages(model, n_stages)
    dtype = next(model.parameters()).dtype
    hidden = model.config.hidden_size
    ranks = [PipelineRank.one_stage(schedule, s, n_stages, n_microbatches) for s in range(n_stages)]
    keys = [(rank.first, rank.last, len(st.layers)) for st, rank in zip(stages, ranks)]
    calls: dict[tuple, tuple] = {}          # identical middle stages are profiled once
    for k, st, rank in zip(keys, stages, ranks):
        if k not in calls:
            x = torch.zeros(microbatch, seq, dtype=torch.long, device="meta") if rank.first else \
                torch.empty(microbatch, seq, hidden, dtype=dtype, device="meta", requires_grad=True)
            calls[k] = (st, x, rank.last, options)
    profiled = dict(zip(calls, at_once(_profiled, list(calls.values()))))
    return [rank_graph(profiled[k][0], rank, profiled[k][1]) for k, rank in zip(keys, ranks)], ranks, stages


def job_table(rows: list[StageRow], budget_bytes: int) -> str:
    """The job's table as `remat report --pipeline` prints it (GB)."""
    gb = lambda b: "-" if b is None else f"{b / 1e9:.2f}"      # noqa: E731
    pct = lambda p: "-" if p is None else f"{p:.1f}%"           # noqa: E731
    lines = [f"per-rank budget {gb(budget_bytes)} GB",
             "stage  layers  in flight  unplanned GB  every block GB (extra)  remat GB (extra, regions)"]
    for r in rows:
        lines.append(f"{r.stage:>5}  {r.layers:>6}  {r.in_flight:>9}  {gb(r.unplanned_bytes):>12}  "
                     f"{gb(r.uniform_bytes):>9} ({pct(r.uniform_extra_pct):>6})  "
                     f"{gb(r.planned_bytes):>9} ({pct(r.planned_extra_pct)}, {'-' if r.regions is None else r.regions})")
    return "\n".join(lines)
