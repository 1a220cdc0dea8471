"""The structure of a graph of repeated blocks (pure: no torch; planner/solve/hierarchy.py's steps 1-2).

*Segments*: the graph cut at its blocks (`baselines.blocks`): what comes before the first block,
each block, what lies between two blocks, what comes after the last (`segments`). *Types*: each
block's subgraph is a networkx DiGraph labelled with what the solver sees of it (position, target
and module relative to the block, FLOPs, cost, ops, extra bytes, flags, the storages it makes and
those from before it that it reads; edges producer -> user/holder/writer with the storages'
bytes), hashed by `networkx.weisfeiler_lehman_graph_hash` (`block_types`): blocks with one hash
are one type; blocks alike but for the profile's measured extra bytes are one *family*.
"""
from __future__ import annotations

import re
import warnings
from itertools import takewhile
from typing import NamedTuple

import networkx as nx

from remat.planner.solve.baselines import blocks
from remat.planner.costgraph import CostGraph


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
    """The graph's nodes cut at its blocks, in order (see the module docstring); made once per graph
    (a block's hash is a Weisfeiler-Lehman pass over its subgraph: 0.4 s for a Llama-2-7B)."""
    got = cg.memo.get("segments")
    if got is None:
        got = cg.memo["segments"] = _segments(cg)
    return list(got)


def _segments(cg: CostGraph) -> tuple[Segment, ...]:
    spans = blocks(cg)
    out, nxt = [], 0
    for a, b in spans:
        if a > nxt:
            out.append(Segment(nxt, a - 1, "other", f"other@{nxt}", f"other@{nxt}"))
        out.append(Segment(a, b, "block", block_hash(cg, a, b), block_hash(cg, a, b, measured=False)))
        nxt = b + 1
    if nxt < len(cg.nodes):
        out.append(Segment(nxt, len(cg.nodes) - 1, "other", f"other@{nxt}", f"other@{nxt}"))
    return tuple(out)
