"""A pipeline rank's memory model (issue 44): other micro-batches in flight hold what one keeps.

`CostGraph.inflight` adds what the other micro-batches in flight retain (simulate.retained_bytes),
and after the first backward every parameter grad, to every node (simulate.pipeline_adds); the
simulator, the ILP ([Pipeline] in NOTE [ ILP ]) and the local search's judge must agree to the
byte, and the ILP must stay the exact optimum (brute force)."""
from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest

from remat.planner import PlanOptions, SolveOptions, solve_plan
from remat.planner.options import PipelineRank
from remat.planner.solve import chain
from remat.planner.solve.baselines import every_block
from remat.planner.solve.candidates import candidates
from remat.planner.solve.hierarchy import HierarchicalSolver
from remat.planner.solve.ilp import solve_ilp
from remat.planner.solve.improve import Judge
from remat.planner.solve.segment import Option
from remat.planner.solve.simulate import keep_release, one_microbatch, region_index, retained_bytes, timeline

from helpers import ilp_peaks_of_random_plans
from test_hierarchy import EXACT, block_chain, exact_budgets, valid
from test_solver import EVERY, every_plan, random_graph


def _retained(cg, regions) -> int:
    where = region_index(len(cg.nodes), regions)
    tops = [None] * len(regions)
    return retained_bytes(cg, keep_release(cg, regions, where, tops), regions)


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


@pytest.mark.parametrize("seed,inflight", [(3, (2, 2, 2, 2)), (4, GPIPE_FIRST), (5, (0, 0, 0, 0)), (6, (3, -1, -1, 2))])
def test_one_micro_batch_with_k_per_retained_byte_bounds_the_rank_and_is_it_under_1f1b(seed, inflight):
    """NOTE [ pipeline chain ]: every plan's peak on the rank is at most its peak on the graph of one
    micro-batch (simulate.one_microbatch, at a reference R0 retained) plus k times what it retains
    above R0: to the byte at R0, and everywhere when the four counts are equal (1F1B) and R0 = 0;
    one step's graph comes back as it is."""
    cg = replace(random_graph(300 + seed), inflight=inflight)
    one = one_microbatch(cg)
    assert one.cg.inflight == () and one.per_byte == max(inflight) and one_microbatch(one.cg).cg is one.cg
    equal = len(set(inflight)) == 1
    plans = list(every_plan(cg))
    for at in sorted({0} | {_retained(cg, p) for p in plans[::7]}):
        one = one_microbatch(cg, at)
        for regions in plans:
            r = _retained(cg, regions)
            bound = timeline(one.cg, regions).peak_bytes + one.per_byte * max(0, r - at)
            peak = timeline(cg, regions).peak_bytes
            assert peak == bound if r == at or (equal and at == 0) else peak <= bound, (at, regions)


def _chain_optimum(options, budget, k, fixed):
    """Brute force: the least cost over every choice of one option per segment whose chain peak
    (kept so far + M, at each segment) plus k max(0, K + fixed) is within budget; and the least such
    total."""
    best, least = None, None
    for pick in itertools.product(*options):
        kept = [sum(o.kept for o in pick[:i]) for i in range(len(pick) + 1)]
        total = max(kept[i] + o.peak for i, o in enumerate(pick)) + k * max(0, kept[-1] + fixed)
        least = total if least is None else min(least, total)
        if total <= budget:
            cost = sum(o.cost_s for o in pick)
            best = cost if best is None else min(best, cost)
    return best, least


@pytest.mark.parametrize("seed", range(30))
def test_the_pipeline_chain_dp_fits_and_with_every_level_is_the_optimum(seed, monkeypatch):
    """chain.pipeline_dp and least_total against every choice: the least total exactly; a plan
    whenever one fits, that fits (chain peak plus k times what it keeps above R0); and, with a level for
    every byte of chain peak, the cheapest."""
    r = random.Random(seed)
    options = [[Option((), r.randint(0, 20), r.randint(5, 60), float(r.randint(0, 9))) for _ in range(r.randint(1, 5))]
               for _ in range(r.randint(1, 4))]
    k, fixed = r.randint(1, 4), r.randint(-30, 5)          # fixed: the outputs less the reference R0
    least = _chain_optimum(options, 0, k, fixed)[1]
    assert chain.least_total(options, k, fixed)[0] == least
    for budget in (least - 1, least, least + 20, least + 80):
        best = _chain_optimum(options, budget, k, fixed)[0]
        got = chain.pipeline_dp(options, budget, k, fixed)
        assert (got is None) == (best is None), budget
        if got is not None:
            assert _chain_optimum([[o[i]] for o, i in zip(options, got[1])], budget, k, fixed)[0] == got[0]
            assert got[0] >= best
        monkeypatch.setattr(chain, "PIPELINE_LEVELS", budget + 2)
        every = chain.pipeline_dp(options, budget, k, fixed)
        assert (every is None) == (best is None) and (every is None or every[0] == best), budget
        monkeypatch.undo()


@pytest.mark.parametrize("seed,inflight", [(0, (2, 2, 2, 2)), pytest.param(1, GPIPE_FIRST, marks=pytest.mark.slow),
                                           pytest.param(3, (1, 1, 1, 1), marks=pytest.mark.slow)])
def test_the_hierarchy_plans_a_pipeline_rank_within_one_percent_of_the_exact_ilp(seed, inflight):
    """The hierarchical solver on a pipeline rank's graph of blocks (NOTE [ pipeline chain ]): its
    plans fit and recompute at most 1% more than the flat exact ILP's optimum."""
    cg = replace(block_chain(30 + seed, n_blocks=5, size=5), inflight=inflight)
    cands, budgets = exact_budgets(cg)
    h = HierarchicalSolver(cg, SolveOptions())
    for budget in budgets:
        exact = solve_ilp(cg, budget, EXACT, cands=cands)
        assert exact is not None and exact.status == "optimal"
        sol = h.solve(cg, budget)
        assert sol is not None and "hierarchical" in sol.status
        got = timeline(cg, sol.regions)
        assert valid(cg, sol.regions) and got.peak_bytes <= budget
        assert got.recompute_s <= timeline(cg, exact.regions).recompute_s * 1.01 + 1e-12, budget


def test_solve_plan_takes_the_hierarchical_path_for_a_pipeline_rank():
    """A pipeline rank's large graph of blocks is planned by the hierarchy (it was the flat ILP's),
    within its budget by the simulator."""
    cg = replace(block_chain(7, n_blocks=12, size=5), inflight=(2, 2, 2, 2))
    budget = (timeline(cg, ()).peak_bytes + timeline(cg, every_block(cg)).peak_bytes) // 2
    plan = solve_plan(cg, budget, PlanOptions(find_min_feasible=False, safety_margin=0.0))
    assert "hierarchical" in plan.status and plan.regions
    assert timeline(cg, plan.regions).peak_bytes == plan.predicted_peak_bytes <= budget


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


def test_a_split_backward_keeps_its_micro_batch_in_flight_until_its_weight_part():
    """Zero bubble's order (rank 0 of 2, stages 0 and 2 of 4, 4 micro-batches, as torch's
    ScheduleInterleavedZeroBubble runs them): a micro-batch is in flight from its "F" to its "W"
    (counted directly, action by action), and the others in flight at each phase are those of the
    same order with each "I" left out and each "W" a backward."""
    order = [(a[1], int(a[0]), int(a[2])) for a in "0F0 0F1 2F0 2F1 2I0 2W0 0F2 2I1 2W1 0F3 0I0 0W0 2F2 0I1 "
             "0W1 2F3 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3".split()]
    for stage in (0, 2):
        rank = PipelineRank.of_rank_order(tuple(order), stage, 4, 4)
        live, most = set(), 0
        for kind, m in rank.actions:
            live = live | {m} if kind == "F" else live - {m} if kind == "W" else live
            most = max(most, len(live))
        assert rank.in_flight() == most
        whole = PipelineRank(tuple(("B" if k == "W" else k, m) for k, m in rank.actions if k != "I"), 4,
                             rank.first, rank.last)
        assert rank.others_in_flight() == whole.others_in_flight()
    assert PipelineRank.of_rank_order(tuple(order), 2, 4, 4).in_flight() == 2


def _section(text: str, heading: str) -> str:
    """`text` from the line `heading` to the next heading of its level or above."""
    at = text.index("\n" + heading + "\n")
    ends = [i for i in (text.find("\n## ", at + 1), text.find("\n# ", at + 1)) if i >= 0]
    return text[at:min(ends) if ends else len(text)]


def test_the_docs_table_is_the_benchmarks_current_file():
    """docs/pipeline.md's tables are benchmarks/pipeline.py's output (benchmarks/results/pipeline.md):
    every row's bytes and extra compute are the results file's, row for row, and every row of the
    results file (GPipe, 1F1B, Interleaved, Zero-bubble, ZBV, DualPipeV: the schedules it was run
    with) is shown; under FSDP2 (`--fsdp`: 4 ranks, 2 pipeline x 2 data-parallel), one row a
    pipeline rank, whose two data-parallel ranks' rows in the results file are alike."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "pipeline.md").read_text()
    results = (root / "benchmarks" / "results" / "pipeline.md").read_text()
    fsdp_heading = "## PP x FSDP2: 2 pipeline x 2 data-parallel ranks"
    main = results.replace(_section(results, fsdp_heading), "")
    rows = {(m[0].lower(), m[1]): m[2:] for m in re.findall(
        r"^\| ([\w-]+) \| (\d) \| (\d+) \| \d+ \| (\d+) \| (\d+) \| (\d+) \| \d+ \| \d+ \| ([\d.]+%) \| ([\d.]+%) \|",
        main, re.M)}
    fsdp = {}
    for m in re.findall(r"^\| (gpipe|1f1b|interleaved) \| \d \| (\d) \| (\d+) \| \d+ \| (\d+) \| (\d+) \| (\d+) \| \d+ \| \d+ \| "
                        r"([\d.]+%) \| ([\d.]+%) \|", _section(results, fsdp_heading), re.M):
        assert fsdp.setdefault((m[0], m[1]), m[2:]) == m[2:], m        # a stage's two ranks alike
    row = (r"^\| (GPipe|1F1B|Interleaved|Zero-bubble|ZBV|DualPipeV) \| (\d) \| ([\d,]+) \| ([\d,]+) \| ([\d,]+) \| "
           r"([\d,]+) \| ([\d.]+%) \| ([\d.]+%) \|$")
    for text, want in ((_section(docs, "## Measured"), rows), (_section(docs, "## Under FSDP2 (PP × DP)"), fsdp)):
        shown = re.findall(row, text, re.M)
        assert want and len(shown) == len(want)
        assert {(sched.lower(), rank) for sched, rank, *_ in shown} == want.keys()
        for sched, rank, *numbers in shown:
            assert tuple(n.replace(",", "") for n in numbers) == want[sched.lower(), rank], (sched, rank)


def _llama_config(path, layers: int) -> str:
    import json
    path.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
                                "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": layers,
                                "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 512,
                                "tie_word_embeddings": False}))
    return str(path)


@pytest.mark.slow
@pytest.mark.hf
def test_a_whole_pipeline_job_is_planned_from_one_process(tmp_path, capsys):
    """`remat report --hf-config ... --pipeline 4` (runtime/distributed/pipeline_job.py): a Llama on
    meta in 4 stages under 1F1B, at the uniform policy's largest per-rank peak (no --budget: the
    CLI requires one, the library does not): every stage fits, recomputes no more than every block
    checkpointed on it, and a stage with fewer micro-batches in flight recomputes no more. (The
    local search scores 1,000 plans, not 10,000: the same plans here, 5.6 -> 1.0 CPU s; the CLI
    plans a 2-stage job of one layer a stage, end to end.)"""
    pytest.importorskip("transformers")
    from remat.runtime.cli.main import main
    from remat.runtime.cli.session import hf_config_model
    from remat.runtime.distributed.pipeline_job import plan_job
    model = hf_config_model(_llama_config(tmp_path / "config.json", 8), 1, 128, "bf16").model
    options = PlanOptions(solve=SolveOptions(improve_evals=1000))
    rows, budget, _ = plan_job(model, 4, "1f1b", 8, 1, 128, options=options)
    with pytest.MonkeyPatch.context() as mp:         # the stages in this process (NOTE [ forked workers ])
        mp.setenv("REMAT_WORKERS", "1")
        assert plan_job(model, 4, "1f1b", 8, 1, 128, options=options)[:2] == (rows, budget)
    assert [r.in_flight for r in rows] == [4, 3, 2, 1] and [r.layers for r in rows] == [2, 2, 2, 2]
    assert max(r.uniform_bytes for r in rows) == budget
    for r in rows:
        assert r.planned_bytes is not None and r.planned_bytes <= budget
        assert r.planned_extra_pct <= r.uniform_extra_pct + 1e-9
    middle = [r.planned_extra_pct for r in rows[1:-1]]
    assert middle == sorted(middle, reverse=True)
    capsys.readouterr()
    assert main(["report", "--hf-config", _llama_config(tmp_path / "two.json", 2), "--pipeline", "2",
                 "--microbatches", "4", "--batch", "1", "--seq", "128", "--budget", "80%", "--quiet"]) == 0
    table = capsys.readouterr().out.splitlines()
    head = table.index(next(line for line in table if line.startswith("stage  layers")))
    assert [line.split()[:3] for line in table[head + 1:head + 3]] == [["0", "1", "2"], ["1", "1", "1"]]
    assert all("-" not in line.split()[-3] for line in table[head + 1:head + 3])       # every stage planned
