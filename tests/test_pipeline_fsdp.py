"""Pipeline parallelism composed with FSDP2 (issue 44, item 1's PP x DP): the tiny GPT on 2 pipeline
ranks, each stage sharded with fully_shard over the data-parallel dimension of a 2 x 2 mesh, on 4
gloo ranks (benchmarks/pipeline_fsdp_run.py): under ScheduleGPipe and Schedule1F1B a stage a rank
(runtime/distributed/pipeline_fsdp.py), under ScheduleInterleaved1F1B two (stages r and r + 2 of 4,
planned together with the runtime's UNSHARD, RESHARD and REDUCE_GRAD actions:
runtime/distributed/interleaved_fsdp.py); planned per rank by plan_and_wrap(stage_module, ...,
schedule=). One spawn of the ranks runs every configuration."""
import pytest
import torch

import benchmarks.pipeline_fsdp_run as pf
from benchmarks.pipeline_fsdp_run import least, steady

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@pytest.fixture(scope="module")
def runs():
    """Per schedule: unplanned, planned at 100% (no region: the prediction of the step as it is)
    and at 85% of each rank's step; 1F1B and interleaved 1F1B with AdamW's step inside the step,
    unplanned and at 85%; zero bubble planned (refused)."""
    cfgs = {}
    for s in SCHEDULES:
        cfgs[s, "plain"] = pf.config(s)
        cfgs[s, "100%"] = pf.config(s, budget="100%", plan=True)
        cfgs[s, "85%"] = pf.config(s, budget="85%", plan=True)
    for s in ("1f1b", "interleaved"):
        cfgs["adamw", s, "plain"] = pf.config(s, optimizer=True)
        cfgs["adamw", s, "85%"] = pf.config(s, budget="85%", plan=True, optimizer=True)
    cfgs["zero-bubble", "85%"] = pf.config("zero-bubble", budget="85%", plan=True, refuse=True)
    return dict(zip(cfgs, pf.run_many(list(cfgs.values()))))


def _same_grads(got: list[dict], want: list[dict]) -> None:
    for r, w in zip(got, want):
        assert r["grads"].keys() == w["grads"].keys() and r["grads"], r["rank"]
        assert all(torch.equal(r["grads"][k], w["grads"][k]) for k in w["grads"]), r["rank"]
        assert r["losses"] == w["losses"], r["rank"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_step_as_it_is_is_predicted_within_the_allocators_bounds(runs, schedule):
    """At 100% of a rank's step no region is planned, and the prediction (the replay with FSDP2's
    parameters and gradients: NOTE [ a stage under FSDP2 ]) lies within 3% above the CPU
    allocator's peak on every rank (its least reading of the two runs' steps: `least`), gloo's
    staging copies of the all-gathers included (made below the dispatcher, the live-storage meter
    does not see them: it reads less, and the prediction lies above it too). With the allocator's
    meter of commit 26ea40f the two were equal to the byte on every rank; the meter is being
    reworked (NOTE [ unseen frees ]), hence the bound."""
    for r, plain in zip(runs[schedule, "100%"], runs[schedule, "plain"]):
        allocator = least(plain["allocator"] + r["allocator"])
        assert r["regions"] == [], r["rank"]
        assert allocator <= r["predicted_peak_bytes"] <= 1.03 * allocator, (r["rank"], allocator,
                                                                           r["predicted_peak_bytes"])
        assert steady(plain["peaks"]) <= r["predicted_peak_bytes"], r["rank"]
    _same_grads(runs[schedule, "100%"], runs[schedule, "plain"])


@pytest.mark.slow
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_planned_stage_under_fsdp2_fits_and_trains_the_same(runs, schedule):
    """At 85% of each rank's own step, every rank (both data-parallel ranks of both stages) plans
    regions, its measured peak (live storages, the steps after the first) fits the budget and is
    predicted within 3% above, and its gradient shards and losses are bitwise the unplanned run's.
    (The CPU allocator's peak is not asserted here: on the idle machine it equals the prediction
    on every rank, the regions' host RNG states counted (NOTE [ host RNG states ]; the benchmark's
    "allocator" column), but under the CI's load its profiler meter read 1F1B's rank 0 195 kB (9%)
    high in every step of one run, as single steps of the benchmark's runs read 200 kB high at
    times: by all appearances a collective's buffer freed by gloo's worker past the meter's bound,
    NOTE [ unseen frees ].)"""
    planned, plain = runs[schedule, "85%"], runs[schedule, "plain"]
    for r, p in zip(planned, plain):
        measured = steady(r["peaks"])
        assert r["regions"], r["rank"]
        assert measured < steady(p["peaks"]), r["rank"]
        assert measured <= r["budget_bytes"], (r["rank"], measured, r["budget_bytes"])
        assert measured <= r["predicted_peak_bytes"] <= 1.03 * measured, (r["rank"], measured,
                                                                         r["predicted_peak_bytes"])
    for a, b in ((0, 1), (2, 3)):       # a stage's data-parallel ranks run one plan
        assert planned[a]["regions"] == planned[b]["regions"]
    _same_grads(planned, plain)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ("1f1b", "interleaved"))
def test_adamw_inside_the_step_fits(runs, schedule):
    """AdamW's step inside the measured step (its state, a shard's, made in step 1): at 85% every
    rank fits, is predicted within 3% above, and trains bitwise like the unplanned run."""
    planned, plain = runs["adamw", schedule, "85%"], runs["adamw", schedule, "plain"]
    for r in planned:
        measured = steady(r["peaks"])
        assert measured <= r["budget_bytes"], (r["rank"], measured, r["budget_bytes"])
        assert measured <= r["predicted_peak_bytes"] <= 1.03 * measured, (r["rank"], measured,
                                                                         r["predicted_peak_bytes"])
    _same_grads(planned, plain)


@pytest.mark.slow
def test_interleaved_stages_under_fsdp2_are_planned_together_to_the_allocators_byte(runs):
    """Interleaved 1F1B under FSDP2: each rank's two stages, their units all-gathered by the
    runtime's UNSHARD before the first forward and reduced at their REDUCE_GRAD (NOTE [ stages
    under FSDP2 on one rank ]), are predicted within 3% above the CPU allocator's peak at 100% (no
    region) and at 85%, gloo's staging copies included (the live-storage meter reads less on the
    second pipeline rank). On the idle machine the two are equal to the byte on every rank; the
    bound is the one-stage tests' (the allocator's meter under load)."""
    for budget, readings in (("100%", lambda r, p: r["allocator"] + p["allocator"]),
                             ("85%", lambda r, p: r["allocator"])):
        for r, p in zip(runs["interleaved", budget], runs["interleaved", "plain"]):
            allocator = least(readings(r, p))
            assert allocator <= r["predicted_peak_bytes"] <= 1.03 * allocator, (budget, r["rank"], allocator,
                                                                               r["predicted_peak_bytes"])
            assert steady(r["peaks"]) <= r["predicted_peak_bytes"], (budget, r["rank"])
    assert all(len(r["stage_regions"]) == 2 for r in runs["interleaved", "85%"])


@pytest.mark.slow
def test_a_split_backward_under_fsdp2_is_refused_by_name(runs):
    """Zero bubble under FSDP2: torch's runtime does not compute every weight gradient of a stage
    in the split backward (its unplanned run holds fewer gradients than interleaved 1F1B's), so
    plan_and_wrap refuses it by name, on every rank, before any step."""
    for r in runs["zero-bubble", "85%"]:
        kind, message = r["refused"]
        assert kind == "PipelineScheduleError" and "ScheduleInterleavedZeroBubble" in message, r["rank"]
        assert "ScheduleInterleaved1F1B" in message


def test_the_marks_keep_the_step_and_fire_fsdp2s_events_in_order():
    """In one process, no FSDP2: a stage's graph rewritten with regions (every block checkpointed)
    and marked at its units (`mark_units`) computes bitwise what the unmarked one does, forward
    and backward, and fires each unit's events where FSDP2's hooks run: the root's pre-forward,
    each block's pre- and post-forward in order, the root's post-forward; in backward the root's
    pre-backward, then each block's pre- and post-backward, last block first."""
    from types import SimpleNamespace

    import benchmarks.pipeline_run as ph
    from remat.planner import analyze
    from remat.planner.distributed import Unit, unit_of
    from remat.runtime.distributed.interleaved import uniform_regions
    from remat.runtime.distributed.pipeline_fsdp import FsdpStage, annotate
    from remat.runtime.rewrite.graph import rewrite

    stage_module = ph.gpt_stages(2)[1]
    x = torch.randn(ph.MB, ph.SEQ, ph.D, requires_grad=True)
    a = analyze(stage_module, (x,))
    cg = a.cost_graph
    names = ("", "blocks.0", "blocks.1")
    where = {c.name: unit_of(c.module, names) for c in cg.nodes[:-1]}
    stage = FsdpStage({n: Unit(n, 1, 1, 1, 1) for n in names}, names[1:], where, staged=True)
    annotate(a.traced.gm, where)
    runs = []
    for marked in (False, True):
        gm = rewrite(stage_module, a.traced.gm, uniform_regions(cg), tuple(c.name for c in cg.nodes), cg.meta)
        events = []
        if marked:
            overlay = stage.marked(gm)
            overlay.start(SimpleNamespace(live_bytes=0, _peak=0))
            overlay.event = lambda name, what: events.append((name, what))
        stage_module.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        out = gm(**{next(iter(a.example_inputs)): xi})
        out = out[0] if isinstance(out, (tuple, list)) else out
        out.square().mean().backward()
        runs.append((out.detach(), xi.grad, [p.grad.clone() for p in stage_module.parameters()], events))
    (o0, g0, p0, _), (o1, g1, p1, events) = runs
    assert torch.equal(o0, o1) and torch.equal(g0, g1) and all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert events == [("", "pre_forward"), ("blocks.0", "pre_forward"), ("blocks.0", "post_forward"),
                      ("blocks.1", "pre_forward"), ("blocks.1", "post_forward"), ("", "post_forward"),
                      ("", "pre_backward"), ("blocks.1", "pre_backward"), ("blocks.1", "post_backward"),
                      ("blocks.0", "pre_backward"), ("blocks.0", "post_backward")]


def test_the_runtimes_fsdp_actions_are_read_in_the_ranks_order():
    """ScheduleInterleaved1F1B's lowering on a rank of two stages (built on stage-shaped objects,
    no process group): with `fsdp`, UNSHARD of both stages before the first forward, and after
    each stage's last backward its REDUCE_GRAD then RESHARD; without, the computations alone."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    from remat.planner.compat import schedule_rank_order
    shaped = [SimpleNamespace(group_size=2, group_rank=0, stage_index=i, num_stages=4, submod=None) for i in (0, 2)]
    schedule = ScheduleInterleaved1F1B(shaped, 4)
    plain, fsdp = schedule_rank_order(schedule), schedule_rank_order(schedule, fsdp=True)
    assert [a for a in fsdp if a[0] in ("F", "B")] == list(plain)
    assert fsdp[:2] == (("UNSHARD", 0, None), ("UNSHARD", 2, None)) and fsdp[2][0] == "F"
    for s in (0, 2):
        last_b = max(i for i, a in enumerate(fsdp) if a[:2] == ("B", s))
        assert fsdp[last_b + 1:last_b + 3] == (("REDUCE_GRAD", s, None), ("RESHARD", s, None))


def test_the_overlay_counts_an_unshard_its_wait_and_a_reshard():
    """FsdpOverlay's runtime actions (NOTE [ stages under FSDP2 on one rank ]) on a stage of a root
    and two units (P_U 100, 10, 20; shards a tenth; gloo staging): UNSHARD holds every flat output
    (at its peak the root's beside its staging copy); the wait copies each out and frees its flat
    output (the peak one copy above, the root's); the forward gathers nothing more; RESHARD frees
    them all."""
    from types import SimpleNamespace

    from remat.planner.distributed import Unit
    from remat.runtime.distributed.pipeline_fsdp import FsdpOverlay, FsdpStage

    units = {n: Unit(n, p, p // 10, p, p // 10) for n, p in (("", 100), ("a", 10), ("b", 20))}
    stage = FsdpStage(units, ("a", "b"), {}, staged=True)
    overlay = FsdpOverlay(stage)
    meter = SimpleNamespace(live_bytes=0, _peak=0)
    overlay.start(meter)
    base = meter.live_bytes                                   # the shards, less the replay's unsharded parameters
    assert base == -(100 + 10 + 20) * 9 // 10
    meter._peak = base
    overlay.unshard()
    assert meter.live_bytes == base + 130 and meter._peak == base + 200
    meter._peak = meter.live_bytes
    overlay.wait()
    assert meter.live_bytes == base + 130 and meter._peak == base + 130 + 100
    for name, what in (("", "pre_forward"), ("a", "pre_forward"), ("a", "post_forward")):
        overlay.event(name, what)
    assert meter.live_bytes == base + 130 - 10              # "a" resharded after its forward
    overlay.reshard()
    assert meter.live_bytes == base and overlay.gathered == set()
