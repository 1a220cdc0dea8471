"""A solver that scales: repeated blocks solved once, then chained (pure: no torch).

The flat ILP (planner/solve/ilp.py) is exact when every region is offered (planner/solve/candidates.py,
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
   built from planner/solve/ilp.py's own pieces; `SegmentILP`) gets one more constraint: K, the bytes
   the segment keeps for backward, at most a level. The epsilon-constraint method on K (the
   cheapest plan keeping at most a level) traces the segment's Pareto front of K against recompute,
   its widest gaps searched first (LEVELS solves). The cheapest plans come from the segment's
   exact front, made once by a DP over its boundaries (planner/solve/front.py, NOTE [ front DP ]: no CBC
   run; the ILP answers where the DP would carry too much), and every point of that front is an
   option too. Plans of a lower peak at the options each budget picks, and of least peak at
   LOW_PEAK levels (made when the floor is sought, or when no chained plan fits a budget without
   them: NOTE [ least peak when needed ]), come from the same DP with the peak checked at every node
   (planner/solve/lower.py, NOTE [ lower DP ]: no CBC run either); where the DP would carry too much,
   from the segment ILP with a bound on the peak. Each plan is scored in the context of every
   segment of its family (`Option`: K, M, recompute).
   The ILPs are solved WIDTH at a time (`run_jobs`: each job on its own copy of the family's
   SegmentILP, CBC a process each, results taken in a fixed order; the widest WIDTH gaps at once),
   and a split by ILP starts CBC from the gap's lower point (it keeps less than the level: it is feasible).
4. *The chain* and 5. *the judge*: one option per segment, picked by a DP over the bytes kept so
   far, replayed by the simulator and corrected, polished by the flat ILP on small graphs
   (planner/solve/chain.py, NOTE [ chain ]). A pipeline rank's segments are scored as one
   micro-batch's, and its chain weighs what the other micro-batches in flight retain (NOTE
   [ pipeline chain ]); the judge, the polish and the local search see the rank's own graph.

The structure (blocks, segments) is in planner/solve/blocks.py, a segment alone in planner/solve/segment.py.
"""
from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import NamedTuple


from remat.planner.solve import ilp as _ilp
from remat.planner.solve.baselines import every_block, known_plans
from remat.planner.solve.blocks import Segment, segments
from remat.planner.solve.candidates import FULL_PAIRS, candidates
from remat.planner.solve.chain import chain_dp, chain_min_peak, least_total, pipeline_dp
from remat.planner.costgraph import CostGraph
from remat.planner.solve.front import cheapest, front
from remat.planner.solve.improve import Search, evals, improve, search
from remat.planner.solve.lower import TooMuchWork, cheapest_under, least_peak_under
from remat.planner.solve.nogc import paused
from remat.planner.options import SolveOptions
from remat.planner.result import Region
from remat.planner.solve.segment import SEGMENT_PAIRS, Context, Option, SegmentILP, shift
from remat.planner.solve.simulate import base_liveness, one_microbatch, plan_retained, timeline

LEVELS = 8           # kept-bytes levels each segment's exact ILP is first solved at (its options)
LOW_PEAK = 2         # at how many of the K found the plan of least peak is solved for, when needed
FRONT_OPTIONS = 128  # points of an exact front offered as options, at most (evenly by rank): the chain
                     # DP's work grows with them (Mixtral's block fronts made it 24 s a call)
REFINE_SOLVES = 12   # per budget: at most this many more segment ILPs around the options the DP picked
REFINE_NEAR = 3      # ... for a budget within NEAR_BUDGET of one solved before (the budget correction's
NEAR_BUDGET = 0.02   # next round: the DP's choice lies where the fronts were refined already)
REFINE_MIN_PEAK = 4  # ... and for the least peak (whose cost matters less)
MIN_GAP = 1e-3       # a gap in a front narrower than this share of the activation bytes is not searched
ROUNDS = 5           # DP solves per budget when the simulator says the chained plan misses
CLOSE = 0.002        # ... stopping once a plan that fits is this close to the budget
POLISH_CANDIDATES = 2000         # the flat ILP over the options' regions (tiled, and across block
                                 # boundaries) runs when there are at most this many of them (the
                                 # exact fronts' options made gpt2's 1421 of 1500 more than 1500:
                                 # unpolished, its floor rose 2%) ...
POLISH_NODES = 100               # ... for at most this many branch-and-bound nodes: warm-started from
                                 # the chain's plan, it stops at this limit well before CBC's time
                                 # limit, so that a busy machine gets the same plan (at 1000, 100
                                 # and 0: the same plans on 15 hierarchical rows of benchmarks/
                                 # plan_time.py at 1000 and 100, hf-bert 0.7 points dearer at 0;
                                 # gpt2 u=0.75 7.2 -> 5.6 s at 100) ...
POLISH_SEARCH = ("heuristics off",)  # ... without CBC's primal heuristics (a budget's polish: warm-
                                 # started, its root heuristics took 1.4 s of gpt2 u=0.75's 2.4 s
                                 # polish and changed nothing: the same plans and floors on those 15 rows)
LOCAL_SEARCH_BUDGETED = 4      # a quarter of the local search's plans (improve.evals) after a solve for a
                               # budget: the chain's plan polished
                               # by the flat ILP left it nothing to find on any hierarchical row of
                               # benchmarks/plan_time.py (0 of 18 improved; 0.2-1.7 s each), while
                               # the least-peak search's starts it does improve (the floor)
CROSS = 3            # positions on each side of a segment boundary a polishing region may reach across
WIDTH = 3            # segment ILPs solved at once, each by its own CBC process (a constant, not the
                     # machine's core count: every machine makes the same plan)


class _Family:
    """Segments solved as one (blocks alike but for measured extra bytes, `Segment.family`; or one
    other segment), through one SegmentILP over its middle member's segment graph. Its plans are in
    that graph's indices, shared by every member. `front` holds the points of the Pareto front of
    (K, recompute) searched so far, in the representative's context (`exact`: the whole front by
    DP, which answers the searches); the gap between two of its points is searched
    by bisection on K (the cheapest plan keeping at most the middle: a new point of the front, or
    none there), and `searched` says how far up from the lower point a gap holds no point."""

    def __init__(self, members: list[int], rep: "Context", make_ilp, min_gap: float):
        self.members, self.rep, self.make_ilp = members, rep, make_ilp
        self.ilps = [make_ilp()]                      # one per batch slot (`ilp_at`), made when needed
        self.ilp = self.ilps[0]
        self.min_gap = max(min_gap, 4 * self.ilp.tol)      # MB: narrower gaps are not searched
        # the segment's whole (K, recompute) front over the ILP's candidates, K as the ILP reads it
        # (planner/solve/front.py): every plan the splits by ILP would find, without a CBC run; None where
        # the DP would carry too much (the ILP's splits search the front then)
        self.exact = front(self.ilp.sub, self.ilp.cands) if self.ilp.cands else None
        self.plans: list[tuple[Region, ...]] = []
        self.front: list[tuple[float, float, tuple[Region, ...]]] = []   # (K MB, seconds, plan), K ascending
        self.searched: dict[tuple[Region, ...], float] = {}             # upper point -> K searched up to
        self.lowered: set[tuple[Region, ...]] = set()                   # plans a lower peak was sought for

    def ilp_at(self, slot: int) -> SegmentILP:
        """This family's ILP for batch slot `slot` (a CBC run at a time each: they set their own levels)."""
        while len(self.ilps) <= slot:
            self.ilps.append(self.make_ilp(self.ilp.cands))   # the first's candidates: the same ILP
        return self.ilps[slot]

    def least_kept(self):
        """(plan, K MB) keeping the least, recompute breaking ties; None without candidates."""
        if self.exact is not None:
            return self.exact[0].plan, self.exact[0].kept_mb
        return self.ilp.least_kept()

    def point(self, plan) -> tuple[float, float, tuple[Region, ...]]:
        o = self.rep.score(plan)
        return o.kept * _ilp.MB, o.cost_s, plan

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
        if self.exact is not None:          # the exact front's answer: no CBC run
            got = cheapest(self.exact, mid)
            return Job(self, lambda _: None if got is None else (got.plan, got.kept_mb), take, ilp=False)
        return Job(self, lambda ilp: ilp.cheapest(mid, start=below[2]), take)

    def least_peak(self, at: int) -> "Job":
        """The least-peak plan keeping at most the K of front point `at` (the cheapest of least peak
        by the DP, `_by_dp`; else the segment ILP's short search)."""
        k = self.front[at][0]
        return (self._by_dp(lambda: least_peak_under(self.rep.sub, self.ilp.cands, k + self.ilp.tol))
                or Job(self, lambda ilp: ilp.least_peak(k), _plan_of))

    def lower(self, plan) -> "Job":
        """The cheapest plan keeping no more than `plan` at a lower peak in the segment graph (a block
        whose working set binds the budget; by the DP, `_by_dp`, else the segment ILP); once per plan."""
        self.lowered.add(plan)
        k = self.rep.score(plan).kept * _ilp.MB + self.ilp.tol
        peak = timeline(self.rep.sub, plan).peak_bytes
        cap = peak - math.ceil(self.ilp.tol / _ilp.MB)       # lower by the ILP's tolerance, as it reads it
        return (self._by_dp(lambda: cheapest_under(self.rep.sub, self.ilp.cands, k, cap))
                or Job(self, lambda ilp: ilp.cheapest(k, peak * _ilp.MB - self.ilp.tol), _plan_of))

    def _by_dp(self, answer) -> "Job | None":
        """A job answered now by `answer()` (a DP of NOTE [ lower DP ]: a Point, or None for no plan),
        with no CBC run, where the exact front was made; None where it was not or the DP would
        carry too much (the caller asks the segment ILP)."""
        if self.exact is None:
            return None
        try:
            got = answer()
        except TooMuchWork:
            return None
        return Job(self, lambda _: None if got is None else got.plan, lambda p: p, ilp=False)


def _plan_of(got):
    return None if got is None else got[0]


class Job(NamedTuple):
    """One segment ILP to solve: `solve(ilp)` on one of the family's SegmentILPs (in a worker
    thread: CBC runs as a process), `take(result)` back in order (the plan found, or None). With
    `ilp` False the answer comes from the family's exact front (`solve(None)`: no CBC run)."""
    family: _Family
    solve: object
    take: object
    ilp: bool = True


def run_jobs(jobs: list[Job]) -> list:
    """Solve `jobs` (at most WIDTH) at once, each ILP on its own SegmentILP, and take their results
    in order: the plans found (None where none). Each job's result depends on its ILP and level
    only, so the plans are those of solving them one after another."""
    on_ilp = [job for job in jobs if job.ilp]
    ilps = [job.family.ilp_at(slot) for slot, job in enumerate(on_ilp)]
    if len(on_ilp) <= 1:
        solved = [job.solve(ilp) for job, ilp in zip(on_ilp, ilps)]
    else:
        with ThreadPoolExecutor(len(on_ilp)) as pool:
            solved = list(pool.map(lambda job, ilp: job.solve(ilp), on_ilp, ilps))
    solved = iter(solved)                    # in the jobs' order
    return [job.take(next(solved) if job.ilp else job.solve(None)) for job in jobs]


class HierarchicalSolver:
    """The hierarchical solve of one graph (module docstring): segment options made once (and
    refined where each budget's chain needs them), solved per budget. `solve` and `min_peak` are
    called like planner.solve.ilp's solve_ilp and solve_min_peak and return its Solution."""

    def __init__(self, cg: CostGraph, opts: SolveOptions = SolveOptions(), ctx: Search | None = None):
        t0 = time.perf_counter()
        self.cg, self.opts = cg, opts
        self.ctx = ctx or search(cg, opts.sac)
        self.segs = segments(cg)
        # a pipeline rank's segments are scored as one micro-batch's (NOTE [ pipeline chain ])
        one = self.one = one_microbatch(cg, _reference_retained(cg))
        base = base_liveness(one.cg)
        settled = _settled(cg, self.segs)
        self.contexts = [Context(one.cg, s, base, settled[i]) for i, s in enumerate(self.segs)]
        self.options: list[list[Option]] = [[] for _ in self.segs]
        self.families: list[_Family] = []
        self.low_done = False
        by: dict[str, list[int]] = {}
        for i, s in enumerate(self.segs):
            by.setdefault(s.family, []).append(i)
        # a gap of the front narrower than this share of the step's activation bytes is not searched
        min_gap = MIN_GAP * (timeline(one.cg, ()).peak_bytes - cg.fixed_bytes) * _ilp.MB
        for members in by.values():
            rep = self.contexts[members[len(members) // 2]]      # a middle block: the usual context
            k_none = rep.score(()).kept
            fam = _Family(members, rep, lambda cands=None, rep=rep, k=k_none: SegmentILP(rep.sub, opts, k, cands),
                          min_gap)
            self.families.append(fam)
            self._first_options(fam)
        self.types = len({s.type for s in self.segs if s.kind == "block"})
        self.refine_left = REFINE_SOLVES
        self.budgets: list[int] = []                  # every budget solved for
        self.setup_s = time.perf_counter() - t0

    def _first_options(self, fam: _Family) -> None:
        """No regions and the least K (the ends of the front), then LEVELS gaps split, the widest
        first, WIDTH at a time (the least-peak plans are made when needed: `_low_peak_options`). With the
        exact front, its answers make the splits (no CBC run), and every point of it is an option
        too: a point's peak in the whole graph (M) is not what the DP chose it by, and the chain
        fits budgets by M as well. (Either alone planned some zoo rows dearer than the ILPs' points
        did: LEVELS points of the front, or every point with the least-peak levels taken among all
        of them.)"""
        plans = [()]
        low = fam.least_kept()
        if low is not None:
            fam.front = sorted({fam.point(()), fam.point(low[0])}, key=lambda e: e[0])
            plans.append(low[0])
            splits = 0
            while True:
                gaps = sorted(fam.gaps(), reverse=True)[:min(WIDTH, LEVELS - splits)]
                jobs = [fam.split(j) for _, j in sorted(gaps, key=lambda g: g[1])]
                splits += len(jobs)
                if not jobs:
                    break
                plans += [p for p in run_jobs(jobs) if p is not None]
        self._add(fam, plans + [p.plan for p in _spread(fam.exact or [], FRONT_OPTIONS)])

    # NOTE [ least peak when needed ]
    # Each family's least-peak plans at LOW_PEAK levels of K (a segment ILP each, with a bound on
    # the peak: a weak LP bound, so a short and costly search) were made with its first options,
    # 2 to 4 of a budget's 5 to 12 CBC runs. Budgets between the floor and the unplanned peak never
    # needed them: without them all 30 rows of benchmarks/plan_time.py plan the same plans and
    # floors at up to 2.8 CPU s less (u=0.5: hf-moe 8.8 -> 6.0, hf-llama 3.8 -> 2.5, gpt2 2.3 ->
    # 1.9; 2026-12-05-plan-time-lazy), and the 6 rows of benchmarks/scale.py the same plans. They
    # are made once, when the floor is sought (`min_peak`: the least peak is what they are for) or
    # when no chained plan fits a budget without them (`solve`: a budget near the floor).
    def _low_peak_options(self) -> None:
        """Once (NOTE [ least peak when needed ]): each family's least-peak plan at LOW_PEAK of its
        front's K, WIDTH at a time."""
        if self.low_done:
            return
        self.low_done = True
        jobs = []
        for fam in self.families:
            n = len(fam.front) - 1
            jobs += [fam.least_peak(p * n // LOW_PEAK) for p in range(min(LOW_PEAK, n))]
        for i in range(0, len(jobs), WIDTH):
            batch = jobs[i:i + WIDTH]
            for job, plan in zip(batch, run_jobs(batch)):
                if plan is not None:
                    self._add(job.family, [plan])

    def _add(self, fam: _Family, plans) -> bool:
        """Offer `plans` to every member of `fam`, scored in its context; whether any was new."""
        new = [p for p in dict.fromkeys(plans) if p not in fam.plans]
        fam.plans += new
        for i in fam.members:
            seg = self.segs[i]
            scored = self.options[i] + [self.contexts[i].score(p) for p in new
                                        if all(self.ctx.space.candidate(r) is not None
                                               for r in shift(p, seg.start - 1))]
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
            picked = {shift(self.options[i][choice[i]].regions, -(self.segs[i].start - 1)) for i in fam.members}
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
        got = self._dp(budget)
        while got is not None and self.refine_left > 0:
            made = self._refine(got[1], self.refine_left)
            if not made:
                break
            self.refine_left -= made
            got = self._dp(budget)
        if got is None:
            return None
        regions, peak, kept = [], 0, 0
        for opts, oi in zip(self.options, got[1]):
            o = opts[oi]
            regions += o.regions
            peak, kept = max(peak, kept + o.peak), kept + o.kept
        return tuple(regions), peak + (self.one.per_byte * max(0, kept + self.one.fixed) if self.one.per_byte else 0)

    def _dp(self, budget: int):
        """The chain DP (NOTE [ chain ]; a pipeline rank's: NOTE [ pipeline chain ])."""
        if self.one.per_byte:
            return pipeline_dp(self.options, budget, self.one.per_byte, self.one.fixed)
        return chain_dp(self.options, budget)

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
                    per_seg[i].update(v for r in shift(p, self.segs[i].start - 1)
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

    @paused
    def solve(self, cg: CostGraph, budget_bytes: int, opts: SolveOptions | None = None,
              warm_start: tuple[Region, ...] = (), cands=None, ctx: Search | None = None):
        """Least-recompute plan whose simulated peak fits `budget_bytes`: the chain (NOTE [ chain ]),
        judged by the simulator and corrected, polished by the flat ILP over the compact candidates
        on small graphs, then local search; from `warm_start` (a known plan that fits) when the
        chain finds none. None when nothing fits. Called like planner.solve.ilp.solve_ilp (`cg`, `cands`
        and `ctx` are this solver's own)."""
        t0 = time.perf_counter()
        opts = opts or self.opts
        near = any(abs(budget_bytes - b) <= NEAR_BUDGET * b for b in self.budgets)
        self.refine_left = REFINE_NEAR if near else REFINE_SOLVES
        self.budgets.append(budget_bytes)
        best = self._chained(budget_bytes)
        if best is None and not self.low_done:       # the least-peak options may reach it
            self._low_peak_options()
            best = self._chained(budget_bytes)
        label = self._label()
        if best is None and warm_start and timeline(self.cg, warm_start).peak_bytes <= budget_bytes:
            best = (timeline(self.cg, warm_start).recompute_s, warm_start)
            label += " (no chain fits: from a known plan)"
        compact = self._polish() if opts.polish else None
        if compact is not None:
            sol = _ilp.solve_ilp(self.cg, budget_bytes, replace(opts, improve_evals=0,
                                                                max_nodes=min(opts.max_nodes, POLISH_NODES)),
                                 warm_start=best[1] if best else (), cands=compact, ctx=self.ctx,
                                 cbc_options=POLISH_SEARCH)
            if sol is not None and (best is None or timeline(self.cg, sol.regions).recompute_s < best[0]):
                best, label = (timeline(self.cg, sol.regions).recompute_s, sol.regions), label + "; polished by the ILP"
        if best is None:
            return None
        regions = best[1]
        if opts.improve_evals:
            better = improve(self.cg, regions, budget_bytes,
                             evals(self.cg, opts.improve_evals) // LOCAL_SEARCH_BUDGETED,
                             ctx=self.ctx)
            if better != regions:
                regions, label = better, label + "; improved by local search"
        return _ilp.Solution(regions, label, float("nan"), time.perf_counter() - t0)

    def _chained(self, budget_bytes: int) -> tuple[float, tuple[Region, ...]] | None:
        """(recompute s, regions) of the cheapest chained plan whose simulated peak fits, or None."""
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
        return best

    @paused
    def min_peak(self, *args, **kwargs):
        """Regions of least peak, like solve_min_peak: the chain's least budget, polished on small
        graphs, then local search from it and from the known plan of least peak."""
        t0 = time.perf_counter()
        self._low_peak_options()
        self.refine_left = REFINE_MIN_PEAK
        k, fixed = self.one.per_byte, self.one.fixed
        got = self._plan(least_total(self.options, k, fixed)[0] if k else chain_min_peak(self.options))
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
            most = evals(self.cg, self.opts.improve_evals) // len(starts)
            done = [improve(self.cg, r, None, most, ctx=self.ctx) for r in starts]
            better = min(done, key=key)
            if key(better) < key(regions):
                regions, label = better, label + "; improved by local search"
        return _ilp.Solution(regions, label, float("nan"), time.perf_counter() - t0)


def _reference_retained(cg: CostGraph) -> int:
    """Where a pipeline rank's chain is exact (NOTE [ pipeline chain ]): 0 when the schedule's four
    counts are equal (then everywhere), else what one micro-batch retains with every block
    checkpointed (budgets lie near the per-block policy's peak); 0 for one step."""
    if len(set(cg.inflight)) <= 1:
        return 0
    return plan_retained(cg, every_block(cg))


def _spread(points: list, most: int) -> list:
    """At most `most` of `points`, evenly by rank, both ends kept."""
    if len(points) <= most:
        return points
    return [points[round(i * (len(points) - 1) / (most - 1))] for i in range(most)]


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


@paused
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
