"""The cheapest plan of a segment keeping at most a level of K and peaking at most a cap, and the plan
of least peak, by dynamic programming over its node boundaries (pure: no torch, no solver;
planner/solve/hierarchy.py's lower-peak and least-peak searches take them instead of the segment ILP
with a bound on its peak).

NOTE [ lower DP ]
The DP of NOTE [ front DP ] (planner/solve/front.py) with the simulator's peak (planner/solve/simulate.py,
NOTE [ liveness ]) checked at every node as the path passes it. A storage is *kept* by its
reasons (a holder skipped, a chosen region that reads it or caches it, a holder no region covers)
and released after the backward of the first of them. Along a path, every node's live bytes are
those of the steps so far plus one sum of the path, A: the bytes of the storages some reason kept
before the step. In backward, at node t of a step, the kept storages are those with a reason at or
before t: A, plus what the step itself keeps by t. In forward, a kept storage is live after its
last reader; every reason for it lies at or before that reader (a reader is what holds it, or
what a region takes it as an input of), so at t it is decided. The state is the set of storages
kept whose reasons are not all past (a later one must not count them twice) or that are still
read (forward still has them to count); a storage held by a node no region covers is kept on
every path, so only its release waits on the path. Two paths into one state differ by their K and
A only, and A less K is the state's: the path keeping less has every later node's live bytes no
higher, so keeping each state's Pareto set of (K, recompute) loses no plan that fits the cap. A
step passes when the most of its nodes' live bytes, A plus what depends on the state alone, is
within the cap; paths past the level of K are dropped at once (K only grows). What the ILP would
answer (its optimum, without its node limit) is the cheapest point at the last boundary. Of plans
that tie in K and recompute, the one covering the fewest nodes is kept (the first found, as the
front DP keeps, took the longer region over free nodes where the ILP had taken the shorter one,
and the chain polished from it planned up to 55x dearer on a generated chain).
The least peak within a level (`least_peak_under`) is the same DP with the peak so far in place of
the recompute: of two paths into one state, the one keeping no more at a peak no higher has every
later peak no higher. The cheapest plan within that peak is then `cheapest_under`'s.
Across states (`undominated`): a path in state S1 beats one in S2 when, with D the storages of S2
not in S1, its K plus D's counted bytes is no more, its A plus D's bytes is no more, and its
recompute (or peak) is no more, K or recompute strictly less. Every later step keeps at most D
more from S1 than from S2 (a storage in neither is kept by both or by neither), so every later
node's backward bytes (A and what the step keeps) are no higher; forward counts a kept storage
after its last reader: A less the bytes of the state (those still read, and those held by a node
no region covers, which forward counts anyway), A1 - |S1| + |S1 not in S2, still read| <= A2 - |S2|
follows from A1 + |D| <= A2. The beaten path's every completion is matched by the same completion
of the other at no more K, recompute and peak, strictly less K or recompute: the answer is the
same (a Mamba2 block's DP at a budget of 75%: 2.1 M entries carried, past FRONT_WORK, -> 0.39 M;
0.3-1.1 M -> 0.28-0.36 M at 60%).
"""
from __future__ import annotations

from bisect import bisect_right
from operator import itemgetter

from remat.planner.solve.candidates import Candidate
from remat.planner.costgraph import CostGraph
from remat.planner.solve.front import FRONT_WORK, Point, _unlink, boundaries
from remat.planner.solve.front import _pareto as front_pareto
from remat.planner.solve.simulate import base_liveness, last_reader, region_recompute
from remat.planner.solve.ilp import MB, keep_reasons


_k, _a = itemgetter(0), itemgetter(3)


def _pareto(entries: list[tuple]) -> list[tuple]:
    """(K, recompute, plan, A, nodes covered) entries no other beats in both K and recompute, K
    ascending; of equals, the plan covering the fewest nodes (then the first)."""
    return front_pareto(entries, key=lambda e: (e[0], e[1], e[4]))


class TooMuchWork(Exception):
    """The DP would carry more than its work limit, or the graph is outside what it models: the
    caller asks the segment ILP instead."""


def _prepare(cg: CostGraph, cands: list[Candidate]):
    """Per storage its reasons as (boundary where they act, node after whose backward they release),
    and the per-node arrays the steps read."""
    n = len(cg.nodes)
    sink = n - 1
    coverable, starts = boundaries(n, cands)
    skip_ev: list[list[int]] = [[] for _ in range(n)]          # node -> storages a skip there keeps
    cand_ev: list[dict[int, int]] = [{} for _ in cands]         # candidate -> {storage: release node}
    # storage -> (bytes, MB counted in K or None, sure: held by a node no region covers, the last
    # boundary a reason acts at, its last reader, that uncovered holder or None)
    info = {}
    for sid, r in enumerate(keep_reasons(cg, cands, coverable)):
        if r is None:
            continue
        xs, holders, fixed = r
        s = cg.storages[sid]
        acts = list(holders)
        for h in holders:
            skip_ev[h].append(sid)
        for q, js in xs.items():
            for j in js:
                cand_ev[j][sid] = min(q, cand_ev[j].get(sid, q))
                acts.append(cands[j].region.start)
        if fixed is not None:
            skip_ev[fixed].append(sid)
            acts.append(fixed)
        if not acts:
            continue
        counted = (fixed is None or fixed == sink) and bool(holders or xs)
        reader = last_reader(s)
        if fixed is None and max(acts) > reader:
            raise TooMuchWork(f"storage {sid} may be kept by a reason after its last reader")
        info[sid] = (s.bytes, s.bytes * MB if counted else None, fixed is not None, max(acts), reader, fixed)
    base = base_liveness(cg)
    sure_fwd = [0] * (n + 1)           # forward: kept on every path (a holder no region covers), after its reader
    sure_before = [0] * (n + 2)        # bytes of those whose uncovered holder is before each boundary
    for sid, (b, _, sure, _, reader, fixed) in info.items():
        if sure:
            sure_fwd[reader + 1] += b
            sure_before[fixed + 1] += b
    for i in range(1, n + 1):
        sure_fwd[i] += sure_fwd[i - 1]
        sure_before[i] += sure_before[i - 1]
    return starts, skip_ev, cand_ev, info, base, sure_fwd, sure_before


def cheapest_under(cg: CostGraph, cands: list[Candidate], level_mb: float, cap: int,
                   work: int = FRONT_WORK) -> Point | None:
    """The cheapest plan of `cg` over `cands` keeping at most `level_mb` MB (K as the segment ILP reads
    it) whose simulated peak (simulate.timeline) is at most `cap` bytes, or None when none is
    (NOTE [ lower DP ]). Raises TooMuchWork past `work` carried entries."""
    return _cheapest(_dp(cg, cands, _prepare(cg, cands), level_mb, cap, work))


def least_peak_under(cg: CostGraph, cands: list[Candidate], level_mb: float, work: int = FRONT_WORK) -> Point | None:
    """The cheapest of the plans of least simulated peak keeping at most `level_mb` MB, or None when
    every plan keeps more: the least peak by the DP with the peak so far in place of the recompute
    (of two paths into one state, the one keeping no more at a peak no higher loses nothing), then
    the cheapest plan within it. Raises TooMuchWork past `work` carried entries (in either DP)."""
    prepared = _prepare(cg, cands)
    final = _dp(cg, cands, prepared, level_mb, None, work)
    if not final:
        return None
    return _cheapest(_dp(cg, cands, prepared, level_mb, min(e[1] for e in final), work))


def _cheapest(final: list[tuple]) -> Point | None:
    """The last boundary's cheapest entry (the last of the Pareto set) as a Point; None when none."""
    if not final:
        return None
    k, c, p, _, _ = final[-1]
    return Point(k, c, _unlink(p))


def _dp(cg: CostGraph, cands: list[Candidate], prepared: tuple, level_mb: float, cap: int | None,
        work: int) -> list[tuple]:
    """The Pareto set at the last boundary of (K, recompute) over the plans within `cap` (or, with
    `cap` None, of (K, peak) over every plan) keeping at most `level_mb` MB, as entries (K, recompute
    or peak, plan as a linked list, A, nodes covered); `prepared`: `_prepare(cg, cands)`."""
    return _LowerDP(cg, cands, prepared, level_mb, cap).run(work)


class _LowerDP:
    """One run of `_dp`: the boundaries' entries (`at`), and the steps over nodes (a skipped node,
    a candidate region) that move entries from one boundary to a later one."""

    def __init__(self, cg: CostGraph, cands: list[Candidate], prepared: tuple, level_mb: float, cap: int | None):
        self.cg, self.cands, self.cap = cg, cands, cap
        n = self.n = len(cg.nodes)
        self.starts, self.skip_ev, self.cand_ev, self.info, base, sure_fwd, self.sure_before = prepared
        self.base, self.level = base, level_mb + 1e-9
        # per storage: bytes in A, and in K (whole bytes) where K counts it (`undominated`)
        self.weights = ({s: v[0] for s, v in self.info.items()},
                        {s: v[0] if v[1] is not None else 0 for s, v in self.info.items()})
        self.fwd_fixed = [base.fwd[t] + sure_fwd[t] for t in range(n)]      # forward bytes no path changes
        self.skips = [([base.bwd[t]], None, base.bwd[t], self.fwd_fixed[t]) for t in range(n)]
        self.steps: list = [None] * len(cands)
        # per boundary: state -> list of (K MB, recompute s or peak, plan as a linked list, A bytes, nodes in regions)
        self.at: list[dict[frozenset, list]] = [dict() for _ in range(n + 1)]
        self.at[0][frozenset()] = [(0.0, 0.0 if cap is not None else 0, None, 0, 0)]

    def step_of(self, j: int):
        """Candidate j's nodes' backward bytes before what is kept, its top's (index, bytes before
        what is kept), and the most of each pass over its nodes (for the quick tests)."""
        if self.steps[j] is None:
            cg, base, r = self.cg, self.base, self.cands[j].region
            rc = region_recompute(cg, r)
            pre = [base.bwd[t] + rc.work[t - r.start] for t in range(r.start, r.end + 1)]
            top = None
            if rc.top is not None:
                top = (rc.top - r.start, base.bwd[rc.top] - cg.nodes[rc.top].bwd_extra_bytes + rc.peak)
            self.steps[j] = (pre, top, max(pre + [top[1]] if top else pre), max(self.fwd_fixed[r.start:r.end + 1]))
        return self.steps[j]

    def worst_of(self, b: int, to: int, held: tuple, new: dict, new_ns: list, step) -> int:
        """The most live bytes less A over the step's nodes, b..to-1."""
        info = self.info
        pre, top, _, _ = step
        held_sure, pending, pending_b = held
        span = to - b
        kept_at, read_at = [0] * span, [0] * (span + 1)
        for s, q in new.items():
            kept_at[q - b] += info[s][0]
        for reader, by in pending:               # still read in forward: live after their reader
            if reader + 1 - b >= span:
                break
            read_at[reader + 1 - b] += by
        for s in new_ns:
            if info[s][4] + 1 - b < span:
                read_at[info[s][4] + 1 - b] += info[s][0]
        worst, kb, fb = -10**30, 0, -held_sure - pending_b
        for k in range(span):
            kb, fb = kb + kept_at[k], fb + read_at[k]
            bwd = pre[k] + kb
            if top is not None and top[0] == k:
                bwd = max(bwd, top[1] + kb)
            worst = max(worst, bwd, self.fwd_fixed[b + k] + fb)
        return worst

    def move(self, b: int, state: frozenset, held: tuple, entries: list, keeps: dict, to: int, region, cost: float,
             step) -> None:
        """The entries of `state` at boundary b, moved over one step (a skip or region to `to`)."""
        info, cap = self.info, self.cap
        new = {s: q for s, q in keeps.items() if s not in state}
        add_a = sum(info[s][0] for s in new)
        add_k = sum(info[s][1] for s, q in new.items() if info[s][1] is not None and q != info[s][5])
        new_ns = [s for s in new if not info[s][2]]
        # live bytes at the step's nodes less A, the same for every entry of the state: bounded first
        _, _, most_b, most_f = step
        worst = max(most_b + add_a, most_f - held[0] + sum(info[s][0] for s in new_ns))
        last = bisect_right(entries, self.level - add_k, key=_k)     # within the level: a prefix (K ascending)
        if not last:
            return
        covers = 0 if region is None else to - b
        if cap is not None:
            if entries[last - 1][3] + worst > cap and entries[0][3] + most_b <= cap:
                worst = self.worst_of(b, to, held, new, new_ns, step)
            last = min(last, bisect_right(entries, cap - worst, key=_a))   # within the cap: a prefix (A with K)
            got = [(k + add_k, c + cost, (region, p) if region is not None else p, a + add_a, v + covers)
                   for k, c, p, a, v in entries[:last]]
        else:
            if any(a + worst > peak for _, peak, _, a, _ in entries[:last]):
                worst = self.worst_of(b, to, held, new, new_ns, step)
            got = [(k + add_k, max(peak, a + worst), (region, p) if region is not None else p, a + add_a, v + covers)
                   for k, peak, p, a, v in entries[:last]]
        if got:
            nxt = frozenset(s for s in (*state, *new) if (info[s][3] if info[s][2] else info[s][4]) >= to)
            self.at[to].setdefault(nxt, []).extend(got)

    def run(self, work: int) -> list[tuple]:
        """Every boundary's entries moved on, in order; the Pareto set at the last (TooMuchWork past
        `work` entries carried)."""
        info, carried = self.info, 0
        for b in range(self.n):
            # K ascending, and A with it (A less K is the state's)
            states = undominated({s: _pareto(e) for s, e in self.at[b].items()}, *self.weights)
            for state, entries in states.items():
                carried += len(entries) * (1 + len(self.starts[b]))
                if carried > work:
                    raise TooMuchWork(f"more than {work} entries")
                pending = sorted((info[s][4], info[s][0]) for s in state if not info[s][2])
                held_sure = self.sure_before[b] + sum(info[s][0] for s in state if info[s][2])
                held = (held_sure, pending, sum(by for _, by in pending))
                self.move(b, state, held, entries, {s: b for s in self.skip_ev[b]}, b + 1, None, 0.0, self.skips[b])
                for j in self.starts[b]:
                    c = self.cands[j]
                    self.move(b, state, held, entries, self.cand_ev[j], c.region.end + 1, c.region, c.cost_s,
                              self.step_of(j))
            self.at[b] = {}
        return _pareto([e for entries in self.at[self.n].values() for e in entries])


def undominated(states: dict[frozenset, list], wa: dict, wk: dict) -> dict[frozenset, list]:
    """Each state's Pareto list (K ascending, A with it) less the entries an entry of another state
    beats (NOTE [ lower DP ], across states): (K1, c1, A1) in S1 beats (K2, c2, A2) in S2 when
    K1 + wk(D) <= K2, A1 + wa(D) <= A2 and c1 <= c2, K or c strictly, D = S2 - S1; K compared in
    whole bytes. A strict order: each entry dropped has a dominator kept."""
    if len(states) < 2:
        return states
    rows = [(s, e, [round(x[0] / MB) for x in e], [x[3] for x in e], sum(wk[x] for x in s), sum(wa[x] for x in s))
            for s, e in states.items()]
    out = {}
    for s2, e2, k2, a2, wk2, wa2 in rows:
        rivals = [r for row in rows if row[0] is not s2 for r in _rival(row, s2, e2, k2, a2, wk2, wa2, wk, wa)]
        kept = [e for e, kb, a in zip(e2, k2, a2) if not any(_beaten(e[1], kb, a, r) for r in rivals)]
        if kept:
            out[s2] = kept
    return out


def _rival(row: tuple, s2: frozenset, e2: list, k2: list, a2: list, wk2: int, wa2: int, wk: dict, wa: dict):
    """[(entries, K bytes, A, wk(D), wa(D))] of the state of `row` where it may beat an entry of s2,
    else []: a quick test first (its least K and A, its least cost against s2's most; D weighs at
    least s2's weight less its own), then D's own weights."""
    s1, e1, k1, a1, wk1, wa1 = row
    if e1[-1][1] > e2[0][1] or k1[0] + wk2 - wk1 > k2[-1] or a1[0] + wa2 - wa1 > a2[-1]:
        return []
    d = s2 - s1
    dk, da = sum(wk[x] for x in d), sum(wa[x] for x in d)
    return [(e1, k1, a1, dk, da)] if k1[0] + dk <= k2[-1] and a1[0] + da <= a2[-1] else []


def _beaten(c: float, kb: int, a: int, rival: tuple) -> bool:
    """Whether the rival state's cheapest entry with K + wk(D) <= kb and A + wa(D) <= a (its last
    such: K and A ascend together, the cost descends) beats (kb, c, a)."""
    e1, k1, a1, dk, da = rival
    i = min(bisect_right(k1, kb - dk), bisect_right(a1, a - da)) - 1
    return i >= 0 and (e1[i][1] < c or (e1[i][1] <= c and k1[i] + dk < kb))
