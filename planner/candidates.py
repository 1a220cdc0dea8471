"""Candidate checkpoint regions for the ILP, and what each one does (pure functions, no torch).

A candidate is a contiguous run of recomputable nodes [a..b] between two *cuts*, in one of two
variants: recompute everything, or keep the outputs of its FLOP-heavy nodes (matmuls, convs: the
nodes FlopCounterMode counts) and recompute the rest — the usual selective-checkpointing recipe.
When the graph is large, cuts are restricted to the positions where the fewest bytes cross
(block boundaries, residual adds), and a region spans at most `max_span` cuts, so that the ILP
stays small enough for CBC.
"""
from __future__ import annotations

from dataclasses import dataclass

from .baselines import blocks, sac_keepable
from .costgraph import CostGraph
from .result import Region
from .simulate import region_recompute


@dataclass(frozen=True)
class Candidate:
    region: Region
    cost_s: float                 # estimated recompute time
    flops: int                    # recomputed FLOPs
    work: tuple[int, ...]         # per node of the region: bytes added to its backward live set
    drops: tuple[int, ...]        # storages freed for backward if this region is chosen
    caches: tuple[int, ...]       # storages kept by SAC (outputs of saved nodes)


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


def make_candidate(cg: CostGraph, region: Region, storage_ids_by_producer: list[list[int]]) -> Candidate | None:
    work, top, rec_peak, flops, cost = region_recompute(cg, region)
    if top is None:
        return None
    work = list(work)
    t = top - region.start
    work[t] = max(work[t], rec_peak - cg.nodes[top].bwd_extra_bytes)
    saved = set(region.saved)
    drops, caches = [], []
    for i in range(region.start, region.end + 1):
        for sid in storage_ids_by_producer[i]:
            s = cg.storages[sid]
            if i in saved:
                caches.append(sid)
                # the ILP counts s from rl(s) = min(holders, p_s + 1) on; SAC may hold it from
                # an earlier node of the region (NOTE [ liveness ]): count the difference here
                inner = [h for h in s.holders if h in region]
                rel = min(inner) if inner and i <= top else region.start
                for t in range(rel, min(list(s.holders) + [i + 1])):
                    work[t - region.start] += s.bytes
            elif s.holders and all(h in region for h in s.holders):
                drops.append(sid)
    if not drops:
        return None
    return Candidate(region, cost, flops, tuple(work), tuple(drops), tuple(caches))


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


def candidates(cg: CostGraph, max_cuts: int = 160, max_span: int = 14, sac: bool = True) -> list[Candidate]:
    """All candidate regions between cut points, each in its plain and (if different) SAC form."""
    by_producer: list[list[int]] = [[] for _ in cg.nodes]
    for sid, s in enumerate(cg.storages):
        by_producer[s.producer].append(sid)
    ok = [c.recomputable for c in cg.nodes]
    keepable = sac_keepable(cg)
    # a storage made before node a and written at or after a must not be an input of a region at a
    written_late = _written_after_reads(cg)
    cuts = cut_points(cg, max_cuts, len(blocks(cg)))
    out = []
    for i, a_cut in enumerate(cuts):
        for b_cut in cuts[i + 1:i + 1 + max_span]:
            a, b = a_cut + 1, b_cut
            if not all(ok[a:b + 1]):
                break
            if any(written_late(a, j) for j in range(a, b + 1)):
                continue
            heavy = tuple(j for j in range(a, b + 1) if keepable[j])
            variants = [Region(a, b)]
            if sac and heavy and len(heavy) < b - a + 1:
                variants.append(Region(a, b, heavy))
            for r in variants:
                c = make_candidate(cg, r, by_producer)
                if c is not None:
                    out.append(c)
    return out
