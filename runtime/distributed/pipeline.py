"""Pipeline parallelism: a stage planned for its rank's whole `schedule.step`.

`plan_and_wrap(stage_module, budget, example_inputs=(one_microbatch,), schedule=schedule)` reads
what the rank runs off torch.distributed.pipelining's own schedule (`rank_of`: its forward and
backward of each micro-batch in the schedule's order) into `PlanOptions.pipeline`, and plans the
stage module as ever, with two differences: the solver's memory model holds the other
micro-batches in flight (`rank_graph`: CostGraph.inflight), and every plan tried is replayed by
`runtime.planning.ExactReplay` through `rank_peak`: the rank's whole action order on fake tensors
(NOTE [ a rank's step ]) instead of one forward and backward. The budget is per rank; '%' is of the rank's step without checkpointing. The plan is
installed in the stage module itself, so the rank's PipelineStage runs it as it is.

NOTE [ a rank's step ]
What torch's pipelining runtime keeps on a rank (torch/distributed/pipelining/stage.py), replayed:
- every micro-batch's inputs, the whole step: the first stage's are chunks of the batch the caller
  holds; a later stage receives each into a buffer of its own, kept between steps;
- a later stage's input gradients (`torch.autograd.backward` fills each receive buffer's `.grad`,
  which stage_backward hands to a send and drops): the sends hold them, under GPipe to the step's
  end, under 1F1B until the next backward ends (`PipelineRank.keeps_input_grads`);
- a stage's output, from its micro-batch's forward to its backward (`fwd_cache`); the last stage
  keeps each output (detached) to the step's end, where the schedule merges them
  (`output_chunks`, `return_outputs=True`: one more copy of them all, as `torch.cat` makes it);
- a stage before the last receives each micro-batch's output gradient into a buffer of its own,
  kept between steps;
- the last stage's loss, from its micro-batch's forward (`_maybe_compute_loss`) to the step's end;
- the latest forward's output until the next forward returns (the schedule's `output` local);
- outputs a pending send holds (gloo's send works keep their tensor): under GPipe every
  forward's, to the step's end; under 1F1B the warmup's last fired one (micro-batch
  min(micro-batches, stages - stage) - 2) until the 1B1F loop ends (`PipelineRank.sends`);
- parameter gradients from the rank's first backward on, accumulated (then scaled in place).
Each micro-batch saves what the plan's regions leave saved; under GPipe a stage holds all of
them before its first backward, under 1F1B at most (stages - stage index). Schedules that split
backward into input and weight parts (zero bubble, DualPipeV) and ranks holding several stages
(interleaved) are refused by name.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from remat.planner.compat import schedule_microbatches, schedule_stages, tree_map
from remat.planner.errors import RematError
from remat.planner.options import PipelineRank
from remat.planner.profile.opaque import step_held
from remat.planner.step.fake import fake_step, meta_first, tensors, training_loss
from remat.planner.step.storage import LiveBytes

from ..measure.replay import _standing_in

# torch's one-stage schedules, by the order they run a stage's micro-batches in (PipelineRank.one_stage:
# their `_step_microbatches`; their `pipeline_order` numbers a later rank's micro-batches from 1 under
# 1F1B on torch 2.13, so it is not read)
ONE_STAGE = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b"}


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
    kind = ONE_STAGE.get(type(schedule).__name__)
    if kind is None:
        raise PipelineScheduleError(
            f"{type(schedule).__name__}: remat plans stages of ScheduleGPipe and Schedule1F1B so far (zero-bubble "
            "schedules split backward into input and weight parts; interleaved ones run several stages per rank)")
    return PipelineRank.one_stage(kind, stage.stage_index, stage.num_stages, schedule_microbatches(schedule))


def stage_inputs(args: tuple, kwargs: dict, rank: PipelineRank) -> tuple[tuple, dict]:
    """A later stage's inputs as its receive buffers are: leaves that take a gradient."""
    if rank.first:
        return args, kwargs

    def received(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().requires_grad_(True)
        return x
    return tree_map(received, args), tree_map(received, kwargs)


def rank_graph(cg, rank: PipelineRank, inputs) -> object:
    """The stage's cost graph as its rank's step (NOTE [ a rank's step ]): the other micro-batches
    in flight (`CostGraph.inflight`), and in the fixed bytes their inputs (the batch's chunks, or
    a later stage's receive buffers) and, before the last stage, a gradient buffer per micro-batch
    the size of the stage's outputs (the graph's outputs: the stage keeps them, `keep_output`)."""
    n = rank.n_microbatches
    inputs_bytes = sum(t.untyped_storage().nbytes() for t in tensors(inputs))
    outputs_bytes = sum(s.bytes for s in cg.storages if s.output)
    extra = (n - 1) * inputs_bytes + (0 if rank.last else n * outputs_bytes)
    return replace(cg, inflight=rank.others_in_flight(), fixed_bytes=cg.fixed_bytes + extra)


def received_grad_loss(out) -> torch.Tensor:
    """The loss a stage before the last is planned with: its backward starts from a gradient the
    size of its output (the one it receives; here its output, detached: no new memory), and the
    loss holds the output until then, as the schedule's `fwd_cache` does."""
    return sum((t * t.detach()).sum() for t in tensors(out) if t.requires_grad and t.is_floating_point())


def _copy(x):
    return x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x


class _Rank:
    """One replay of a rank's action order (NOTE [ a rank's step ]) on a fake step."""

    def __init__(self, gm, fake, loss_fn, rank: PipelineRank, meter: LiveBytes):
        self.gm, self.fake, self.loss_fn, self.rank, self.meter = gm, fake, loss_fn, rank, meter
        self.cache: dict[int, tuple] = {}
        self.kept: list = []
        self.losses: list = []
        self.latest = None       # the schedule's `output` local: the latest forward's, until the next returns
        self.sent: dict[int, object] = {}    # outputs pending sends hold (PipelineRank.sends)
        self.grad_sends: list = []           # input grads pending sends hold (PipelineRank.keeps_input_grads)
        self.loss_reads = 0      # the other micro-batches' targets (`_loss_reads`)

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
            with self.fake.reads(), self._loss_reads():
                loss = training_loss(out, self.loss_fn)
            self.losses.append(loss)     # the schedule keeps each loss to the step's end (`losses=`)
            if self.rank.keeps_outputs:
                self.kept.append(out)
        self.cache[m] = (out, loss)
        self.latest = out
        if any(k == m for k, _ in self.rank.sends):
            self.sent[m] = out

    @contextlib.contextmanager
    def _loss_reads(self):
        """Counts what the other micro-batches' targets add: a target the loss reads that the step
        did not make is one micro-batch's; the caller holds every micro-batch's (a slice of a whole
        batch's targets holds them all already: its storage is counted whole)."""
        meter, seen = self.meter, []

        def read(t):
            new = LiveBytes.read(meter, t)
            if new:
                seen.append((t.numel() * t.element_size(), t.untyped_storage().nbytes()))
            return new
        meter.read = read
        try:
            yield
        finally:
            del meter.read
        n = self.rank.n_microbatches
        self.loss_reads = max(self.loss_reads, sum(max(0, n * viewed - whole) for viewed, whole in seen))

    def backward(self, m: int) -> None:
        out, loss = self.cache.pop(m)
        with self.fake.reads():
            if loss is not None:
                loss.backward()
            else:
                outs = [t for t in tensors(out) if t.requires_grad]
                torch.autograd.backward(outs, self.grads[m][:len(outs)])
        for k, until in self.rank.sends:
            if until == m:
                self.sent.pop(k, None)
        # the input grads leave the receive buffers for their sends (stage_backward: `val.grad = None`)
        grads = []
        for x in tensors(self.inputs[m]):
            if x.grad is not None:
                grads.append(x.grad)
                x.grad = None
        self.grad_sends = self.grad_sends + [grads] if self.rank.keeps_input_grads else [grads]


def rank_peak(gm: torch.nn.Module, kwargs: dict, loss_fn, rank: PipelineRank, opaque: tuple[str, ...] = (),
              examples: dict | None = None) -> tuple[int, int]:
    """(peak, live at the end) of the rank's whole step on fake tensors (NOTE [ a rank's step ])."""
    def run(meta: bool) -> tuple[int, int]:
        with _standing_in(gm, opaque, examples or {}), fake_step(gm, kwargs, False, meta) as fake:
            with torch.no_grad():       # the shapes of the output grads the stage receives
                shapes = [(t.shape, t.dtype) for t in tensors(gm(**fake.inputs)) if t.is_floating_point()]
            with LiveBytes(baseline=fake.fixed, known=fake.made_from) as meter, step_held():
                step = _Rank(gm, fake, loss_fn, rank, meter)
                step.run(shapes)
                end = meter.live_bytes + meter.read_bytes
            # every micro-batch's loss reads its own chunk of the targets the caller holds all step
            return meter.peak_bytes + step.loss_reads, end + step.loss_reads
    return meta_first(gm, kwargs, run)
