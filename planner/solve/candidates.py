"""Candidate checkpoint regions for the ILP, and what each one does (pure functions, no torch).

A candidate is a contiguous run of recomputable nodes [a..b], in one of two variants: recompute
everything, or keep the outputs of its FLOP-heavy nodes (matmuls, convs: the nodes
FlopCounterMode counts) and recompute the rest — the usual selective-checkpointing recipe.

Which runs are offered:
- A *trivial* node (no FLOPs, makes no storage of positive size, holds none, writes none: views,
  `size`, `getitem`) never starts or ends a candidate. Trimming it off an end gives a region that
  is never worse: the same storages dropped and recomputed, a subset of the inputs kept (released
  no earlier), the same recompute working set, no more recompute time. So this loses no optimum.
  A region that recomputes no storage never pays either, and is not offered.
- When the graph is small enough (at most `FULL_PAIRS` (start, end) pairs), or the caller asks
  for every cut and span, every remaining region is offered: the ILP over them is then exact
  (NOTE [ ILP ]); benchmarks/results/2026-12-01-solver-notes.md has the solve times measured.
- Otherwise: the regions between *cuts* (the `max_cuts` boundaries where the fewest activation
  bytes cross, each region spanning at most `max_span` cuts, trivial ends trimmed), which give
  block-sized and longer regions, plus the `EXTRA` regions of at most about two blocks that save
  the most bytes per second of recompute on their own (`efficient_spans`): an attention core
  (scores to softmax to dropout) starts and ends where many bytes cross, so cuts alone miss it.
  The hand-made plans' regions (planner/solve/baselines.py: every block, sqrt, SAC on every block) are
  offered too, so the ILP can always express them: a budget a hand-made plan meets is never
  infeasible to the ILP (hf-t5 at 11.55 MB: its 527 regions held no block of its own, the ILP
  said infeasible, and the plan fell back to every block at 88% extra compute).

`SearchSpace` holds what every region of one graph is judged by (its validity rules, the
storages each node makes and reads, the cached candidates): `candidates` and the local search
(planner/solve/improve.py) share one, so a region is valid for one exactly when it is for the other.
"""
from __future__ import annotations

from dataclasses import dataclass

from remat.planner.solve.baselines import blocks, known_plans, sac_keepable
from remat.planner.costgraph import CostGraph, same_unit
from remat.planner.solve.nogc import paused
from remat.planner.options import SolveOptions
from remat.planner.result import Region
from remat.planner.solve.simulate import base_liveness, region_recompute, runs_top

FULL_PAIRS = 1500    # every region is offered up to this many (start, end) pairs (docstring)
EXTRA = 400          # on larger graphs: regions offered for their efficiency, besides those between cuts
FREE_SPAN = 48       # ... spanning at most this many positions when the graph has no repeated blocks
CUTS_PER_BLOCK = 6   # with repeated blocks, about this many cuts per block (a region spans a block or two)
EXTRA_CUTS = 8       # ... plus these, for what comes before and after the blocks
_TINY = 1e-12        # seconds: guards a division by a region's cost


@dataclass(frozen=True)
class Candidate:
    region: Region
    cost_s: float                 # estimated recompute time
    flops: int                    # recomputed FLOPs
    work: tuple[int, ...]         # per node of the region: bytes added to its backward live set
    drops: tuple[int, ...]        # storages (of positive size) freed for backward if chosen alone
    caches: tuple[int, ...]       # storages kept by SAC (outputs of saved nodes)
    cache_release: tuple[int, ...] = ()   # per cached storage: the node after whose backward it goes
    inputs: tuple[int, ...] = ()  # storages read in the region, made before it (checkpoint keeps them)


def trivial_nodes(cg: CostGraph) -> list[bool]:
    """Nodes that never need to start or end a region (see the module docstring)."""
    busy = [c.flops > 0 for c in cg.nodes]
    for s in cg.storages:
        if s.bytes > 0:
            busy[s.producer] = True
        for h in s.holders:
            busy[h] = True
        for m in s.mutated_by:
            busy[m] = True
    return [not b for b in busy]


class SearchSpace:
    """The regions of one graph: which are valid, and what each does (its Candidate, cached).

    A region a..b is valid when every node in it is recomputable, in one unit (`same_unit`), and no node in it reads a
    storage made before a that some node >= a writes (recomputing it would read the written
    value). `sac`: whether regions that keep their FLOP-heavy nodes' outputs are offered."""

    def __init__(self, cg: CostGraph, sac: bool = True):
        self.cg, self.sac = cg, sac
        n = len(cg.nodes)
        self.ok = [c.recomputable for c in cg.nodes]
        triv = trivial_nodes(cg)
        self.trivial = triv
        self.positions = [i for i in range(n) if self.ok[i] and not triv[i]]   # where regions start and end
        self.keepable = sac_keepable(cg)
        self.by_producer: list[list[int]] = [[] for _ in cg.nodes]
        for sid, s in enumerate(cg.storages):
            self.by_producer[s.producer].append(sid)
        self.reads: list[list[int]] = [[] for _ in cg.nodes]    # per node, the storages (> 0 bytes) it reads
        for sid, s in enumerate(cg.storages):
            if s.bytes > 0:
                for u in set(s.users):
                    self.reads[u].append(sid)
        # (reader, producer, last writer) of every read of a storage some node writes, readers ascending
        self._written = sorted((u, s.producer, max(s.mutated_by)) for s in cg.storages if s.mutated_by
                               for u in s.users)
        self._bad_from: dict[int, int] = {}
        self._cache: dict[Region, Candidate | None] = {}
        self._got: dict[tuple[int, int, bool], Candidate | None] = {}

    def valid(self, a: int, b: int) -> bool:
        if a > b or not all(self.ok[a:b + 1]) or not same_unit(self.cg, a, b):
            return False
        if a not in self._bad_from:    # the first node >= a reading a storage made before a that a node >= a writes
            self._bad_from[a] = next((j for j, made, written in self._written if j >= a and made < a <= written),
                                     len(self.cg.nodes))
        return self._bad_from[a] > b

    def heavy(self, a: int, b: int) -> tuple[int, ...]:
        """The nodes of a..b whose outputs a SAC region keeps."""
        return tuple(j for j in range(a, b + 1) if self.keepable[j])

    def variants(self, a: int, b: int) -> list[Region]:
        """a..b plain, and keeping its heavy nodes when SAC is on and that differs; [] if invalid."""
        if not self.valid(a, b):
            return []
        h = self.heavy(a, b) if self.sac else ()
        return [Region(a, b)] + ([Region(a, b, h)] if h and len(h) < b - a + 1 else [])

    def get(self, a: int, b: int, sac: bool) -> Candidate | None:
        """Region a..b, plain or (`sac`) keeping its heavy nodes; None if not a candidate (kept:
        local search asks for the same ranges over and over)."""
        key = (a, b, sac)
        if key not in self._got:
            rs = self.variants(a, b)
            r = rs[1] if sac and len(rs) > 1 else (rs[0] if rs and not sac else None)
            self._got[key] = None if r is None else self.candidate(r)
        return self._got[key]

    def candidate(self, r: Region) -> Candidate | None:
        if r not in self._cache:
            self._cache[r] = make_candidate(self.cg, r, self.by_producer, self.reads)
        return self._cache[r]

    def between(self, lo: int, hi: int) -> list[int]:
        return [p for p in self.positions if lo <= p <= hi]


def cut_points(cg: CostGraph, max_cuts: int, n_blocks: int = 0) -> list[int]:
    """Positions i (a cut after node i) where regions may begin or end; -1 is the graph's start.

    With repeated blocks, about CUTS_PER_BLOCK cuts per block: a region can then span a block or two."""
    n = len(cg.nodes)
    cross = base_liveness(cg).crossing
    cuts = list(range(n - 1))
    if n_blocks:
        max_cuts = min(max_cuts, CUTS_PER_BLOCK * n_blocks + EXTRA_CUTS)
    if len(cuts) > max_cuts:
        cuts = sorted(sorted(cuts, key=lambda i: (cross[i], i))[:max_cuts])
    return [-1] + cuts


def make_candidate(cg: CostGraph, region: Region, storage_ids_by_producer: list[list[int]],
                   reads: list[list[int]]) -> Candidate | None:
    rc = region_recompute(cg, region)
    if rc.top is None:
        return None
    lo, hi, storages = region.start, region.end, cg.storages
    work = list(rc.work)
    t = rc.top - lo
    work[t] = max(work[t], rc.peak - cg.nodes[rc.top].bwd_extra_bytes)
    saved = set(region.saved)
    drops, caches, release = [], [], []
    pays = False        # a storage made in R, not kept, that a node of R holds: recomputed
    for i in range(lo, hi + 1):
        for sid in storage_ids_by_producer[i]:
            s = storages[sid]
            if i in saved:
                # SAC cache: handed to the recomputation (and its holders) when it reaches p_s
                # (NOTE [ liveness ]; simulate.keep_release)
                inner = [h for h in s.holders if lo <= h <= hi]
                caches.append(sid)
                release.append(min(inner) if inner and i <= rc.top else lo)
            elif s.bytes > 0 and s.holders:
                if lo <= min(s.holders) and max(s.holders) <= hi:
                    drops.append(sid)
                pays = pays or (not s.output and any(lo <= h <= hi for h in s.holders))
    if not drops and not pays:
        # nothing dropped and nothing recomputed: no storage lives less, so the region never pays
        # (one that drops nothing can still pay: a storage also held outside is then released
        # after the outer holder's backward, not its first holder's; NOTE [ liveness ])
        return None
    inputs = sorted({sid for u in range(lo, hi + 1) for sid in reads[u] if not lo <= storages[sid].producer <= hi})
    return Candidate(region, rc.seconds, rc.flops, tuple(work), tuple(drops), tuple(caches), tuple(release),
                     tuple(inputs))


def _full(space: SearchSpace, max_cuts: int, max_span: int) -> bool:
    """Every region is offered: the caller asks for it, or there are few enough of them."""
    n, pos = len(space.cg.nodes), space.positions
    return (max_cuts >= n - 1 and max_span >= n) or len(pos) * (len(pos) + 1) // 2 <= FULL_PAIRS


def spans(space: SearchSpace, max_cuts: int, max_span: int) -> list[tuple[int, int]]:
    """The (a, b) node ranges offered as candidates, before validity checks: every pair of
    positions on small graphs, else the ranges between cuts (trivial ends trimmed)."""
    cg, triv = space.cg, space.trivial
    if _full(space, max_cuts, max_span):
        pos = space.positions
        pairs = [(a, b) for i, a in enumerate(pos) for b in pos[i:]]
    else:
        cuts = cut_points(cg, max_cuts, len(blocks(cg)))
        found = set()
        for i, a_cut in enumerate(cuts):
            for b_cut in cuts[i + 1:i + 1 + max_span]:
                a, b = a_cut + 1, b_cut
                while a <= b and triv[a]:          # trim trivial ends: never worse (docstring)
                    a += 1
                while b >= a and triv[b]:
                    b -= 1
                if a <= b:
                    found.add((a, b))
        pairs = sorted(found)
    return [(a, b) for a, b in pairs if all(space.ok[a:b + 1])]


class _Prefix:
    """Prefix sums over nodes of what a region's recompute costs (simulate.region_recompute)."""

    def __init__(self, cg: CostGraph, keep: list[bool]):
        self.cg = cg
        self.runs = [runs_top(cg, j) for j in range(len(cg.nodes))]
        self.plain, self.sac, self.ops = [0.0], [0.0], [0]
        for j, c in enumerate(cg.nodes):
            self.plain.append(self.plain[-1] + c.cost_s)
            self.sac.append(self.sac[-1] + (0.0 if keep[j] else c.cost_s))
            self.ops.append(self.ops[-1] + c.ops)

    def cost(self, a: int, b: int, top: int, sac: bool) -> float:
        end = top + 1 if self.runs[top] else top
        if sac:
            return self.cg.region_s + self.cg.sac_op_s * (self.ops[b + 1] - self.ops[a]) + self.sac[end] - self.sac[a]
        return self.cg.region_s + self.plain[end] - self.plain[a]


def _inputs_only_held_from(a: int, st: list, users: list) -> dict[int, int]:
    """For regions starting at a: node e -> bytes of inputs made before a, held by no node
    before a, that a region becomes the only keeper of once it reaches e."""
    newly_at: dict[int, int] = {}
    for s, us in zip(st, users):
        if s.producer >= a or (s.holders and min(s.holders) < a):
            continue                             # made inside, or held before a: kept whatever this region does
        k = next((u for u in us if u >= a), None)
        if k is not None:
            e = max(k, max(s.holders, default=-1))
            newly_at[e] = newly_at.get(e, 0) + s.bytes
    return newly_at


def efficient_spans(space: SearchSpace, span: int) -> list[tuple[float, int, int, bool]]:
    """(score, a, b, sac) for every region of at most `span` positions, best first, where the
    score is what the region saves standing alone — bytes it drops less the inputs only it keeps
    (read inside, made before, held by no node outside) — per second of recompute (its cost as
    in simulate.region_recompute). Regions that save nothing are left out. Incremental in b for
    each a: O(positions x span + positions x storages)."""
    cg, pos, keep = space.cg, space.positions, space.keepable
    n = len(cg.nodes)
    st = [s for s in cg.storages if s.bytes > 0 and not s.output]
    by_maxh: list[list] = [[] for _ in range(n)]     # storages droppable once b reaches their last holder
    held_at: list[list] = [[] for _ in range(n)]     # storages node b holds (b may become top(R))
    for s in st:
        if s.holders:
            by_maxh[max(s.holders)].append(s)
            for h in set(s.holders):
                held_at[h].append(s)
    prefix = _Prefix(cg, keep)
    users = [sorted(set(s.users)) for s in st]
    out = []
    for i, a in enumerate(pos):
        newly_at = _inputs_only_held_from(a, st, users)
        dropped, top = [0, 0], [None, None]          # per variant: plain, SAC
        newly = heavy = 0
        nxt = a                                      # the next node to take in
        for b in pos[i:i + span]:
            if not all(space.ok[nxt:b + 1]):
                break
            for j in range(nxt, b + 1):
                heavy += keep[j]
                newly += newly_at.get(j, 0)
                for s in by_maxh[j]:
                    if s.producer >= a:
                        dropped[0] += s.bytes
                        dropped[1] += 0 if keep[s.producer] else s.bytes
                for s in held_at[j]:
                    if s.producer >= a:
                        top[0] = j
                        top[1] = top[1] if keep[s.producer] else j
            nxt = b + 1
            for sac in (False, True):
                if (sac and (not heavy or heavy == b - a + 1)) or top[sac] is None or dropped[sac] <= newly:
                    continue
                cost = prefix.cost(a, b, top[sac], sac)
                out.append(((dropped[sac] - newly) / max(cost, _TINY), a, b, sac))
    out.sort(key=lambda e: (-e[0], e[1], e[2], e[3]))
    return out


@paused
def candidates(cg: CostGraph, opts: SolveOptions = SolveOptions(), space: SearchSpace | None = None) -> list[Candidate]:
    """All candidate regions, each in its plain and (if different) SAC form; on large graphs,
    those between cuts (`opts.max_cuts`, `opts.max_span`) plus the `EXTRA` most efficient ones of
    at most ~two blocks (or `FREE_SPAN` positions) and the hand-made plans' regions. `space`: the
    graph's SearchSpace, if made."""
    space = space or SearchSpace(cg, opts.sac)
    out, seen = [], set()
    for a, b in spans(space, opts.max_cuts, opts.max_span):
        for r in space.variants(a, b):
            seen.add(r)
            c = space.candidate(r)
            if c is not None:
                out.append(c)
    if _full(space, opts.max_cuts, opts.max_span):
        return out
    n_blocks = len(blocks(cg))
    span = -(-2 * len(space.positions) // n_blocks) if n_blocks else FREE_SPAN
    added = 0
    for _, a, b, use_sac in efficient_spans(space, span):
        if added >= EXTRA:
            break
        variants = space.variants(a, b)
        r = (variants[1] if len(variants) > 1 else None) if use_sac else (variants[0] if variants else None)
        if r is None or r in seen:
            continue
        seen.add(r)
        c = space.candidate(r)
        if c is not None:
            out.append(c)
            added += 1
    for r in (r for plan in known_plans(cg, opts.sac).values() for r in plan if r not in seen):
        seen.add(r)
        if (c := space.candidate(r)) is not None:
            out.append(c)
    return out
