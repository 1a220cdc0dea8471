"""The exact optimum on small graphs, to measure our optimality gap.

The problem our plan is judged on: least estimated recompute seconds among all plans whose
simulated peak (planner.solve.simulate.timeline) times (1 + safety margin) is within the budget, over
the planner's plan space (contiguous regions, each recomputing everything or keeping the outputs
of all its FLOP-counted nodes). Its exact optimum is the planner's ILP over every region
(`candidates` with no cut or span limit; no region starts or ends at a trivial node, which loses
nothing, see planner/solve/candidates.py), solved by CBC to a zero gap with no node limit (300 s at
most) and no local search. The ILP's memory model is the simulator's, not a bound of it (NOTE
[ ILP ] in planner/solve/ilp.py), so its optimum is the problem's; tests/test_solver.py checks the
ILP's peak against the simulator's on random plans, and its optimum against brute force over
every plan on random graphs. As a guard, the reference is the best of the ILP's plan, ours and
the known plans (every block, sqrt, SAC every block) under the same check: should ours or a known
plan ever beat the ILP, `reference` says so and the gap is measured against it.

The objective is seconds; the FLOPs are those of the plan that minimises the seconds. The issue
counts recomputed FLOPs, so `min_flops` also gives the least recomputed FLOPs any plan that fits
reaches (the same ILP, FLOPs as its objective): our planner trades FLOPs for fewer ops and
regions where the estimate says that is faster, so a gap in FLOPs against that optimum is by
design, not a missed plan (`min_flops=True`; slow, so the benchmark leaves it out).
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from remat.planner import CostGraph, Plan, SolveOptions
from remat.planner.solve.baselines import BASELINES
from remat.planner.solve.candidates import candidates
from remat.planner.solve.simulate import timeline
from remat.planner.solve.ilp import solve_ilp

MAX_NODES = 90        # the 2-layer GPT-2 has 85 nodes; its full ILP solves in a few seconds
FLOPS_LIMIT_S = 60.0
EXACT = SolveOptions(max_cuts=10**6, max_span=10**6, time_limit_s=300, rel_gap=0.0, max_nodes=10**9,
                     improve_evals=0)


def fits(cg: CostGraph, regions, budget: int, safety_margin: float) -> bool:
    """The check our plan is held to: simulated peak times (1 + margin), rounded up, within budget."""
    return math.ceil(timeline(cg, regions).peak_bytes * (1.0 + safety_margin)) <= budget


def exact_row(cg: CostGraph, budget: int, ours: Plan, safety_margin: float, min_flops: bool = False) -> dict:
    t0 = time.perf_counter()
    cands = candidates(cg, EXACT)
    target = int(budget / (1.0 + safety_margin))
    for _ in range(4):   # CBC's tolerances are about a byte per MB: re-solve tighter if it shows
        sol = solve_ilp(cg, target, EXACT, cands=cands)
        if sol is None or fits(cg, sol.regions, budget, safety_margin):
            break
        target -= math.ceil(timeline(cg, sol.regions).peak_bytes * (1.0 + safety_margin)) - budget
    solve_s = time.perf_counter() - t0
    mine = timeline(cg, ours.regions)
    row = dict(nodes=len(cg.nodes), candidates=len(cands), solve_s=solve_s,
               ours_flops=mine.recompute_flops, ours_s=mine.recompute_s)
    # the guard: every plan that passes the same check competes with the ILP's
    field = {f"known plan {k}": fn(cg) for k, fn in BASELINES.items() if k != "none"}
    field["ours"] = ours.regions
    if sol is not None:
        field["exact ILP"] = sol.regions
    ok = {k: timeline(cg, r) for k, r in field.items() if fits(cg, r, budget, safety_margin)}
    if sol is None and not ok:
        timed_out = solve_s >= EXACT.time_limit_s
        return row | dict(status="time limit, no solution" if timed_out else "infeasible")
    ref = min(ok, key=lambda k: (ok[k].recompute_s, k != "exact ILP"))
    status = sol.status if sol is not None else "no ILP solution"
    if sol is not None and sol.status != "optimal":
        status += " (not proven optimal)"
    row |= dict(status=status, reference=ref, reference_regions=field[ref], exact_flops=ok[ref].recompute_flops,
                exact_s=ok[ref].recompute_s)
    return row | (least_flops(cg, cands, target, ok.values()) if min_flops else {})


def least_flops(cg: CostGraph, cands, target: int, fitting) -> dict:
    """The least recomputed FLOPs a plan that fits reaches: the same ILP with FLOPs as the
    objective (seconds, at a millionth of the weight, break ties). Many regions then recompute no
    FLOPs at all (SAC keeps every matmul), so CBC rarely proves it within FLOPS_LIMIT_S: the row
    then carries the LP relaxation's gap, a bound on how far from the optimum it may be."""
    by_flops = [replace(c, cost_s=c.flops * 1e-12 + c.cost_s * 1e-6) for c in cands]
    sol = solve_ilp(cg, target, replace(EXACT, time_limit_s=FLOPS_LIMIT_S), cands=by_flops)
    best = min(([timeline(cg, sol.regions).recompute_flops] if sol is not None else [])
               + [t.recompute_flops for t in fitting])
    return dict(min_flops=best, min_flops_status="no solution" if sol is None else sol.status,
                min_flops_gap=float("nan") if sol is None else sol.gap)
