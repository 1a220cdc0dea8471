"""Solvers: pure functions (CostGraph, budget_bytes, options) -> Solution. No torch here.

NOTE [ ILP ]
The ILP's memory model is the simulator's (NOTE [ liveness ] in simulate.py), to the byte: a plan
fits the ILP's budget exactly when its simulated peak does (tests/test_solver.py checks both this
and, by brute force on random graphs, that the ILP over every region finds the optimum).
[Path] Over the candidate regions X (planner/solve/candidates.py), binary x_X picks regions. They form a path
over the node boundaries 0..n: a region [a..b] goes a -> b+1, continuous y_i in [0, 1] skips node i
(y_i = 1: i is in no region), with one unit of flow in at 0 and out at n, so regions are disjoint.
[Keep] A storage s (b_s bytes, made by p_s; zero-size ones and model outputs, which are kept
whatever the plan and so are in the base liveness, are left out) is *kept*, and stays live in
backward from its release point on (t >= point), for any of these reasons, each with a point:
  a holder h outside every region        point h          active: y_h
  an input of X (read in X, made before) point start(X)   active: x_X (one X per point: they overlap)
  X keeps p_s's outputs (SAC)            point as simulate.keep_release    active: x_X
  a holder that no candidate covers      point h          always (a constant)
Per storage and point q (ascending): z_{s,q} in [0, 1], z_{s,q} >= z_{s,q-1}, z_{s,q} >= every
reason at q; z at its last point says s is kept at all.
[Shelter] Where every holder but p_s reads s:
  z_{s,h} >= 1 - sum_{X contains p_s and h, p_s not saved in X} x_X   for each holder h
(outside every region h holds s; inside a region without p_s, s is that region's input, released
at its start <= h): valid at integer points, and it tightens the LP relaxation a lot.
[Forward] at node t:  Base^f_t + J_t <= B,   Base^f_t = F + e_t + sum_{p_s < t <= last(s)} b_s (+ outputs),
                     J_t = sum_{last(s) < t} b_s k_s            (kept: live to the end of forward)
[Pipeline] a pipeline rank (CostGraph.inflight) adds simulate.pipeline_adds to the lines: each
forward line twice (a R; G + b R) and each backward line twice (c R; G - G_param(t) + d R), with
R = J at the end of forward + the outputs (what each other micro-batch in flight holds).
[State] each chosen region's host RNG state (0 on a device), held as the simulator holds it:
J and K gain it at the region's start and at its lowest saving node (`state_lines`).
[Optimizer] F + all parameter grads + outputs + the optimizer step's temporaries <= B (a
constant: the same under every plan; present when the step planned ends with optimizer.step()).
[Backward] at node t: Base^b_t + K_t + sum_{X contains t} x_X w_X(t) <= B,
                     K_t = sum_s b_s z_{s, last point <= t}
where Base^b_t = F + G_param(t) + G_act(t) + bwd_extra_t (+ outputs) (both bases are
simulate.base_liveness, the one liveness kernel) and w_X(t) is X's recompute working set,
its recomputation's own peak folded in at top(X). J and K are chains of variables (J_t = J_{t-1}
+ what enters at t). With a fixed budget, a constraint that could not bind even if every reason
held is left out. [Objective] min sum x_X cost_X (estimated recompute seconds). For the smallest
feasible budget, B becomes a variable and is minimised first.

The LP relaxation is weak (a fraction of a region drops a fraction of its storages and adds a
fraction of its working set), so CBC proves small graphs optimal by branching and on large ones
mostly finds plans early; each solve ends with local search (planner/solve/improve.py, judged by the
simulator), which also reaches regions a large graph's candidate set leaves out.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import pulp

from remat.planner.solve.baselines import known_plans
from remat.planner.solve.cbc import cbc, cbc_command, constraints_of, variable
from remat.planner.solve.candidates import Candidate, candidates
from remat.planner.costgraph import CostGraph
from remat.planner.solve.improve import Search, evals, improve, search
from remat.planner.solve.nogc import paused
from remat.planner.options import SolveOptions
from remat.planner.result import Region
from remat.planner.solve.simulate import base_liveness, grads_before, last_reader, state_release, timeline

US = 1e6     # the objective is in microseconds: CBC's tolerances suit numbers of that size
MB = 1e-6    # bytes -> MB: keeps CBC's numerics sane
TIE = 1e-3   # least-peak solve: the weight of recompute cost (as a fraction of all) next to the peak
SOLVED = (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible)


@dataclass(frozen=True)
class Solution:
    regions: tuple[Region, ...]
    status: str
    gap: float
    solve_s: float


class BlockSolver(Protocol):
    """A solver for graphs of repeated blocks (planner/solve/hierarchy.py's HierarchicalSolver), which
    planner.solve.fit takes instead of `solve_ilp` and `solve_min_peak` where it has one."""

    def solve(self, cg: CostGraph, budget_bytes: int, opts: SolveOptions | None = None,
              warm_start: tuple[Region, ...] = (), cands=None, ctx=None) -> Solution | None: ...

    def min_peak(self) -> Solution: ...


class Model(NamedTuple):
    """The ILP of NOTE [ ILP ], built by `_model`."""
    prob: pulp.LpProblem
    x: list                   # per candidate: chosen
    y: list                   # per node: in no region
    B: object                 # the budget: a number, or a variable to minimise
    cost: pulp.LpAffineExpression   # estimated recompute, in microseconds


class Lines(NamedTuple):
    """The live-bytes terms of the [Forward] and [Backward] constraints, in MB, by node."""
    fwd_const: list           # difference arrays of the constant terms
    bwd_const: list
    fwd_max: list             # the same if every reason held (a constraint that cannot bind is left out)
    bwd_max: list
    fwd_d: list               # variable terms entering at t (J's chain)
    bwd_d: list               # ... (K's chain)


def keep_reasons(cg: CostGraph, cands: list[Candidate], coverable: list[bool]):
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


def lin(terms, constant: float = 0.0) -> pulp.LpAffineExpression:
    """sum coef * var + constant, built at once (pulp's operators copy the expression each time);
    each variable at most once in `terms`."""
    return pulp.LpAffineExpression(terms, constant)


def _at_most(prob, lhs, rhs) -> None:
    """prob += lhs <= rhs; a constant lhs over a constant budget makes the problem infeasible."""
    if isinstance(lhs, (int, float)) and isinstance(rhs, (int, float)):
        if lhs > rhs:
            prob += variable(prob, f"infeasible{len(constraints_of(prob))}", 0, 0) >= 1
        return
    prob += lhs <= rhs


def path_lines(prob, cands: list[Candidate], n: int):
    """[Path]: the chosen regions are disjoint. Returns x, y, the candidates covering each node
    (with work there), and which nodes any candidate covers."""
    x = [variable(prob, f"x{j}", cat=pulp.LpBinary) for j in range(len(cands))]
    y = [variable(prob, f"y{i}", 0, 1) for i in range(n)]
    starts: list[list[int]] = [[] for _ in range(n + 1)]
    ends: list[list[int]] = [[] for _ in range(n + 1)]
    covering: list[list[int]] = [[] for _ in range(n)]
    coverable = [False] * n
    for j, c in enumerate(cands):
        starts[c.region.start].append(j)
        ends[c.region.end + 1].append(j)
        for i in range(c.region.start, c.region.end + 1):
            coverable[i] = True
            if c.work[i - c.region.start]:
                covering[i].append(j)
    for b in range(n + 1):
        # in - out == 0, with one unit entering at boundary 0 and leaving at n
        terms = [(x[j], 1) for j in ends[b]] + [(x[j], -1) for j in starts[b]]
        terms += ([(y[b - 1], 1)] if b else []) + ([(y[b], -1)] if b < n else [])
        prob += lin(terms, (1 if b == 0 else 0) - (1 if b == n else 0)) == 0
    for i in range(n):
        if not coverable[i]:
            prob += y[i] == 1
    return x, y, covering, coverable


def keep_lines(prob, cg: CostGraph, cands: list[Candidate], x, y, coverable) -> Lines:
    """[Keep] and [Shelter]: the z chains of every storage, as terms of the live-bytes lines."""
    n = len(cg.nodes)
    lines = Lines(*([0.0] * (n + 1) for _ in range(4)), [[] for _ in range(n + 1)], [[] for _ in range(n + 1)])
    shelters = _shelters(cg, cands)
    for sid, (s, r) in enumerate(zip(cg.storages, keep_reasons(cg, cands, coverable))):
        if r is None:
            continue
        mb, last = s.bytes * MB, min(last_reader(s) + 1, n)
        xs, holders, fixed = r
        points = sorted(set(xs) | set(holders))
        if fixed is not None:            # a holder no candidate covers: kept from there on, always
            lines.bwd_const[fixed] += mb
            lines.bwd_max[fixed] += mb
            lines.fwd_const[last] += mb
            lines.fwd_max[last] += mb
        if not points:
            continue
        # z_q: s is kept and not yet released at backward node q (a reason with point <= q holds)
        prev = None
        for q in points:
            z = variable(prob, f"z{sid}_{q}", 0, 1)
            if prev is not None:
                prob += z >= prev
            if q in holders:
                prob += z >= y[q]                           # a holder outside every region
            if q in xs:
                prob += z >= lin([(x[j], 1) for j in xs[q]])  # one region only: they all overlap
            if q in holders and sid in shelters:            # [Shelter]
                prob += z >= lin([(x[j], -1) for j in shelters[sid][q]], 1)
            lines.bwd_d[q].append(mb * z)
            if prev is not None:
                lines.bwd_d[q].append(-mb * prev)
            prev = z
        if fixed is not None:
            lines.bwd_d[fixed].append(-mb * prev)
        else:
            lines.fwd_d[last].append(mb * prev)             # kept at all: live to the end of forward
            lines.fwd_max[last] += mb
        lines.bwd_max[points[0]] += mb
        if fixed is not None:
            lines.bwd_max[fixed] -= mb
    return lines


def state_lines(cg: CostGraph, cands: list[Candidate], x, lines: Lines) -> None:
    """[State] Each chosen region's host RNG state (`CostGraph.region_state_bytes`), live from its
    start to the end of forward and in backward from its lowest saving node on (a candidate
    recomputes something, so one of its nodes saves: simulate.state_release); its
    recomputation's is in its working set. Chosen regions are disjoint: at most one starts, and
    one releases, at a node."""
    mb = cg.region_state_bytes * MB
    if not mb:
        return
    starts, lows = set(), set()
    for j, c in enumerate(cands):
        low = state_release(cg, c.region)
        lines.fwd_d[c.region.start].append(mb * x[j])
        lines.bwd_d[low].append(mb * x[j])
        starts.add(c.region.start)
        lows.add(low)
    for t in starts:
        lines.fwd_max[t] += mb
    for t in lows:
        lines.bwd_max[t] += mb


def budget_lines(prob, cg: CostGraph, cands: list[Candidate], x, covering, lines: Lines, B,
                  fixed_budget: bool) -> None:
    """[Forward] and [Backward]: live bytes at every node, each pass, at most B."""
    n = len(cg.nodes)
    base = base_liveness(cg)
    if base.opt:                          # the optimizer's step: the same under every plan
        _at_most(prob, base.opt * MB, B)
    work_max = [max((cands[j].work[t - cands[j].region.start] for j in covering[t]), default=0) * MB
                for t in range(n)]
    fwd_held, bwd_held = _held(prob, cg, lines)
    fc = bc = fm = bm = 0.0
    Jv = Kv = 0
    for t in range(n):
        fc, bc = fc + lines.fwd_const[t], bc + lines.bwd_const[t]
        fm, bm = fm + lines.fwd_max[t], bm + lines.bwd_max[t]
        if lines.fwd_d[t]:
            J = variable(prob, f"J{t}", 0)
            prob += J == Jv + pulp.lpSum(lines.fwd_d[t])
            Jv = J
        if lines.bwd_d[t]:
            K = variable(prob, f"K{t}", 0)
            prob += K == Kv + pulp.lpSum(lines.bwd_d[t])
            Kv = K
        # a constraint that cannot bind even if every reason held is left out
        for held, most in fwd_held:
            if not fixed_budget or base.fwd[t] * MB + fm + most > B:
                _at_most(prob, base.fwd[t] * MB + fc + Jv + held, B)
        for held, most in bwd_held(t):
            if not fixed_budget or base.bwd[t] * MB + bm + work_max[t] + most > B:
                work = lin([(x[j], cands[j].work[t - cands[j].region.start] * MB) for j in covering[t]],
                            base.bwd[t] * MB + bc)
                _at_most(prob, work + Kv + held if covering[t] or not isinstance(Kv, int) or most
                         else work.constant, B)


def _held(prob, cg: CostGraph, lines: Lines):
    """[Pipeline] What a pipeline rank adds to the forward lines, and to backward node t's
    (simulate.pipeline_adds, with R = the storages kept at all (J at the end of forward) and the
    outputs): (expression, its most) per variant; one (0, 0) each for one step."""
    if not cg.inflight:
        return [(0, 0.0)], lambda t: [(0, 0.0)]
    a, b, c, d = cg.inflight
    out = sum(s.bytes for s in cg.storages if s.output) * MB
    R = variable(prob, "R", 0)
    prob += R == pulp.lpSum([term for terms in lines.fwd_d for term in terms]) + sum(lines.fwd_const) + out
    r_max = sum(lines.fwd_max) + out
    grads = [g * MB for g in grads_before(cg)]
    total = grads[-1] + cg.nodes[-1].param_grad_bytes * MB

    def variants(pairs):
        return [(k * R + const, k * r_max + const) for k, const in pairs if k >= 0]
    fwd = variants([(a, 0.0), (b, total)])
    return fwd, lambda t: variants([(c, 0.0), (d, grads[t])])


def _model(cg: CostGraph, cands: list[Candidate], budget_bytes: int | None) -> Model:
    """Build the ILP (NOTE [ ILP ]). With budget_bytes None, the budget is a variable to minimise."""
    prob = pulp.LpProblem("remat", pulp.LpMinimize)
    B = variable(prob, "B", 0) if budget_bytes is None else budget_bytes * MB
    x, y, covering, coverable = path_lines(prob, cands, len(cg.nodes))
    lines = keep_lines(prob, cg, cands, x, y, coverable)
    state_lines(cg, cands, x, lines)
    budget_lines(prob, cg, cands, x, covering, lines, B, budget_bytes is not None)
    cost = lin([(x[j], c.cost_s * US) for j, c in enumerate(cands)])     # [Objective]
    return Model(prob, x, y, B, cost)


# CBC's options for a short search of a weak LP bound (the least-peak segment ILPs): cut generation
# and the primal heuristics spend most of its time there and change nothing it finds. On the
# least-peak segment ILPs of the built-in gpt2 and the zoo's hf-llama (100 nodes): 6.0 -> 0.95 s
# and 3.1 -> 1.6 s, the same objective to 1e-7; on the other segment ILPs they are needed (an
# hf-llama segment's cheapest plan got 11% dearer without them at the same node limit).
PLAIN_SEARCH = ("cuts off", "heuristics off")


def run_cbc(prob, opts: SolveOptions, warm: bool, max_nodes: int | None = None, extra: tuple[str, ...] = ()):
    nodes = opts.max_nodes if max_nodes is None else max_nodes
    solver = cbc_command(opts.threads, timeLimit=opts.time_limit_s, gapRel=opts.rel_gap,
                         warmStart=warm, options=[f"maxNodes {nodes}", *extra])
    t0 = time.perf_counter()
    cbc(prob, solver)
    return time.perf_counter() - t0, pulp.LpStatus[prob.status], prob.sol_status


def set_start(cands: list[Candidate], x, y, regions) -> None:
    """CBC's initial solution: the candidates of `regions` chosen, the nodes outside them on the path."""
    warm, covered = set(regions), set()
    for c, v in zip(cands, x):
        v.setInitialValue(1 if c.region in warm else 0)
        if c.region in warm:
            covered.update(range(c.region.start, c.region.end + 1))
    for i, v in enumerate(y):
        v.setInitialValue(0 if i in covered else 1)


def chosen_regions(cands, x) -> tuple[Region, ...]:
    return tuple(sorted((c.region for c, v in zip(cands, x) if (v.value() or 0) > 0.5),
                        key=lambda r: r.start))


def _lp_gap(m: Model, objective: float, opts: SolveOptions) -> float:
    """Relative gap of `objective` to the LP relaxation's bound (loose, but proven)."""
    if objective <= 0:
        return 0.0
    for v in m.x:
        v.cat = pulp.LpContinuous
    cbc(m.prob, cbc_command(timeLimit=opts.time_limit_s))
    bound = pulp.value(m.prob.objective) if m.prob.status == pulp.LpStatusOptimal else 0.0
    for v in m.x:
        v.cat = pulp.LpBinary
    return max(0.0, (objective - (bound or 0.0)) / objective)


@paused
def solve_ilp(cg: CostGraph, budget_bytes: int, opts: SolveOptions = SolveOptions(),
              warm_start: tuple[Region, ...] = (), cands: list[Candidate] | None = None,
              ctx: Search | None = None, cbc_options: tuple[str, ...] = ()) -> Solution | None:
    """Least-recompute regions whose simulated peak fits `budget_bytes` (the ILP's memory model is
    the simulator's, up to CBC's tolerance of about a byte per MB), then local search
    (`improve_evals`); None when no plan fits. `cands`, `ctx`: the graph's, when already made;
    `cbc_options`: more of CBC's options (PLAIN_SEARCH's)."""
    ctx = ctx or search(cg, opts.sac)
    cands = candidates(cg, opts, ctx.space) if cands is None else cands
    m = _model(cg, cands, budget_bytes)
    m.prob.setObjective(m.cost)
    set_start(cands, m.x, m.y, warm_start)
    solve_s, status, sol = run_cbc(m.prob, opts, bool(warm_start), extra=cbc_options)
    if sol not in SOLVED:
        return None
    obj = (pulp.value(m.cost) or 0.0) / US
    regions = chosen_regions(cands, m.x)
    label = "optimal" if sol == pulp.LpSolutionOptimal else "feasible (node or time limit)"
    gap = (opts.rel_gap if obj else 0.0) if sol == pulp.LpSolutionOptimal else _lp_gap(m, obj * US, opts)
    t0 = time.perf_counter()
    better = regions
    if opts.improve_evals:
        better = improve(cg, regions, budget_bytes, evals(cg, opts.improve_evals), ctx=ctx)
    solve_s += time.perf_counter() - t0
    if better != regions:
        regions, label = better, label + "; improved by local search"
    return Solution(regions, label, gap, solve_s)


def _key(cg: CostGraph, regions) -> tuple[int, float]:
    tl = timeline(cg, regions)
    return tl.peak_bytes, tl.recompute_s


@paused
def solve_min_peak(cg: CostGraph, opts: SolveOptions = SolveOptions(),
                   cands: list[Candidate] | None = None, ctx: Search | None = None) -> Solution:
    """Regions that minimise the peak (recompute cost breaks ties): CBC for `min_peak_nodes`
    nodes, then local search."""
    ctx = ctx or search(cg, opts.sac)
    cands = candidates(cg, opts, ctx.space) if cands is None else cands
    m = _model(cg, cands, None)
    total = sum(c.cost_s * US for c in cands) or 1.0
    m.prob.setObjective(m.B + TIE * m.cost / total)   # the least peak first; recompute only breaks ties
    solve_s, status, sol = run_cbc(m.prob, opts, False, min(opts.max_nodes, opts.min_peak_nodes))
    if sol not in SOLVED and opts.min_peak_nodes < opts.max_nodes:
        more_s, status, sol = run_cbc(m.prob, opts, False)      # no plan found at the root: branch
        solve_s += more_s
    known = min(known_plans(cg, opts.sac).values(), key=lambda r: _key(cg, r), default=())
    if sol in SOLVED:
        regions = chosen_regions(cands, m.x)
        label = "optimal" if sol == pulp.LpSolutionOptimal else "feasible (node or time limit)"
    else:    # CBC found no plan within its limits (a graph of thousands of nodes): the known plan
        regions = min([known, ()], key=lambda r: _key(cg, r))
        label = f"CBC found none within its limits ({status}): the known plan of least peak"
    t0 = time.perf_counter()
    if opts.improve_evals:
        # local search from CBC's plan and from the hand-made plan of least peak: on large graphs
        # (a partial candidate set) the latter sometimes ends lower
        starts = [regions] + ([known] if known and known != regions else [])
        done = [improve(cg, r, None, evals(cg, opts.improve_evals) // len(starts), ctx=ctx) for r in starts]
        better = min(done, key=lambda r: _key(cg, r))
        if _key(cg, better) < _key(cg, regions):
            regions, label = better, label + "; improved by local search"
    solve_s += time.perf_counter() - t0
    return Solution(regions, label, float("nan"), solve_s)


def ilp_peak_bytes(cg: CostGraph, cands: list[Candidate], regions: tuple[Region, ...]) -> float:
    """The least budget the ILP's memory model admits for exactly `regions` (each one of
    `cands`): the ILP's own view of their peak, to hold against the simulator's (NOTE [ ILP ])."""
    m = _model(cg, cands, None)
    prob = m.prob
    prob.setObjective(m.B + 0)
    chosen = set(regions)
    for c, v in zip(cands, m.x):
        prob += v == int(c.region in chosen)
    cbc(prob, cbc_command())
    return pulp.value(m.B) / MB
