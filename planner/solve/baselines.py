"""What users do by hand, as plans over the same CostGraph (pure functions, no torch).

Blocks are read off module paths: the repeated children of the module list or sequential that
covers the most nodes (`h.0`, `h.1`, ... in a GPT-2; `layer1.0`, ... in a ResNet).
"""
from __future__ import annotations

import math

from remat.planner.costgraph import CostGraph, same_unit
from remat.planner.result import Region


def _digit_prefixes(module: str) -> list[tuple[str, str]]:
    """(list prefix, index) for each numbered component of a module path, outermost first:
    "encoder.block.0.layer.1" -> [("encoder.block", "0"), ("encoder.block.0.layer", "1")]."""
    parts = module.split(".") if module else []
    return [(".".join(parts[:k]), p) for k, p in enumerate(parts) if p.isdigit()]


def blocks(cg: CostGraph) -> list[tuple[int, int]]:
    """(first, last) node of each repeated block, in order; [] when the model has none.

    A block is an element of a module list or sequential with at least two elements, the
    outermost such list on each node's module path: every list of blocks the model has
    (an encoder's and a decoder's, as Hugging Face's per-block checkpointing takes them), not
    the lists nested inside a block (a block's experts). Blocks whose nodes interleave with an
    earlier block's are left out."""
    nodes: dict[str, dict[str, int]] = {}      # list prefix -> element index -> nodes in it
    for c in cg.nodes:
        for prefix, index in _digit_prefixes(c.module):
            counts = nodes.setdefault(prefix, {})
            counts[index] = counts.get(index, 0) + 1
    # a list of blocks: two elements or more, one of them more than a single layer
    lists = {p for p, counts in nodes.items() if len(counts) >= 2 and max(counts.values()) >= 2}
    spans: dict[str, list[int]] = {}
    for i, c in enumerate(cg.nodes):
        outer = next(((p, k) for p, k in _digit_prefixes(c.module) if p in lists), None)
        if outer is not None:
            spans.setdefault(f"{outer[0]}.{outer[1]}", [i, i])[1] = i
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans.values()):
        if not out or a > out[-1][1]:
            out.append((a, b))
    return out


def _recomputable(cg: CostGraph, spans) -> tuple[Region, ...]:
    return tuple(Region(a, b) for a, b in spans
                 if all(c.recomputable for c in cg.nodes[a:b + 1]) and same_unit(cg, a, b))


def no_checkpointing(cg: CostGraph) -> tuple[Region, ...]:
    return ()


def every_block(cg: CostGraph) -> tuple[Region, ...]:
    """Checkpoint each block (what `gradient_checkpointing_enable()` does)."""
    return _recomputable(cg, blocks(cg))


def sqrt_segments(cg: CostGraph) -> tuple[Region, ...]:
    """`checkpoint_sequential` over the blocks with ceil(sqrt(n)) segments; the last runs plainly."""
    bl = blocks(cg)
    if not bl:
        return ()
    k = math.ceil(math.sqrt(len(bl)))
    size = math.ceil(len(bl) / k)
    groups = [bl[i:i + size] for i in range(0, len(bl), size)]
    return _recomputable(cg, [(g[0][0], g[-1][1]) for g in groups[:-1]])


def sac_keepable(cg: CostGraph) -> list[bool]:
    """Nodes whose outputs SAC may keep: FLOP-heavy ones (matmul, conv) whose outputs no other
    node writes in place (a cached tensor written later would be replayed wrong), and that draw
    no random numbers (a cached draw is skipped in the recompute, so every later random op of
    the region would draw from another point of the RNG stream). Never an opaque module: SAC
    would cache every op inside it, which its stand-in in the memory model does not hold. None
    when the loss differentiates through the graph (`CostGraph.loss_differentiates`)."""
    if cg.loss_differentiates:
        return [False] * len(cg.nodes)
    written_by: dict[int, set[int]] = {}
    for s in cg.storages:
        written_by.setdefault(s.producer, set()).update(s.mutated_by)
    return [c.flops > 0 and not c.random and not c.opaque and written_by.get(j, set()) <= {j}
            for j, c in enumerate(cg.nodes)]


def sac_every_block(cg: CostGraph) -> tuple[Region, ...]:
    """Every block checkpointed, keeping matmul/conv outputs and recomputing the rest (the
    common selective-checkpointing recipe)."""
    keep = sac_keepable(cg)
    return tuple(Region(r.start, r.end, tuple(j for j in range(r.start, r.end + 1) if keep[j]))
                 for r in every_block(cg))


BASELINES = {"none": no_checkpointing, "every_block": every_block, "sqrt": sqrt_segments,
             "sac_every_block": sac_every_block}


def known_plans(cg: CostGraph, sac: bool = True) -> dict[str, tuple[Region, ...]]:
    """The hand-made plans (every baseline but "none"); with `sac` False, only those whose regions
    keep nothing (SolveOptions(sac=False) binds every plan the planner may return)."""
    plans = {name: fn(cg) for name, fn in BASELINES.items() if name != "none"}
    return {k: r for k, r in plans.items() if sac or not any(x.saved for x in r)}
