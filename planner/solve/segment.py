"""One segment of a graph of blocks on its own (pure: no torch; planner/solve/hierarchy.py's step 3):
its CostGraph (`segment_graph`: a source node for what comes before it, a sink for what comes
after), its options scored in the whole graph's context (`Option`, `Context`), and NOTE [ ILP ]'s
exact model over it with a bound on K, the bytes it keeps for backward (`SegmentILP`): the
epsilon-constraint method on K traces the segment's Pareto front of K against recompute.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import pulp

from remat.planner.solve import ilp as ilp
from remat.planner.solve.blocks import Segment
from remat.planner.solve.cbc import variable
from remat.planner.solve.candidates import FULL_PAIRS, SearchSpace, candidates
from remat.planner.costgraph import CostGraph, NodeCost, StorageCost
from remat.planner.options import SolveOptions
from remat.planner.result import Region
from remat.planner.solve.simulate import base_liveness, keep_release, region_index, region_recompute, timeline

SEGMENT_NODES = 500  # branch-and-bound nodes of a segment ILP: a Llama-2-7B block's ILPs hit the 6 s
                     # time limit (a plan that moved with the machine's load) at 20,000; at 500 they
                     # stop by count, with the same plans on GPT-2 and the 7B (benchmarks/scale.py)
SEGMENT_PAIRS = 2 * FULL_PAIRS   # a segment's ILP offers every region up to this many (start, end) pairs
LOW_PEAK_NODES = 30  # branch-and-bound nodes of a least-peak solve (its LP bound is weak: a short search;
                     # 100 -> 30: the same plans and floors on all 30 rows of benchmarks/plan_time.py
                     # and the 6 of benchmarks/scale.py, hf-moe's 4 least-peak CBC runs 2.0 -> 1.6 s)


def segment_graph(cg: CostGraph, a: int, b: int, settled: frozenset = frozenset()) -> CostGraph:
    """Nodes a..b as a CostGraph of their own (NOTE [ chain ]): node 0 is a source standing for
    everything before a, nodes 1..b-a+1 are a..b, the last node a sink for everything after b (neither
    recomputable). Storages that touch a..b are kept: made before a -> made by the source, read, held
    or written after b -> by the sink. A storage made before a that a node before a holds, or whose
    id is in `settled` (read by an earlier segment too: that one decides whether it is kept), is an
    output here: this segment does not decide. Fixed and gradient bytes are what the segment sees of
    them (the caller takes base liveness differences out again)."""
    m = b - a + 1
    sink = m + 1

    def at(i: int) -> int:
        return 0 if i < a else (sink if i > b else i - a + 1)

    src = NodeCost(name="<before>", target="<before>", module="", flops=0, cost_s=0.0, fwd_extra_bytes=0,
                   bwd_extra_bytes=0, grad_bytes=0, grad_last_user=0, param_grad_bytes=0, recomputable=False,
                   why_not="outside the segment")
    nodes = [src] + [replace(c, grad_last_user=min(max(at(c.grad_last_user), k + 1), sink))
                     for k, c in enumerate(cg.nodes[a:b + 1])] + [replace(src, name="<after>", target="<after>")]
    storages = []
    for sid, s in enumerate(cg.storages):
        inside = [v for v in s.users + s.holders + s.mutated_by if a <= v <= b]
        if not (a <= s.producer <= b or inside):
            continue
        if s.producer > b:
            continue
        decided = s.producer < a and (sid in settled or any(h < a for h in s.holders))
        storages.append(StorageCost(
            s.bytes, at(s.producer),
            tuple(at(u) for u in s.users if u >= a),
            tuple(sorted({at(h) for h in s.holders if h >= a})),
            s.output or decided,
            tuple(sorted({at(w) for w in s.mutated_by if w >= a}))))
    return CostGraph(nodes=tuple(nodes), storages=tuple(storages), fixed_bytes=0, param_bytes=0,
                     region_s=cg.region_s, sac_op_s=cg.sac_op_s, loss_differentiates=cg.loss_differentiates)


def shift(regions, by: int) -> tuple[Region, ...]:
    return tuple(Region(r.start + by, r.end + by, tuple(j + by for j in r.saved)) for r in regions)


class Option(NamedTuple):
    """One region set of a segment, scored in that segment's context (NOTE [ chain ])."""
    regions: tuple[Region, ...]   # in the whole graph's node indices
    kept: int                     # K: bytes it keeps that are released in its backward
    peak: int                     # M: the most live bytes over its nodes, less what earlier segments keep
    cost_s: float                 # estimated recompute time


class Context:
    """One segment in the whole graph: its CostGraph and the base liveness of both, to score options."""

    def __init__(self, cg: CostGraph, seg: Segment, full_base, settled: frozenset = frozenset()):
        self.seg = seg
        self.sub = segment_graph(cg, seg.start, seg.end, settled)
        sb = base_liveness(self.sub)
        m = seg.end - seg.start + 1
        # full base minus the segment graph's base, per node of the segment, each pass
        self.off_f = [full_base.fwd[seg.start + k] - sb.fwd[k + 1] for k in range(m)]
        self.off_b = [full_base.bwd[seg.start + k] - sb.bwd[k + 1] for k in range(m)]

    def score(self, local: tuple[Region, ...]) -> Option:
        """`local`: regions in the segment graph's indices (1..m)."""
        sub, m = self.sub, self.seg.end - self.seg.start + 1
        tl = timeline(sub, local)
        where = region_index(len(sub.nodes), local)
        rel = keep_release(sub, local, where, [region_recompute(sub, r).top for r in local])
        kept = sum(s.bytes for s, q in zip(sub.storages, rel) if q is not None and not s.output and 1 <= q <= m)
        peak = max(max(tl.fwd[k + 1] + self.off_f[k] for k in range(m)),
                   max(tl.bwd[k + 1] + self.off_b[k] for k in range(m)))
        return Option(shift(local, self.seg.start - 1), kept, peak, tl.recompute_s)


# ------------------------------------------------------------------------------ options by exact ILP
def _segment_options(opts: SolveOptions) -> SolveOptions:
    """A segment ILP's limits: every region offered, no gap, no local search, SEGMENT_NODES nodes."""
    return replace(opts, max_cuts=10**6, max_span=10**6, rel_gap=0.0, improve_evals=0,
                   max_nodes=min(opts.max_nodes, SEGMENT_NODES))


class SegmentILP:
    """NOTE [ ILP ]'s model over one segment graph (every region inside offered, up to
    SEGMENT_PAIRS start/end pairs), built once (at its first solve: a family whose exact front
    answers its splits may never need it) from planner/solve/ilp.py's own pieces, with one more
    constraint: K, the bytes the segment keeps for backward and releases in its own backward (the z
    chain of every storage at its last point inside the segment), at most a level. Solved at one
    level after another; plans are in the segment graph's indices."""

    def __init__(self, sub: CostGraph, opts: SolveOptions, k_none: int, cands: list | None = None):
        """`cands`: another SegmentILP's over `sub` (a family's batch slots share them: made once)."""
        self.sub, self.opts = sub, _segment_options(opts)
        if cands is None:
            space = SearchSpace(sub, opts.sac)
            pos = space.positions
            full = len(pos) * (len(pos) + 1) // 2 <= SEGMENT_PAIRS
            cands = candidates(sub, self.opts if full else opts, space)
        self.cands = cands
        self.k_none = k_none * ilp.MB
        self.tol = 1e-3 + 1e-6 * self.k_none          # MB: CBC's tolerance on a constraint
        self.prob = None            # the model, made at the first solve (the exact front answers most)

    def build(self) -> None:
        """Make the model (once; its first solve does)."""
        if self.prob is not None:
            return
        sub = self.sub
        prob = self.prob = pulp.LpProblem("segment", pulp.LpMinimize)
        self.B = variable(prob, "B", 0)
        self.x, self.y, covering, coverable = ilp.path_lines(prob, self.cands, len(sub.nodes))
        lines = ilp.keep_lines(prob, sub, self.cands, self.x, self.y, coverable)
        ilp.budget_lines(prob, sub, self.cands, self.x, covering, lines, self.B, False)
        # a storage also held after the segment (by the sink) has its -z term at the sink in K's chain
        sink = len(sub.nodes) - 1
        self.kept = pulp.lpSum([t for ts in lines.fwd_d for t in ts] + [-t for t in lines.bwd_d[sink]])
        self.cost = ilp.lin([(x, c.cost_s * ilp.US) for x, c in zip(self.x, self.cands)])
        self.total = sum(c.cost_s * ilp.US for c in self.cands) or 1.0
        # a weight on K too small ever to trade recompute for, so that the z chains take their least
        # values (the K read back is then the plan's own)
        self.nudge = 1e-4 * min(c.cost_s * ilp.US for c in self.cands) / max(self.k_none, 1e-9)
        self.cap = pulp.LpConstraint(self.kept, pulp.LpConstraintLE, "kept_cap", 1e18)
        prob += self.cap

    def _run(self, objective, below: float, nodes: int | None = None, start=None, extra=()):
        self.cap.constant = -below        # the model: built by the caller (`build`)
        self.prob.setObjective(objective)
        if start is not None:                  # a plan known to meet the constraints: CBC's first incumbent
            ilp.set_start(self.cands, self.x, self.y, start)
        _, _, sol = ilp.run_cbc(self.prob, self.opts, start is not None, nodes, extra)
        if sol not in ilp.SOLVED:
            return None
        return ilp.chosen_regions(self.cands, self.x), pulp.value(self.kept) or 0.0

    def least_kept(self):
        """(plan, K in MB) keeping the least (recompute breaking ties); None without candidates."""
        if not self.cands:
            return None
        self.build()
        return self._run(self.kept + ilp.TIE * self.cost / self.total, 1e18)

    def cheapest(self, below: float, peak_below: float | None = None, start=None):
        """(plan, K in MB) of least recompute keeping at most `below` MB (and peaking below
        `peak_below` MB in the segment graph, if given), or None. `start`: a plan that meets both."""
        if not self.cands:
            return None
        self.build()
        self.B.upBound = peak_below
        try:
            return self._run(self.cost + self.nudge * self.kept, below, start=start)
        finally:
            self.B.upBound = None

    def least_peak(self, below: float):
        """(plan, K) of least peak in the segment graph keeping at most `below` MB (a short search)."""
        if not self.cands:
            return None
        self.build()
        return self._run(self.B + ilp.TIE * self.cost / self.total, below + self.tol, LOW_PEAK_NODES,
                         extra=ilp.PLAIN_SEARCH)
