"""The per-rank step of data-parallel training (FSDP2, DDP) as a CostGraph: plain math, no torch.

The profile measures one process running the unsharded model on the local batch. `per_rank`
turns that into what one rank holds, so the budget is bytes per rank and the simulator, the ILP
and the local search plan it unchanged (they all start from simulate.base_liveness).

NOTE [ per-rank memory ]
FSDP2 (`fully_shard` per unit, then the root). Unit U (a fully_shard module) runs the nodes
lo_U..hi_U of the graph; P_U are its parameters unsharded (in the dtype forward computes in),
S_U this rank's shard of them as stored, g_U its gradients unsharded, s_U this rank's shard of
them. Per rank:
  F'         = F - sum_U P_U + sum_U S_U + P_root: sharded parameters live throughout; the root
               unit's are all-gathered once and held for the step (FSDP2 does not reshard the
               root after forward); its all-gather's buffer (P_root) at node 0's forward, its
               reduce-scatter's input and output (g_root + s_root) at node 0's backward, the last,
  held fwd t = P_U while t runs in U (its all-gather), plus, at lo_U, the all-gather's own
               buffer (P_U, freed once copied out; its input S_U is a view of it), plus P_V of
               every unit V whose forward ran before t and that is not resharded after forward,
               plus the flat output of the latest all-gather (FSDP2 keeps it until it issues the
               next one, or until the root's post-forward: not while the loss, node n-1, runs),
  held bwd t = P_U and the prefetched P_U' of the unit whose backward comes next (t in U), the
               unsharded gradients of U's nodes >= t until U's reduce-scatter at lo_U, and there
               its input (g_U: FSDP2 copies the gradients in, frees them, then allocates the
               output, the shards s_U: the reduce-scatter holds max(2 g_U, g_U + s_U) = 2 g_U),
               the input of the latest reduce-scatter issued before (kept by FSDP2 until it
               issues the next: the unit after U's within U, the unit after t's root nodes in
               theirs), plus P_V of the units not resharded after forward whose backward has
               not run yet, plus the latest all-gather's flat output: none in the loss's
               backward, the first unit's (which the root's pre-backward prefetches) in the
               root's last nodes' (within a unit it is the prefetched P_U', counted once),
  param grad = U's gradient shards (x s_U / g_U) enter at lo_U, its reduce-scatter's output, live
               to the end; the root's stay whole until its reduce-scatter, the last.
The optimizer's state and step temporaries were measured on unsharded parameters: x S/P.
Recompute inside U runs during U's backward, when U's parameters are gathered again: held bwd
covers it (NOTE [ liveness ]: H_t is live while t's region recomputes). A region of the root's
own nodes (embedding, final norm, head) recomputes while the root's parameters are gathered: FSDP2
does not reshard the root after forward (fully_shard's default for the root: its lazy init sets
no post-forward mesh), and reshards it in the post-backward at the end of backward, so P_root in
F' covers it too (a root resharded after forward, reshard_after_forward=True passed to it, is
gathered again by its pre-backward, on its outputs, before any of its nodes runs backward).
Regions never span two units (costgraph.same_unit), nor the root's nodes and a unit's.
Staged collectives (Sharding.staged: gloo, on CPU): an all-gather stages through a temporary the
size of its output and a reduce-scatter through one the size of its input (measured on torch
2.13.0), so the prefetched unit's all-gather counts twice at the node where it is issued (U's
last, whose backward starts U's; the root's last node for the first unit of backward), and the
reduce-scatter holds its input, output and temporary (2 g_U + s_U, the gradients freed). Both
are waited for in the node that issues them; a temporary gloo's worker thread frees after that
wait is freed unseen by the profiler, and the measure bounds it (NOTE [ unseen frees ] in
runtime/measure/peak.py).
DDP: every rank holds the whole model; its gradient buckets (the reducer's flat copies of the
gradients, allocated at construction) are live throughout: F' = F + buckets.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from remat.planner.costgraph import CostGraph, NodeCost
from remat.planner.facts import StepFacts

@dataclass(frozen=True)
class Unit:
    """One fully_shard module as one rank sees it."""
    name: str                         # qualified module name; "" is the root
    unsharded_bytes: int              # P_U: its parameters all-gathered, in the dtype forward computes in
    shard_bytes: int                  # S_U: this rank's shard of them, as stored
    grad_bytes: int                   # g_U: their gradients unsharded (the compute dtype)
    grad_shard_bytes: int             # s_U: this rank's shard of the reduced gradients
    reshard_after_forward: bool = True


@dataclass(frozen=True)
class Sharding:
    """How the step is split over ranks: `engine` "fsdp" (units) or "ddp" (buckets)."""
    engine: str
    world_size: int
    units: tuple[Unit, ...] = ()      # FSDP2: the root ("") and every unit below it
    bucket_bytes: int = 0             # DDP: the reducer's gradient buckets
    backward_prefetch: int = 1        # FSDP2 all-gathers this many units ahead in backward
    staged: bool = False              # the collectives stage through a temporary of their full size (gloo)


def unit_of(module: str, names: tuple[str, ...]) -> str:
    """The innermost of `names` (qualified module names, "" the root) that contains `module`."""
    best = ""
    for u in names:
        if u and (module == u or module.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def per_rank(cg: CostGraph, sharding: Sharding) -> CostGraph:
    """`cg` (one process, the unsharded model, the local batch) as one rank of `sharding` holds it
    (NOTE [ per-rank memory ])."""
    if sharding.engine == "ddp":
        return replace(cg, fixed_bytes=cg.fixed_bytes + sharding.bucket_bytes,
                       meta=StepFacts.noted(cg.meta, distributed=_meta(sharding)))
    if sharding.engine != "fsdp":
        raise ValueError(f"unknown data-parallel engine {sharding.engine!r}: 'fsdp' or 'ddp'")
    units = {u.name: u for u in sharding.units}
    names = tuple(units)
    where = [unit_of(c.module, names) for c in cg.nodes[:-1]] + [""]    # the loss runs in the root
    spans = _spans(where)
    fwd, bwd = _held(len(cg.nodes), spans, units, sharding.backward_prefetch, sharding.staged)
    _add_grads(cg, where, spans, units, bwd, sharding.staged)
    nodes = [_node(c, u, f, b, units[u] if u else None) for c, u, f, b in zip(cg.nodes, where, fwd, bwd)]
    for lo, hi in spans.values():     # a unit's gradient shards appear at its reduce-scatter, after lo's backward
        made = sum(c.param_grad_bytes for c in nodes[lo:hi + 1])
        nodes[lo:hi + 1] = [replace(c, param_grad_bytes=made if i == lo else 0)
                            for i, c in enumerate(nodes[lo:hi + 1], lo)]
    nodes = tuple(nodes)
    full = sum(u.unsharded_bytes for u in sharding.units)
    shards = sum(u.shard_bytes for u in sharding.units)
    root = units.get("")
    fixed = cg.fixed_bytes - full + shards + (root.unsharded_bytes if root else 0)
    out = replace(cg, nodes=nodes, fixed_bytes=fixed, meta=StepFacts.noted(cg.meta, distributed=_meta(sharding)))
    state = StepFacts.of(cg.meta).optimizer_state_bytes
    if cg.optimizer_step_bytes is not None and full:           # measured on unsharded parameters: a rank steps its shard
        ratio = shards / full
        step = round((cg.optimizer_step_bytes or 0) * ratio)
        out = replace(out, fixed_bytes=out.fixed_bytes - state + round(state * ratio), optimizer_step_bytes=step,
                      meta=StepFacts.noted(out.meta, optimizer_state_bytes=round(state * ratio),
                                           optimizer_step_bytes=step))
    return out


def _meta(s: Sharding) -> dict:
    return {"engine": s.engine, "world_size": s.world_size, "units": [u.name for u in s.units],
            "bucket_bytes": s.bucket_bytes}


def _spans(where: list[str]) -> dict[str, tuple[int, int]]:
    """Per unit below the root: (first node, last node). A unit must run once, as one range."""
    spans: dict[str, tuple[int, int]] = {}
    for i, u in enumerate(where):
        if u:
            lo, hi = spans.get(u, (i, i))
            if hi < i - 1 and any(w != u for w in where[hi + 1:i]):
                raise ValueError(f"unit {u!r} runs twice in one forward (nodes {lo}..{hi} and {i}): remat plans "
                                 "a unit that runs once per step")
            spans[u] = (lo, i)
    return spans


def _held(n: int, spans: dict, units: dict, prefetch: int, staged: bool) -> tuple[list[int], list[int]]:
    """Unsharded parameters (and the all-gather's buffers) held at each node, forward and backward."""
    fwd, bwd = [0] * n, [0] * n
    root = units.get("")
    if root is not None:            # gathered before the first node, reduce-scattered after the last backward
        fwd[0] += root.unsharded_bytes
        # its input and output (the whole gradients are freed before; staged: its temporary)
        bwd[0] += root.grad_bytes + root.grad_shard_bytes
    order = sorted(spans, key=lambda u: spans[u][0])
    for k, name in enumerate(order):
        u, (lo, hi) = units[name], spans[name]
        for t in range(lo, hi + 1):
            fwd[t] += u.unsharded_bytes
            bwd[t] += u.unsharded_bytes
        # the all-gather's flat output, until copied out (FSDP2 copies the shard in at this
        # rank's offset in it: its input is a view of it, no buffer of its own)
        fwd[lo] += u.unsharded_bytes
        bwd[hi] += u.unsharded_bytes
        for nxt in order[max(0, k - prefetch):k]:              # gathered ahead while U runs backward
            for t in range(lo, hi + 1):
                bwd[t] += units[nxt].unsharded_bytes
            if staged:                          # issued as U's backward starts, through its temporary
                bwd[hi] += units[nxt].unsharded_bytes
        if not u.reshard_after_forward:                        # held from its forward to its backward
            for t in range(hi + 1, n):
                fwd[t] += u.unsharded_bytes
            for t in range(hi + 1, n):
                bwd[t] += u.unsharded_bytes
    _retained(fwd, bwd, [(spans[u], units[u].unsharded_bytes) for u in order], root, staged)
    return fwd, bwd


def _retained(fwd: list[int], bwd: list[int], spans: list[tuple[tuple[int, int], int]], root: Unit | None,
              staged: bool = False) -> None:
    """FSDP2 keeps the flat output of its latest all-gather until it issues the next one (a
    stream may still copy out of it); the root's post-forward frees the last one, before the
    loss (node n-1) runs. Forward: the unit gathered last (the root's before the first unit),
    up to the loss. Backward: none during the loss's; the root's pre-backward hook (on its
    outputs, after the loss's backward) prefetches the first unit of backward, in flight while
    the root's last nodes run backward.
    Within U's backward that flat output is the prefetched unit's, which `_held` counts (a
    prefetched unit is its all-gather's output until its own pre-backward copies it out), so it
    is not counted twice."""
    n = len(fwd)
    issued = [(0, root.unsharded_bytes if root else 0)] + [(lo, size) for (lo, _), size in spans]
    for (start, size), nxt in zip(issued, issued[1:] + [(n - 1, 0)]):
        for t in range(start, nxt[0]):
            fwd[t] += size
    if spans:
        for t in range(spans[-1][0][1] + 1, n - 1):
            bwd[t] += spans[-1][1]
        if staged and spans[-1][0][1] + 1 < n - 1:       # issued as the root's last node's backward starts
            bwd[n - 2] += spans[-1][1]


def _add_grads(cg: CostGraph, where: list[str], spans: dict, units: dict, bwd: list[int], staged: bool) -> None:
    """Unsharded gradients of a unit, from their node's backward to the unit's reduce-scatter;
    the reduce-scatter's input, which FSDP2 keeps until it issues the next one (the next unit's
    in backward order), through that unit's backward."""
    order = sorted(spans, key=lambda u: spans[u][0])
    for before, after in zip(order, order[1:]):        # `after`'s backward runs first
        lo, hi = spans[before]
        for t in range(lo, hi + 1):
            bwd[t] += units[after].grad_bytes
    for k, name in enumerate(order):                   # the root's nodes before U run backward after U's
        for t in range(spans[order[k - 1]][1] + 1 if k else 0, spans[name][0]):
            bwd[t] += units[name].grad_bytes
    for name, (lo, hi) in spans.items():
        u = units[name]
        for i in range(lo, hi + 1):
            g = cg.nodes[i].param_grad_bytes
            for t in range(lo, i + 1):
                bwd[t] += g
        # the reduce-scatter's input; its output, the shards (counted from lo: per_rank), is
        # allocated once the unsharded gradients are freed (staged: then the temporary, g_U)
        bwd[lo] += u.grad_bytes - (0 if staged else u.grad_shard_bytes)


def _node(c: NodeCost, unit: str, fwd: int, bwd: int, u: Unit | None) -> NodeCost:
    """Node c as a rank runs it in `unit` (u; None: the root, whose gradients are reduced at the
    end of backward, so they stay whole until then)."""
    scale = (u.grad_shard_bytes / u.grad_bytes) if u is not None and u.grad_bytes else 1.0
    return replace(c, unit=unit, fwd_held_bytes=c.fwd_held_bytes + fwd, bwd_held_bytes=c.bwd_held_bytes + bwd,
                   param_grad_bytes=round(c.param_grad_bytes * scale))
