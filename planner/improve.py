"""Local improvement of a plan, judged by the simulator (pure functions, no torch).

`improve(cg, regions, budget_bytes)` starts from a plan (the ILP's) and applies improving moves:
drop a region; move one end of a region to another start or end (between its neighbours, plain or
SAC); merge two neighbouring regions; split a region in two; add a region in a gap. Ends are
non-trivial nodes (planner/candidates.py), so a move may reach regions the ILP was not offered
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

from .baselines import sac_keepable
from .candidates import Candidate, _readers, _written_after_reads, make_candidate, trivial_nodes
from .costgraph import CostGraph
from .result import Region
from .simulate import timeline


class _Pool:
    """Candidates built on demand (cached), with the same validity rules as candidates()."""

    def __init__(self, cg: CostGraph):
        self.cg = cg
        n = len(cg.nodes)
        self.ok = [c.recomputable for c in cg.nodes]
        triv = trivial_nodes(cg)
        self.positions = [i for i in range(n) if self.ok[i] and not triv[i]]
        self.keepable = sac_keepable(cg)
        self.by_producer: list[list[int]] = [[] for _ in cg.nodes]
        for sid, s in enumerate(cg.storages):
            self.by_producer[s.producer].append(sid)
        self.reads = _readers(cg)
        self.written_late = _written_after_reads(cg)
        self.bad_from: dict[int, int] = {}
        self.cache: dict[Region, Candidate | None] = {}
        self.sac_ok = True      # set per improve() call: SolveOptions(sac=False) offers no SAC regions

    def region(self, r: Region) -> Candidate | None:
        if r not in self.cache:
            self.cache[r] = make_candidate(self.cg, r, self.by_producer, self.reads)
        return self.cache[r]

    def get(self, a: int, b: int, sac: bool) -> Candidate | None:
        """Region a..b, plain or keeping its FLOP-heavy nodes' outputs; None if not a candidate."""
        if a > b or not all(self.ok[a:b + 1]):
            return None
        if a not in self.bad_from:
            n = len(self.cg.nodes)
            self.bad_from[a] = next((j for j in range(a, n) if self.written_late(a, j)), n)
        if self.bad_from[a] <= b:
            return None
        if not sac:
            return self.region(Region(a, b))
        if not self.sac_ok:
            return None
        heavy = tuple(j for j in range(a, b + 1) if self.keepable[j])
        if not heavy or len(heavy) == b - a + 1:
            return None
        return self.region(Region(a, b, heavy))

    def between(self, lo: int, hi: int) -> list[int]:
        return [p for p in self.positions if lo <= p <= hi]


class _Judge:
    """Peak of a plan under the exact memory model (NOTE [ ILP ] in solve.py)."""

    def __init__(self, cg: CostGraph):
        n = len(cg.nodes)
        self.n = n
        fwd_d, bwd_d = [0] * (n + 1), [0] * (n + 1)
        self.bytes: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.held: list[tuple[int, tuple[int, ...]]] = []
        for sid, s in enumerate(cg.storages):
            last = max(s.users, default=s.producer)
            if last > s.producer:
                fwd_d[s.producer + 1] += s.bytes
                fwd_d[last + 1] -= s.bytes
            if s.bytes <= 0:
                continue
            if s.output:                      # kept for the caller: to the end of forward, all backward
                fwd_d[min(last + 1, n)] += s.bytes
                bwd_d[0] += s.bytes
                continue
            self.bytes[sid], self.last[sid] = s.bytes, last
            if s.holders:
                self.held.append((sid, tuple(sorted(set(s.holders)))))
        for i, c in enumerate(cg.nodes):
            bwd_d[i] += c.grad_bytes
            bwd_d[c.grad_last_user + 1] -= c.grad_bytes
            bwd_d[0] += c.param_grad_bytes
            bwd_d[i + 1] -= c.param_grad_bytes
        self.fwd, self.bwd = [], []
        a = b = 0
        for t in range(n):
            a, b = a + fwd_d[t], b + bwd_d[t]
            self.fwd.append(cg.fixed_bytes + a + cg.nodes[t].fwd_extra_bytes)
            self.bwd.append(cg.fixed_bytes + b + cg.nodes[t].bwd_extra_bytes)

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
                if sid in self.bytes and rel.get(sid, n) > a:      # outputs are kept anyway
                    rel[sid] = a
            for sid, q in zip(c.caches, c.cache_release):
                if sid in self.bytes and rel.get(sid, n) > q:
                    rel[sid] = q
        fd, bd = [0] * (n + 1), [0] * (n + 1)
        for sid, q in rel.items():
            b = self.bytes[sid]
            fd[self.last[sid] + 1] += b
            bd[q] += b
        peak = f = k = 0
        fwd, bwd = self.fwd, self.bwd
        for t in range(n):
            f += fd[t]
            k += bd[t]
            peak = max(peak, fwd[t] + f, bwd[t] + k + work[t])
        return peak


def _cost(plan) -> float:
    return sum(c.cost_s for c in plan)


def _neighbours(pool: _Pool, plan: list[Candidate], n: int, add_span: int):
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
            for a in pool.between(lo, r.end):
                m = pool.get(a, r.end, sac)
                if m is not None and m.region != r:
                    yield rest[0] + [m] + rest[1], m.cost_s - cost[i]
            for b in pool.between(r.start, hi):
                m = pool.get(r.start, b, sac)
                if m is not None and m.region != r:
                    yield rest[0] + [m] + rest[1], m.cost_s - cost[i]
        if i + 1 < len(plan):
            nxt = plan[i + 1].region
            for sac in (False, True):
                m = pool.get(r.start, nxt.end, sac)
                if m is not None:
                    yield rest[0] + [m] + plan[i + 2:], m.cost_s - cost[i] - cost[i + 1]
        inner = pool.between(r.start, r.end)
        sac = bool(r.saved)
        for e, s in zip(inner, inner[1:]):
            m1, m2 = pool.get(r.start, e, sac), pool.get(s, r.end, sac)
            if m1 is not None and m2 is not None:
                yield rest[0] + [m1, m2] + rest[1], m1.cost_s + m2.cost_s - cost[i]
    if add_span:
        ends = [-1] + [c.region.end for c in plan]
        starts = [c.region.start for c in plan] + [n]
        for k, (lo, hi) in enumerate(zip(ends, starts)):
            gap = pool.between(lo + 1, hi - 1)
            for x, a in enumerate(gap):
                for b in gap[x:x + add_span]:
                    for sac in (False, True):
                        m = pool.get(a, b, sac)
                        if m is not None:
                            yield plan[:k] + [m] + plan[k:], m.cost_s


_LAST: list = [None]      # the last graph's pool and judge: solve_plan improves several plans of one graph


def improve(cg: CostGraph, regions: tuple[Region, ...], budget_bytes: int | None,
            max_evals: int = 20_000, add_span: int = 24, sac: bool = True) -> tuple[Region, ...]:
    """A plan at least as good as `regions` (see the module docstring); with `sac` False, every
    region it adds or reshapes is a plain one (regions keeping nodes are only kept or removed)."""
    if _LAST[0] is None or _LAST[0][0] is not cg:
        _LAST[0] = (cg, _Pool(cg), _Judge(cg))
    _, pool, judge = _LAST[0]
    pool.sac_ok = sac
    n = len(cg.nodes)
    plan = [pool.region(r) for r in sorted(regions, key=lambda r: r.start)]
    if any(c is None for c in plan):
        return regions
    peak, cost = judge.peak(plan), _cost(plan)
    if budget_bytes is not None and peak > budget_bytes:
        return regions
    evals = 0
    while evals < max_evals:
        if budget_bytes is not None:
            found, evals = _cheaper(pool, judge, plan, n, budget_bytes, evals, max_evals, add_span)
        else:
            found, evals = _lower(pool, judge, plan, n, peak, cost, evals, max_evals, add_span)
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


def _cheaper(pool, judge, plan, n, budget, evals, max_evals, add_span):
    """The first plan that fits, cheapest first, among single moves; failing that, among single
    moves over budget followed by one move that brings the plan back within it."""
    moves = sorted((m for m in _neighbours(pool, plan, n, 0) if m[1] < -1e-12), key=lambda m: m[1])
    over = []
    for new, d in moves:
        if evals >= max_evals:
            return None, evals
        evals += 1
        if judge.peak(new) <= budget:
            return new, evals
        if len(over) < _REPAIRS:
            over.append((new, d))
    found, evals = _repair(pool, judge, over, n, add_span, budget, evals, max_evals)
    if found is not None or evals >= max_evals:
        return found, evals
    # a dearer plan with a lower peak (a merged or longer region), then a cheaper move it makes
    # room for (regions elsewhere given up)
    peak = judge.peak(plan)
    room = []
    for new, d in _neighbours(pool, plan, n, 0):
        if d < 0 or evals >= max_evals:
            continue
        evals += 1
        p = judge.peak(new)
        if p < peak:
            room.append((p, d, new))
    room.sort(key=lambda e: (e[0], e[1]))
    return _repair(pool, judge, [(new, d) for _, d, new in room[:_REPAIRS]], n, 0, budget, evals, max_evals)


def _repair(pool, judge, starts, n, add_span, budget, evals, max_evals):
    """From each (plan, its cost change) in `starts`, in turn: the first move, cheapest first,
    that leaves the total change negative and fits the budget; (plan or None, evals)."""
    for start, d in starts:
        fixes = sorted((m for m in _neighbours(pool, start, n, add_span) if m[1] + d < -1e-12), key=lambda m: m[1])
        for fixed, _ in fixes:
            if evals >= max_evals:
                return None, evals
            evals += 1
            if judge.peak(fixed) <= budget:
                return fixed, evals
    return None, evals


def _lower(pool, judge, plan, n, peak, cost, evals, max_evals, add_span):
    """The first single move that lowers the peak, or keeps it and lowers the cost."""
    for new, d in _neighbours(pool, plan, n, add_span):
        if evals >= max_evals:
            break
        evals += 1
        p = judge.peak(new)
        if p < peak or (p == peak and d < -1e-12):
            return new, evals
    return None, evals
