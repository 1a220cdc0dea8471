"""The chain: one option per segment, picked by a DP over the bytes kept so far (pure: no torch;
planner/solve/hierarchy.py's step 4).

NOTE [ chain ]): with regions inside segments, the step's live bytes at node t of
   segment i are base(t) + sum_{j<i} K_j + d_i(t), where d_i is what segment i's own plan adds at t.
   A DP over the segments (`chain_dp`), its state the bytes kept so far, picks one option per
   segment at the least recompute with sum_{j<i} K_j + M_i within the budget at every segment
   (M_i: the most of base + d_i over segment i's nodes). Its choice then refines the fronts where
   it lies (REFINE_SOLVES more segment searches per budget, WIDTH at once: the same K at a lower
   peak for the options picked, gaps next to them), and the DP runs again.
5. *The judge.* The chained plan is replayed by `simulate.timeline`; where the chain's prediction
   missed (the decomposition is exact only under NOTE [ chain ]'s conditions) the DP runs again at a
   budget corrected by the miss. On graphs small enough (POLISH_CANDIDATES), the flat ILP then
   polishes it over a compact candidate set (every option's regions on every block of its family,
   regions across block boundaries, the flat path's own candidates), warm-started from it; last,
   the same local search (planner/solve/improve.py) as after the flat ILP.

`for_graph` returns a solver only for graphs too large for the exact flat ILP that have repeated
blocks; `planner.solve.fit.solve_plan` takes the flat path otherwise.

NOTE [ chain ]
Nodes fall into segments S_0 < S_1 < ... (node ranges). A plan whose regions each lie inside one
segment is a choice P_i per segment. Backward at node t (simulate NOTE [ liveness ]) holds the
plan-independent base (simulate.base_liveness), the kept storages released at points <= t, and
t's region's working set. Attribute each kept storage to the segment of its release point: the
kept storages released at or below t are those of the segments before t's (K_j, j < i) and those of
t's own segment released at or below t. The segment's CostGraph has the storages that touch it,
readers, holders and writers after it mapped to the sink (a storage the next block holds is
released there, not in this segment) and storages made before it made by the source; a storage made
before the segment that a node before it holds, or that an earlier segment (other than the
producer's) reads too, is an output there: an earlier segment decides whether it is kept (a mask or
rotary table every block reads is counted by the first block that reads it). The segment graph's
timeline less its own base is d_i(t), exactly, when each storage's reasons to be kept lie in one
segment: the residual stream between blocks (made by block i's last add, read and held by block
i + 1) does. Forward at t holds the storages kept by earlier segments whose last reader is before t:
K_j counts every storage released in S_j, which is never less. Where reasons lie in two segments
(block i's last node SAC-kept while block i + 1 reads its output in a region; a shared table kept
only by a later block) the chain is off by those storages' bytes, one way or the other; the
simulator's correction (step 5) takes care of it.
"""
from __future__ import annotations

import heapq
import math
from bisect import bisect_right

from remat.planner.solve.segment import Option

DP_STATES = 3000     # states the chain DP keeps per segment (beyond that, the cheapest per bucket of bytes)


def chain_dp(options: list[list[Option]], budget: int, cap: int | None = None) -> tuple[float, list[int]] | None:
    """One option per segment, least total cost, with every segment's kept-so-far + M within
    `budget` (NOTE [ chain ]) and, with `cap`, all segments' K within it: (cost, option index per
    segment), or None when none fits. The states per segment are the Pareto front of (bytes kept
    so far, cost): NOTE [ chain merge ]."""
    states = [(0, 0.0, -1, -1)]          # (kept so far, cost, previous state, option), kept ascending
    trail = []
    for opts in options:
        front = _next_front(states, opts, budget)
        if cap is not None:              # kept so far only grows: a state over the cap stays over
            front = front[:bisect_right([e[0] for e in front], cap)]
        if not front:
            return None
        if len(front) > DP_STATES:       # the cheapest per bucket of kept bytes
            lo, hi = front[0][0], front[-1][0]
            width = max(1, (hi - lo) // DP_STATES + 1)
            buckets: dict[int, tuple] = {}
            for e in front:
                b = (e[0] - lo) // width
                if b not in buckets or e[1] < buckets[b][1]:
                    buckets[b] = e
            front = sorted(buckets.values())
        trail.append(front)
        states = front
    i = min(range(len(states)), key=lambda j: states[j][1])
    cost, choice = states[i][1], []
    for front in reversed(trail):
        _, _, i, oi = front[i]
        choice.append(oi)
    return cost, choice[::-1]


# NOTE [ chain merge ]
# A segment's next states are the Pareto front of every (state, option) pair that fits: (kept +
# option's kept, cost + option's cost), in the order of (kept, cost, state, option), each kept only
# when it costs less (by 1e-15) than the last one kept. Per option, the pairs are a run over a prefix
# of the states (those the option fits after: kept ascending), kept ascending and cost descending.
# The runs are merged by a heap in that same order, and a run skips (bisection on the states'
# costs, then an exact check either way: a float sum is monotone) the pairs that cost no less than
# the last one kept, which the front would drop anyway: the same front as sorting all the pairs,
# from a fifth of them (a Llama-2-7B's 34 segments, 51 options each: 6.0 M pairs in a budget's 8
# calls, 1.3 M popped; 5.2 -> 1.2 s).
def _next_front(states: list[tuple], opts: list[Option], budget: int) -> list[tuple]:
    ks = [s[0] for s in states]
    neg = [-s[1] for s in states]        # ascending: costs descend along the states
    heap = []
    for oi, o in enumerate(opts):
        fit = bisect_right(ks, budget - o.peak)
        if fit:
            heap.append((states[0][0] + o.kept, states[0][1] + o.cost_s, 0, oi, fit, o.kept, o.cost_s))
    heapq.heapify(heap)
    front, best = [], math.inf
    while heap:
        kept, cost, si, oi, fit, ko, co = heap[0]
        if cost < best - 1e-15:
            front.append((kept, cost, si, oi))
            best = cost
            si += 1
        if si < fit:                     # the first state left whose pair costs less than `best`
            j = bisect_right(neg, co - best + 1e-15, si, fit)
            while j > si and states[j - 1][1] + co < best - 1e-15:
                j -= 1
            while j < fit and not states[j][1] + co < best - 1e-15:
                j += 1
            si = j
        if si < fit:
            heapq.heapreplace(heap, (states[si][0] + ko, states[si][1] + co, si, oi, fit, ko, co))
        else:
            heapq.heappop(heap)
    return front


def least_kept(options: list[list[Option]], level: int) -> int | None:
    """The least bytes a chain keeps with every segment's peak (its kept-so-far + M) within
    `level`; None where none fits. Less kept so far is never worse, so one state per segment
    suffices (a greedy pass)."""
    kept = 0
    for opts in options:
        ks = [kept + o.kept for o in opts if kept + o.peak <= level]
        if not ks:
            return None
        kept = min(ks)
    return kept


def chain_min_peak(options: list[list[Option]]) -> int:
    """The least budget the chain DP meets: bisection, each budget checked by feasibility alone
    (`least_kept`)."""
    def feasible(budget: int) -> bool:
        return least_kept(options, budget) is not None

    lo = max(min(o.peak for o in opts) for opts in options)
    hi = lo
    while not feasible(hi):
        hi = 2 * hi + 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# NOTE [ pipeline chain ]
# A pipeline rank (CostGraph.inflight) holds what each other micro-batch in flight retains, R =
# its outputs plus every storage a plan keeps: the chain's K summed over the segments, plus the
# outputs. simulate.one_microbatch puts what the others add at a reference R0 in each node's held
# bytes and gives k, the most they add per byte of R above it: a plan fits when its chain peak P
# (on that graph) plus k max(0, K + outputs - R0) does. Under 1F1B (the four counts equal) each
# add is linear in R and R0 = 0: exact. Else R0 is what every block checkpointed retains (budgets
# lie near the per-block policy's peak), exact at R0 and cautious away from it (the judge,
# hierarchy step 5, corrects): the 70B job's stage graphs given GPipe's counts for 4 micro-batches,
# at the per-block policy's largest peak: the last stage at 67.5% extra compute, 70.3% with R0 = 0
# (no chain fit: every block's plan), the flat ILP 68.7% (the others alike or cheaper). The DP's state knows the K so far, not
# the whole K, so the chain is solved at levels b of P: at b, with every K at most (budget - b) /
# k - outputs + R0 (`chain_dp`'s cap). The levels: PIPELINE_LEVELS evenly from the least chain
# peak to the highest a K can leave room for, and the level of the least total peak
# (`least_total`: a plan wherever one fits); then the best level's cap lowered to the K its plan
# keeps, its level raised by as much (that plan still fits: never dearer), while that finds a
# cheaper plan. On the 70B job's 8 stages (benchmarks/pipeline.py --job) 24 levels planned within
# half a point of 8's extra compute (one stage dearer, two cheaper) at 0.9 CPU s more in all; 3
# levels up to 3.1 points dearer.
PIPELINE_LEVELS = 8
PIPELINE_RAISES = 4


def pipeline_dp(options: list[list[Option]], budget: int, k: int, fixed: int) -> tuple[float, list[int]] | None:
    """chain_dp for a pipeline rank (NOTE [ pipeline chain ]): every segment's kept-so-far + M plus
    k max(0, the whole K + `fixed`) within `budget`."""
    least = least_total(options, k, fixed)
    if least[0] > budget:
        return None

    def at(level: int):
        cap = (budget - level) // k - fixed
        return chain_dp(options, level, cap) if cap >= 0 and level <= budget else None

    lo = chain_min_peak(options)
    hi = budget - k * max(0, sum(min(o.kept for o in opts) for opts in options) + fixed)
    levels = {least[1]} | {lo + (hi - lo) * j // (PIPELINE_LEVELS - 1) for j in range(PIPELINE_LEVELS) if hi > lo}
    tried = [(got, level) for level in sorted(levels) if (got := at(level)) is not None]
    if not tried:                        # the least-total plan lost to the DP's buckets (DP_STATES)
        return None
    best, level = min(tried, key=lambda g: g[0][0])
    for _ in range(PIPELINE_RAISES):
        kept = sum(opts[oi].kept for opts, oi in zip(options, best[1]))
        up = budget - k * max(0, kept + fixed)
        got = at(up) if up > level else None
        if got is None or got[0] >= best[0]:
            break
        best, level = got, up
    return best


def least_total(options: list[list[Option]], k: int, fixed: int) -> tuple[int, int]:
    """(the least P + k max(0, K + fixed) a chain reaches, the level of P it is reached at): NOTE
    [ pipeline chain ]. The least K within a level (one state per segment: less kept so far is
    never worse) falls as the level rises; the total is least where it has just fallen, so the
    levels are walked from the least chain peak, each time up to the next one that keeps less
    (bisection), while a level can still beat the best found."""
    def kept_at(level: int) -> int | None:
        return least_kept(options, level)

    floor = k * max(0, sum(min(o.kept for o in opts) for opts in options) + fixed)
    level = chain_min_peak(options)
    kept = kept_at(level)
    best = (level + k * max(0, kept + fixed), level)
    while level + floor < best[0]:
        lo, hi = level + 1, best[0] - floor
        if kept_at(hi) >= kept:
            break
        while lo < hi:
            mid = (lo + hi) // 2
            if kept_at(mid) < kept:
                hi = mid
            else:
                lo = mid + 1
        level, kept = lo, kept_at(lo)
        best = min(best, (level + k * max(0, kept + fixed), level))
    return best
