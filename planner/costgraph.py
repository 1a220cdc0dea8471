"""CostGraph: the only thing the solver sees — plain numbers in topological order, as JSON.

Nodes are the fx graph's compute nodes in execution order, then one final `loss` node (the
user's loss, or a stand-in that holds a tensor of the output's size; it is never recomputed).
Storages are the activations those nodes create that outlive the node that made them.
See NOTE [ liveness ] in planner/solve/simulate.py for how these numbers become a memory timeline.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property


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
    # bytes a data-parallel engine holds while this node runs, on top of the step's own (unsharded
    # parameters of the units in flight, gradients not yet reduce-scattered: planner/distributed.py)
    fwd_held_bytes: int = 0
    bwd_held_bytes: int = 0
    unit: str = ""            # the data-parallel unit that runs it (an FSDP2 `fully_shard` module,
                              # planner/distributed.py): a region never spans two units


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
    # the optimizer's step after backward (planner/step/optimizer.py): its peak above the fixed bytes
    # (which then hold its state), the parameter gradients and the kept outputs; None: the step
    # planned ends with backward
    optimizer_step_bytes: int | None = None
    # the loss differentiates through the graph (`autograd.grad(out, x, create_graph=True)`: a
    # physics-informed loss, a gradient penalty): regions recompute once per backward, and a SAC
    # region cannot (torch allows one backward through it), so no region keeps anything
    loss_differentiates: bool = False
    # a pipeline rank (runtime/distributed/pipeline.py): the most *other* micro-batches in flight
    # (forwarded, not yet backwarded) during (a forward before any backward, a forward after one,
    # the first backward, a later backward), -1 where the schedule has none; each holds what the
    # plan keeps of it (simulate.retained_bytes), and after the first backward every parameter
    # gradient exists (NOTE [ liveness ]). (): one step
    inflight: tuple[int, ...] = ()
    # the host RNG state each region keeps (planner/step/storage.py NOTE [ host RNG states ]): from
    # its start until the backward of its lowest node that saves a tensor, one more while it
    # recomputes; 0 where the step's memory is a device's
    region_state_bytes: int = 0

    def __post_init__(self):
        n = len(self.nodes)
        for s in self.storages:
            assert 0 <= s.producer < n and all(s.producer <= u < n for u in s.users + s.holders)

    @cached_property
    def made_by(self) -> tuple[tuple[StorageCost, ...], ...]:
        """Per node, the storages it makes (computed once per graph: not a field)."""
        made: list[list[StorageCost]] = [[] for _ in self.nodes]
        for s in self.storages:
            made[s.producer].append(s)
        return tuple(tuple(m) for m in made)

    @cached_property
    def memo(self) -> dict:
        """What the planner derives from this graph alone (its base liveness, each region's
        recompute, its segments), made once per graph as asked: not a field. A Llama-2-7B plan
        simulated 19,982 regions and 1,927 base livenesses, a few thousand distinct."""
        return {}

    def to_networkx(self):
        """The graph with its costs as a networkx.MultiDiGraph: node i carries every NodeCost field
        and `storages`, a (storage id, bytes, output) triple per storage it makes; each storage gives one edge
        producer -> node per entry of its users (kind "user"), holders ("holder") and mutated_by
        ("mutated_by"), keyed by (storage id, kind, position in that tuple), with `storage`, `bytes`,
        `kind` and `output`. Graph attributes: fixed_bytes, param_bytes, region_s, sac_op_s,
        optimizer_step_bytes, loss_differentiates, inflight, region_state_bytes, meta, and n_storages (a storage nobody reads, holds or writes has no
        edge: its producer's `storages` has it)."""
        import networkx as nx

        g = nx.MultiDiGraph(fixed_bytes=self.fixed_bytes, param_bytes=self.param_bytes, region_s=self.region_s,
                            sac_op_s=self.sac_op_s, optimizer_step_bytes=self.optimizer_step_bytes,
                            loss_differentiates=self.loss_differentiates, inflight=self.inflight,
                            region_state_bytes=self.region_state_bytes, meta=dict(self.meta), n_storages=len(self.storages))
        made: list[list[tuple]] = [[] for _ in self.nodes]
        for sid, s in enumerate(self.storages):
            made[s.producer].append((sid, s.bytes, s.output))
        for i, c in enumerate(self.nodes):
            g.add_node(i, **asdict(c), storages=tuple(made[i]))
        for sid, s in enumerate(self.storages):
            for kind, ends in (("user", s.users), ("holder", s.holders), ("mutated_by", s.mutated_by)):
                for k, v in enumerate(ends):
                    g.add_edge(s.producer, v, key=(sid, kind, k), storage=sid, bytes=s.bytes, kind=kind,
                               output=s.output)
        return g

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
            optimizer_step_bytes=d.get("optimizer_step_bytes"),
            loss_differentiates=d.get("loss_differentiates", False),
            inflight=tuple(d.get("inflight", ())),
            region_state_bytes=d.get("region_state_bytes", 0),
        )


def same_unit(cg: CostGraph, a: int, b: int) -> bool:
    """Nodes a..b all run in one data-parallel unit (`NodeCost.unit`; "" everywhere when the step
    is not sharded): only such a range may be a region."""
    unit = cg.nodes[a].unit
    return all(c.unit == unit for c in cg.nodes[a + 1:b + 1])


def with_optimizer(cg: CostGraph, state_bytes: int, step_bytes: int, name: str = "") -> CostGraph:
    """The step followed by an optimizer step: its state live from the start (fixed), its step's
    temporaries after backward (planner/step/optimizer.py measures both)."""
    return replace(cg, fixed_bytes=cg.fixed_bytes + state_bytes, optimizer_step_bytes=step_bytes,
                   meta={**cg.meta, "optimizer": name, "optimizer_state_bytes": state_bytes,
                         "optimizer_step_bytes": step_bytes})


def with_workspace(cg: CostGraph, workspace_bytes: int) -> CostGraph:
    """The step with the math libraries' workspaces (planner/step/workspace.py) live throughout (fixed)."""
    if not workspace_bytes:
        return cg
    return replace(cg, fixed_bytes=cg.fixed_bytes + workspace_bytes,
                   meta={**cg.meta, "workspace_bytes": workspace_bytes})


def accumulating(cg: CostGraph, steps: int) -> CostGraph:
    """A micro-step of gradient accumulation after the first (the largest): every parameter
    gradient exists from the start (fixed), and each backward's new gradient lives only until
    it is added in place to the existing one (at its node: backward working memory)."""
    if steps <= 1:
        return cg
    grads = sum(c.param_grad_bytes for c in cg.nodes)
    nodes = tuple(replace(c, param_grad_bytes=0, bwd_extra_bytes=c.bwd_extra_bytes + c.param_grad_bytes)
                  for c in cg.nodes)
    return replace(cg, nodes=nodes, fixed_bytes=cg.fixed_bytes + grads,
                   meta={**cg.meta, "accumulation_steps": steps, "accumulated_grad_bytes": grads})
