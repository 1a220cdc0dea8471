"""A solver that scales: repeated blocks solved once, then chained (pure: no torch).

The flat ILP (planner/solve.py) is exact when every region is offered (planner/candidates.py,
`FULL_PAIRS`), but a 32-layer Llama has ~1900 nodes, and there CBC stops at its limits with poor
plans or none. Most of such a graph is one block again and again, so `HierarchicalSolver`:

1. *Segments.* The graph is cut at its blocks (`baselines.blocks`): what comes before the first
   block, each block, what lies between two blocks, what comes after the last (`segments`).
2. *Types.* Each block's subgraph is a networkx DiGraph labelled with what the solver sees of it
   (position, target and module relative to the block, FLOPs, cost, ops, extra bytes, flags, the
   storages it makes and those from before it that it reads; edges producer -> user/holder/writer
   with the storages' bytes), hashed by `networkx.weisfeiler_lehman_graph_hash` (`block_types`):
   blocks with one hash are one type. Blocks alike but for the profile's measured extra bytes (the
   first block's backward often measures more) are one *family*, solved once.
3. *Options.* For the middle block of each family, and for each other segment, the segment is
   made a CostGraph of its own (`segment_graph`: a source node stands for what comes before it, a
   sink for what comes after) and NOTE [ ILP ]'s exact model over it (every region inside offered,
   built from planner/solve.py's own pieces; `SegmentILP`) gets one more constraint: K, the bytes
   the segment keeps for backward, at most a level. The epsilon-constraint method on K (the
   cheapest plan keeping at most a level) traces the segment's Pareto front of K against recompute,
   its widest gaps searched first (LEVELS solves), plus plans of least peak at some levels. Each
   plan is scored in the context of every segment of its family (`Option`: K, M, recompute).
   The ILPs are solved WIDTH at a time (`run_jobs`: each job on its own copy of the family's
   SegmentILP, CBC a process each, results taken in a fixed order; the widest WIDTH gaps at once),
   and a split starts CBC from the gap's lower point (it keeps less than the level: it is feasible).
4. *The chain* (NOTE [ chain ]): with regions inside segments, the step's live bytes at node t of
   segment i are base(t) + sum_{j<i} K_j + d_i(t), where d_i is what segment i's own plan adds at t.
   A DP over the segments (`chain_dp`), its state the bytes kept so far, picks one option per
   segment at the least recompute with sum_{j<i} K_j + M_i within the budget at every segment
   (M_i: the most of base + d_i over segment i's nodes). Its choice then refines the fronts where
   it lies (REFINE_SOLVES more ILPs per budget, WIDTH at once: the same K at a lower peak for the
   options picked, gaps next to them), and the DP runs again.
5. *The judge.* The chained plan is replayed by `simulate.timeline`; where the chain's prediction
   missed (the decomposition is exact only under NOTE [ chain ]'s conditions) the DP runs again at a
   budget corrected by the miss. On graphs small enough (POLISH_CANDIDATES), the flat ILP then
   polishes it over a compact candidate set (every option's regions on every block of its family,
   regions across block boundaries, the flat path's own candidates), warm-started from it; last,
   the same local search (planner/improve.py) as after the flat ILP.

`for_graph` returns a solver only for graphs too large for the exact flat ILP that have repeated
blocks; `planner.fit.solve_plan` takes the flat path otherwise.

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

import math
import re
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from itertools import takewhile
from typing import NamedTuple

import networkx as nx
import pulp

from . import solve as _ilp
from .baselines import blocks, known_plans
from .candidates import FULL_PAIRS, SearchSpace, candidates
from .costgraph import CostGraph, NodeCost, StorageCost
from .improve import Search, improve, search
from .options import SolveOptions
from .result import Region
from .simulate import base_liveness, keep_release, region_index, region_recompute, timeline

LEVELS = 8           # kept-bytes levels each segment's exact ILP is first solved at (its options)
LOW_PEAK = 2         # ... and at how many of the K found the plan of least peak is solved for
LOW_PEAK_NODES = 100 # branch-and-bound nodes of a least-peak solve (its LP bound is weak: a short search)
REFINE_SOLVES = 12   # per budget: at most this many more segment ILPs around the options the DP picked
REFINE_MIN_PEAK = 4  # ... and for the least peak (whose cost matters less)
MIN_GAP = 1e-3       # a gap in a front narrower than this share of the activation bytes is not searched
DP_STATES = 3000     # states the chain DP keeps per segment (beyond that, the cheapest per bucket of bytes)
ROUNDS = 5           # DP solves per budget when the simulator says the chained plan misses
CLOSE = 0.002        # ... stopping once a plan that fits is this close to the budget
SEGMENT_NODES = 500  # branch-and-bound nodes of a segment ILP: a Llama-2-7B block's ILPs hit the 6 s
                     # time limit (a plan that moved with the machine's load) at 20,000; at 500 they
                     # stop by count, with the same plans on GPT-2 and the 7B (benchmarks/scale.py)
SEGMENT_PAIRS = 2 * FULL_PAIRS   # a segment's ILP offers every region up to this many (start, end) pairs
POLISH_CANDIDATES = 1500         # the flat ILP over the options' regions (tiled, and across block
                                 # boundaries) runs when there are at most this many of them ...
POLISH_NODES = 1000              # ... for at most this many branch-and-bound nodes: warm-started from
                                 # the chain's plan, it stops at this limit well before CBC's time
                                 # limit, so that a busy machine gets the same plan
LOCAL_SEARCH_WORK = 2_000_000  # plans times nodes the local search scores after a solve, at most ...
LOCAL_SEARCH_MIN = 1000        # ... but at least this many plans
CROSS = 3            # positions on each side of a segment boundary a polishing region may reach across
WIDTH = 3            # segment ILPs solved at once, each by its own CBC process (a constant, not the
                     # machine's core count: every machine makes the same plan)


# ------------------------------------------------------------------------------ structure
def _block_prefix(cg: CostGraph, a: int, b: int) -> str:
    """The module path all nodes of block a..b share, to its list index ("h.3", "model.layers.3")."""
    common: list[str] | None = None
    for c in cg.nodes[a:b + 1]:
        parts = c.module.split(".") if c.module else []
        common = parts if common is None else [x for x, _ in takewhile(lambda p: p[0] == p[1], zip(common, parts))]
    common = list(common or [])
    while common and not common[-1].isdigit():
        common.pop()
    return ".".join(common)


def _relative(text: str, prefix: str) -> str:
    """`text` with the block's own module path replaced by '@' (so h.3's and h.4's nodes compare equal)."""
    if not prefix:
        return text
    return re.sub(rf"(?<![\w.]){re.escape(prefix)}(?![\w])", "@", text)


def block_graph(cg: CostGraph, a: int, b: int, measured: bool = True) -> nx.DiGraph:
    """Block a..b as a networkx DiGraph over 0..b-a: each node labelled with what the solver sees of
    it (its position, target and module relative to the block, FLOPs, cost, ops, extra bytes,
    gradients, flags, the bytes of the storages it makes and of those from before the block it reads,
    holds or writes), each edge producer -> user/holder/writer labelled with the storages' bytes and
    kinds. `measured` False leaves out the profile's measured extra working memory and gradient bytes:
    blocks alike but for those (the first block's backward often measures more) then compare equal."""
    prefix = _block_prefix(cg, a, b)
    makes: dict[int, list[str]] = {}
    outside: dict[int, list[str]] = {}
    edges: dict[tuple[int, int], list[str]] = {}
    for s in cg.storages:
        ends = [(u, "u") for u in s.users] + [(h, "h") for h in s.holders] + [(m, "m") for m in s.mutated_by]
        tag = f"{s.bytes}{'o' if s.output else ''}"
        if a <= s.producer <= b:
            later = "".join(sorted({kind for v, kind in ends if v > b}))   # read, held, written after it
            makes.setdefault(s.producer - a, []).append(f"{tag}>{later}" if later else tag)
            for v, kind in ends:
                if v <= b:
                    edges.setdefault((s.producer - a, v - a), []).append(tag + kind)
        elif s.producer < a:
            for v, kind in ends:
                if a <= v <= b:
                    outside.setdefault(v - a, []).append(tag + kind)
    g = nx.DiGraph()
    for k, c in enumerate(cg.nodes[a:b + 1]):
        extra = (c.fwd_extra_bytes, c.bwd_extra_bytes, c.grad_bytes, c.param_grad_bytes,
                 min(c.grad_last_user - a, b - a + 1)) if measured else ()
        g.add_node(k, label="|".join(map(str, (
            k, _relative(c.target, prefix), _relative(c.module, prefix), c.flops, f"{c.cost_s:.9g}", c.ops,
            *extra, c.recomputable, c.random, c.opaque,
            ",".join(sorted(makes.get(k, ()))), ",".join(sorted(outside.get(k, ())))))))
    for (u, v), tags in edges.items():
        g.add_edge(u, v, label=",".join(sorted(tags)))
    return g


def block_hash(cg: CostGraph, a: int, b: int, measured: bool = True) -> str:
    """The Weisfeiler-Lehman hash of `block_graph` (node and edge labels)."""
    with warnings.catch_warnings():   # networkx 3.5 changed directed graphs' hashes (a bug fix): said once
        warnings.simplefilter("ignore", UserWarning)
        return nx.weisfeiler_lehman_graph_hash(block_graph(cg, a, b, measured), node_attr="label",
                                               edge_attr="label")


def block_types(cg: CostGraph, spans: list[tuple[int, int]] | None = None) -> list[str]:
    """The Weisfeiler-Lehman hash of each block (`baselines.blocks` unless `spans` is given): blocks
    the solver cannot tell apart share one."""
    return [block_hash(cg, a, b) for a, b in (blocks(cg) if spans is None else spans)]


class Segment(NamedTuple):
    start: int
    end: int
    kind: str        # "block", or "other": before, between or after the blocks
    type: str        # the block's hash (`block_hash`); a segment of its own for the others
    family: str      # the hash without measured extra bytes: one set of options is solved for it


def segments(cg: CostGraph) -> list[Segment]:
    """The graph's nodes cut at its blocks, in order (see the module docstring)."""
    spans = blocks(cg)
    out, nxt = [], 0
    for a, b in spans:
        if a > nxt:
            out.append(Segment(nxt, a - 1, "other", f"other@{nxt}", f"other@{nxt}"))
        out.append(Segment(a, b, "block", block_hash(cg, a, b), block_hash(cg, a, b, measured=False)))
        nxt = b + 1
    if nxt < len(cg.nodes):
        out.append(Segment(nxt, len(cg.nodes) - 1, "other", f"other@{nxt}", f"other@{nxt}"))
    return out


# ------------------------------------------------------------------------------ a segment alone
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
                     region_s=cg.region_s, sac_op_s=cg.sac_op_s)


def _shift(regions, by: int) -> tuple[Region, ...]:
    return tuple(Region(r.start + by, r.end + by, tuple(j + by for j in r.saved)) for r in regions)


class Option(NamedTuple):
    """One region set of a segment, scored in that segment's context (NOTE [ chain ])."""
    regions: tuple[Region, ...]   # in the whole graph's node indices
    kept: int                     # K: bytes it keeps that are released in its backward
    peak: int                     # M: the most live bytes over its nodes, less what earlier segments keep
    cost_s: float                 # estimated recompute time


class _Context:
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
        return Option(_shift(local, self.seg.start - 1), kept, peak, tl.recompute_s)


# ------------------------------------------------------------------------------ options by exact ILP
def _segment_options(opts: SolveOptions) -> SolveOptions:
    """A segment ILP's limits: every region offered, no gap, no local search, SEGMENT_NODES nodes."""
    return replace(opts, max_cuts=10**6, max_span=10**6, rel_gap=0.0, improve_evals=0,
                   max_nodes=min(opts.max_nodes, SEGMENT_NODES))


class SegmentILP:
    """NOTE [ ILP ]'s model over one segment graph (every region inside offered, up to
    SEGMENT_PAIRS start/end pairs), built once from planner/solve.py's own pieces, with one more
    constraint: K, the bytes the segment keeps for backward and releases in its own backward (the z
    chain of every storage at its last point inside the segment), at most a level. Solved at one
    level after another; plans are in the segment graph's indices."""

    def __init__(self, sub: CostGraph, opts: SolveOptions, k_none: int):
        self.sub, self.opts = sub, _segment_options(opts)
        space = SearchSpace(sub, opts.sac)
        pos = space.positions
        full = len(pos) * (len(pos) + 1) // 2 <= SEGMENT_PAIRS
        self.cands = candidates(sub, self.opts if full else opts, space)
        self.k_none = k_none * _ilp._MB
        self.tol = 1e-3 + 1e-6 * self.k_none          # MB: CBC's tolerance on a constraint
        if not self.cands:
            return
        prob = self.prob = pulp.LpProblem("segment", pulp.LpMinimize)
        self.B = pulp.LpVariable("B", 0)
        self.x, self.y, covering, coverable = _ilp._path(prob, self.cands, len(sub.nodes))
        lines = _ilp._keep(prob, sub, self.cands, self.x, self.y, coverable)
        _ilp._budget_lines(prob, sub, self.cands, self.x, covering, lines, self.B, False)
        # a storage also held after the segment (by the sink) has its -z term at the sink in K's chain
        sink = len(sub.nodes) - 1
        self.kept = pulp.lpSum([t for ts in lines.fwd_d for t in ts] + [-t for t in lines.bwd_d[sink]])
        self.cost = _ilp._lin([(x, c.cost_s * _ilp._US) for x, c in zip(self.x, self.cands)])
        self.total = sum(c.cost_s * _ilp._US for c in self.cands) or 1.0
        # a weight on K too small ever to trade recompute for, so that the z chains take their least
        # values (the K read back is then the plan's own)
        self.nudge = 1e-4 * min(c.cost_s * _ilp._US for c in self.cands) / max(self.k_none, 1e-9)
        self.cap = pulp.LpConstraint(self.kept, pulp.LpConstraintLE, "kept_cap", 1e18)
        prob += self.cap

    def _run(self, objective, below: float, nodes: int | None = None, start=None):
        self.cap.constant = -below
        self.prob.setObjective(objective)
        if start is not None:                  # a plan known to meet the constraints: CBC's first incumbent
            _ilp.set_start(self.cands, self.x, self.y, start)
        _, _, sol = _ilp._run(self.prob, self.opts, start is not None, nodes)
        if sol not in _ilp._SOLVED:
            return None
        return _ilp._chosen(self.cands, self.x), pulp.value(self.kept) or 0.0

    def least_kept(self):
        """(plan, K in MB) keeping the least (recompute breaking ties); None without candidates."""
        if not self.cands:
            return None
        return self._run(self.kept + _ilp._TIE * self.cost / self.total, 1e18)

    def cheapest(self, below: float, peak_below: float | None = None, start=None):
        """(plan, K in MB) of least recompute keeping at most `below` MB (and peaking below
        `peak_below` MB in the segment graph, if given), or None. `start`: a plan that meets both."""
        if not self.cands:
            return None
        self.B.upBound = peak_below
        try:
            return self._run(self.cost + self.nudge * self.kept, below, start=start)
        finally:
            self.B.upBound = None

    def least_peak(self, below: float):
        """(plan, K) of least peak in the segment graph keeping at most `below` MB (a short search)."""
        if not self.cands:
            return None
        return self._run(self.B + _ilp._TIE * self.cost / self.total, below + self.tol, LOW_PEAK_NODES)


# ------------------------------------------------------------------------------ the chain
def chain_dp(options: list[list[Option]], budget: int) -> tuple[float, list[int]] | None:
    """One option per segment, least total cost, with every segment's kept-so-far + M within
    `budget` (NOTE [ chain ]): (cost, option index per segment), or None when none fits. The
    states per segment are the Pareto front of (bytes kept so far, cost)."""
    states = [(0, 0.0, -1, -1)]          # (kept so far, cost, previous state, option)
    trail = []
    for opts in options:
        nxt = [(k + o.kept, c + o.cost_s, si, oi) for si, (k, c, _, _) in enumerate(states)
               for oi, o in enumerate(opts) if k + o.peak <= budget]
        if not nxt:
            return None
        nxt.sort()                       # ties in (kept, cost): the first made first, as made
        front, best = [], math.inf
        for e in nxt:                    # less kept, less cost
            if e[1] < best - 1e-15:
                front.append(e)
                best = e[1]
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


def chain_min_peak(options: list[list[Option]]) -> int:
    """The least budget the chain DP meets: bisection, each budget checked by feasibility alone
    (less kept so far is never worse, so one state per segment suffices)."""
    def feasible(budget: int) -> bool:
        k = 0
        for opts in options:
            ks = [k + o.kept for o in opts if k + o.peak <= budget]
            if not ks:
                return False
            k = min(ks)
        return True

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


class _Family:
    """Segments solved as one (blocks alike but for measured extra bytes, `Segment.family`; or one
    other segment), through one SegmentILP over its middle member's segment graph. Its plans are in
    that graph's indices, shared by every member. `front` is the Pareto front of (K, recompute) the
    ILP has found, in the representative's context; the gap between two of its points is searched
    by bisection on K (the cheapest plan keeping at most the middle: a new point of the front, or
    none there), and `searched` says how far up from the lower point a gap holds no point."""

    def __init__(self, members: list[int], rep: "_Context", make_ilp, min_gap: float):
        self.members, self.rep, self.make_ilp = members, rep, make_ilp
        self.ilps = [make_ilp()]                      # one per batch slot (`ilp_at`), made when needed
        self.ilp = self.ilps[0]
        self.min_gap = max(min_gap, 4 * self.ilp.tol)      # MB: narrower gaps are not searched
        self.plans: list[tuple[Region, ...]] = []
        self.front: list[tuple[float, float, tuple[Region, ...]]] = []   # (K MB, seconds, plan), K ascending
        self.searched: dict[tuple[Region, ...], float] = {}             # upper point -> K searched up to
        self.lowered: set[tuple[Region, ...]] = set()                   # plans a lower peak was sought for

    def ilp_at(self, slot: int) -> SegmentILP:
        """This family's ILP for batch slot `slot` (a CBC run at a time each: they set their own levels)."""
        while len(self.ilps) <= slot:
            self.ilps.append(self.make_ilp())
        return self.ilps[slot]

    def point(self, plan) -> tuple[float, float, tuple[Region, ...]]:
        o = self.rep.score(plan)
        return o.kept * _ilp._MB, o.cost_s, plan

    def _open(self, j: int) -> tuple[float, float]:
        lo = max(self.front[j][0], self.searched.get(self.front[j + 1][2], -math.inf))
        return lo, self.front[j + 1][0]

    def gaps(self):
        """(area, lower point index) of each gap still open: its unsearched K range times its
        recompute range, each as a fraction of the front's."""
        f = self.front
        if len(f) < 2:
            return []
        dk, dc = (f[-1][0] - f[0][0]) or 1.0, (f[0][1] - f[-1][1]) or 1.0
        out = []
        for j in range(len(f) - 1):
            lo, hi = self._open(j)
            if hi - lo > self.min_gap:
                out.append(((hi - lo) / dk * (f[j][1] - f[j + 1][1]) / dc, j))
        return out

    def split(self, j: int) -> "Job":
        """The search of the gap above front point j, once (marked searched now): the cheapest plan
        keeping at most the gap's middle; taken, it is a new point of the front, or nothing."""
        lo, hi = self._open(j)
        tol = self.ilp.tol
        mid = (lo + hi) / 2 if hi - lo > 16 * tol else hi - 2 * tol
        below, above = self.front[j], self.front[j + 1]
        self.searched[above[2]] = mid

        def take(got) -> tuple[Region, ...] | None:
            if got is None or got[0] in {p for _, _, p in self.front}:
                return None
            k, c, plan = self.point(got[0])
            if not below[0] + tol < k < above[0] - tol or c >= below[1]:
                return None
            self.front.insert(self.front.index(below) + 1, (k, c, plan))   # other jobs split other gaps
            return plan
        return Job(self, lambda ilp: ilp.cheapest(mid, start=below[2]), take)

    def least_peak(self, at: int) -> "Job":
        """The least-peak plan keeping at most the K of front point `at`."""
        k = self.front[at][0]
        return Job(self, lambda ilp: ilp.least_peak(k), _plan_of)

    def lower(self, plan) -> "Job":
        """The cheapest plan keeping no more than `plan` at a lower peak in the segment graph (a block
        whose working set binds the budget); once per plan."""
        self.lowered.add(plan)
        k = self.rep.score(plan).kept * _ilp._MB + self.ilp.tol
        peak = timeline(self.rep.sub, plan).peak_bytes * _ilp._MB - self.ilp.tol
        return Job(self, lambda ilp: ilp.cheapest(k, peak), _plan_of)


def _plan_of(got):
    return None if got is None else got[0]


class Job(NamedTuple):
    """One segment ILP to solve: `solve(ilp)` on one of the family's SegmentILPs (in a worker
    thread: CBC runs as a process), `take(result)` back in order (the plan found, or None)."""
    family: _Family
    solve: object
    take: object


def run_jobs(jobs: list[Job]) -> list:
    """Solve `jobs` (at most WIDTH) at once, each on its own ILP, and take their results in order:
    the plans found (None where none). Each job's result depends on its ILP and level only, so the
    plans are those of solving them one after another."""
    ilps = [job.family.ilp_at(slot) for slot, job in enumerate(jobs)]
    if len(jobs) == 1:
        got = [jobs[0].solve(ilps[0])]
    else:
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job, ilp: job.solve(ilp), jobs, ilps))
    return [job.take(g) for job, g in zip(jobs, got)]


class HierarchicalSolver:
    """The hierarchical solve of one graph (module docstring): segment options made once (and
    refined where each budget's chain needs them), solved per budget. `solve` and `min_peak` are
    called like planner.solve's solve_ilp and solve_min_peak and return its Solution."""

    def __init__(self, cg: CostGraph, opts: SolveOptions = SolveOptions(), ctx: Search | None = None):
        t0 = time.perf_counter()
        self.cg, self.opts = cg, opts
        self.ctx = ctx or search(cg, opts.sac)
        self.segs = segments(cg)
        base = base_liveness(cg)
        settled = _settled(cg, self.segs)
        self.contexts = [_Context(cg, s, base, settled[i]) for i, s in enumerate(self.segs)]
        self.options: list[list[Option]] = [[] for _ in self.segs]
        self.families: list[_Family] = []
        by: dict[str, list[int]] = {}
        for i, s in enumerate(self.segs):
            by.setdefault(s.family, []).append(i)
        # a gap of the front narrower than this share of the step's activation bytes is not searched
        min_gap = MIN_GAP * (timeline(cg, ()).peak_bytes - cg.fixed_bytes) * _ilp._MB
        for members in by.values():
            rep = self.contexts[members[len(members) // 2]]      # a middle block: the usual context
            k_none = rep.score(()).kept
            fam = _Family(members, rep, lambda rep=rep, k=k_none: SegmentILP(rep.sub, opts, k), min_gap)
            self.families.append(fam)
            self._first_options(fam)
        self.types = len({s.type for s in self.segs if s.kind == "block"})
        self.refine_left = REFINE_SOLVES
        self.setup_s = time.perf_counter() - t0

    def _first_options(self, fam: _Family) -> None:
        """No regions and the least K (the ends of the front), then LEVELS gaps split, the widest
        first, WIDTH at a time; and the least-peak plan at LOW_PEAK of the front's K: the least in
        the first batch (one gap to split there), the others once the splits are done."""
        plans = [()]
        low = fam.ilp.least_kept()
        if low is not None:
            fam.front = sorted({fam.point(()), fam.point(low[0])}, key=lambda e: e[0])
            plans.append(low[0])
            splits, peaks = 0, 0
            while True:
                gaps = sorted(fam.gaps(), reverse=True)[:min(WIDTH, LEVELS - splits)]
                jobs = [fam.split(j) for _, j in sorted(gaps, key=lambda g: g[1])]
                splits += len(jobs)
                last = not gaps or splits >= LEVELS
                n = len(fam.front) - 1
                while peaks < min(LOW_PEAK, n) and len(jobs) < WIDTH and (peaks == 0 or last):
                    jobs.append(fam.least_peak(peaks * n // LOW_PEAK))
                    peaks += 1
                if not jobs:
                    break
                plans += [p for p in run_jobs(jobs) if p is not None]
        self._add(fam, plans)

    def _add(self, fam: _Family, plans) -> bool:
        """Offer `plans` to every member of `fam`, scored in its context; whether any was new."""
        new = [p for p in dict.fromkeys(plans) if p not in fam.plans]
        fam.plans += new
        for i in fam.members:
            seg = self.segs[i]
            scored = self.options[i] + [self.contexts[i].score(p) for p in new
                                        if all(self.ctx.space.candidate(r) is not None
                                               for r in _shift(p, seg.start - 1))]
            self.options[i] = _pareto(scored)
        return bool(new)

    def _refine(self, choice: list[int], most: int) -> int:
        """Up to `most` (at most WIDTH) more segment ILPs where the DP's choice lies, solved at once:
        for the options it picked (once each), the cheapest plan keeping no more at a lower peak in
        the segment graph; then the widest open gaps of the families' fronts next to a picked
        option. The ILPs solved: 0 when there is nothing left to search there."""
        most = min(most, WIDTH)
        jobs, gaps = [], []
        for fam in self.families:
            picked = {_shift(self.options[i][choice[i]].regions, -(self.segs[i].start - 1)) for i in fam.members}
            for p in sorted(picked - fam.lowered, key=lambda p: fam.plans.index(p)):
                if len(jobs) < most:
                    jobs.append(fam.lower(p))
            near = {j for j, (_, _, p) in enumerate(fam.front) if p in picked}
            gaps += [(area, j, fam) for area, j in fam.gaps() if j in near or j + 1 in near]
        # the widest first (a stable sort: ties in the families' and gaps' order)
        for _, j, fam in sorted(gaps, key=lambda g: g[0], reverse=True)[:most - len(jobs)]:
            jobs.append(fam.split(j))
        if not jobs:
            return 0
        for job, plan in zip(jobs, run_jobs(jobs)):
            if plan is not None:
                self._add(job.family, [plan])
        return len(jobs)

    def _plan(self, budget: int) -> tuple[tuple[Region, ...], int] | None:
        """The chain DP's plan within `budget` (options refined around its choice first, as long as
        `self.refine_left` segment ILPs are left) and the peak the chain predicts for it."""
        got = chain_dp(self.options, budget)
        while got is not None and self.refine_left > 0:
            made = self._refine(got[1], self.refine_left)
            if not made:
                break
            self.refine_left -= made
            got = chain_dp(self.options, budget)
        if got is None:
            return None
        regions, peak, kept = [], 0, 0
        for opts, oi in zip(self.options, got[1]):
            o = opts[oi]
            regions += o.regions
            peak, kept = max(peak, kept + o.peak), kept + o.kept
        return tuple(regions), peak

    def _evals(self, opts: SolveOptions) -> int:
        """The local search's plans to score: `improve_evals`, at most LOCAL_SEARCH_WORK / nodes (each
        costs a pass over the graph; the chain's plan leaves it less to find than the flat ILP's)."""
        return min(opts.improve_evals, max(LOCAL_SEARCH_MIN, LOCAL_SEARCH_WORK // len(self.cg.nodes)))

    def _label(self) -> str:
        n = sum(s.kind == "block" for s in self.segs)
        return f"hierarchical: {n} blocks of {self.types} type{'s' if self.types > 1 else ''}"

    def compact_candidates(self) -> list:
        """The flat ILP's candidates for polishing ([] when more than POLISH_CANDIDATES): every region of every segment's options (each
        family's on each of its members, plain and keeping), the known plans' regions, and the regions across each
        segment boundary that start where a region of the segment before starts and end where one
        of the segment after ends, or that reach up to CROSS positions across it (a region from one
        block's attention into the next block's first norm)."""
        space = self.ctx.space
        per_seg: list[set[Region]] = [set() for _ in self.segs]
        for fam in self.families:
            for i in fam.members:
                for p in fam.plans:
                    per_seg[i].update(v for r in _shift(p, self.segs[i].start - 1)
                                      for v in space.variants(r.start, r.end))
        regions: set[Region] = set().union(*per_seg)
        for plan in known_plans(self.cg, self.opts.sac).values():
            regions.update(plan)
        for i, seg in enumerate(self.segs[:-1]):
            here = space.between(seg.start, seg.end)
            there = space.between(self.segs[i + 1].start, self.segs[i + 1].end)
            starts = {r.start for r in per_seg[i]} | set(here[-CROSS:])
            ends = {r.end for r in per_seg[i + 1]} | set(there[:CROSS])
            for a in starts:
                for b in ends:
                    regions.update(space.variants(a, b))
        if len(regions) > POLISH_CANDIDATES:        # too many to polish with: not made
            return []
        out = [space.candidate(r) for r in sorted(regions, key=lambda r: (r.start, r.end, r.saved))]
        return [c for c in out if c is not None]

    def _polish(self):
        """The polishing ILP's candidates: the compact ones and those the flat path offers
        (candidates.candidates: between low-crossing cuts, the most efficient short regions; every
        region on small graphs), when there are at most POLISH_CANDIDATES of them; else None (on
        large graphs the flat ILP does not improve on the chain within its limits)."""
        if not hasattr(self, "_compact"):
            cands = {c.region: c for c in self.compact_candidates()}
            if 0 < len(cands) <= POLISH_CANDIDATES:
                cands.update((c.region, c) for c in candidates(self.cg, self.opts, self.ctx.space))
            self._compact = list(cands.values()) if 0 < len(cands) <= POLISH_CANDIDATES else None
        return self._compact

    def solve(self, cg: CostGraph, budget_bytes: int, opts: SolveOptions | None = None,
              warm_start: tuple[Region, ...] = (), cands=None, ctx: Search | None = None):
        """Least-recompute plan whose simulated peak fits `budget_bytes`: the chain (NOTE [ chain ]),
        judged by the simulator and corrected, polished by the flat ILP over the compact candidates
        on small graphs, then local search; from `warm_start` (a known plan that fits) when the
        chain finds none. None when nothing fits. Called like planner.solve.solve_ilp (`cg`, `cands`
        and `ctx` are this solver's own)."""
        t0 = time.perf_counter()
        opts = opts or self.opts
        self.refine_left = REFINE_SOLVES
        best, effective, tried = None, budget_bytes, set()
        for _ in range(ROUNDS):
            got = self._plan(effective)
            if got is None or got[0] in tried:
                break
            regions, predicted = got
            tried.add(regions)
            tl = timeline(self.cg, regions)
            if tl.peak_bytes <= budget_bytes:
                if best is None or tl.recompute_s < best[0]:
                    best = (tl.recompute_s, regions)
                if budget_bytes - tl.peak_bytes < CLOSE * budget_bytes:
                    break
            # the next budget of the chain: corrected by how far its prediction missed this plan
            nxt = budget_bytes - (tl.peak_bytes - predicted)
            if nxt == effective:
                break
            effective = nxt
        label = self._label()
        if best is None and warm_start and timeline(self.cg, warm_start).peak_bytes <= budget_bytes:
            best = (timeline(self.cg, warm_start).recompute_s, warm_start)
            label += " (no chain fits: from a known plan)"
        compact = self._polish()
        if compact is not None:
            sol = _ilp.solve_ilp(self.cg, budget_bytes, replace(opts, improve_evals=0,
                                                                max_nodes=min(opts.max_nodes, POLISH_NODES)),
                                 warm_start=best[1] if best else (), cands=compact, ctx=self.ctx)
            if sol is not None and (best is None or timeline(self.cg, sol.regions).recompute_s < best[0]):
                best, label = (timeline(self.cg, sol.regions).recompute_s, sol.regions), label + "; polished by the ILP"
        if best is None:
            return None
        regions = best[1]
        if opts.improve_evals:
            better = improve(self.cg, regions, budget_bytes, self._evals(opts), ctx=self.ctx)
            if better != regions:
                regions, label = better, label + "; improved by local search"
        return _ilp.Solution(regions, label, float("nan"), time.perf_counter() - t0)

    def min_peak(self, *args, **kwargs):
        """Regions of least peak, like solve_min_peak: the chain's least budget, polished on small
        graphs, then local search from it and from the known plan of least peak."""
        t0 = time.perf_counter()
        self.refine_left = REFINE_MIN_PEAK
        got = self._plan(chain_min_peak(self.options))
        regions = got[0] if got else ()
        label = self._label() + ": least peak"
        key = lambda r: (timeline(self.cg, r).peak_bytes, timeline(self.cg, r).recompute_s)  # noqa: E731
        compact = self._polish()
        if compact is not None:
            sol = _ilp.solve_min_peak(self.cg, replace(self.opts, improve_evals=0,
                                                       max_nodes=min(self.opts.max_nodes, POLISH_NODES)),
                                      cands=compact, ctx=self.ctx)
            if key(sol.regions) < key(regions):
                regions, label = sol.regions, label + "; polished by the ILP"
        if self.opts.improve_evals:
            known = min(known_plans(self.cg, self.opts.sac).values(), key=key, default=())
            starts = [regions] + ([known] if known and known != regions else [])
            done = [improve(self.cg, r, None, self._evals(self.opts) // len(starts), ctx=self.ctx) for r in starts]
            better = min(done, key=key)
            if key(better) < key(regions):
                regions, label = better, label + "; improved by local search"
        return _ilp.Solution(regions, label, float("nan"), time.perf_counter() - t0)


def _pareto(options: list[Option]) -> list[Option]:
    """Options no other beats in kept bytes, peak and cost at once (no regions always stays)."""
    out = []
    for o in sorted(options, key=lambda o: (o.cost_s, o.kept, o.peak)):
        if not any(p.kept <= o.kept and p.peak <= o.peak and p.cost_s <= o.cost_s for p in out):
            out.append(o)
    return out


def _settled(cg: CostGraph, segs: list[Segment]) -> list[frozenset]:
    """Per segment, the storages made before it that an earlier segment other than the producer's
    reads or holds too (a mask or rotary table every block reads): the first segment after the
    producer's that reads it decides whether it is kept (NOTE [ chain ])."""
    seg_of = [0] * len(cg.nodes)
    for i, sg in enumerate(segs):
        seg_of[sg.start:sg.end + 1] = [i] * (sg.end - sg.start + 1)
    out: list[set[int]] = [set() for _ in segs]
    for sid, s in enumerate(cg.storages):
        readers = sorted({seg_of[v] for v in s.users + s.holders} - {seg_of[s.producer]})
        for i in readers[1:]:
            out[i].add(sid)
    return [frozenset(x) for x in out]


def for_graph(cg: CostGraph, opts: SolveOptions, ctx: Search) -> HierarchicalSolver | None:
    """The hierarchical solver where it is the better path, else None (the flat path): the graph
    has more start/end pairs than the exact flat ILP takes (candidates.FULL_PAIRS) and the caller
    did not ask for every region, it has repeated blocks (two in one family at least), and no
    segment outside the blocks is too large for its own exact ILP (SEGMENT_PAIRS)."""
    pos = ctx.space.positions
    n = len(cg.nodes)
    if len(pos) * (len(pos) + 1) // 2 <= FULL_PAIRS or (opts.max_cuts >= n - 1 and opts.max_span >= n):
        return None
    segs = segments(cg)
    fams = [s.family for s in segs if s.kind == "block"]
    if len(set(fams)) == len(fams):
        return None
    for s in segs:
        p = len(ctx.space.between(s.start, s.end))
        if s.kind == "other" and p * (p + 1) // 2 > SEGMENT_PAIRS:
            return None
    return HierarchicalSolver(cg, opts, ctx)
