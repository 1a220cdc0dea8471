"""A plan as the recompute tags AOTAutograd's partitioner honours (NOTE [ a plan, as tags ]).

`partition` makes the forward and backward graphs of a captured joint graph under a plan, as
the training compile will (`Tagged`, Inductor's partitioner for that compile): the same joint
graph, the same tags, the same min-cut partitioner.
"""
from __future__ import annotations

import contextlib
import hashlib
from pathlib import Path

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from remat.planner.compat import FakeTensor, lazy_graph_module, min_cut_partition, partitioner, tree_leaves
from remat.planner.result import Region

from .joint import KEY, Joint

# NOTE [ a plan, as tags ]
# A region's nodes are recomputed in the backward: each forward op of the joint graph that one of
# them computes is tagged MUST_RECOMPUTE, with the region's number as its `ac_graph_id` (torch's
# partitioner then saves the boundary between two adjacent regions, as checkpoint does). A node the
# region keeps (a selective-checkpointing region's saved node) is MUST_SAVE, and so is every op
# outside the regions that a recomputed op reads: the region's inputs, which checkpoint saves.
# Everything else is the min-cut partitioner's to decide, as without remat (it recomputes cheap
# pointwise ops where that saves memory). Random ops recompute their forward's draws: Inductor's
# draws are `inductor_random` of a seed the backward is given, and eager-RNG draws are replayed
# from saved RNG state by the partitioner (functionalize_rng_ops).
Decisions = tuple[tuple[str, int, bool], ...]       # (node name, region number, kept)


def decisions(regions: tuple[Region, ...], names: tuple[str, ...]) -> Decisions:
    """Each node a plan decides: its name, the region's number (from 1), whether it is kept."""
    return tuple((names[i], k + 1, i in r.saved) for k, r in enumerate(regions) for i in range(r.start, r.end + 1))


def _forward_nodes(g: fx.Graph) -> list[fx.Node]:
    """The joint graph's forward ops: the ops no tangent reaches."""
    backward: set[fx.Node] = set()
    for n in g.nodes:
        if (n.op == "placeholder" and "tangents" in n.name) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    return [n for n in g.nodes if n.op == "call_function" and n not in backward]


def tag(gm: fx.GraphModule, decided: Decisions) -> int:
    """Tag `gm`'s forward ops (in place) by `decided`; returns how many ops are recomputed."""
    by_name = {name: (k, kept) for name, k, kept in decided}
    fwd = _forward_nodes(gm.graph)
    recomputed = 0
    for n in fwd:
        d = by_name.get(n.meta.get("custom", {}).get(KEY))
        if d is not None:
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE if d[1] else CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = d[0]
            recomputed += not d[1]
    for n in fwd:
        if "recompute" not in n.meta and any(u.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
                                             for u in n.users):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
    return recomputed


def _copied(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with a graph of its own (its nodes' meta copied; not its pytree codegen, whose specs
    warn when deep-copied)."""
    g = fx.Graph()
    g.output(g.graph_copy(gm.graph, {}))
    return lazy_graph_module(gm, g)


def partition(joint: Joint, decided: Decisions) -> tuple[fx.GraphModule, fx.GraphModule]:
    """The forward and backward graphs the training compile makes of `joint` under `decided`."""
    gm = _copied(joint.gm)
    tag(gm, decided)
    # inside the compile's fake mode, as Inductor calls it: the partitioner makes fake RNG state for
    # recomputed eager-RNG draws (functionalize_rng_ops) in the fake mode it finds
    fake = next((t.fake_mode for t in tree_leaves(joint.inputs) if isinstance(t, FakeTensor)), None)
    with fake if fake is not None else contextlib.nullcontext():
        fw, bw = min_cut_partition(gm, joint.inputs, **joint.kwargs)
    # lazy, as Inductor's compile makes its graph modules (the partitioner returns both plain)
    return lazy_graph_module(fw, fw.graph), lazy_graph_module(bw, bw.graph)


class Tagged:
    """Inductor's partitioner for a compile under a plan: the joint graph tagged, then min-cut
    (`tagged`: registered as one)."""

    def __init__(self, decided: Decisions):
        self.decided = decided

    def __call__(self, gm, joint_inputs, **kwargs):
        tag(gm, self.decided)
        return min_cut_partition(gm, joint_inputs, **kwargs)

    def __deepcopy__(self, memo):
        return self         # a config value: torch copies Inductor's config to log it

    def uuid(self):
        """Inductor's caches key compiled graphs by this: the code and the plan."""
        h = hashlib.sha256(Path(__file__).read_bytes())
        h.update(repr(self.decided).encode())
        return h.hexdigest()


def tagged(decided: Decisions) -> Tagged:
    """The partitioner of a compile under the plan `decided` (compat.partitioner)."""
    return partitioner(Tagged(decided))
