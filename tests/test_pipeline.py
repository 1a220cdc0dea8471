"""Pipeline parallelism (issue 44): a tiny GPT split into 2 stages on 2 gloo ranks under
torch.distributed.pipelining's GPipe and 1F1B schedules, and into 4 (2 a rank) under
ScheduleInterleaved1F1B (benchmarks/pipeline_run.py), metered per rank, and planned per rank by
plan_and_wrap(..., schedule=). The gloo runs share spawns of the ranks (`run_many`): one for
every unplanned run, one for every planned one."""
import pytest
import torch

import benchmarks.pipeline_run as ph
from benchmarks.pipeline_run import MB, SEQ, D

NMB = 4
BUF = NMB * MB * SEQ * D * 4          # one receive buffer per micro-batch (float32 activations)


# ---------------------------------------------------------------- in one process

def test_split_layers():
    assert [list(r) for r in ph.split_layers(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [list(r) for r in ph.split_layers(4, 4)] == [[0], [1], [2], [3]]


@pytest.mark.parametrize("n_stages", [2, 3])
def test_gpt_stages_compose_to_the_same_model(n_stages):
    """The stages are one GPT made from the seed: run in turn they give the same logits whatever
    the split, and each stage owns its parameters (none shared across stages)."""
    tokens, _ = ph.batch(NMB)
    outs = []
    for n in (1, n_stages):
        x = tokens
        for st in ph.gpt_stages(n, layers_per_stage=6 // n):
            x = st(x)
        outs.append(x)
    assert outs[0].shape == (NMB * MB, SEQ, ph.VOCAB)
    assert torch.equal(outs[0], outs[1])
    ids = [{id(p) for p in st.parameters()} for st in ph.gpt_stages(n_stages)]
    assert all(not (a & b) for i, a in enumerate(ids) for b in ids[i + 1:])


@pytest.mark.slow
@pytest.mark.hf
def test_llama_stages_compose_to_the_model():
    """The Llama split gives LlamaForCausalLM's own logits (rotary embedding on each stage, SDPA's
    causal mask)."""
    pytest.importorskip("transformers")
    tokens, _ = ph.batch(1)
    model = ph.llama_model(4)
    want = model(tokens).logits
    x = tokens
    for st in ph.llama_stages(2):
        x = st(x)
    torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-5)


def test_checkpoint_blocks_keeps_the_gradients():
    tokens, targets = ph.batch(1)
    grads = []
    for ck in (False, True):
        stages = ph.stages("gpt", 2, checkpoint_blocks=ck)
        x = tokens
        for st in stages:
            x = st(x)
        ph.loss_fn(x, targets).backward()
        grads.append([p.grad for st in stages for p in st.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------- two ranks

def _stages_held(schedule: str, rank: int) -> list[int]:
    """The stage indices a rank of 2 holds: its own, or under interleaved 1F1B r and r + 2 of 4."""
    return [rank, rank + 2] if schedule in ph.MULTI_STAGE else [rank]


@pytest.fixture(scope="module")
def two_ranks():
    """Unplanned (1F1B's traced) and per-block-checkpointed runs of every schedule, 2 ranks, 4
    micro-batches, and 1F1B with AdamW: one spawn of the ranks runs them all."""
    cfgs = {(s, ck): ph.config(s, n_microbatches=NMB, checkpoint_blocks=ck, trace=(s, ck) == ("1f1b", False))
            for s in ph.SCHEDULES for ck in (False, True)}
    cfgs["optimizer"] = ph.config("1f1b", n_microbatches=NMB, steps=2, optimizer=True)
    return dict(zip(cfgs, ph.run_many(list(cfgs.values()))))


@pytest.mark.slow
def test_unplanned_peaks_follow_the_schedule(two_ranks):
    """GPipe runs every micro-batch's forward before any backward: each rank holds all 4
    micro-batches' activations; under 1F1B rank 0 holds 2 (its warm-up) and rank 1 one at a time.
    Per-block checkpointing holds less on every rank, under every schedule."""
    gpipe, ofob = two_ranks["gpipe", False], two_ranks["1f1b", False]
    for r in range(2):
        assert ofob[r]["peaks"][-1] < gpipe[r]["peaks"][-1]
        for s in ph.SCHEDULES:
            assert two_ranks[s, True][r]["peaks"][-1] < two_ranks[s, False][r]["peaks"][-1]
    # rank 0 keeps 2 micro-batches in flight under 1F1B, rank 1 one: rank 0 holds more there
    assert ofob[0]["peaks"][-1] > ofob[1]["peaks"][-1]


@pytest.mark.slow
def test_what_persists_between_steps(two_ranks):
    """NOTE [ what a pipeline rank holds between steps ]: step 1 allocates one receive buffer per
    micro-batch per stage (activations on a stage after the first, their gradients on a stage
    before the last); later steps begin with them live, and with nothing else but parameters and
    the batch."""
    for (s, ck), ranks in ((k, v) for k, v in two_ranks.items() if isinstance(k, tuple)):
        n_stages = 4 if s in ph.MULTI_STAGE else 2
        for rank, r in enumerate(ranks):
            first, later = r["live_before"][0], r["live_before"][-1]
            assert first["total"] == r["param_bytes"] + first["inputs"]
            assert later["param_grads"] == later["optimizer_state"] == later["other"] == 0
            assert later["recv_act_buffer_grads"] == 0
            assert r["peaks"][-1] <= r["peaks"][0]
            held = _stages_held(s, rank)
            assert later["recv_act_buffers"] == BUF * sum(i > 0 for i in held), (s, rank)
            assert later["recv_grad_buffers"] == BUF * sum(i < n_stages - 1 for i in held), (s, rank)
        assert ranks[0]["live_before"][-1]["inputs"] == ranks[1]["live_before"][-1]["inputs"] == NMB * MB * SEQ * 8


@pytest.mark.slow
def test_schedules_and_checkpointing_give_the_same_gradients(two_ranks):
    """The same micro-batches in the same order: GPipe, 1F1B and per-block checkpointing give
    bitwise the same parameter gradients, and every schedule (interleaved 1F1B too: its 4
    stages split the same GPT) the same losses (what a planned run is compared with)."""
    ref = two_ranks["gpipe", False]
    assert ref[0]["loss"] is None and ref[1]["loss"] > 0
    for (s, ck), ranks in ((k, v) for k, v in two_ranks.items() if isinstance(k, tuple)):
        assert ranks[1]["losses"] == ref[1]["losses"]
        want_ranks = two_ranks["interleaved", False] if s in ph.MULTI_STAGE else ref
        for r, want in zip(ranks, want_ranks):
            assert r["grads"].keys() == want["grads"].keys() and r["grads"]
            assert all(torch.equal(r["grads"][k], want["grads"][k]) for k in want["grads"])


@pytest.mark.slow
def test_optimizer_step_inside_the_step(two_ranks):
    """AdamW in the metered step: its state (2 tensors a parameter, and a step count) is live
    before step 2, and the second step's loss is lower."""
    ranks = two_ranks["optimizer"]
    for r in ranks:
        assert r["live_before"][0]["optimizer_state"] == 0
        assert r["live_before"][1]["optimizer_state"] >= 2 * r["param_bytes"]
    assert ranks[1]["losses"][1] < ranks[1]["losses"][0]


@pytest.fixture(scope="module")
def llama():
    """A tiny HF Llama split by decoder layers on 2 ranks, AdamW's step inside the measured step:
    GPipe and 1F1B unplanned, and 1F1B planned at 90% of each rank's own unplanned step: one
    spawn of the ranks."""
    pytest.importorskip("transformers")
    kw = dict(n_stages=2, n_microbatches=NMB, model="llama", optimizer=True)
    cfgs = {"gpipe": ph.config("gpipe", **kw), "1f1b": ph.config("1f1b", **kw),
            "planned": ph.config("1f1b", budget="90%", plan=True, **kw)}
    return dict(zip(cfgs, ph.run_many(list(cfgs.values()))))


@pytest.mark.slow
@pytest.mark.hf
def test_llama_pipeline_runs(llama):
    """The Hugging Face split runs under both schedules with the same losses and gradients, and
    1F1B holds less than GPipe on each rank."""
    for r0, r1 in zip(llama["gpipe"], llama["1f1b"]):
        assert r1["peaks"][-1] < r0["peaks"][-1]
        assert r0["losses"] == r1["losses"]
        assert all(torch.equal(r0["grads"][k], r1["grads"][k]) for k in r0["grads"])


@pytest.mark.slow
def test_trace_marks_the_micro_batches(two_ranks):
    """`trace` gives the meter's live bytes op by op, its largest the measured peak, and the
    schedule's order of micro-batches (1F1B on rank 0: F0 F1 B0 F2 B1 F3 B2 B3)."""
    ranks = two_ranks["1f1b", False]
    for r in ranks:
        events = r["trace"][0]
        assert max(v for k, v in events if k not in ("F", "B", "end F", "end B")) == r["peaks"][0]
    order = [f"{k}{i}" for k, i in ranks[0]["trace"][0] if k in ("F", "B")]
    assert order == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]


# ---------------------------------------------------------------- planned per rank (issue 44)

def _budget(two_ranks, schedule: str) -> int:
    """One budget for every rank, between the per-block-checkpointed peaks and the unplanned ones."""
    lo = max(r["peaks"][-1] for r in two_ranks[schedule, True])
    hi = min(r["peaks"][-1] for r in two_ranks[schedule, False])
    assert lo < hi
    return (lo + hi) // 2


@pytest.fixture(scope="module")
def planned(two_ranks):
    """Every schedule planned at `_budget` on each rank, and interleaved zero bubble at 90% of each
    rank's own unplanned step: one spawn of the ranks."""
    cfgs = {s: ph.config(s, n_microbatches=NMB, budget=_budget(two_ranks, s), plan=True) for s in ph.SCHEDULES}
    cfgs["zero-bubble"] = ph.config("zero-bubble", n_microbatches=NMB, budget="90%", plan=True)
    for s in ph.V_SHAPED:
        for budget in ("100%", "90%"):
            cfgs[s, budget] = ph.config(s, n_microbatches=NMB, budget=budget, plan=True)
    return dict(zip(cfgs, ph.run_many(list(cfgs.values()))))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ph.SCHEDULES)
def test_planned_pipeline_fits_the_budget(two_ranks, planned, schedule):
    """Each rank's measured peak (its whole schedule.step, every micro-batch; under interleaved
    1F1B both of its stages, planned together for the rank's one budget) fits the budget and its
    prediction is within 3% above; losses and gradients are bitwise the unplanned ones."""
    budget = _budget(two_ranks, schedule)
    for r, want in zip(planned[schedule], two_ranks[schedule, False]):
        measured = max(r["peaks"])
        assert r["budget_bytes"] == budget
        assert measured <= budget, (r["rank"], measured, budget)
        assert measured <= r["predicted_peak_bytes"] <= 1.03 * measured, (r["rank"], measured, r["predicted_peak_bytes"])
        assert r["losses"] == want["losses"]
        assert r["grads"].keys() == want["grads"].keys()
        assert all(torch.equal(r["grads"][k], want["grads"][k]) for k in want["grads"])


@pytest.mark.slow
def test_interleaved_stage_that_fits_gets_no_region(planned):
    """Interleaved 1F1B on 2 ranks: rank 1's last stage (the logits, one micro-batch in flight
    at a time in the cool-down) fits once rank 1's stage 1 recomputes, and gets no region; every
    stage of rank 0 needs some. The plans live in the stage modules (`stage_regions`: per stage)."""
    r0, r1 = planned["interleaved"]
    assert all(r0["stage_regions"]) and r1["stage_regions"][0] and r1["stage_regions"][1] == []


@pytest.mark.slow
def test_planned_zero_bubble_fits(two_ranks, planned):
    """ScheduleInterleavedZeroBubble (each backward split into its input part "I" and weight part
    "W", the runtime keeping the graph between them: torch's own stage_backward_input and
    stage_backward_weight replayed) on 2 ranks of 2 stages, at 90% of each rank's own unplanned
    step: every rank fits, is predicted within 3% above, and trains bitwise like the unplanned
    pipeline (interleaved 1F1B's: the same stages, micro-batches and order of accumulation)."""
    for r, want in zip(planned["zero-bubble"], two_ranks["interleaved", False]):
        measured = max(r["peaks"])
        assert r["regions"], r["rank"]
        assert measured <= r["budget_bytes"], (r["rank"], measured, r["budget_bytes"])
        assert measured <= r["predicted_peak_bytes"] <= 1.03 * measured, (r["rank"], measured, r["predicted_peak_bytes"])
        assert r["losses"] == want["losses"]
        assert r["grads"].keys() == want["grads"].keys()
        assert all(torch.equal(r["grads"][k], want["grads"][k]) for k in want["grads"])


def _whole(ranks: list[dict]) -> dict:
    """Every rank's parameter gradients, by stage ("stage<i>." names): the same GPT's whatever the
    stages' ranks."""
    return {k: g for r in ranks for k, g in r["grads"].items()}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ph.V_SHAPED)
def test_planned_v_schedule_fits(two_ranks, planned, schedule):
    """ScheduleZBVZeroBubble and ScheduleDualPipeV (V-shaped: rank 0 holds stages 0 and 3, rank 1
    the adjacent 1 and 2, handed over in place; DualPipeV's overlapped forward-backward pairs run
    in turn, as torch's runtime runs them) on 2 gloo ranks: at 100% of each rank's step no region
    and the prediction (the rank's replay) equals the measured peak to the byte; at 90% every rank
    fits, is predicted within 3% above, and both train bitwise like unplanned interleaved 1F1B
    (the same 4 stages and micro-batches: the last stage's losses are rank 0's here)."""
    want = two_ranks["interleaved", False]
    for budget in ("100%", "90%"):
        ranks = planned[schedule, budget]
        for r in ranks:
            measured = max(r["peaks"])
            assert measured <= r["budget_bytes"], (budget, r["rank"], measured, r["budget_bytes"])
            assert measured <= r["predicted_peak_bytes"] <= 1.03 * measured, (budget, r["rank"], measured,
                                                                               r["predicted_peak_bytes"])
            if budget == "100%":
                assert r["regions"] == [] and r["predicted_peak_bytes"] == measured, (r["rank"], measured)
            else:
                assert r["regions"], r["rank"]
        assert ranks[0]["losses"] == want[1]["losses"]
        grads, ref = _whole(ranks), _whole(want)
        assert grads.keys() == ref.keys()
        assert all(torch.equal(grads[k], ref[k]) for k in ref), (schedule, budget)


def test_v_schedules_hand_over_between_adjacent_stages():
    """In one process, on schedule-shaped stages: torch's V-shaped schedules put stages 1 and 2 on
    rank 1 of 2, read as one handover (positions 0 to 1), and stages 0 and 3 on rank 0, none."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleDualPipeV, ScheduleZBVZeroBubble

    from remat.runtime.distributed.pipeline import rank_stages

    for cls in (ScheduleZBVZeroBubble, ScheduleDualPipeV):
        for rank, held, handovers in ((0, (0, 3), ()), (1, (1, 2), ((0, 1),))):
            stages = [SimpleNamespace(group_size=2, group_rank=rank, stage_index=i, num_stages=4,
                                      submod=torch.nn.Linear(2, 2)) for i in held]
            rs = rank_stages(cls(stages, NMB), stages[0].submod)
            assert [st.stage_index for st in rs.stages] == list(held) and rs.handovers == handovers
            assert sum(kind == "F" for kind, _, _ in rs.order) == 2 * NMB


def test_rank_order_refusals_name_the_schedule():
    """In one process, on schedule-shaped objects: a multi-stage schedule remat does not plan
    (looped BFS), one splitting backward (torch's runtime given an order of input and weight parts)
    and one not V-shaped putting adjacent stages on a rank are refused with PipelineScheduleError
    naming the schedule."""
    from torch.distributed.pipelining.schedules import _Action
    from remat.runtime.distributed.pipeline import PipelineScheduleError, rank_stages

    def schedule(name: str, actions: list[str], stage_indices=(0, 2)):
        stages = [type("Stage", (), {"stage_index": i, "num_stages": 4, "submod": torch.nn.Linear(2, 2)})()
                  for i in stage_indices]
        return type(name, (), {"_stages": stages, "rank": 0, "_n_microbatches": 2,
                               "pipeline_order_with_comms": {0: [_Action.from_str(a) for a in actions]}})()

    cases = [("ScheduleLoopedBFS", ["0F0", "2F0", "2B0", "0B0"], (0, 2), "ScheduleLoopedBFS"),
             ("_PipelineScheduleRuntime", ["0F0", "3F0", "3I0", "3W0", "0I0", "0W0"], (0, 3), "input and weight"),
             ("ScheduleInterleaved1F1B", ["0F0", "1F0", "1B0", "0B0"], (0, 1), "adjacent stages")]
    for name, actions, idx, says in cases:
        s = schedule(name, actions, idx)
        with pytest.raises(PipelineScheduleError, match=says) as e:
            rank_stages(s, s._stages[0].submod)
        assert name in str(e.value)


@pytest.mark.slow
@pytest.mark.hf
def test_a_planned_hugging_face_llama_pipeline_with_adamw_fits(llama):
    """A tiny HF Llama split by decoder layers, 1F1B, AdamW's step inside the measured step (its
    state made in step 1, live in step 2): at 90% of each rank's own unplanned step (the last stage's
    floor is 88%: its logits, loss and AdamW state leave little to recompute), every rank
    fits, is predicted within 3% above, and trains bitwise like the unplanned pipeline."""
    for r, want in zip(llama["planned"], llama["1f1b"]):
        measured = max(r["peaks"])
        assert measured <= r["budget_bytes"], (r["rank"], measured, r["budget_bytes"])
        assert measured <= r["predicted_peak_bytes"] <= 1.03 * measured, (r["rank"], measured, r["predicted_peak_bytes"])
        assert r["losses"] == want["losses"]
        assert all(torch.equal(r["grads"][k], want["grads"][k]) for k in want["grads"])


def test_a_rank_that_no_plan_fits_names_a_budget_that_fits():
    """In one process, two stages of a small MLP as one interleaved rank holds them (stages 0 and
    2 of 4, 2 micro-batches): a budget below the rank's parameters raises InfeasibleBudgetError,
    and the budget it names fits: planned there, every stage's prediction (the rank's replay under
    all of the plans) is within it."""
    from remat.planner import PlanOptions
    from remat.planner.errors import InfeasibleBudgetError
    from remat.planner.options import PipelineRank
    from remat.runtime.budget import StepBudget
    from remat.runtime.distributed import interleaved
    from remat.runtime.distributed.pipeline import received_grad_loss, stage_inputs

    torch.manual_seed(0)
    modules = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 32)) for _ in range(2)]
    order = tuple((a[1], int(a[0]), int(a[2])) for a in ["0F0", "0F1", "2F0", "2B0", "2F1", "2B1", "0B0", "0B1"])
    settings = []
    for module, stage in zip(modules, (0, 2)):
        rank = PipelineRank.of_rank_order(order, stage, 4, 2)
        args, kwargs = stage_inputs((torch.randn(16, 32),), {}, rank)
        settings.append(interleaved.StageSetting(module, args, kwargs, received_grad_loss,
                                                 PlanOptions(pipeline=rank, keep_output=True)))
    positions = tuple((kind, 0 if stage == 0 else 1, m) for kind, stage, m in order)
    with pytest.raises(InfeasibleBudgetError) as e:
        interleaved.plan_rank(settings, positions, StepBudget.of(1e-9))
    assert e.value.min_feasible_bytes > 1
    plans = interleaved.plan_rank(settings, positions, StepBudget.of(e.value.min_feasible_bytes / 1e9))
    assert all(p.predicted_peak_bytes <= e.value.min_feasible_bytes for p in plans)
    assert len({p.predicted_peak_bytes for p in plans}) == 1


def test_a_stage_of_unknown_input_shapes_is_refused():
    """An interleaved rank's other stage built without `input_args` (its shapes known only after a
    first step) is refused with PipelineScheduleError, naming the stage and what to pass."""
    from types import SimpleNamespace

    from remat.planner import PlanOptions
    from remat.planner.options import PipelineRank
    from remat.runtime.distributed import interleaved
    from remat.runtime.distributed.pipeline import PipelineScheduleError, RankStages

    order = (("F", 0, 0), ("F", 2, 0), ("B", 2, 0), ("B", 0, 0))
    unknown = SimpleNamespace(inputs=None)
    stages = tuple(SimpleNamespace(stage_index=i, submod=torch.nn.Linear(2, 2), _stage_meta=unknown, _user_meta=unknown)
                   for i in (0, 2))
    rs = RankStages(stages, tuple(PipelineRank.of_rank_order(order, i, 4, 1) for i in (0, 2)), order)
    with pytest.raises(PipelineScheduleError, match="stage 2's input shapes .* input_args="):
        interleaved.stage_settings(rs, stages[0].submod, (torch.zeros(1, 2),), {}, None, PlanOptions())


def _interleaved_rank(rank: int):
    """The benchmark's interleaved rank in one process: stages `rank` and `rank` + 2 of the 4-block
    GPT split one block a stage, 4 micro-batches, in the order torch's ScheduleInterleaved1F1B runs
    them on that rank of 2 (read off the schedule, built on stage-shaped objects: no process group)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    from remat.planner import PlanOptions
    from remat.planner.compat import schedule_rank_order
    from remat.planner.options import PipelineRank
    from remat.runtime.distributed import interleaved
    from remat.runtime.distributed.pipeline import received_grad_loss, stage_inputs

    held = (rank, rank + 2)
    shaped = [SimpleNamespace(group_size=2, group_rank=rank, stage_index=i, num_stages=4, submod=None) for i in held]
    order = schedule_rank_order(ScheduleInterleaved1F1B(shaped, NMB))
    modules, (tokens, targets) = ph.stages("gpt", 4, 1), ph.batch(NMB)
    settings = []
    for i in held:
        part = replace(PipelineRank.of_rank_order(order, i, 4, NMB), keeps_outputs=False)     # the harness's
        x = tokens[:MB].clone() if i == 0 else torch.zeros(MB, SEQ, D)
        args, kwargs = stage_inputs((x,), {}, part)
        loss = (lambda out: ph.loss_fn(out, targets[:MB])) if part.last else received_grad_loss
        options = PlanOptions(pipeline=part, keep_output=True)
        settings.append(interleaved.StageSetting(modules[i], args, kwargs, loss, options))
    return settings, tuple((kind, held.index(i), m) for kind, i, m in order)


def test_an_interleaved_rank_recomputes_no_more_than_per_block_at_its_peak():
    """In one process, the benchmark's interleaved rank 0 at the per-block policy's peak (every
    block of both stages checkpointed, replayed as the rank's whole step: the budget): remat's
    plans together recompute no more than the per-block plans (the same cost model, the same
    graphs), and the rank's replay under them, every plan's prediction, fits. Planned in turn from
    no regions alone, stage 0 took the room and stage 2 recomputed 97.9% of its forward: 85.7% of
    the rank's against per-block's 84.5%."""
    from remat.planner.api import analyze_for
    from remat.planner.solve.simulate import timeline
    from remat.runtime.budget import StepBudget
    from remat.runtime.distributed import interleaved
    from remat.runtime.distributed.pipeline import rank_graph
    from remat.runtime.rewrite import REGION_PROBE

    settings, order = _interleaved_rank(0)
    analyses = [analyze_for(s.module, s.args, s.kwargs, s.loss_fn, s.options, None, REGION_PROBE) for s in settings]
    graphs = [rank_graph(a.cost_graph, s.options.pipeline, a.example_inputs) for s, a in zip(settings, analyses)]
    uniform = tuple(interleaved.uniform_regions(cg) for cg in graphs)
    assert all(uniform)
    replay = interleaved.RankReplay(settings, analyses, order)
    budget = replay(uniform)
    plans = interleaved.plan_replayed(replay, settings, StepBudget.of(budget / 1e9))     # plan_rank's, its replays kept
    regions = tuple(tuple(p.regions) for p in plans)
    assert all(p.budget_bytes == budget and p.predicted_peak_bytes == replay(regions) <= budget for p in plans)
    ours = sum(timeline(cg, r).recompute_s for cg, r in zip(graphs, regions))
    assert ours == pytest.approx(sum(p.recompute_s for p in plans))
    assert ours <= sum(timeline(cg, r).recompute_s for cg, r in zip(graphs, uniform))
