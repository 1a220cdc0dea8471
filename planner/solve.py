"""Solvers: pure functions (CostGraph, budget_bytes, options) -> Solution. No torch here.

NOTE [ ILP ]
Over the candidate regions X (planner/candidates.py), binary x_X picks regions; continuous
k_s in [0, 1] says storage s is kept for backward. With b_s its bytes and p_s its producer:
  sum_{X contains i} x_X <= 1                           regions are disjoint, for every node i
  k_s >= 1 - sum_{X drops s} x_X                        s has holders: kept unless a region drops it
  k_s >= x_X                  for X caching s           SAC keeps outputs of a region's saved nodes
  k_s >= sum_{X contains u, not p_s} x_X   for readers u     checkpoint keeps a region's inputs
  k_s = 1                     for model outputs
Forward, at node t:  F + e_t + sum_{p_s < t <= last(s)} b_s + J_t <= B,
                     J_t = sum_{last(s) < t} b_s k_s            (kept past their last reader)
Backward, at node t: Base_t + K_t + sum_{X contains t} x_X w_X(t) <= B,
                     K_t = sum_{rl(s) <= t} b_s k_s,  rl(s) = min(holders, p_s + 1)
where Base_t = F + G_param(t) + G_act(t) + bwd_extra_t and w_X(t) is X's recompute working set
(NOTE [ liveness ] in simulate.py). rl(s) is no later than the simulator's release, so the ILP's
peak is an upper bound of the simulated one: any ILP-feasible plan simulates within budget.
Objective: min sum x_X cost_X (estimated recompute seconds). For the smallest feasible budget,
B becomes a variable and is minimised first.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

from .candidates import Candidate, candidates
from .costgraph import CostGraph
from .errors import SolverError
from .result import Region


_US = 1e6   # the objective is in microseconds: CBC's tolerances suit numbers of that size


@dataclass(frozen=True, kw_only=True)
class SolveOptions:
    time_limit_s: float = 10.0    # wall-clock limit of one CBC solve (a safety net; see max_nodes)
    max_nodes: int = 20_000       # branch-and-bound node limit: unlike time, it stops CBC at the
                                  # same point on every run, so plans are reproducible
    rel_gap: float = 0.02         # stop when the proven relative gap is below this
    max_cuts: int = 64            # cut positions a region may start or end at
    max_span: int = 10            # a region spans at most this many consecutive cuts
    sac: bool = True              # also offer regions that keep their matmul/conv outputs
    threads: int = 1              # CBC threads (1 keeps results deterministic)


@dataclass(frozen=True)
class Solution:
    regions: tuple[Region, ...]
    status: str
    gap: float
    solve_s: float
    objective_s: float


def _base(cg: CostGraph) -> tuple[list[int], list[int]]:
    """Plan-independent parts of the forward and backward live bytes (everything but K, J, W)."""
    n = len(cg.nodes)
    fwd_d, bwd_d = [0] * (n + 1), [0] * (n + 1)
    for s in cg.storages:
        last = max(s.users, default=s.producer)
        if last > s.producer:
            fwd_d[s.producer + 1] += s.bytes
            fwd_d[last + 1] -= s.bytes
    for i, c in enumerate(cg.nodes):
        bwd_d[i] += c.grad_bytes
        bwd_d[c.grad_last_user + 1] -= c.grad_bytes
        bwd_d[0] += c.param_grad_bytes
        bwd_d[i + 1] -= c.param_grad_bytes
    fwd, bwd, a, b = [], [], 0, 0
    for t in range(n):
        a, b = a + fwd_d[t], b + bwd_d[t]
        fwd.append(cg.fixed_bytes + a + cg.nodes[t].fwd_extra_bytes)
        bwd.append(cg.fixed_bytes + b + cg.nodes[t].bwd_extra_bytes)
    return fwd, bwd


def _model(cg: CostGraph, cands: list[Candidate], budget_bytes: int | None):
    """Build the ILP. With budget_bytes None, the budget is a variable to minimise."""
    n = len(cg.nodes)
    prob = pulp.LpProblem("remat", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x{j}", cat="Binary") for j in range(len(cands))]
    k = [pulp.LpVariable(f"k{s}", 0, 1) for s in range(len(cg.storages))]
    scale = 1e-6                                  # bytes -> MB keeps CBC's numerics sane
    B = pulp.LpVariable("B", 0) if budget_bytes is None else budget_bytes * scale
    covering: list[list[int]] = [[] for _ in range(n)]
    drops: dict[int, list[int]] = {}
    for j, c in enumerate(cands):
        for i in range(c.region.start, c.region.end + 1):
            covering[i].append(j)
        for sid in c.drops:
            drops.setdefault(sid, []).append(j)
        for sid in c.caches:
            prob += k[sid] >= x[j]
    for i in range(n):
        if len(covering[i]) > 1:
            prob += pulp.lpSum(x[j] for j in covering[i]) <= 1
    fwd_base, bwd_base = _base(cg)
    j_terms: list[list] = [[] for _ in range(n + 1)]
    k_terms: list[list] = [[] for _ in range(n)]
    for sid, s in enumerate(cg.storages):
        if s.output:
            prob += k[sid] == 1
        elif s.holders:
            prob += k[sid] >= 1 - pulp.lpSum(x[j] for j in drops.get(sid, []))
        for u in set(s.users):
            inputs_of = [j for j in covering[u] if s.producer not in cands[j].region]
            if inputs_of:
                prob += k[sid] >= pulp.lpSum(x[j] for j in inputs_of)
        last = max(s.users, default=s.producer)
        j_terms[min(last + 1, n)].append(s.bytes * scale * k[sid])
        rl = 0 if s.output else min(list(s.holders) + [s.producer + 1])
        k_terms[min(rl, n - 1)].append(s.bytes * scale * k[sid])
    J = K = 0
    for t in range(n):
        J = J + pulp.lpSum(j_terms[t])
        K = K + pulp.lpSum(k_terms[t])
        prob += fwd_base[t] * scale + J <= B
        work = pulp.lpSum(cands[j].work[t - cands[j].region.start] * scale * x[j] for j in covering[t])
        prob += bwd_base[t] * scale + K + work <= B
    cost = pulp.lpSum(c.cost_s * _US * x[j] for j, c in enumerate(cands))
    return prob, x, B, cost


def _run(prob, opts: SolveOptions, warm: bool):
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=opts.time_limit_s, gapRel=opts.rel_gap,
                               threads=opts.threads, warmStart=warm, options=[f"maxNodes {opts.max_nodes}"])
    t0 = time.perf_counter()
    prob.solve(solver)
    return time.perf_counter() - t0, pulp.LpStatus[prob.status], prob.sol_status


def _chosen(cands, x) -> tuple[Region, ...]:
    return tuple(sorted((c.region for c, v in zip(cands, x) if (v.value() or 0) > 0.5),
                        key=lambda r: r.start))


def _lp_gap(prob, x, objective: float) -> float:
    """Relative gap of `objective` to the LP relaxation's bound (loose, but proven)."""
    if objective <= 0:
        return 0.0
    for v in x:
        v.cat = pulp.LpContinuous
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=10))
    bound = pulp.value(prob.objective) if prob.status == pulp.LpStatusOptimal else 0.0
    for v in x:
        v.cat = pulp.LpBinary
    return max(0.0, (objective - (bound or 0.0)) / objective)


def solve_ilp(cg: CostGraph, budget_bytes: int, opts: SolveOptions = SolveOptions(),
              warm_start: tuple[Region, ...] = (), cands: list[Candidate] | None = None) -> Solution | None:
    """Least-recompute regions whose ILP peak fits `budget_bytes`; None when none does."""
    cands = candidates(cg, opts.max_cuts, opts.max_span, opts.sac) if cands is None else cands
    prob, x, _, cost = _model(cg, cands, budget_bytes)
    prob += cost
    warm = set(warm_start)
    for c, v in zip(cands, x):
        v.setInitialValue(1 if c.region in warm else 0)
    solve_s, status, sol = _run(prob, opts, bool(warm))
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    obj = (pulp.value(cost) or 0.0) / _US
    regions = _chosen(cands, x)
    if sol == pulp.LpSolutionOptimal:
        return Solution(regions, "optimal", opts.rel_gap if obj else 0.0, solve_s, obj)
    return Solution(regions, "feasible (node or time limit)", _lp_gap(prob, x, obj * _US), solve_s, obj)


def solve_min_peak(cg: CostGraph, opts: SolveOptions = SolveOptions(),
                   cands: list[Candidate] | None = None) -> Solution:
    """Regions that minimise the ILP peak (recompute cost breaks ties)."""
    cands = candidates(cg, opts.max_cuts, opts.max_span, opts.sac) if cands is None else cands
    prob, x, B, cost = _model(cg, cands, None)
    total = sum(c.cost_s * _US for c in cands) or 1.0
    prob += B + 1e-3 * cost / total        # the least peak first; recompute only breaks ties
    solve_s, status, sol = _run(prob, opts, False)
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise SolverError(status, "while minimising the peak")
    label = "optimal" if sol == pulp.LpSolutionOptimal else "feasible (node or time limit)"
    return Solution(_chosen(cands, x), label, float("nan"), solve_s, (pulp.value(cost) or 0.0) / _US)
