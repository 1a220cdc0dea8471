"""The simulator against the exact replay (the rewritten step on fake tensors), on random plans:
the simulated peak, plus the 1% safety margin, never falls below the replayed one."""
import random
from dataclasses import replace

import pytest
from conftest import ilp_peaks_of_random_plans

from remat.planner import solve_plan
from remat.planner.candidates import candidates
from remat.planner.simulate import timeline
from remat.runtime.rewrite import rewrite, rewrite_plan
from remat.runtime.measure import dry_run_peak


def random_plans(cg, n: int, seed: int):
    rng = random.Random(seed)
    cands = candidates(cg)
    for _ in range(n):
        rng.shuffle(cands)
        chosen, taken = [], set()
        for c in cands:
            span = set(range(c.region.start, c.region.end + 1))
            if taken.isdisjoint(span) and rng.random() < 0.3:
                chosen.append(c.region)
                taken |= span
        yield tuple(sorted(chosen, key=lambda r: r.start))


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) for n in ("gpt2", "resnet", "unet")] + ["mlp"])
def test_simulated_peak_bounds_the_exact_replay(case, name):
    c = case(name)
    a, ex = c.analysis, c.example
    skeleton = solve_plan(a.cost_graph, 10**15)
    for regions in random_plans(a.cost_graph, 8, seed=0):
        gm = rewrite(ex.model, a.traced.gm, regions, skeleton.node_names, a.cost_graph.meta)
        replayed = dry_run_peak(gm, a.example_inputs, ex.loss_fn)
        simulated = timeline(a.cost_graph, regions).peak_bytes
        assert simulated * 1.01 >= replayed, f"{regions}: simulated {simulated} < replayed {replayed}"


def test_exact_replay_of_the_unplanned_step_equals_the_profile(case):
    c = case("gpt2")
    a, ex = c.analysis, c.example
    gm = rewrite_plan(ex.model, a.traced.gm, solve_plan(a.cost_graph, 10**15))
    assert dry_run_peak(gm, a.example_inputs, ex.loss_fn) == timeline(a.cost_graph, ()).peak_bytes


@pytest.mark.parametrize("name", ["gpt2", pytest.param("unet", marks=pytest.mark.slow)])
def test_ilp_peak_is_the_simulated_peak(case, name):
    """The ILP's memory model is the simulator's (NOTE [ ILP ]): for fixed regions, the least
    budget it admits is the simulated peak (CBC's tolerances: about a byte per MB)."""
    cg = case(name).analysis.cost_graph
    for regions, ilp_bytes in ilp_peaks_of_random_plans(cg, candidates(cg), seed=1, p=0.3, rounds=6):
        simulated = timeline(cg, regions).peak_bytes
        assert ilp_bytes == pytest.approx(simulated, rel=1e-6), regions
