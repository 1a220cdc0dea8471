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
  (NOTE [ ILP ]). Measured (CBC, 1 thread, this 2-core VM): the 85-node 2-layer GPT-2 (42
  positions, 903 pairs) and the 53-node U-Net (52 positions, 1378 pairs) solve to optimality in
  1-4 s; the 161-node 4-layer GPT-2 (78 positions, 3081 pairs) takes 24-67 s.
- Otherwise: the regions between *cuts* (the `max_cuts` boundaries where the fewest activation
  bytes cross, each region spanning at most `max_span` cuts, trivial ends trimmed), which give
  block-sized and longer regions, plus the `EXTRA` regions of at most about two blocks that save
  the most bytes per second of recompute on their own (`efficient_spans`): an attention core
  (scores to softmax to dropout) starts and ends where many bytes cross, so cuts alone miss it.
  On the 4-layer GPT-2 this set (642 candidates) gives the exact optimum at 30/50/70% budgets.
"""
from __future__ import annotations

from dataclasses import dataclass

from .baselines import blocks, sac_keepable
from .costgraph import CostGraph
from .result import Region
from .simulate import region_recompute

FULL_PAIRS = 1500    # every region is offered up to this many (start, end) pairs (docstring)
EXTRA = 400          # on larger graphs: regions offered for their efficiency, besides those between cuts
FREE_SPAN = 48       # ... spanning at most this many positions when the graph has no repeated blocks


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


def crossing_bytes(cg: CostGraph) -> list[int]:
    """Bytes of activations live across the cut after each node (made at <= i, read at > i)."""
    n = len(cg.nodes)
    diff = [0] * (n + 1)
    for s in cg.storages:
        last = max(s.users, default=s.producer)
        if last > s.producer:
            diff[s.producer] += s.bytes
            diff[last] -= s.bytes
    out, acc = [], 0
    for d in diff[:-1]:
        acc += d
        out.append(acc)
    return out


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


def cut_points(cg: CostGraph, max_cuts: int, n_blocks: int = 0) -> list[int]:
    """Positions i (a cut after node i) where regions may begin or end; -1 is the graph's start.

    With repeated blocks, about six cuts per block: a region can then span a block or two."""
    n = len(cg.nodes)
    cross = crossing_bytes(cg)
    cuts = list(range(n - 1))
    if n_blocks:
        max_cuts = min(max_cuts, 6 * n_blocks + 8)
    if len(cuts) > max_cuts:
        cuts = sorted(sorted(cuts, key=lambda i: (cross[i], i))[:max_cuts])
    return [-1] + cuts


def _readers(cg: CostGraph) -> list[list[int]]:
    """Per node, the storages (of positive size) it reads."""
    reads: list[list[int]] = [[] for _ in cg.nodes]
    for sid, s in enumerate(cg.storages):
        if s.bytes > 0:
            for u in set(s.users):
                reads[u].append(sid)
    return reads


def make_candidate(cg: CostGraph, region: Region, storage_ids_by_producer: list[list[int]],
                   reads: list[list[int]] | None = None) -> Candidate | None:
    work, top, rec_peak, flops, cost = region_recompute(cg, region)
    if top is None:
        return None
    work = list(work)
    t = top - region.start
    work[t] = max(work[t], rec_peak - cg.nodes[top].bwd_extra_bytes)
    saved = set(region.saved)
    drops, caches, release = [], [], []
    for i in range(region.start, region.end + 1):
        for sid in storage_ids_by_producer[i]:
            s = cg.storages[sid]
            if i in saved:
                # SAC cache: handed to the recomputation (and its holders) when it reaches p_s
                # (NOTE [ liveness ]; simulate.keep_release)
                inner = [h for h in s.holders if h in region]
                caches.append(sid)
                release.append(min(inner) if inner and i <= top else region.start)
            elif s.bytes > 0 and s.holders and all(h in region for h in s.holders):
                drops.append(sid)
    if not drops and not any(cg.storages[sid].bytes > 0 and not cg.storages[sid].output
                             for i in range(region.start, region.end + 1) if i not in saved
                             for sid in storage_ids_by_producer[i]
                             if any(h in region for h in cg.storages[sid].holders)):
        # nothing dropped and nothing recomputed: no storage lives less, so the region never pays
        # (one that drops nothing can still pay: a storage also held outside is then released
        # after the outer holder's backward, not its first holder's; NOTE [ liveness ])
        return None
    reads = _readers(cg) if reads is None else reads
    inputs = sorted({sid for u in range(region.start, region.end + 1) for sid in reads[u]
                     if cg.storages[sid].producer not in region})
    return Candidate(region, cost, flops, tuple(work), tuple(drops), tuple(caches), tuple(release), tuple(inputs))


def _written_after_reads(cg: CostGraph):
    """written_late(a, j): node j reads a storage made before a that some node >= a writes."""
    reads: dict[int, list] = {}
    for s in cg.storages:
        if s.mutated_by:
            for u in s.users:
                reads.setdefault(u, []).append(s)
    def written_late(a: int, j: int) -> bool:
        return any(s.producer < a and max(s.mutated_by) >= a for s in reads.get(j, ()))
    return written_late


def _positions(cg: CostGraph) -> list[int]:
    """Nodes a region may start or end at: recomputable and not trivial."""
    triv = trivial_nodes(cg)
    return [i for i, c in enumerate(cg.nodes) if c.recomputable and not triv[i]]


def _full(cg: CostGraph, max_cuts: int, max_span: int) -> bool:
    """Every region is offered: the caller asks for it, or there are few enough of them."""
    n, pos = len(cg.nodes), _positions(cg)
    return (max_cuts >= n - 1 and max_span >= n) or len(pos) * (len(pos) + 1) // 2 <= FULL_PAIRS


def spans(cg: CostGraph, max_cuts: int = 160, max_span: int = 14) -> list[tuple[int, int]]:
    """The (a, b) node ranges offered as candidates, before validity checks: every pair of
    positions on small graphs, else the ranges between cuts (trivial ends trimmed)."""
    triv = trivial_nodes(cg)
    ok = [c.recomputable for c in cg.nodes]
    if _full(cg, max_cuts, max_span):
        pos = _positions(cg)
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
    return [(a, b) for a, b in pairs if all(ok[a:b + 1])]


def efficient_spans(cg: CostGraph, span: int) -> list[tuple[float, int, int, bool]]:
    """(score, a, b, sac) for every region of at most `span` positions, best first, where the
    score is what the region saves standing alone — bytes it drops less the inputs only it keeps
    (read inside, made before, held by no node outside) — per second of recompute (its cost as
    in simulate.region_recompute). Regions that save nothing are left out. Incremental in b for
    each a: O(positions x span + positions x storages)."""
    n = len(cg.nodes)
    pos = _positions(cg)
    keep = sac_keepable(cg)
    st = [s for s in cg.storages if s.bytes > 0 and not s.output]
    by_maxh: list[list] = [[] for _ in range(n)]     # storages droppable once b reaches their last holder
    held_at: list[list] = [[] for _ in range(n)]     # storages node b holds (b may become top(R))
    for s in st:
        if s.holders:
            by_maxh[max(s.holders)].append(s)
            for h in set(s.holders):
                held_at[h].append(s)
    pre, pre_sac, pre_ops = [0.0], [0.0], [0]
    for j, c in enumerate(cg.nodes):
        pre.append(pre[-1] + c.cost_s)
        pre_sac.append(pre_sac[-1] + (0.0 if keep[j] else c.cost_s))
        pre_ops.append(pre_ops[-1] + c.ops)
    users = [sorted(set(s.users)) for s in st]
    out = []
    for i, a in enumerate(pos):
        newly_at: dict[int, int] = {}
        for s, us in zip(st, users):
            if s.producer >= a:
                continue
            if s.holders and min(s.holders) < a:
                continue                             # held before a: kept whatever this region does
            k = next((u for u in us if u >= a), None)
            if k is not None:
                e = max(k, max(s.holders, default=-1))
                newly_at[e] = newly_at.get(e, 0) + s.bytes
        dropped = [0, 0]           # plain, SAC
        newly = 0
        top = [None, None]
        heavy = 0
        nxt = a                    # the next node to take in
        for b in pos[i:i + span]:
            if not all(c.recomputable for c in cg.nodes[nxt:b + 1]):
                break
            for j in range(nxt, b + 1):
                heavy += keep[j]
                for s in by_maxh[j]:
                    if s.producer >= a:
                        dropped[0] += s.bytes
                        if not keep[s.producer]:
                            dropped[1] += s.bytes
                newly += newly_at.get(j, 0)
                for s in held_at[j]:
                    if s.producer >= a:
                        top[0] = j
                        if not keep[s.producer]:
                            top[1] = j
            nxt = b + 1
            for sac in (False, True):
                if sac and (not heavy or heavy == b - a + 1):
                    continue
                t = top[sac]
                if t is None or dropped[sac] <= newly:
                    continue
                if sac:
                    cost = cg.region_s + cg.sac_op_s * (pre_ops[b + 1] - pre_ops[a]) + pre_sac[t + 1] - pre_sac[a]
                else:
                    cost = cg.region_s + pre[t + 1] - pre[a]
                out.append(((dropped[sac] - newly) / max(cost, 1e-12), a, b, sac))
    out.sort(key=lambda e: (-e[0], e[1], e[2], e[3]))
    return out


def candidates(cg: CostGraph, max_cuts: int = 160, max_span: int = 14, sac: bool = True) -> list[Candidate]:
    """All candidate regions, each in its plain and (if different) SAC form; on large graphs,
    those between cuts plus the `EXTRA` most efficient ones of at most ~two blocks (or
    `FREE_SPAN` positions)."""
    by_producer: list[list[int]] = [[] for _ in cg.nodes]
    for sid, s in enumerate(cg.storages):
        by_producer[s.producer].append(sid)
    keepable = sac_keepable(cg)
    reads = _readers(cg)
    # a storage made before node a and written at or after a must not be an input of a region at a
    written_late = _written_after_reads(cg)
    bad_from: dict[int, int] = {}     # per start a: the first node j >= a with written_late(a, j)
    n = len(cg.nodes)

    def valid(a: int, b: int) -> bool:
        if a not in bad_from:
            bad_from[a] = next((j for j in range(a, n) if written_late(a, j)), n)
        return bad_from[a] > b

    def heavy(a: int, b: int) -> tuple[int, ...]:
        return tuple(j for j in range(a, b + 1) if keepable[j])

    out, seen = [], set()
    for a, b in spans(cg, max_cuts, max_span):
        if not valid(a, b):
            continue
        h = heavy(a, b)
        variants = [Region(a, b)]
        if sac and h and len(h) < b - a + 1:
            variants.append(Region(a, b, h))
        for r in variants:
            c = make_candidate(cg, r, by_producer, reads)
            seen.add(r)
            if c is not None:
                out.append(c)
    if _full(cg, max_cuts, max_span):
        return out
    n_blocks = len(blocks(cg))
    span = -(-2 * len(_positions(cg)) // n_blocks) if n_blocks else FREE_SPAN
    added = 0
    for _, a, b, use_sac in efficient_spans(cg, span):
        if added >= EXTRA:
            break
        if (use_sac and not sac) or not valid(a, b):
            continue
        r = Region(a, b, heavy(a, b)) if use_sac else Region(a, b)
        if r in seen:
            continue
        seen.add(r)
        c = make_candidate(cg, r, by_producer, reads)
        if c is not None:
            out.append(c)
            added += 1
    return out
