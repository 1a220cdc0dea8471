"""Replay a plan on a CostGraph: the exact memory timeline of one step under the liveness model.

NOTE [ liveness ]
Nodes 0..n-1 run forward in order (the last is the loss), then backward runs n-1..0.
Fixed bytes F (parameters, buffers, inputs) are live throughout. A storage s of b_s bytes is
made by node p_s. Under a plan (regions R = [a..b] with SAC-saved nodes S_R) s is *kept* for
backward when
  (i)   a holder of s (a node whose autograd saved s) lies outside every region, or
  (ii)  s is an input of a region (read inside R, made outside R: checkpoint keeps its inputs), or
  (iii) p_s is a saved node of a region (SAC caches its outputs), or
  (iv)  the caller holds s (`StorageCost.output`): part of the model's output when the plan
        keeps the output (PlanOptions.keep_output), or a storage that outlives the step.
Forward: s is live from p_s until its last reader, or to the end of forward when kept. The peak
during node t is live_start(t) + fwd_extra_t (measured on fake tensors) + fwd_held_t.
Backward, at node t: live(t) = F + G_param(t) + G_act(t) + K(t) + W(t) + bwd_extra_t + H_t, where
  G_param(t) = parameter grads made by nodes >= t (they stay),
  G_act(t)   = grads of outputs of nodes u with u <= t <= last reader of u (in flight),
  K(t)       = kept storages not yet released; a storage is released after the backward of the
               lowest node that needs it (a holder outside regions, or the start of a region it
               is an input or SAC output of); outputs are released only at the end,
  W(t)       = the recompute working set of t's region: storages made in R by non-saved nodes
               and held by nodes of R, from the region's first unpack (top(R), the last holder)
               until the backward of their lowest holder in R.
  H_t        = what a data-parallel engine holds at t (`bwd_held_bytes`: FSDP2's unsharded
               parameters of the units in flight, gradients before their reduce-scatter;
               planner/distributed.py); forward adds `fwd_held_bytes` the same way. Unlike
               bwd_extra_t, H_t is live while t's region recomputes (it is in the `outside` below).
A pipeline rank (`CostGraph.inflight` = (a, b, c, d): the most other micro-batches in flight in a
forward before any backward, a forward after one, the first backward, a later backward) adds, with
R what one micro-batch retains from its forward to its backward (its kept storages and outputs,
`retained_bytes`) and G all parameter grads: forward max(a R, G + b R); backward at t
max(c R, G - G_param(t) + d R) (after the first backward every parameter grad exists), each term
only where the schedule has such an action; the optimizer's step aside (`pipeline_adds`).
Each region also keeps the host RNG state checkpoint stashes (`CostGraph.region_state_bytes`, 0 on a
device; NOTE [ host RNG states ] in planner/step/storage.py): from its start to the end of forward
and in backward until after its lowest saving node (the lowest node of R that holds a storage:
its saved tensors reference checkpoint's frame, which holds the state), only over its own nodes
when none of them saves; its recomputation holds one more (fork_rng's); a pipeline micro-batch
retains the states of its saving regions.
After backward, when the step planned has one, the optimizer steps: live are F (its state among
them), every parameter grad, the kept outputs and the step's measured temporaries.
At top(R), the recomputation itself runs, when top(R)'s backward starts: its peak is what is live
then outside it (live(top(R)) less W and bwd_extra, and less what top(R)'s backward makes: the
gradients it completes and the parameter gradients that first appear there,
`made_in_backward`), plus the recomputed storages made so far, plus region intermediates still
to be read, plus the node's fwd_extra, over the ops it runs (top(R) only when `runs_top`: a top
stopped before it computes never makes its output). Counting those made the simulator high:
the top's output on 139 of the mlp's 208 such single regions (up to 2 MB; 1.1% on an hf-bert
plan the ILP then passed over), the top's gradients on 59 of the unet's 226 (up to 4.6%: the
unet's least-peak plan simulated 4.1% over its replay; tests/test_simulate.py). The step's peak
is the maximum
over both passes. Recompute cost: nodes of R up to top(R), less the saved ones (torch stops
recomputing once the last saved tensor is back), top(R) itself only when it saves a storage it
makes (`runs_top`: an op packs its inputs before it computes and its outputs after, so a top
that saves only its inputs, a Linear or a GELU, is stopped before it computes), plus a fixed
cost per region and, with a SAC policy, a cost per op of the region (the policy's dispatch mode
runs for each).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import NamedTuple

from remat.planner.costgraph import CostGraph
from remat.planner.result import Region


@dataclass(frozen=True)
class Timeline:
    fwd: tuple[int, ...]      # peak live bytes during each node's forward
    bwd: tuple[int, ...]      # peak live bytes during each node's backward
    recompute_flops: int
    recompute_s: float
    opt: int = 0              # peak live bytes during the optimizer's step (0: none planned)

    @property
    def peak_bytes(self) -> int:
        return max(max(self.fwd), max(self.bwd), self.opt)

    @property
    def phase(self) -> str:
        """The part of the step that holds the peak: "forward", "backward" or "optimizer step"."""
        top = self.peak_bytes
        return "forward" if max(self.fwd) == top else ("backward" if max(self.bwd) == top else "optimizer step")


class Base(NamedTuple):
    """The live bytes every plan has (NOTE [ liveness ] without K, J and W), computed here only:
    the simulator, the ILP (planner/solve/ilp.py), the local search (planner/solve/improve.py) and the
    candidates (planner/solve/candidates.py) all start from it."""
    fwd: tuple[int, ...]        # F + storages between their producer and last reader + fwd_extra_t,
                                # plus outputs kept to the end of forward
    bwd: tuple[int, ...]        # F + G_param(t) + G_act(t) + outputs + bwd_extra_t
    crossing: tuple[int, ...]   # bytes made at <= i and read at > i: live across the cut after node i
    opt: int = 0                # the optimizer's step: F + all parameter grads + outputs + its
                                # temporaries (0 when the step planned has none)


class Recompute(NamedTuple):
    """What one region costs in backward (simulate.region_recompute)."""
    work: tuple[int, ...]     # per node of the region: its recompute working set W
    top: int | None           # top(R): where the recomputation runs (None: it recomputes nothing)
    peak: int                 # the recomputation's own peak, above what is live outside it
    flops: int                # recomputed FLOPs
    seconds: float            # estimated recompute time, the region's fixed costs included


def last_reader(s) -> int:
    """The last node that reads storage `s` in forward (its producer when none does)."""
    return max(s.users, default=s.producer)


def base_liveness(cg: CostGraph) -> Base:
    got = cg.memo.get("base")
    if got is None:
        got = cg.memo["base"] = _base_liveness(cg)
    return got


def _base_liveness(cg: CostGraph) -> Base:
    n = len(cg.nodes)
    fwd_d, bwd_d, between = [0] * (n + 1), [0] * (n + 1), [0] * (n + 1)
    for s in cg.storages:
        last = last_reader(s)
        _prefix_add(between, s.producer + 1, last, s.bytes)   # live at the start of these nodes
        if s.output:                                           # kept for the caller, always
            _prefix_add(fwd_d, last + 1, n - 1, s.bytes)
            _prefix_add(bwd_d, 0, n - 1, s.bytes)
    for i, c in enumerate(cg.nodes):
        _prefix_add(bwd_d, i, c.grad_last_user, c.grad_bytes)
        _prefix_add(bwd_d, 0, i, c.param_grad_bytes)
    outputs, bwd_live, live = _cumsum(fwd_d), _cumsum(bwd_d), _cumsum(between) + [0]
    opt = 0
    if cg.optimizer_step_bytes is not None:
        opt = (cg.fixed_bytes + sum(c.param_grad_bytes for c in cg.nodes) + cg.optimizer_step_bytes
               + sum(s.bytes for s in cg.storages if s.output))
    nodes = cg.nodes
    return Base(tuple(cg.fixed_bytes + live[t] + outputs[t] + nodes[t].fwd_extra_bytes + nodes[t].fwd_held_bytes
                      for t in range(n)),
                tuple(cg.fixed_bytes + bwd_live[t] + nodes[t].bwd_extra_bytes + nodes[t].bwd_held_bytes for t in range(n)),
                tuple(live[i + 1] for i in range(n)), opt)


def region_index(n: int, regions: tuple[Region, ...]) -> list[int]:
    """For each node, the index of its region, or -1."""
    where = [-1] * n
    for k, r in enumerate(regions):
        for i in range(r.start, r.end + 1):
            assert where[i] == -1, "regions overlap"
            where[i] = k
    return where


def _prefix_add(arr: list[int], lo: int, hi: int, v: int) -> None:
    """Add v over arr[lo..hi] in a difference array."""
    if lo <= hi:
        arr[lo] += v
        arr[hi + 1] -= v


def _cumsum(diff: list[int]) -> list[int]:
    out, acc = [], 0
    for d in diff[:-1]:
        acc += d
        out.append(acc)
    return out


def keep_release(cg: CostGraph, regions: tuple[Region, ...], where: list[int],
                 tops: list[int | None]) -> list[int | None]:
    """Per storage: the node after whose backward it is released, or None if not kept (see NOTE)."""
    rel: list[int | None] = []
    for s in cg.storages:
        cands = [h for h in s.holders if where[h] < 0]
        k = where[s.producer]
        if k >= 0 and s.producer in regions[k].saved:
            # SAC cache: handed to the recomputation (and its holders) when it reaches p_s
            r, top = regions[k], tops[k]
            inner = [h for h in s.holders if h in r]
            cands.append(min(inner) if inner and top is not None and s.producer <= top else r.start)
        for u in s.users:
            k = where[u]
            if k >= 0 and s.producer not in regions[k]:
                cands.append(regions[k].start)
        if s.output:
            cands.append(0)
        rel.append(min(cands) if cands else None)
    return rel


def timeline(cg: CostGraph, regions: tuple[Region, ...]) -> Timeline:
    n = len(cg.nodes)
    where = region_index(n, regions)
    recomputes = [region_recompute(cg, r) for r in regions]
    rel = keep_release(cg, regions, where, [rc.top for rc in recomputes])
    base = base_liveness(cg)
    fwd_d, bwd_d = [0] * (n + 1), [0] * (n + 1)
    for s, r in zip(cg.storages, rel):
        if r is not None and not s.output:                      # outputs are in the base
            _prefix_add(fwd_d, last_reader(s) + 1, n - 1, s.bytes)   # kept: live to the end of forward
            _prefix_add(bwd_d, r, n - 1, s.bytes)
    state = cg.region_state_bytes
    for r in regions if state else ():
        low = state_release(cg, r)
        _prefix_add(fwd_d, r.start, n - 1 if low is not None else r.end, state)
        if low is not None:
            _prefix_add(bwd_d, low, n - 1, state)
    fwd_kept, bwd_kept = _cumsum(fwd_d), _cumsum(bwd_d)
    fwd = tuple(base.fwd[t] + fwd_kept[t] for t in range(n))
    bwd = [base.bwd[t] + bwd_kept[t] for t in range(n)]
    flops, secs = 0, 0.0
    if cg.inflight:                                       # the other micro-batches in flight
        fwd_add, bwd_add = pipeline_adds(cg, retained_bytes(cg, rel, regions))
        fwd = tuple(f + fwd_add for f in fwd)
        bwd = [b + a for b, a in zip(bwd, bwd_add)]
    for r, rc in zip(regions, recomputes):
        for t in range(r.start, r.end + 1):
            bwd[t] += rc.work[t - r.start]
        if rc.top is not None:
            outside = bwd[rc.top] - rc.work[rc.top - r.start] - cg.nodes[rc.top].bwd_extra_bytes
            bwd[rc.top] = max(bwd[rc.top], outside + rc.peak)
        flops, secs = flops + rc.flops, secs + rc.seconds
    return Timeline(fwd, tuple(bwd), flops, secs, base.opt)


def retained_bytes(cg: CostGraph, rel: list[int | None], regions: tuple[Region, ...]) -> int:
    """What one micro-batch holds from its forward to its backward under a plan: the storages it
    keeps (`keep_release`'s not None), its outputs and its saving regions' RNG states. A pipeline
    rank holds it once per other micro-batch in flight (`CostGraph.inflight`) throughout the step
    (NOTE [ liveness ])."""
    states = cg.region_state_bytes * sum(state_release(cg, r) is not None for r in regions) if cg.region_state_bytes else 0
    return states + sum(s.bytes for s, r in zip(cg.storages, rel) if r is not None or s.output)


def state_release(cg: CostGraph, r: Region) -> int | None:
    """The node after whose backward region `r`'s host RNG state is freed: its lowest node that
    holds a storage (None: none does, and the state is freed as its forward ends)."""
    got = cg.memo.get("savers")
    if got is None:
        got = cg.memo["savers"] = sorted({h for s in cg.storages for h in s.holders})
    k = bisect_left(got, r.start)
    return got[k] if k < len(got) and got[k] <= r.end else None


def grads_before(cg: CostGraph) -> tuple[int, ...]:
    """Per backward node t: the parameter grads made by nodes before t (all, less G_param(t));
    made once per graph (the local search's judge asks at every plan it scores)."""
    got = cg.memo.get("grads before")
    if got is None:
        got = cg.memo["grads before"] = tuple(accumulate((c.param_grad_bytes for c in cg.nodes[:-1]), initial=0))
    return got


def pipeline_adds(cg: CostGraph, retained: int) -> tuple[int, list[int]]:
    """What a pipeline rank adds to a forward node, and to each backward node (NOTE [ liveness ]),
    when one micro-batch retains `retained` bytes."""
    a, b, c, d = cg.inflight
    grads = grads_before(cg)
    total = grads[-1] + cg.nodes[-1].param_grad_bytes
    fwd = max(a * retained if a >= 0 else 0, total + b * retained if b >= 0 else 0)
    bwd = [max(c * retained if c >= 0 else 0, g + d * retained if d >= 0 else 0) for g in grads]
    return fwd, bwd


def plan_retained(cg: CostGraph, regions: tuple[Region, ...]) -> int:
    """`retained_bytes` of a plan."""
    where = region_index(len(cg.nodes), regions)
    return retained_bytes(cg, keep_release(cg, regions, where, [region_recompute(cg, r).top for r in regions]), regions)


class OneMicrobatch(NamedTuple):
    """A pipeline rank's graph as one micro-batch's step (NOTE [ pipeline chain ] in chain.py)."""
    cg: CostGraph      # inflight (): what the other micro-batches add at the reference R0, as held bytes
    per_byte: int      # k: the most those adds grow per byte retained above R0 (0: one step)
    fixed: int         # bytes every micro-batch retains whatever the plan (its outputs), less R0


def one_microbatch(cg: CostGraph, at: int = 0) -> OneMicrobatch:
    """`cg` (a pipeline rank's, `CostGraph.inflight`) with `pipeline_adds` at R0 = `at` bytes
    retained in each node's held bytes: for every plan, timeline(cg) <= timeline(one.cg) + k max(0,
    retained_bytes - R0), equal at R0, and everywhere when the schedule's four counts are equal
    (1F1B) and R0 = 0: each add is a max of terms linear in R, of slope a, b, c or d (k the
    largest), and never less at R0 than below it. A graph of one step comes back as it is, k = 0."""
    if not cg.inflight:
        return OneMicrobatch(cg, 0, 0)
    fwd0, bwd0 = pipeline_adds(cg, at)
    nodes = tuple(replace(c, fwd_held_bytes=c.fwd_held_bytes + fwd0, bwd_held_bytes=c.bwd_held_bytes + b)
                  for c, b in zip(cg.nodes, bwd0))
    return OneMicrobatch(replace(cg, nodes=nodes, inflight=()), max(0, *cg.inflight),
                         sum(s.bytes for s in cg.storages if s.output) - at)


def made_in_backward(cg: CostGraph) -> list[int]:
    """Per node t, the bytes the base liveness counts at t's backward that t's backward makes: the
    gradients it completes first (of the nodes whose last reader is t) and the parameter
    gradients that first appear there. A recomputation at top(R) runs before they exist."""
    got = cg.memo.get("made_in_backward")
    if got is None:
        got = [c.param_grad_bytes for c in cg.nodes]
        for i, c in enumerate(cg.nodes):
            if i < c.grad_last_user < len(got):
                got[c.grad_last_user] += c.grad_bytes
        cg.memo["made_in_backward"] = got
    return got


def runs_top(cg: CostGraph, top: int) -> bool:
    """Whether a recompute whose last saved tensor node `top` holds runs `top`'s own op: only
    when it saves something it makes (NOTE [ liveness ]: recompute cost)."""
    return any(top in s.holders for s in cg.made_by[top])


def region_recompute(cg: CostGraph, r: Region) -> Recompute:
    """Working set per node of R in backward, top(R), the recompute's own peak, and its cost."""
    got = cg.memo.get(r)
    if got is None:
        got = cg.memo[r] = _region_recompute(cg, r)
    return got


def _tables(cg: CostGraph) -> tuple:
    """Per node, what `_region_recompute` reads of it, as plain lists (made once per graph): the
    storages it makes as (bytes, producer, holders sorted, last reader), its forward extra bytes,
    FLOPs, cost, ops, and whether a recompute stopping at it runs it (`runs_top`)."""
    got = cg.memo.get("recompute tables")
    if got is None:
        nodes = cg.nodes
        made = [tuple((s.bytes, s.producer, tuple(sorted(set(s.holders))), last_reader(s)) for s in m)
                for m in cg.made_by]
        got = cg.memo["recompute tables"] = (
            made, [c.fwd_extra_bytes for c in nodes], [c.flops for c in nodes], [c.cost_s for c in nodes],
            [c.ops for c in nodes], [runs_top(cg, j) for j in range(len(nodes))])
    return got


def _region_recompute(cg: CostGraph, r: Region) -> Recompute:
    """(NOTE [ liveness ]) The storages R's nodes make (not those of its SAC-kept nodes) that a node
    of R holds are recomputed: each is part of the working set W from its first holder in R to
    top(R), the last holder in R of any of them, and live in the recomputation's forward from its
    producer on; the others pass through it, live from their producer to their last reader in R."""
    made, fwd_extra, flops, cost, ops, runs = _tables(cg)
    lo, hi = r.start, r.end
    size = hi - lo + 1
    saved = set(r.saved)
    work_d, live_d = [0] * (size + 1), [0] * (size + 1)      # difference arrays over R's nodes
    top, recomputed = -1, []
    for i in range(lo, hi + 1):
        if i in saved:
            continue
        for b, p, holders, last in made[i]:
            a, z = bisect_left(holders, lo), bisect_right(holders, hi)
            if a < z:                                 # held in R: recomputed
                recomputed.append((b, p, holders[a]))
                top = max(top, holders[z - 1])
            elif p < min(last, hi):                   # passing: live until its last reader in R
                live_d[p + 1 - lo] += b
                live_d[min(last, hi) - lo + 1] -= b
    if top < 0:
        return Recompute((0,) * size, None, 0, 0, 0.0)
    for b, p, first in recomputed:
        work_d[first - lo] += b
        work_d[top - lo + 1] -= b
        if p < hi:                                    # recomputed so far: live to R's end
            live_d[p + 1 - lo] += b
            live_d[size] -= b
    work = tuple(accumulate(work_d[:-1]))
    live = list(accumulate(live_d[:-1]))
    end = top + 1 if runs[top] else top               # the ops the recomputation runs: lo..end-1
    # above what is live outside it: the base at top(R) less what top(R)'s own backward makes
    # (it runs before that backward computes)
    peak = max((live[j - lo] + fwd_extra[j] for j in range(lo, end)), default=0)
    peak += cg.region_state_bytes - made_in_backward(cg)[top]      # fork_rng's state while it runs
    todo = [j for j in range(lo, end) if j not in saved] if saved else range(lo, end)
    overhead = cg.region_s + (cg.sac_op_s * sum(ops[lo:hi + 1]) if saved else 0.0)
    return Recompute(work, top, peak, sum(flops[j] for j in todo), overhead + sum(cost[j] for j in todo))
