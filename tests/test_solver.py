"""The solver layer on hand-built CostGraphs with known optima (no torch)."""
import math

import pytest

from planner import CostGraph, InfeasibleBudgetError, Plan, PlanOptions, Region, SolveOptions, solve_plan
from planner.costgraph import NodeCost, StorageCost
from planner.simulate import timeline
from planner.solve import solve_ilp

MB = 10**6


def node(name, flops=0, recomputable=True, grad_last=None, i=0):
    return NodeCost(name=name, target=name, module=f"blocks.{i}", flops=flops, cost_s=flops * 1e-9 + 1e-6,
                    fwd_extra_bytes=0, bwd_extra_bytes=0, grad_bytes=0, grad_last_user=i if grad_last is None else grad_last,
                    param_grad_bytes=0, recomputable=recomputable, why_not="" if recomputable else "loss")


def chain(n: int, act_mb: list[int], flops: list[int]) -> CostGraph:
    """n nodes in a chain, node i makes one activation of act_mb[i] MB that node i+1 saves;
    a final loss node."""
    nodes = [node(f"n{i}", flops[i], i=i) for i in range(n)] + [node("loss", recomputable=False, i=n)]
    storages = [StorageCost(act_mb[i] * MB, i, (i + 1,), (i + 1,)) for i in range(n)]
    return CostGraph(nodes=tuple(nodes), storages=tuple(storages), fixed_bytes=10 * MB, param_bytes=0)


def test_simulator_by_hand():
    cg = chain(3, [4, 2, 1], [10, 10, 10])
    # no plan: after forward all three activations are kept: 10 + 7 MB
    assert timeline(cg, ()).peak_bytes == 17 * MB
    # checkpoint nodes 0..1: storage 0 (held by node 1, inside) is dropped; storage 1 (held by
    # node 2, outside) is kept until node 2's backward. Forward peak: node 1 runs while storage 0
    # is live: 14. Backward of the region: storage 0 recomputed (4), storage 1 released: 14.
    # After forward only 2 + 1 MB are kept: the peak moved from 17 to 14.
    tl = timeline(cg, (Region(0, 1),))
    assert tl.fwd == (10 * MB, 14 * MB, 12 * MB, 13 * MB)
    assert tl.bwd == (10 * MB, 14 * MB, 12 * MB, 13 * MB)
    assert tl.recompute_flops == 20    # nodes up to the region's last holder (conservative)


def test_ilp_picks_the_cheap_region():
    # dropping activation 0 (8 MB) needs region {0,1}: recompute node 0 (cheap, 1 flop);
    # dropping activation 2 (8 MB) needs region {2,3}: recompute node 2 (expensive)
    cg = chain(4, [8, 1, 8, 1], [1, 1, 1000, 1])
    assert timeline(cg, ()).peak_bytes == 28 * MB
    sol = solve_ilp(cg, 21 * MB, SolveOptions(max_span=4))
    assert sol.regions == (Region(0, 1),)
    assert timeline(cg, sol.regions).peak_bytes <= 21 * MB
    assert timeline(cg, sol.regions).recompute_flops == 2     # nodes 0 and 1, never node 2


def test_ilp_none_when_impossible():
    cg = chain(2, [8, 8], [1, 1])
    assert solve_ilp(cg, 11 * MB, SolveOptions()) is None


def test_solve_plan_infeasible_error_carries_smallest_budget():
    cg = chain(4, [8, 1, 8, 1], [1, 1, 1000, 1])
    with pytest.raises(InfeasibleBudgetError) as e:
        solve_plan(cg, 11 * MB)
    assert e.value.budget_bytes == 11 * MB
    assert e.value.min_feasible_bytes > 11 * MB
    assert f"at least {e.value.min_feasible_bytes / 1e9:.4g} GB" in str(e.value)
    # and that smallest budget is indeed feasible
    p = solve_plan(cg, e.value.min_feasible_bytes)
    assert p.predicted_peak_bytes <= e.value.min_feasible_bytes


def test_no_regions_when_budget_covers_unplanned_peak():
    cg = chain(3, [4, 2, 1], [10, 10, 10])
    p = solve_plan(cg, 100 * MB)
    assert p.regions == () and p.solver == "none" and p.recompute_flops == 0
    assert p.predicted_peak_bytes == math.ceil(17 * MB * 1.01)


def test_plan_never_predicted_over_budget():
    cg = chain(6, [5, 3, 5, 3, 5, 3], [1, 2, 3, 4, 5, 6])
    unplanned = timeline(cg, ()).peak_bytes
    for frac in (0.6, 0.7, 0.8, 0.9):
        budget = int(unplanned * frac)
        try:
            p = solve_plan(cg, budget, PlanOptions(solve=SolveOptions(time_limit_s=5)))
        except InfeasibleBudgetError:
            continue
        assert p.predicted_peak_bytes <= budget


def test_costgraph_and_plan_json_round_trip():
    cg = chain(4, [8, 1, 8, 1], [1, 1, 1000, 1])
    assert CostGraph.from_json(cg.to_json()) == cg
    p = solve_plan(cg, 21 * MB)
    assert Plan.from_json(p.to_json()) == p
