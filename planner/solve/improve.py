"""Local improvement of a plan, judged by the simulator (pure functions, no torch).

`improve(cg, regions, budget_bytes)` starts from a plan (the ILP's) and applies improving moves:
drop a region; move one end of a region to another start or end (between its neighbours, plain or
SAC); merge two neighbouring regions; split a region in two; add a region in a gap. Ends are
non-trivial nodes (planner/solve/candidates.py), so a move may reach regions the ILP was not offered
(on large graphs it sees a subset).
- With a budget: the cheaper plans first, the first that fits is taken; when none does, a cheaper
  plan over budget followed by one more move (an added region, a moved end...) that brings it
  back within budget and keeps it cheaper (a region given up here, one added there).
- With `budget_bytes=None` (the least peak): the first move that lowers the peak, or keeps it and
  lowers the estimated recompute time.

Plans are scored with the exact memory model of NOTE [ ILP ] (kept storages, release points,
recompute working sets; it equals `simulate.timeline`, which tests/test_solver.py checks), and
the result is checked once more with `simulate.timeline`; the input plan comes back unchanged if
it does not check out. Deterministic: moves in a fixed order, at most `max_evals` plans scored.
"""
from __future__ import annotations

from itertools import accumulate
from operator import add
from typing import NamedTuple

from remat.planner.solve.candidates import SearchSpace
from remat.planner.costgraph import CostGraph
from remat.planner.result import Region
from remat.planner.solve.simulate import base_liveness, last_reader, pipeline_adds, state_release, timeline

_EPS_S = 1e-12       # seconds: a cost change smaller than this is no change
WORK = 2_000_000     # plans times nodes a local search after a solve scores, at most ...
AT_LEAST = 1000      # ... but at least this many plans (`evals`)


def evals(cg: CostGraph, wanted: int) -> int:
    """The plans a local search after a solve scores: `wanted` (SolveOptions.improve_evals), at most
    WORK / nodes (each costs a pass over the graph). On the flat path too: hf-t5's (394 nodes)
    10,000 took 1.0 s of its 3.7 s plan and found its one better plan (2.3% cheaper, u=0.25) within
    the first 1,000."""
    return min(wanted, max(AT_LEAST, WORK // len(cg.nodes)))


class Judge:
    """Peak of a plan under the exact memory model (NOTE [ ILP ] in solve.py): the base liveness
    (simulate.base_liveness) plus the storages the plan keeps and its regions' working sets."""

    def __init__(self, cg: CostGraph):
        self.n = len(cg.nodes)
        base = base_liveness(cg)
        self.fwd, self.bwd, self.opt = base.fwd, base.bwd, base.opt
        self.bytes: dict[int, int] = {}
        self.cg = cg                        # a pipeline rank's (cg.inflight): simulate.pipeline_adds
        self.outputs = sum(s.bytes for s in cg.storages if s.output)
        self.last: dict[int, int] = {}
        self.held: list[tuple[int, tuple[int, ...]]] = []
        self.state = cg.region_state_bytes          # each region's host RNG state (NOTE [ liveness ])
        self.low: dict = {}                         # region -> simulate.state_release
        for sid, s in enumerate(cg.storages):
            if s.bytes <= 0 or s.output:          # outputs are in the base: kept whatever the plan
                continue
            self.bytes[sid], self.last[sid] = s.bytes, last_reader(s)
            if s.holders:
                self.held.append((sid, tuple(sorted(set(s.holders)))))

    def peak(self, plan) -> int:
        n = self.n
        covered = bytearray(n)
        work = [0] * n
        for c in plan:
            r = c.region
            covered[r.start:r.end + 1] = b"\x01" * (r.end - r.start + 1)
            work[r.start:r.end + 1] = c.work
        rel: dict[int, int] = {}
        for sid, holders in self.held:
            for h in holders:
                if not covered[h]:
                    rel[sid] = h
                    break
        for c in plan:
            a = c.region.start
            for sid in c.inputs:
                if sid in self.bytes and rel.get(sid, n) > a:
                    rel[sid] = a
            for sid, q in zip(c.caches, c.cache_release):
                if sid in self.bytes and rel.get(sid, n) > q:
                    rel[sid] = q
        fd, bd = [0] * (n + 1), [0] * (n + 1)
        for sid, q in rel.items():
            b = self.bytes[sid]
            fd[self.last[sid] + 1] += b
            bd[q] += b
        for c in plan if self.state else ():       # a candidate recomputes: one of its nodes saves
            r = c.region
            low = self.low.get(r)
            if low is None:
                low = self.low[r] = state_release(self.cg, r)
            fd[r.start] += self.state
            bd[low] += self.state
        # forward: base + kept so far; backward: base + released so far + the region's working set;
        # the optimizer's step: the same under every plan (running sums in C: the search's inner loop)
        fwd = max(map(add, self.fwd[:n], accumulate(fd[:n])))
        bwd = max(map(add, map(add, self.bwd[:n], accumulate(bd[:n])), work))
        if not self.cg.inflight:
            return max(self.opt, fwd, bwd)
        fwd_add, bwd_add = pipeline_adds(self.cg, self.outputs + sum(self.bytes[sid] for sid in rel)
                                         + self.state * len(plan))
        bwd = max(map(add, map(add, map(add, self.bwd[:n], accumulate(bd[:n])), work), bwd_add))
        return max(self.opt, fwd + fwd_add, bwd)


class Search(NamedTuple):
    """What the searches over one graph share: its regions (validity, cached candidates) and the
    judge of a plan's peak. Made once per graph (`search`), passed explicitly."""
    space: SearchSpace
    judge: Judge


def search(cg: CostGraph, sac: bool = True) -> Search:
    return Search(SearchSpace(cg, sac), Judge(cg))


def _cost(plan) -> float:
    return sum(c.cost_s for c in plan)


def _neighbours(space: SearchSpace, plan: list, n: int, add_span: int):
    """(new plan, cost change) for every move from `plan` (see the module docstring); regions
    added in gaps span at most `add_span` positions (0: none are added)."""
    cost = [c.cost_s for c in plan]
    for i, c in enumerate(plan):
        r = c.region
        lo = plan[i - 1].region.end + 1 if i else 0
        hi = plan[i + 1].region.start - 1 if i + 1 < len(plan) else n - 1
        rest = plan[:i], plan[i + 1:]
        yield rest[0] + rest[1], -cost[i]
        for sac in (False, True):
            for a in space.between(lo, r.end):
                m = space.get(a, r.end, sac)
                if m is not None and m.region != r:
                    yield rest[0] + [m] + rest[1], m.cost_s - cost[i]
            for b in space.between(r.start, hi):
                m = space.get(r.start, b, sac)
                if m is not None and m.region != r:
                    yield rest[0] + [m] + rest[1], m.cost_s - cost[i]
        if i + 1 < len(plan):
            nxt = plan[i + 1].region
            for sac in (False, True):
                m = space.get(r.start, nxt.end, sac)
                if m is not None:
                    yield rest[0] + [m] + plan[i + 2:], m.cost_s - cost[i] - cost[i + 1]
        inner = space.between(r.start, r.end)
        sac = bool(r.saved)
        for e, s in zip(inner, inner[1:]):
            m1, m2 = space.get(r.start, e, sac), space.get(s, r.end, sac)
            if m1 is not None and m2 is not None:
                yield rest[0] + [m1, m2] + rest[1], m1.cost_s + m2.cost_s - cost[i]
    if add_span:
        ends = [-1] + [c.region.end for c in plan]
        starts = [c.region.start for c in plan] + [n]
        for k, (lo, hi) in enumerate(zip(ends, starts)):
            gap = space.between(lo + 1, hi - 1)
            for x, a in enumerate(gap):
                for b in gap[x:x + add_span]:
                    for sac in (False, True):
                        m = space.get(a, b, sac)
                        if m is not None:
                            yield plan[:k] + [m] + plan[k:], m.cost_s


def improve(cg: CostGraph, regions: tuple[Region, ...], budget_bytes: int | None,
            max_evals: int = 20_000, add_span: int = 24, sac: bool = True,
            ctx: Search | None = None) -> tuple[Region, ...]:
    """A plan at least as good as `regions` (see the module docstring); with `sac` False, every
    region it adds or reshapes is a plain one (regions keeping nodes are only kept or removed).
    `ctx`: the graph's Search (made here when not given; its space says whether SAC is on)."""
    space, judge = ctx if ctx is not None else search(cg, sac)
    n = len(cg.nodes)
    plan = [space.candidate(r) for r in sorted(regions, key=lambda r: r.start)]
    if any(c is None for c in plan):
        return regions
    peak, cost = judge.peak(plan), _cost(plan)
    if budget_bytes is not None and peak > budget_bytes:
        return regions
    evals = 0
    while evals < max_evals:
        if budget_bytes is not None:
            found, evals = _cheaper(space, judge, plan, n, budget_bytes, evals, max_evals, add_span)
        else:
            found, evals = _lower(space, judge, plan, n, peak, evals, max_evals, add_span)
        if found is None:
            break
        plan = found
        peak, cost = judge.peak(plan), _cost(plan)
    out = tuple(c.region for c in plan)
    if out == tuple(sorted(regions, key=lambda r: r.start)):
        return regions
    # the simulator is the judge: keep the result only if it checks out
    before, after = timeline(cg, tuple(regions)), timeline(cg, out)
    if budget_bytes is not None:
        ok = after.peak_bytes <= budget_bytes and after.recompute_s < before.recompute_s
    else:
        ok = (after.peak_bytes, after.recompute_s) < (before.peak_bytes, before.recompute_s)
    return out if ok else regions


_REPAIRS = 24        # cheaper plans over budget that one more move is tried on


def _cheaper(space, judge, plan, n, budget, evals, max_evals, add_span):
    """The first plan that fits, cheapest first, among single moves; failing that, among single
    moves over budget followed by one move that brings the plan back within it."""
    moves = sorted((m for m in _neighbours(space, plan, n, 0) if m[1] < -_EPS_S), key=lambda m: m[1])
    over = []
    for new, d in moves:
        if evals >= max_evals:
            return None, evals
        evals += 1
        if judge.peak(new) <= budget:
            return new, evals
        if len(over) < _REPAIRS:
            over.append((new, d))
    found, evals = _repair(space, judge, over, n, add_span, budget, evals, max_evals)
    if found is not None or evals >= max_evals:
        return found, evals
    # a dearer plan with a lower peak (a merged or longer region), then a cheaper move it makes
    # room for (regions elsewhere given up)
    peak = judge.peak(plan)
    room = []
    for new, d in _neighbours(space, plan, n, 0):
        if d < 0 or evals >= max_evals:
            continue
        evals += 1
        p = judge.peak(new)
        if p < peak:
            room.append((p, d, new))
    room.sort(key=lambda e: (e[0], e[1]))
    return _repair(space, judge, [(new, d) for _, d, new in room[:_REPAIRS]], n, 0, budget, evals, max_evals)


def _repair(space, judge, starts, n, add_span, budget, evals, max_evals):
    """From each (plan, its cost change) in `starts`, in turn: the first move, cheapest first,
    that leaves the total change negative and fits the budget; (plan or None, evals)."""
    for start, d in starts:
        fixes = sorted((m for m in _neighbours(space, start, n, add_span) if m[1] + d < -_EPS_S), key=lambda m: m[1])
        for fixed, _ in fixes:
            if evals >= max_evals:
                return None, evals
            evals += 1
            if judge.peak(fixed) <= budget:
                return fixed, evals
    return None, evals


def _lower(space, judge, plan, n, peak, evals, max_evals, add_span):
    """The first single move that lowers the peak, or keeps it and lowers the cost."""
    for new, d in _neighbours(space, plan, n, add_span):
        if evals >= max_evals:
            break
        evals += 1
        p = judge.peak(new)
        if p < peak or (p == peak and d < -_EPS_S):
            return new, evals
    return None, evals
