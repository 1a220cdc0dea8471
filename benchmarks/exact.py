"""The exact optimum of the planner's ILP on small graphs, to measure our optimality gap.

Every node boundary is a cut, regions may span the whole graph, CBC runs to a zero gap with no
branch-and-bound node limit (300 s at most). The budget is the one our plan is held to: simulated
peak times (1 + safety margin) within the budget. The ILP's memory model is an upper bound of the
simulator's, so "exact" means optimal among ILP-feasible plans; a known plan (every block, sqrt)
that the simulator admits can beat it, and then the gap is negative. The objective is estimated
recompute seconds; the FLOPs are those of the plan that minimises the seconds.
"""
from __future__ import annotations

import time

from planner import CostGraph, Plan, SolveOptions
from planner.simulate import timeline
from planner.solve import solve_ilp

MAX_NODES = 90        # the 2-layer GPT-2 has 85 nodes; its full ILP solves in about a second
EXACT = SolveOptions(max_cuts=10**6, max_span=10**6, time_limit_s=300, rel_gap=0.0, max_nodes=10**9)


def exact_row(cg: CostGraph, budget: int, ours: Plan, safety_margin: float) -> dict:
    t0 = time.perf_counter()
    sol = solve_ilp(cg, int(budget / (1.0 + safety_margin)), EXACT)
    solve_s = time.perf_counter() - t0
    mine = timeline(cg, ours.regions)
    row = dict(nodes=len(cg.nodes), solve_s=solve_s, ours_flops=mine.recompute_flops, ours_s=mine.recompute_s)
    if sol is None:
        timed_out = solve_s >= EXACT.time_limit_s
        return row | dict(status="time limit, no solution" if timed_out else "infeasible in the ILP")
    best = timeline(cg, sol.regions)
    return row | dict(status=sol.status, exact_flops=best.recompute_flops, exact_s=best.recompute_s)
