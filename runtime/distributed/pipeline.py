"""Pipeline parallelism: a stage planned for its rank's whole `schedule.step`.

`plan_and_wrap(stage_module, budget, example_inputs=(one_microbatch,), schedule=schedule)` reads
what the rank runs off torch.distributed.pipelining's own schedule (`rank_of`: its forward and
backward of each micro-batch in the schedule's order) into `PlanOptions.pipeline`, and plans the
stage module as ever, with two differences: the solver's memory model holds the other
micro-batches in flight (`rank_graph`: CostGraph.inflight), and every plan tried is replayed by
`runtime.planning.ExactReplay` through `rank_peak`: the rank's whole action order on fake tensors
(NOTE [ a rank's step ]) instead of one forward and backward. The budget is per rank; '%' is of the rank's step without checkpointing. The plan is
installed in the stage module itself, so the rank's PipelineStage runs it as it is. A rank that
runs several stages (interleaved, zero bubble, V-shaped: `rank_stages` reads its order) has them all planned
together for its one budget (runtime/distributed/interleaved.py), each plan in its own module.
A stage under FSDP2 (one a rank) is replayed with FSDP2's parameters and gradients counted in
(`StageStep.fsdp`: runtime/distributed/pipeline_fsdp.py, NOTE [ a stage under FSDP2 ]).

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
them before its first backward, under 1F1B at most (stages - stage index). Under torch's
multi-stage runtime (interleaved 1F1B) every send is waited for at the step's end: each forward's
output and each backward's input gradients are held to then, and no `output` local outlives its
forward (`PipelineRank.of_rank_order`); a rank's stages hold their tensors apart (NOTE [ a rank
of several stages ]). Under zero bubble (ScheduleInterleavedZeroBubble) a backward is split into
its input part "I" and weight part "W", run as the runtime runs them (torch's stage_backward_input
and stage_backward_weight, through planner.compat): between them a stage before the first keeps
the graph the weight part needs (param groups, and what the regions recomputed for the input
part), the last stage its loss, not its output; the first stage computes nothing at "I" and
the whole backward at "W". The V-shaped ones (ScheduleZBVZeroBubble, ScheduleDualPipeV) hand a
rank's adjacent stages' tensors over in place (NOTE [ a V's handover ]); DualPipeV's overlapped
forward-backward pairs are run by the runtime one after the other, and replayed so
(compat.schedule_rank_order). Other multi-stage schedules (looped BFS) are refused by name.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import replace
from typing import Callable, NamedTuple

import torch

from remat.planner.compat import (schedule_microbatches, schedule_rank_order, schedule_stages, stage_backward_input,
                                  stage_backward_weight, tree_map)
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
# torch's multi-stage schedules planned: their order is read off the schedule (`pipeline_order_with_comms`,
# micro-batches numbered from 0 on every rank on torch 2.13)
MULTI_STAGE = ("ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
# V-shaped ones: rank r holds stages r and 2R - 1 - r, the middle rank two adjacent ones (NOTE [ a V's handover ])
V_SHAPED = ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
SUPPORTED = ("ScheduleGPipe, Schedule1F1B (one stage per rank), ScheduleInterleaved1F1B, "
             "ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble and ScheduleDualPipeV (several)")


class PipelineScheduleError(RematError, TypeError):
    """A schedule remat cannot plan a stage for (yet), or a stage module that is not the schedule's."""


def rank_of(schedule, stage_module: torch.nn.Module) -> PipelineRank:
    """What this rank runs of `schedule` (a torch.distributed.pipelining schedule built on the
    PipelineStage that runs `stage_module`), as plain data."""
    stages = schedule_stages(schedule)
    if len(stages) != 1:
        raise PipelineScheduleError(f"{type(schedule).__name__} runs {len(stages)} stages on this rank: plan them "
                                    "together (rank_stages)")
    stage = stages[0]
    if stage.submod is not stage_module:
        raise PipelineScheduleError("the module planned is not the one the schedule's PipelineStage runs "
                                    "(pass stage.submod)")
    kind = ONE_STAGE.get(type(schedule).__name__)
    if kind is None:
        raise PipelineScheduleError(f"{type(schedule).__name__}: remat plans stages of {SUPPORTED} so far")
    return PipelineRank.one_stage(kind, stage.stage_index, stage.num_stages, schedule_microbatches(schedule))


class RankStages(NamedTuple):
    """A rank that runs several stages of a multi-stage schedule (interleaved 1F1B), as
    `rank_stages` reads it: its PipelineStages by stage index, each one's part (PipelineRank), the
    rank's order as ("F" or "B", position in `stages`, micro-batch), the handovers of a V-shaped
    schedule's adjacent stages ((a, b): positions, stage b the one after stage a: NOTE [ a V's handover ]),
    and the order with the actions the runtime adds for stages under FSDP2 ("UNSHARD", "RESHARD",
    "REDUCE_GRAD": NOTE [ stages under FSDP2 on one rank ] in interleaved_fsdp.py)."""
    stages: tuple
    ranks: tuple[PipelineRank, ...]
    order: tuple[tuple[str, int, int], ...]
    handovers: tuple[tuple[int, int], ...] = ()
    fsdp_order: tuple[tuple[str, int, int | None], ...] = ()


def runs_several(schedule) -> bool:
    """Whether `schedule` runs several stages on this rank (a multi-stage schedule)."""
    return len(schedule_stages(schedule)) > 1 or schedule_rank_order(schedule) is not None


def rank_stages(schedule, stage_module: torch.nn.Module) -> RankStages:
    """What this rank runs of a multi-stage `schedule` (one of its PipelineStages runs
    `stage_module`), as plain data; PipelineScheduleError, naming the schedule, for one remat
    does not plan."""
    name = type(schedule).__name__
    order = schedule_rank_order(schedule) or ()
    if name not in MULTI_STAGE and any(kind in ("I", "W") for kind, _, _ in order):
        raise PipelineScheduleError(f"{name} splits backward into input and weight parts as remat does not model "
                                    f"(yet): remat plans {SUPPORTED} so far")
    if name not in MULTI_STAGE:
        raise PipelineScheduleError(f"{name}: remat plans {SUPPORTED} so far")
    stages = tuple(sorted(schedule_stages(schedule), key=lambda st: st.stage_index))
    if not any(st.submod is stage_module for st in stages):
        raise PipelineScheduleError("the module planned is not one the schedule's PipelineStages on this rank run "
                                    "(pass one of their .submod)")
    index = {st.stage_index: i for i, st in enumerate(stages)}
    handovers = tuple((index[s], index[s + 1]) for s in index if s + 1 in index)
    if handovers and name not in V_SHAPED:
        raise PipelineScheduleError(f"{name} puts adjacent stages on one rank (its runtime hands activations over "
                                    "locally, modelled for V-shaped schedules only): remat plans ranks whose stages "
                                    "are apart")
    n, n_stages = schedule_microbatches(schedule), stages[0].num_stages
    ranks = tuple(PipelineRank.of_rank_order(order, st.stage_index, n_stages, n) for st in stages)
    fsdp_order = tuple((kind, index[s], m) for kind, s, m in schedule_rank_order(schedule, fsdp=True))
    return RankStages(stages, ranks, tuple((kind, index[s], m) for kind, s, m in order), handovers, fsdp_order)


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


class StageStep(NamedTuple):
    """One stage of a rank's step as `rank_step_peak` replays it: its (rewritten) module, one
    micro-batch's inputs, its loss (None before the last stage), its part of the schedule, and
    the modules stood in for (planner.profile.opaque) with their examples."""
    gm: torch.nn.Module
    kwargs: dict
    loss_fn: Callable | None
    rank: PipelineRank
    opaque: tuple[str, ...] = ()
    examples: dict | None = None
    fsdp: object | None = None      # a stage under FSDP2: its FsdpOverlay (runtime/distributed/pipeline_fsdp.py)


class _Rank:
    """One stage's part of a replay of its rank's action order (NOTE [ a rank's step ]) on a fake step."""

    def __init__(self, gm, fake, inputs, loss_fn, rank: PipelineRank, meter: LiveBytes):
        self.gm, self.fake, self.loss_fn, self.rank, self.meter = gm, fake, loss_fn, rank, meter
        self.first_inputs = inputs      # the fake step's inputs of this stage: micro-batch 0's
        self.cache: dict[int, tuple] = {}
        self.kept: list = []
        self.losses: list = []
        self.latest = None       # the schedule's `output` local: the latest forward's, until the next returns
        self.sent: dict[int, object] = {}    # outputs pending sends hold (PipelineRank.sends)
        self.grad_sends: list = []           # input grads pending sends hold (PipelineRank.keeps_input_grads)
        self.loss_reads = 0      # the other micro-batches' targets (`_loss_reads`)
        self.split: dict[int, tuple] = {}    # a split backward's input part done, its weight part to come

    def start(self, grad_shapes: list) -> None:
        """Every micro-batch's inputs (the first is the fake step's), and a stage's output-grad buffers."""
        rank = self.rank
        self.inputs = [self.first_inputs] + [tree_map(_copy, self.first_inputs) for _ in range(rank.n_microbatches - 1)]
        self.grads = [] if rank.last else [[torch.empty(s, dtype=d) for s, d in grad_shapes]
                                           for _ in range(rank.n_microbatches)]

    def finish(self) -> None:
        """The last stage's outputs merged at the step's end (`return_outputs`)."""
        if self.rank.last and self.rank.keeps_outputs and self.kept:
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
        if self.rank.holds_latest:
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
        self._whole_backward(m, out, loss)
        self._sent_back(m)

    def _whole_backward(self, m: int, out, loss) -> None:
        with self.fake.reads():
            if loss is not None:
                loss.backward()
            else:
                outs = [t for t in tensors(out) if t.requires_grad]
                torch.autograd.backward(outs, self.grads[m][:len(outs)])

    def _sent_back(self, m: int) -> None:
        """After micro-batch m's backward (or its input part): the sends it ends dropped, and
        its input grads out of the receive buffers into their sends (stage_backward: `val.grad = None`)."""
        for k, until in self.rank.sends:
            if until == m:
                self.sent.pop(k, None)
        grads = []
        for x in tensors(self.inputs[m]):
            if x.grad is not None:
                grads.append(x.grad)
                x.grad = None
        self.grad_sends = self.grad_sends + [grads] if self.rank.keeps_input_grads else [grads]

    def input_backward(self, m: int) -> None:
        """A split backward's input part ("I", zero bubble), as torch's runtime runs it: on the
        first stage nothing (its "W" runs the whole backward), else the inputs' gradients with the
        graph kept for the weight part (compat.stage_backward_input)."""
        out, loss = self.cache.pop(m)
        groups = None
        if not self.rank.first:
            outs = [loss] if loss is not None else [t for t in tensors(out) if t.is_floating_point()]
            with self.fake.reads():
                groups = stage_backward_input(outs, None if loss is not None else self.grads[m],
                                              list(tensors(self.inputs[m])), self.gm.parameters())
        # the runtime keeps the last stage's loss, not its output (`backward_state`: the stage output it
        # backwards from), to the weight part
        self.split[m] = (None if self.rank.last and not self.rank.first else out, loss, groups)
        self._sent_back(m)

    def weight_backward(self, m: int) -> None:
        """A split backward's weight part ("W"): the parameters' gradients from what its input
        part kept (compat.stage_backward_weight); on the first stage, the whole backward."""
        out, loss, groups = self.split.pop(m)
        if self.rank.first:
            self._whole_backward(m, out, loss)
            return
        with self.fake.reads():
            stage_backward_weight(self.gm.parameters(), groups)


def rank_peak(gm: torch.nn.Module, kwargs: dict, loss_fn, rank: PipelineRank, opaque: tuple[str, ...] = (),
              examples: dict | None = None, fsdp=None) -> tuple[int, int]:
    """(peak, live at the end) of the rank's whole step on fake tensors (NOTE [ a rank's step ]);
    `fsdp`, a stage under FSDP2: its FsdpOverlay (NOTE [ a stage under FSDP2 ] in pipeline_fsdp.py)."""
    step = StageStep(gm, kwargs, loss_fn, rank, opaque, examples, fsdp)
    return rank_step_peak((stage_trace(step),), tuple((kind, 0, m) for kind, m in rank.actions))


class StageTrace(NamedTuple):
    """One stage's part of its rank's step replayed alone, action by action (its start, each of
    its forwards and backwards in the rank's order, its finish): NOTE [ a rank of several stages ]."""
    before: int                  # live bytes before its start: its parameters and inputs
    peaks: tuple[int, ...]       # per action, the most bytes live during it
    levels: tuple[int, ...]      # per action, the bytes live after it
    held: int                    # counted the whole step: reads of tensors made before it, the other targets
    received: int = 0            # one micro-batch's receive buffers (inputs that take a gradient): NOTE [ a V's handover ]


def stage_trace(step: StageStep) -> StageTrace:
    """The stage's actions (`step.rank.actions`) replayed on fake tensors, metered one by one; a
    stage under FSDP2 on a rank of several, the runtime's actions for it too (`FsdpStage.actions`)."""
    overlay = step.fsdp.marked(step.gm) if step.fsdp is not None else None

    def run(meta: bool) -> StageTrace:
        with _standing_in(step.gm, step.opaque, step.examples or {}), \
                fake_step(step.gm, step.kwargs, False, meta) as fake:
            with torch.no_grad():       # the shapes of the output grads the stage receives
                shapes = [(t.shape, t.dtype) for t in tensors(step.gm(**fake.inputs)) if t.is_floating_point()]
            with LiveBytes(baseline=fake.fixed, known=fake.made_from) as meter, step_held():
                stage = _Rank(step.gm, fake, fake.inputs, step.loss_fn, step.rank, meter)
                if overlay is not None:     # the parameters as the rank holds them
                    overlay.start(meter)
                calls = [functools.partial(stage.start, shapes)] + _calls(stage, overlay, step)
                before, peaks, levels = meter.live_bytes, [], []
                for call in calls:
                    meter.reset_peak()
                    call()
                    peaks.append(meter.peak_bytes - meter.read_bytes)
                    levels.append(meter.live_bytes)
                # every micro-batch's loss reads its own chunk of the targets the caller holds all step
                received = sum(t.untyped_storage().nbytes() for t in tensors(fake.inputs) if t.requires_grad)
                return StageTrace(before, tuple(peaks), tuple(levels), meter.read_bytes + stage.loss_reads,
                                  0 if step.rank.first else received)
    return meta_first(step.gm, step.kwargs, run)


def _calls(stage: _Rank, overlay, step: StageStep) -> list:
    """The stage's actions and its finish, as calls: under FSDP2 its gradients reduced at the end
    (one stage a rank) or where the runtime's REDUCE_GRAD runs (several: `FsdpStage.actions`, each
    computation first waiting for an UNSHARD's all-gathers)."""
    run = {"F": stage.forward, "B": stage.backward, "I": stage.input_backward, "W": stage.weight_backward}
    if overlay is None:
        return [functools.partial(run[kind], m) for kind, m in step.rank.actions] + [stage.finish]
    if not step.fsdp.actions:
        return ([functools.partial(run[kind], m) for kind, m in step.rank.actions]
                + [functools.partial(_then, overlay.finish, stage.finish)])
    runtime = {"UNSHARD": overlay.unshard, "RESHARD": overlay.reshard, "REDUCE_GRAD": overlay.finish}
    return [runtime[kind] if kind in runtime else functools.partial(_then, overlay.wait, functools.partial(run[kind], m))
            for kind, m in step.fsdp.actions] + [stage.finish]


def _then(*calls) -> None:
    for call in calls:
        call()


# NOTE [ a rank of several stages ]
# A rank running several stages (interleaved 1F1B) holds each stage's tensors apart: no stage
# reads another's (a stage's output reaches the next stage by a send, never handed over in place,
# but for a V's adjacent stages: NOTE [ a V's handover ]). Its live bytes
# at any moment are the sum of its stages' own, and a stage's own change only in its actions. So
# each stage is replayed alone, its actions in the rank's order (`stage_trace`), and the rank's
# peak is composed (`rank_step_peak`): during an action of stage s, s's peak in that action plus
# every other stage's bytes after its latest action; every stage starts (its inputs and buffers)
# before the first action and finishes (the last stage's merged outputs) after the last. A plan
# of one stage is then replayed once, whatever the others' plans: the planner of a rank of k
# stages replays each stage per plan tried, not the rank per combination. One stage alone is the
# same replay, to the byte, as before (`rank_peak`).
#
# NOTE [ a V's handover ]
# Under a V-shaped schedule (ScheduleZBVZeroBubble, ScheduleDualPipeV: rank r of R holds stages r
# and 2R - 1 - r) the middle rank holds two adjacent stages a and b = a + 1, and torch's runtime
# hands over in place, no send: after a's forward of micro-batch m, b's receive buffer m becomes
# a's output, detached (`set_local_fwd_input`; the buffer it held is dropped), and after b's
# backward of m (or its input part), a's output-grad buffer m becomes b's input gradients
# (`set_local_bwd_input`; the one it held is dropped). Each stage replayed alone keeps its own
# buffers all step, a's outputs as if sent (held to the step's end) and b's input gradients as
# if sent: the rank holds one tensor where the two replays count two. So after each such action
# the composed bytes are one micro-batch's receive buffers of b less (`StageTrace.received`:
# b's input gradients are their size too), for the rest of the step; inside the action, the
# dropped buffer is still live, as in the runtime.
def _handed_over(traces: tuple[StageTrace, ...], handovers: tuple[tuple[int, int], ...], kind: str, i: int) -> int:
    """The bytes an action of the stage at position i hands over in place (NOTE [ a V's handover ])."""
    return sum(traces[b].received for a, b in handovers
               if (kind == "F" and i == a) or (kind in ("B", "I") and i == b))


def rank_step_peak(traces: tuple[StageTrace, ...], order: tuple[tuple[str, int, int], ...],
                   handovers: tuple[tuple[int, int], ...] = ()) -> tuple[int, int]:
    """(peak, live at the end) of a rank's whole step from its stages' traces (NOTE [ a rank of
    several stages ]): `order` runs ("F" or "B", position in `traces`, micro-batch); `handovers`,
    a V's adjacent stages' positions (NOTE [ a V's handover ])."""
    levels = [t.before for t in traces]
    done = [0] * len(traces)
    peak, shared = 0, 0
    steps = [("start", i) for i in range(len(traces))] + [(k, i) for k, i, _ in order]
    for kind, i in steps + [("finish", i) for i in range(len(traces))]:
        k = done[i]
        peak = max(peak, traces[i].peaks[k] + sum(levels) - levels[i] - shared)
        levels[i] = traces[i].levels[k]
        done[i] += 1
        shared += _handed_over(traces, handovers, kind, i)
    held = sum(t.held for t in traces)
    return peak + held, sum(levels) - shared + held
