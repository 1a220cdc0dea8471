"""Solvers: pure functions (CostGraph, budget_bytes, options) -> Solution. No torch here.

NOTE [ ILP ]
The ILP's memory model is the simulator's (NOTE [ liveness ] in simulate.py), to the byte: a plan
fits the ILP's budget exactly when its simulated peak does (tests/test_solver.py checks both this
and, by brute force on random graphs, that the ILP over every region finds the optimum).
Over the candidate regions X (planner/candidates.py), binary x_X picks regions. They form a path
over the node boundaries 0..n: a region [a..b] goes a -> b+1, continuous y_i in [0, 1] skips node i
(y_i = 1: i is in no region), with one unit of flow in at 0 and out at n, so regions are disjoint.
A storage s (b_s bytes, made by p_s; zero-size ones are left out) is *kept*, and stays live in
backward from its release point on (t >= point), for any of these reasons, each with a point:
  a holder h outside every region        point h          active: y_h
  an input of X (read in X, made before) point start(X)   active: x_X (one X per point: they overlap)
  X keeps p_s's outputs (SAC)            point as simulate.keep_release    active: x_X
  a model output                         point 0          always (a constant)
  a holder that no candidate covers      point h          always (a constant)
Per storage and point q (ascending): z_{s,q} in [0, 1], z_{s,q} >= z_{s,q-1}, z_{s,q} >= every
reason at q; z at its last point says s is kept at all. Also, where every holder but p_s reads s:
  z_{s,h} >= 1 - sum_{X contains p_s and h, p_s not saved in X} x_X   for each holder h
(outside every region h holds s; inside a region without p_s, s is that region's input, released
at its start <= h): valid at integer points, and it tightens the LP relaxation a lot.
Forward, at node t:  F + e_t + sum_{p_s < t <= last(s)} b_s + J_t <= B,
                     J_t = sum_{last(s) < t} b_s k_s            (kept: live to the end of forward)
Backward, at node t: Base_t + K_t + sum_{X contains t} x_X w_X(t) <= B,
                     K_t = sum_s b_s z_{s, last point <= t}
where Base_t = F + G_param(t) + G_act(t) + bwd_extra_t and w_X(t) is X's recompute working set,
its recomputation's own peak folded in at top(X). J and K are chains of variables (J_t = J_{t-1}
+ what enters at t). With a fixed budget, a constraint that could not bind even if every reason
held is left out. Objective: min sum x_X cost_X (estimated recompute seconds). For the smallest
feasible budget, B becomes a variable and is minimised first.

The LP relaxation is weak (a fraction of a region drops a fraction of its storages and adds a
fraction of its working set), so CBC proves small graphs optimal by branching and on large ones
mostly finds plans early; each solve ends with local search (planner/improve.py, judged by the
simulator), which also reaches regions a large graph's candidate set leaves out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import pulp

from .baselines import known_plans
from .candidates import Candidate, candidates
from .costgraph import CostGraph
from .errors import SolverError
from .improve import improve
from .result import Region
from .simulate import timeline


_US = 1e6   # the objective is in microseconds: CBC's tolerances suit numbers of that size


@dataclass(frozen=True, kw_only=True)
class SolveOptions:
    time_limit_s: float = 6.0     # wall-clock limit of one CBC solve (a safety net; see max_nodes)
    max_nodes: int = 20_000       # branch-and-bound node limit: unlike time, it stops CBC at the
                                  # same point on every run, so plans are reproducible
    rel_gap: float = 0.02         # stop when the proven relative gap is below this
    max_cuts: int = 64            # cut positions a region may start or end at
    max_span: int = 10            # a region spans at most this many consecutive cuts
    sac: bool = True              # also offer regions that keep their matmul/conv outputs
    threads: int = 1              # CBC threads (1 keeps results deterministic)
    min_peak_nodes: int = 0       # node limit of the least-peak solve: its LP bound is weak, CBC
                                  # finds its plans early and would spend the rest proving them
    improve_evals: int = 10_000   # plans the local search (planner/improve.py) scores after a solve


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


def _reasons(cg: CostGraph, cands: list[Candidate], coverable: list[bool]):
    """Per storage (positive size, not a model output): its keep reasons (NOTE [ ILP ]) as
    {point: [x indices]}, the holders that may be covered, and the first point at which a reason
    always holds (None when none does)."""
    by_point: list[dict[int, list[int]]] = [{} for _ in cg.storages]
    for j, c in enumerate(cands):
        for sid in c.inputs:
            by_point[sid].setdefault(c.region.start, []).append(j)
        for sid, rel in zip(c.caches, c.cache_release):
            by_point[sid].setdefault(rel, []).append(j)
    out = []
    for sid, s in enumerate(cg.storages):
        if s.bytes <= 0 or s.output:
            out.append(None)
            continue
        fixed = min((h for h in s.holders if not coverable[h]), default=None)
        holders = sorted({h for h in s.holders if coverable[h] and (fixed is None or h < fixed)})
        xs = {q: js for q, js in by_point[sid].items() if fixed is None or q < fixed}
        out.append((xs, holders, fixed))
    return out


def _shelters(cg: CostGraph, cands: list[Candidate]) -> dict[int, dict[int, list[int]]]:
    """For storages whose every holder but its producer reads it: storage -> holder h -> the
    regions that contain both h and the producer without keeping the producer's outputs. Unless
    one of those is chosen, h keeps s live from h's backward on: outside every region it holds
    s; inside a region that does not contain p_s, s is that region's input, released at its
    start <= h. A valid inequality of the exact model that tightens its LP relaxation a lot."""
    ok = [all(h == s.producer or h in s.users for h in s.holders) for s in cg.storages]
    out: dict[int, dict[int, list[int]]] = {}
    by_producer: dict[int, list[int]] = {}
    for sid, s in enumerate(cg.storages):
        if ok[sid] and s.bytes > 0 and not s.output and s.holders:
            out[sid] = {h: [] for h in set(s.holders)}
            by_producer.setdefault(s.producer, []).append(sid)
    for j, c in enumerate(cands):
        r = c.region
        saved = set(r.saved)
        for p in range(r.start, r.end + 1):
            if p in saved:
                continue
            for sid in by_producer.get(p, ()):
                for h, js in out[sid].items():
                    if h <= r.end:
                        js.append(j)
    return out


def _lin(terms, constant: float = 0.0) -> pulp.LpAffineExpression:
    """sum coef * var + constant, built at once (pulp's operators copy the expression each time);
    each variable at most once in `terms`."""
    return pulp.LpAffineExpression(terms, constant)


def _at_most(prob, lhs, rhs) -> None:
    """prob += lhs <= rhs; a constant lhs over a constant budget makes the problem infeasible."""
    if isinstance(lhs, (int, float)) and isinstance(rhs, (int, float)):
        if lhs > rhs:
            prob += pulp.LpVariable(f"infeasible{len(prob.constraints)}", 0, 0) >= 1
        return
    prob += lhs <= rhs


def _model(cg: CostGraph, cands: list[Candidate], budget_bytes: int | None):
    """Build the ILP. With budget_bytes None, the budget is a variable to minimise."""
    n = len(cg.nodes)
    prob = pulp.LpProblem("remat", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x{j}", cat="Binary") for j in range(len(cands))]
    scale = 1e-6                                  # bytes -> MB keeps CBC's numerics sane
    B = pulp.LpVariable("B", 0) if budget_bytes is None else budget_bytes * scale
    # regions as a path over node boundaries 0..n: a region [a..b] goes a -> b+1, y_i skips node i
    y = [pulp.LpVariable(f"y{i}", 0, 1) for i in range(n)]
    starts: list[list[int]] = [[] for _ in range(n + 1)]
    ends: list[list[int]] = [[] for _ in range(n + 1)]
    covering: list[list[int]] = [[] for _ in range(n)]
    for j, c in enumerate(cands):
        starts[c.region.start].append(j)
        ends[c.region.end + 1].append(j)
        for i in range(c.region.start, c.region.end + 1):
            if c.work[i - c.region.start]:
                covering[i].append(j)
    for b in range(n + 1):
        # in - out == 0, with one unit entering at boundary 0 and leaving at n
        terms = [(x[j], 1) for j in ends[b]] + [(x[j], -1) for j in starts[b]]
        terms += ([(y[b - 1], 1)] if b else []) + ([(y[b], -1)] if b < n else [])
        prob += _lin(terms, (1 if b == 0 else 0) - (1 if b == n else 0)) == 0
    coverable = [False] * n
    for c in cands:
        for i in range(c.region.start, c.region.end + 1):
            coverable[i] = True
    for i in range(n):
        if not coverable[i]:
            prob += y[i] == 1
    fwd_base, bwd_base = _base(cg)
    fwd_const, bwd_const = [0.0] * (n + 1), [0.0] * (n + 1)   # difference arrays, in MB
    fwd_max, bwd_max = [0.0] * (n + 1), [0.0] * (n + 1)       # the same if every reason held
    fwd_d: list[list] = [[] for _ in range(n + 1)]            # variable terms entering at t
    bwd_d: list[list] = [[] for _ in range(n + 1)]
    shelters = _shelters(cg, cands)
    for sid, (s, r) in enumerate(zip(cg.storages, _reasons(cg, cands, coverable))):
        mb = s.bytes * scale
        last = min(max(s.users, default=s.producer) + 1, n)
        if s.bytes > 0 and s.output:
            for arr in (bwd_const, bwd_max):
                arr[0] += mb
            for arr in (fwd_const, fwd_max):
                arr[last] += mb
            continue
        if r is None:
            continue
        xs, holders, fixed = r
        points = sorted(set(xs) | set(holders))
        if fixed is not None:
            bwd_const[fixed] += mb
            bwd_max[fixed] += mb
            fwd_const[last] += mb
            fwd_max[last] += mb
            if not points:
                continue
        elif not points:
            continue
        # z_q: s is kept and not yet released at backward node q (a reason with point <= q holds)
        prev = None
        for q in points:
            z = pulp.LpVariable(f"z{sid}_{q}", 0, 1)
            if prev is not None:
                prob += z >= prev
            for h in holders:
                if h == q:
                    prob += z >= y[h]                       # a holder outside every region
            if q in xs:
                prob += z >= _lin([(x[j], 1) for j in xs[q]])  # one region only: they all overlap
            if q in holders and sid in shelters:
                prob += z >= _lin([(x[j], -1) for j in shelters[sid][q]], 1)
            bwd_d[q].append(mb * z)
            if prev is not None:
                bwd_d[q].append(-mb * prev)
            prev = z
        if fixed is not None:
            bwd_d[fixed].append(-mb * prev)
        else:
            fwd_d[last].append(mb * prev)             # kept at all: live to the end of forward
            fwd_max[last] += mb
        bwd_max[points[0]] += mb
        if fixed is not None:
            bwd_max[fixed] -= mb
    work_max = [max((cands[j].work[t - cands[j].region.start] for j in covering[t]), default=0) * scale
                for t in range(n)]
    fc = bc = fm = bm = 0.0
    Jv = Kv = 0
    for t in range(n):
        fc, bc, fm, bm = fc + fwd_const[t], bc + bwd_const[t], fm + fwd_max[t], bm + bwd_max[t]
        if fwd_d[t]:
            J = pulp.LpVariable(f"J{t}", 0)
            prob += J == Jv + pulp.lpSum(fwd_d[t])
            Jv = J
        if bwd_d[t]:
            K = pulp.LpVariable(f"K{t}", 0)
            prob += K == Kv + pulp.lpSum(bwd_d[t])
            Kv = K
        # a constraint that cannot bind even if every reason held is left out
        if budget_bytes is None or fwd_base[t] * scale + fm > B:
            _at_most(prob, fwd_base[t] * scale + fc + Jv, B)
        if budget_bytes is None or bwd_base[t] * scale + bm + work_max[t] > B:
            work = _lin([(x[j], cands[j].work[t - cands[j].region.start] * scale) for j in covering[t]],
                        bwd_base[t] * scale + bc)
            _at_most(prob, work + Kv if covering[t] or not isinstance(Kv, int) else work.constant, B)
    cost = _lin([(x[j], c.cost_s * _US) for j, c in enumerate(cands)])
    return prob, x, B, cost, y


def _run(prob, opts: SolveOptions, warm: bool, max_nodes: int | None = None):
    nodes = opts.max_nodes if max_nodes is None else max_nodes
    solver = pulp.PULP_CBC_CMD(msg=False, timeLimit=opts.time_limit_s, gapRel=opts.rel_gap,
                               threads=opts.threads, warmStart=warm, options=[f"maxNodes {nodes}"])
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
    """Least-recompute regions whose simulated peak fits `budget_bytes` (the ILP's memory model is
    the simulator's, up to CBC's tolerance of about a byte per MB), then local search
    (`improve_evals`); None when no plan fits."""
    cands = candidates(cg, opts.max_cuts, opts.max_span, opts.sac) if cands is None else cands
    prob, x, _, cost, y = _model(cg, cands, budget_bytes)
    prob += cost
    warm = set(warm_start)
    covered = set()
    for c, v in zip(cands, x):
        v.setInitialValue(1 if c.region in warm else 0)
        if c.region in warm:
            covered.update(range(c.region.start, c.region.end + 1))
    for i, v in enumerate(y):
        v.setInitialValue(0 if i in covered else 1)
    solve_s, status, sol = _run(prob, opts, bool(warm))
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        return None
    obj = (pulp.value(cost) or 0.0) / _US
    regions = _chosen(cands, x)
    label = "optimal" if sol == pulp.LpSolutionOptimal else "feasible (node or time limit)"
    gap = (opts.rel_gap if obj else 0.0) if sol == pulp.LpSolutionOptimal else _lp_gap(prob, x, obj * _US)
    t0 = time.perf_counter()
    better = improve(cg, regions, budget_bytes, opts.improve_evals, sac=opts.sac) if opts.improve_evals else regions
    solve_s += time.perf_counter() - t0
    if better != regions:
        regions, obj = better, timeline(cg, better).recompute_s
        label += "; improved by local search"
    return Solution(regions, label, gap, solve_s, obj)


def solve_min_peak(cg: CostGraph, opts: SolveOptions = SolveOptions(),
                   cands: list[Candidate] | None = None) -> Solution:
    """Regions that minimise the peak (recompute cost breaks ties): CBC for `min_peak_nodes`
    nodes, then local search."""
    cands = candidates(cg, opts.max_cuts, opts.max_span, opts.sac) if cands is None else cands
    prob, x, B, cost, y = _model(cg, cands, None)
    total = sum(c.cost_s * _US for c in cands) or 1.0
    prob += B + 1e-3 * cost / total        # the least peak first; recompute only breaks ties
    solve_s, status, sol = _run(prob, opts, False, min(opts.max_nodes, opts.min_peak_nodes))
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible) and opts.min_peak_nodes < opts.max_nodes:
        more_s, status, sol = _run(prob, opts, False)      # no plan found at the root: branch
        solve_s += more_s
    if sol not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        raise SolverError(status, "while minimising the peak")
    label = "optimal" if sol == pulp.LpSolutionOptimal else "feasible (node or time limit)"
    regions = _chosen(cands, x)
    t0 = time.perf_counter()
    if opts.improve_evals:
        # local search from CBC's plan and from the hand-made plan of least peak: on large graphs
        # (a partial candidate set) the latter sometimes ends lower
        known = min(known_plans(cg, opts.sac).values(), key=lambda r: timeline(cg, r).peak_bytes, default=())
        starts = [regions] + ([known] if known and known != regions else [])
        done = [improve(cg, r, None, opts.improve_evals // len(starts), sac=opts.sac) for r in starts]
        better = min(done, key=lambda r: (timeline(cg, r).peak_bytes, timeline(cg, r).recompute_s))
        if (timeline(cg, better).peak_bytes, timeline(cg, better).recompute_s) < \
                (timeline(cg, regions).peak_bytes, timeline(cg, regions).recompute_s):
            regions, label = better, label + "; improved by local search"
    solve_s += time.perf_counter() - t0
    return Solution(regions, label, float("nan"), solve_s, timeline(cg, regions).recompute_s)
