"""A pipeline rank's memory model (issue 44): other micro-batches in flight hold what one keeps.

`CostGraph.inflight` adds what the other micro-batches in flight retain (simulate.retained_bytes),
and after the first backward every parameter grad, to every node (simulate.pipeline_adds); the
simulator, the ILP ([Pipeline] in NOTE [ ILP ]) and the local search's judge must agree to the
byte, and the ILP must stay the exact optimum (brute force)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from remat.planner.options import PipelineRank
from remat.planner.solve.candidates import candidates
from remat.planner.solve.ilp import solve_ilp
from remat.planner.solve.improve import Judge
from remat.planner.solve.simulate import keep_release, region_index, retained_bytes, timeline

from helpers import ilp_peaks_of_random_plans
from test_solver import EVERY, every_plan, random_graph


def _retained(cg, regions) -> int:
    where = region_index(len(cg.nodes), regions)
    tops = [None] * len(regions)
    return retained_bytes(cg, keep_release(cg, regions, where, tops))


GPIPE_FIRST = (3, -1, 3, 2)      # 4 micro-batches under GPipe: (forwards, forwards after a backward, B0, later)


@pytest.mark.parametrize("seed,inflight", [(0, GPIPE_FIRST), (1, (1, 1, 1, 1)), (2, (0, 0, 0, 0))])
def test_inflight_micro_batches_add_what_a_plan_keeps_in_every_model(seed, inflight):
    one = random_graph(200 + seed, n=9)
    cg = replace(one, inflight=inflight)
    a, b, c, d = inflight
    grads = [sum(n.param_grad_bytes for n in one.nodes[:t]) for t in range(len(one.nodes))]
    total = sum(n.param_grad_bytes for n in one.nodes)
    cands = candidates(cg, EVERY)
    judge = Judge(cg)
    by_region = {c_.region: c_ for c_ in cands}
    for regions, ilp_bytes in ilp_peaks_of_random_plans(cg, cands, seed=seed, p=0.4, rounds=8):
        tl, single = timeline(cg, regions), timeline(one, regions)
        r = _retained(one, regions)
        fwd_add = max(a * r, total + b * r if b >= 0 else 0)
        assert tl.fwd == tuple(f + fwd_add for f in single.fwd)
        assert tl.bwd == tuple(x + max(c * r, g + d * r) for x, g in zip(single.bwd, grads))
        assert ilp_bytes == pytest.approx(tl.peak_bytes, abs=1)
        assert judge.peak([by_region[x] for x in regions]) == tl.peak_bytes


@pytest.mark.parametrize("seed", range(3))
def test_the_ilp_is_the_exact_optimum_with_micro_batches_in_flight(seed):
    cg = replace(random_graph(seed), inflight=GPIPE_FIRST if seed else (1, 1, 1, 1))
    plans = [(timeline(cg, p), p) for p in every_plan(cg)]
    peaks = sorted({tl.peak_bytes for tl, _ in plans})
    cands = candidates(cg, EVERY)
    mids = [(a + b) // 2 for a, b in zip(peaks, peaks[1:])]
    for budget in {mids[0], mids[len(mids) // 2], mids[-1]}:
        best = min(tl.recompute_s for tl, _ in plans if tl.peak_bytes <= budget)
        sol = solve_ilp(cg, budget, EVERY, cands=cands)
        assert sol is not None and timeline(cg, sol.regions).peak_bytes <= budget
        assert timeline(cg, sol.regions).recompute_s == pytest.approx(best, rel=1e-6)


def test_a_schedules_micro_batches_in_flight():
    gpipe0 = PipelineRank(tuple([("F", m) for m in range(4)] + [("B", m) for m in range(4)]), 4, True, False)
    one_f_one_b0 = PipelineRank((("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("F", 3), ("B", 2), ("B", 3)),
                                4, True, False)
    last = PipelineRank(tuple(a for m in range(4) for a in (("F", m), ("B", m))), 4, False, True)
    assert (gpipe0.in_flight(), one_f_one_b0.in_flight(), last.in_flight()) == (4, 2, 1)
    assert gpipe0.others_in_flight() == GPIPE_FIRST
    assert one_f_one_b0.others_in_flight() == (1, 1, 1, 1)
    assert last.others_in_flight() == (0, 0, 0, 0)
    assert PipelineRank.one_stage("gpipe", 0, 2, 4).actions == gpipe0.actions
    assert PipelineRank.one_stage("1f1b", 0, 2, 4).actions == one_f_one_b0.actions
    assert PipelineRank.one_stage("1f1b", 1, 2, 4).actions == last.actions


def test_the_docs_table_is_the_benchmarks_current_file():
    """docs/pipeline.md's table is benchmarks/pipeline.py's output (benchmarks/results/pipeline.md):
    every row's bytes and extra compute are the results file's, row for row."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "pipeline.md").read_text()
    results = (root / "benchmarks" / "results" / "pipeline.md").read_text()
    rows = {(m[0].lower(), m[1]): m[2:] for m in re.findall(
        r"^\| (\w+) \| (\d) \| (\d+) \| \d+ \| (\d+) \| (\d+) \| (\d+) \| \d+ \| ([\d.]+%) \| ([\d.]+%) \|",
        results, re.M)}
    shown = re.findall(r"^\| (GPipe|1F1B) \| (\d) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+%) \| "
                       r"([\d.]+%) \|$", docs, re.M)
    assert len(shown) == len(rows) == 4
    for sched, rank, *numbers in shown:
        assert tuple(n.replace(",", "") for n in numbers) == rows[sched.lower(), rank], (sched, rank)


@pytest.mark.slow
@pytest.mark.hf
def test_a_whole_pipeline_job_is_planned_from_one_process(tmp_path):
    """`remat report --hf-config ... --pipeline 4` (runtime/distributed/pipeline_job.py): a Llama on
    meta in 4 stages under 1F1B, at the uniform policy's largest per-rank peak (no --budget: the
    CLI requires one, the library does not): every stage fits, recomputes no more than every block
    checkpointed on it, and a stage with fewer micro-batches in flight recomputes no more."""
    pytest.importorskip("transformers")
    import json

    from remat.runtime.cli.main import main
    from remat.runtime.cli.session import hf_config_model
    from remat.runtime.distributed.pipeline_job import plan_job
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
                               "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 8,
                               "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
                               "tie_word_embeddings": False}))
    model = hf_config_model(str(cfg), 1, 128, "bf16").model
    rows, budget, _ = plan_job(model, 4, "1f1b", 8, 1, 128)
    assert [r.in_flight for r in rows] == [4, 3, 2, 1] and [r.layers for r in rows] == [2, 2, 2, 2]
    assert max(r.uniform_bytes for r in rows) == budget
    for r in rows:
        assert r.planned_bytes is not None and r.planned_bytes <= budget
        assert r.planned_extra_pct <= r.uniform_extra_pct + 1e-9
    middle = [r.planned_extra_pct for r in rows[1:-1]]
    assert middle == sorted(middle, reverse=True)
    assert main(["report", "--hf-config", str(cfg), "--pipeline", "4", "--microbatches", "8", "--batch", "1",
                 "--seq", "128", "--budget", "60%", "--quiet"]) == 0
