"""The exact Pareto front of a segment's kept bytes K against its recompute, by dynamic
programming over its node boundaries (pure: no torch, no solver; planner/solve/hierarchy.py's families
take their K-bounded cheapest plans from it instead of the segment ILP's).

NOTE [ front DP ]
A plan is a path over the boundaries 0..n of NOTE [ ILP ]: at boundary b a node is skipped (in no
region) or a candidate region starting at b is chosen, which moves the path past its end. K is the
segment ILP's `kept`: the bytes of the storages it counts (not outputs, not left to a holder no
region covers, except the sink) that some reason keeps: a holder skipped, or a chosen region that
reads the storage as its input or caches it (SAC). A storage counts once however many reasons
hold, so the DP's state at a boundary is the set of storages kept already that a later step could
keep again (a reason at or after the boundary: `last`); with no later reason a storage leaves the
state. Each state holds the Pareto set of (K, recompute) over the paths reaching it, each with its
plan. The front is the Pareto set of all paths at n: for every level, the cheapest plan keeping at
most that level is its point of largest K at or below the level, exactly the epsilon-constraint
ILP's optimum (without its node limit). Costs add over regions (each region's recompute is its own);
ties keep the plan found first (boundaries ascending, candidates in their order).
Across states (`undominated`): a path in state S1 beats one in S2 when its K plus the bytes of S2's
storages not in S1 is no more, at no more recompute (every later step adds at most those bytes more
from S1 than from S2): the beaten path is dropped, and the front's points are the same (a Mamba2
block, whose scan reads a few storages from many regions: 2.1 M entries carried -> 0.38 M, the same
138 points; without it the DP gave up and 9 segment ILPs of ~12 s searched the front instead).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import NamedTuple

from remat.planner.solve.candidates import Candidate
from remat.planner.costgraph import CostGraph
from remat.planner.result import Region
from remat.planner.solve.ilp import MB, keep_reasons


FRONT_WORK = 2_000_000   # (K, recompute) entries the DP may carry across its boundaries in all; beyond,
                         # it gives up (None) and the segment ILP answers instead. The largest segment
                         # of the zoo (hf-moe's block, 2290 candidates) needs 92 k (0.5 s), gpt2's 4.7 k


class Point(NamedTuple):
    kept_mb: float
    cost_s: float
    plan: tuple[Region, ...]


def _counted(cg: CostGraph, cands: list[Candidate], coverable: list[bool]):
    """Per storage K counts: (bytes, coverable holders, candidates that keep it); as the ILP's
    [Keep] reasons (planner/solve/ilp.py `keep_reasons`) of the storages in its `kept` sum."""
    sink = len(cg.nodes) - 1
    out = {}
    for sid, r in enumerate(keep_reasons(cg, cands, coverable)):
        if r is None:
            continue
        xs, holders, fixed = r
        if fixed is not None and fixed != sink:
            continue
        by = sorted({j for js in xs.values() for j in js})
        if holders or by:
            out[sid] = (cg.storages[sid].bytes, holders, by)
    return out


def _pareto(points: list[tuple], key=lambda p: (p[0], p[1])) -> list[tuple]:
    """(K, cost, ...) entries no other beats in both, K ascending; of equals, the first in `key`'s
    order (by default the first found) stays."""
    out = []
    for p in sorted(points, key=key):
        if not out or p[1] < out[-1][1]:
            out.append(p)
    return out


def boundaries(n: int, cands: list[Candidate]) -> tuple[list[bool], list[list[int]]]:
    """Per node whether some candidate covers it, and per boundary 0..n the candidates starting there."""
    coverable = [False] * n
    starts: list[list[int]] = [[] for _ in range(n + 1)]
    for j, c in enumerate(cands):
        starts[c.region.start].append(j)
        for i in range(c.region.start, c.region.end + 1):
            coverable[i] = True
    return coverable, starts


def front(cg: CostGraph, cands: list[Candidate], work: int = FRONT_WORK) -> list[Point] | None:
    """The exact (K, recompute) Pareto front of `cg` over `cands` (NOTE [ front DP ]), K ascending;
    K in MB as the segment ILP reads it. Plans in `cg`'s indices. None when the DP would carry more
    than `work` entries (a count, not a clock: every machine gives up on the same segments)."""
    n = len(cg.nodes)
    coverable, starts = boundaries(n, cands)
    counted = _counted(cg, cands, coverable)
    by_holder: list[list[int]] = [[] for _ in range(n)]
    by_cand: list[list[int]] = [[] for _ in cands]
    last = {}                          # storage -> the last boundary at which a reason can act
    for sid, (_, holders, js) in counted.items():
        for h in holders:
            by_holder[h].append(sid)
        for j in js:
            by_cand[j].append(sid)
        last[sid] = max([*holders, *(cands[j].region.start for j in js)])
    mb = {sid: v[0] for sid, v in counted.items()}

    # per boundary: state (frozenset of storages kept that a later reason may keep again) -> Pareto
    # list of (K, cost, plan as a linked list (region, rest) or None); K in whole bytes, exact: MB
    # summed in floats made one K of two paths' orders differ by 1e-16, and either stayed (a Mamba2
    # block's front carried 2.1 M entries, past FRONT_WORK: 9 segment ILPs of ~12 s each instead)
    at: list[dict[frozenset, list]] = [dict() for _ in range(n + 1)]
    at[0][frozenset()] = [(0.0, 0.0, None)]

    def move(state: frozenset, entries: list, keeps, to: int, region, cost: float) -> None:
        new = [s for s in keeps if s not in state]
        add = sum(mb[s] for s in new)
        nxt = frozenset(s for s in (*state, *new) if last[s] >= to)
        got = at[to].setdefault(nxt, [])
        got += [(k + add, c + cost, (region, p) if region is not None else p) for k, c, p in entries]

    carried = 0
    for b in range(n):
        for state, entries in undominated({s: _pareto(e) for s, e in at[b].items()}, mb).items():
            carried += len(entries) * (1 + len(starts[b]))
            if carried > work:
                return None
            move(state, entries, by_holder[b], b + 1, None, 0.0)
            for j in starts[b]:
                c = cands[j]
                move(state, entries, by_cand[j], c.region.end + 1, c.region, c.cost_s)
        at[b] = {}                     # done with: memory back
    final = _pareto([e for entries in at[n].values() for e in entries])
    return [Point(k * MB, c, _unlink(p)) for k, c, p in final]


def undominated(states: dict[frozenset, list], weight: dict) -> dict[frozenset, list]:
    """Each state's Pareto list (K ascending) less the entries an entry of another state beats
    (NOTE [ front DP ], across states): (K1, c1) in S1 beats (K2, c2) in S2 when K1 + d <= K2 and
    c1 <= c2, one of them strictly, d the `weight` of S2's storages not in S1 (every later step adds
    at most d more from S1 than from S2). A strict order: each entry dropped has a dominator kept."""
    if len(states) < 2:
        return states
    lists = [(s, e, [x[0] for x in e]) for s, e in states.items()]
    out = {}
    for s2, e2, k2 in lists:
        rivals = [(sum(weight[x] for x in s2 - s1), e1, k1) for s1, e1, k1 in lists if s1 is not s2]
        rivals = [r for r in rivals if r[2][0] + r[0] <= k2[-1]]       # one that can beat any of e2
        kept = [e for e in e2 if not any(_beaten(e, d, e1, k1) for d, e1, k1 in rivals)]
        if kept:
            out[s2] = kept
    return out


def _beaten(e: tuple, d: int, rival: list, ks: list) -> bool:
    """Whether the rival state's cheapest entry with K + d <= e's K (its last such) beats `e`."""
    i = bisect_right(ks, e[0] - d) - 1
    return i >= 0 and (rival[i][1] < e[1] or (rival[i][1] <= e[1] and ks[i] + d < e[0]))


def cheapest(points: list[Point], below: float) -> Point | None:
    """The segment ILP's optimum keeping at most `below` MB, read off its front: the point of largest
    K at or below the level (the cheapest such); None when every plan keeps more."""
    got = [p for p in points if p.kept_mb <= below + 1e-9]
    return got[-1] if got else None


def _unlink(p) -> tuple[Region, ...]:
    out = []
    while p is not None:
        out.append(p[0])
        p = p[1]
    return tuple(reversed(out))

