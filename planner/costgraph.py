"""CostGraph: the only thing the solver sees — plain numbers in topological order, as JSON.

Nodes are the fx graph's compute nodes in execution order, then one final `loss` node (the
user's loss, or a stand-in that holds a tensor of the output's size; it is never recomputed).
Storages are the activations those nodes create that outlive the node that made them.
See NOTE [ liveness ] in planner/simulate.py for how these numbers become a memory timeline.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class NodeCost:
    name: str                 # fx node name
    target: str               # what it calls (module path, function or method name)
    module: str               # qualified name of the innermost module it belongs to ("" = root)
    flops: int                # forward FLOPs (FlopCounterMode)
    cost_s: float             # estimated forward time: roofline of flops and bytes moved, op overhead
    fwd_extra_bytes: int      # peak live bytes during its forward, above live bytes at its start
    bwd_extra_bytes: int      # measured backward working memory not explained by the model
    grad_bytes: int           # bytes of the gradients of its (new, differentiable) outputs
    grad_last_user: int       # index of the last node whose backward produces that gradient
    param_grad_bytes: int     # parameter gradients that first appear in its backward
    recomputable: bool        # may be placed inside a checkpoint region
    why_not: str = ""         # reason when not recomputable
    ops: int = 0              # aten ops it dispatches
    random: bool = False      # draws random numbers (dropout, attention with dropout): never SAC-kept
    opaque: bool = False      # an opaque module (stood in for): never SAC-kept (SAC would cache every op inside)


@dataclass(frozen=True)
class StorageCost:
    bytes: int
    producer: int             # index of the node that allocated it
    users: tuple[int, ...]    # nodes that read it (through any view) in the forward
    holders: tuple[int, ...]  # nodes whose autograd saved it for backward
    output: bool = False      # held to the end of the step: a kept output, or alive after it
    mutated_by: tuple[int, ...] = ()  # nodes that write it in place


@dataclass(frozen=True)
class CostGraph:
    nodes: tuple[NodeCost, ...]
    storages: tuple[StorageCost, ...]
    fixed_bytes: int          # parameters, buffers and inputs: live the whole step
    param_bytes: int          # parameters that require grad (their grads appear in backward)
    meta: dict = field(default_factory=dict)  # provenance: model, shapes, torch version
    region_s: float = 0.0     # estimated fixed cost of one checkpoint region
    sac_op_s: float = 0.0     # estimated extra cost per op inside a region with a SAC policy

    def __post_init__(self):
        n = len(self.nodes)
        for s in self.storages:
            assert 0 <= s.producer < n and all(s.producer <= u < n for u in s.users + s.holders)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CostGraph":
        d = json.loads(text)
        return cls(
            nodes=tuple(NodeCost(**x) for x in d["nodes"]),
            storages=tuple(
                StorageCost(x["bytes"], x["producer"], tuple(x["users"]), tuple(x["holders"]), x["output"],
                            tuple(x["mutated_by"]))
                for x in d["storages"]
            ),
            fixed_bytes=d["fixed_bytes"],
            param_bytes=d["param_bytes"],
            meta=d.get("meta", {}),
            region_s=d.get("region_s", 0.0),
            sac_op_s=d.get("sac_op_s", 0.0),
        )
