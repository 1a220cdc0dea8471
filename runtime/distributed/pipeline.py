"""Pipeline parallelism: a stage planned for its rank's whole `schedule.step`.

`plan_and_wrap(stage_module, budget, example_inputs=(one_microbatch,), schedule=schedule)` reads
what the rank runs off torch.distributed.pipelining's own schedule (`rank_of`: its forward and
backward of each micro-batch in the schedule's order) into `PlanOptions.pipeline`, and plans the
stage module as ever, with one difference: every plan tried is judged by `ScheduleReplay`, which
runs the rank's whole action order on fake tensors (NOTE [ a rank's step ]) instead of one forward
and backward. The budget is per rank; '%' is of the rank's step without checkpointing. The plan is
installed in the stage module itself, so the rank's PipelineStage runs it as it is.

NOTE [ a rank's step ]
What torch's pipelining runtime keeps on a rank (torch/distributed/pipelining/stage.py), replayed:
- every micro-batch's inputs, the whole step: the first stage's are chunks of the batch the caller
  holds; a later stage receives each into a buffer of its own, kept between steps;
- a later stage's inputs take gradients (`torch.autograd.backward` fills each receive buffer's
  `.grad`), kept until the next step clears them (`clear_runtime_states`);
- a stage's output, from its micro-batch's forward to its backward (`fwd_cache`); the last stage
  keeps each output (detached) to the step's end, where the schedule merges them
  (`output_chunks`, `return_outputs=True`: one more copy of them all, as `torch.cat` makes it);
- a stage before the last receives each micro-batch's output gradient into a buffer of its own,
  kept between steps;
- the last stage's loss, from its micro-batch's forward (`_maybe_compute_loss`) to its backward;
- parameter gradients from the rank's first backward on, accumulated (then scaled in place).
Each micro-batch saves what the plan's regions leave saved; under GPipe a stage holds all of
them before its first backward, under 1F1B at most (stages - stage index). Schedules that split
backward into input and weight parts (zero bubble, DualPipeV) and ranks holding several stages
(interleaved) are refused by name.
"""
from __future__ import annotations

import torch

from remat.planner.compat import schedule_microbatches, schedule_stages, tree_map
from remat.planner.errors import RematError
from remat.planner.options import PipelineRank
from remat.planner.profile.opaque import step_held
from remat.planner.step.fake import fake_step, meta_first, tensors, training_loss
from remat.planner.step.storage import LiveBytes

from ..measure.replay import _standing_in

class PipelineScheduleError(RematError, TypeError):
    """A schedule remat cannot plan a stage for (yet), or a stage module that is not the schedule's."""


def rank_of(schedule, stage_module: torch.nn.Module) -> PipelineRank:
    """What this rank runs of `schedule` (a torch.distributed.pipelining schedule built on the
    PipelineStage that runs `stage_module`), as plain data."""
    stages = schedule_stages(schedule)
    if len(stages) != 1:
        raise PipelineScheduleError(
            f"{type(schedule).__name__} runs {len(stages)} stages on this rank: remat plans one stage per rank "
            "(GPipe, 1F1B) so far; plan each stage module on its own with a one-stage schedule")
    stage = stages[0]
    if stage.submod is not stage_module:
        raise PipelineScheduleError("the module planned is not the one the schedule's PipelineStage runs "
                                    "(pass stage.submod)")
    order = getattr(schedule, "pipeline_order", None)
    if not order or stage.group_rank not in order:
        raise PipelineScheduleError(f"{type(schedule).__name__} has no action order (pipeline_order) remat can read")
    actions, seen = [], {"F": 0, "B": 0}
    for a in order[stage.group_rank]:
        kind = None if a is None else a.computation_type.value
        if kind in ("I", "W", "OVERLAP_F_B"):
            raise PipelineScheduleError(f"{type(schedule).__name__} splits backward into input and weight parts "
                                        "(zero bubble): remat plans GPipe and 1F1B schedules so far")
        if kind in ("F", "B") and a.stage_index == stage.stage_index:
            # a one-stage schedule runs its micro-batches' forwards, and their backwards, in order; its
            # action order numbers a later rank's from 1 under 1F1B (torch 2.13), so they are counted here
            actions.append((kind, seen[kind]))
            seen[kind] += 1
    return PipelineRank(tuple(actions), schedule_microbatches(schedule), bool(stage.is_first), bool(stage.is_last))


def stage_inputs(args: tuple, kwargs: dict, rank: PipelineRank) -> tuple[tuple, dict]:
    """A later stage's inputs as its receive buffers are: leaves that take a gradient."""
    if rank.first:
        return args, kwargs

    def received(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x
    return tree_map(received, args), tree_map(received, kwargs)


def _copy(x):
    return x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


class _Rank:
    """One replay of a rank's action order (NOTE [ a rank's step ]) on a fake step."""

    def __init__(self, gm, fake, loss_fn, rank: PipelineRank):
        self.gm, self.fake, self.loss_fn, self.rank = gm, fake, loss_fn, rank
        self.cache: dict[int, tuple] = {}
        self.kept: list = []

    def run(self, grad_shapes: list) -> None:
        rank, fake = self.rank, self.fake
        # every micro-batch's inputs (the first is the fake step's), and a stage's output-grad buffers
        self.inputs = [fake.inputs] + [tree_map(_copy, fake.inputs) for _ in range(rank.n_microbatches - 1)]
        self.grads = [] if rank.last else [[torch.empty(s, dtype=d) for s, d in grad_shapes]
                                           for _ in range(rank.n_microbatches)]
        for kind, m in rank.actions:
            self.forward(m) if kind == "F" else self.backward(m)
        if rank.last and rank.keeps_outputs and self.kept:
            merged = [torch.cat(list(parts)) for parts in zip(*(tensors(o) for o in self.kept))]
            del merged

    def forward(self, m: int) -> None:
        out = self.gm(**self.inputs[m])
        loss = None
        if self.rank.last:
            with self.fake.reads():
                loss = training_loss(out, self.loss_fn)
            if self.rank.keeps_outputs:
                self.kept.append(out)
        self.cache[m] = (out, loss)

    def backward(self, m: int) -> None:
        out, loss = self.cache.pop(m)
        with self.fake.reads():
            if loss is not None:
                loss.backward()
            else:
                outs = [t for t in tensors(out) if t.requires_grad]
                torch.autograd.backward(outs, self.grads[m][:len(outs)])


def rank_peak(gm: torch.nn.Module, kwargs: dict, loss_fn, rank: PipelineRank, opaque: tuple[str, ...] = (),
              examples: dict | None = None) -> tuple[int, int]:
    """(peak, live at the end) of the rank's whole step on fake tensors (NOTE [ a rank's step ])."""
    def run(meta: bool) -> tuple[int, int]:
        with _standing_in(gm, opaque, examples or {}), fake_step(gm, kwargs, False, meta) as fake:
            with torch.no_grad():       # the shapes of the output grads the stage receives
                shapes = [(t.shape, t.dtype) for t in tensors(gm(**fake.inputs)) if t.is_floating_point()]
            with LiveBytes(baseline=fake.fixed, known=fake.made_from) as meter, step_held():
                _Rank(gm, fake, loss_fn, rank).run(shapes)
                end = meter.live_bytes + meter.read_bytes
            return meter.peak_bytes, end
    return meta_first(gm, kwargs, run)
