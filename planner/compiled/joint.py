"""The joint forward/backward graph Inductor partitions, captured on fake tensors.

`annotated(gm)` is the traced model with each node's ops named after it: every node runs inside
`torch.fx.traceback.annotate({"remat": name})`, which Dynamo and AOTAutograd carry to the aten
nodes of the joint graph as `node.meta["custom"]["remat"]`. A plan's decisions, made over the
traced graph's nodes, are then tags on the joint graph's nodes (planner/compiled/tags.py).

`capture_joint` compiles the annotated graph with Inductor's backend and a partitioner that keeps
the joint graph and its partitioner arguments, then stops the compile (NOTE [ the joint graph,
captured ]).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from remat.planner.compat import autograd_cache_off, compile_failure_cause, partitioner, pytree, partitioner_installed
from remat.planner.capture.trace import OUTPUT

KEY = "remat"       # node.meta["custom"][KEY]: the traced graph's node an aten node computes


def _named(name: str, f):
    def run(*args, **kwargs):
        with torch.fx.traceback.annotate({KEY: name}):
            return f(*args, **kwargs)
    run.__name__ = run.__qualname__ = f"remat_{name}"
    return run


def _method(name: str):
    def call(obj, *args, **kwargs):
        return getattr(obj, name)(*args, **kwargs)
    return call


def annotated(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with each call run annotated by its node's name (same parameters, buffers and children,
    the same objects); an exported graph's output structure stays the `OUTPUT` module it is."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_module", "call_method") and n.target != OUTPUT:
            f = (n.target if n.op == "call_function" else gm.get_submodule(n.target) if n.op == "call_module"
                 else _method(n.target))
            env[n] = g.call_function(_named(n.name, f), fx.node.map_arg(n.args, env.__getitem__),
                                     fx.node.map_arg(n.kwargs, env.__getitem__))
            env[n].meta = dict(n.meta)
        else:
            env[n] = g.node_copy(n, env.__getitem__)
    out = fx.GraphModule(gm, g)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


@dataclass
class Joint:
    """The joint graph Inductor's partitioner is given, and the arguments it is called with."""
    gm: fx.GraphModule
    inputs: list                        # the joint graph's example inputs (fake): primals then tangents
    kwargs: dict                        # num_fwd_outputs, static_lifetime_input_indices, compiler
    layout: tuple[int, int]             # the forward's first outputs: (mutated inputs, user outputs)
    seconds: float = 0.0                # spent capturing
    names: frozenset = field(default_factory=frozenset)   # the traced nodes the joint graph's ops name


class _Stop(Exception):
    """Raised by `_Keep` once it holds the joint graph: nothing is lowered or run."""


class _Keep:
    """Inductor's partitioner (compat.partitioner) that keeps the joint graph and stops the compile."""

    def __init__(self):
        self.joint: Joint | None = None

    def __call__(self, gm, joint_inputs, **kwargs):
        self.joint = Joint(gm, list(joint_inputs), dict(kwargs), (0, 0))
        raise _Stop

    def uuid(self):
        return None         # never cached: the compile stops here

    def __deepcopy__(self, memo):
        return self         # torch copies Inductor's config to log it: not the joint graph held here


# NOTE [ the joint graph, captured ]
# The partitioner sees the graph Inductor compiles: Dynamo's capture, AOTAutograd's joint trace
# with Inductor's decompositions, and Inductor's joint-graph passes (pattern rewrites; dropout's
# draws become `inductor_random` of a seed, so a recompute draws the same numbers). Capturing it
# through Inductor's own hook, rather than tracing with our own decompositions, makes the graph we
# plan on the graph the training compile partitions. Dynamo and AOTAutograd trace on fake tensors
# made from the model's: nothing runs, no memory of the step is needed, and a model on `meta`
# works too. The compile is stopped by an exception from the partitioner, caught here.
def output_leaves(gm: fx.GraphModule) -> tuple[list, object, bool]:
    """The leaves of `gm`'s output, their pytree spec, and whether the output is an exported graph's
    structure (the `OUTPUT` module, planner/capture/trace.py), whose arguments the leaves are:
    what the compiled graph returns, in order, after its mutated inputs."""
    out = gm.graph.find_nodes(op="output")[0].args[0]
    structured = isinstance(out, fx.Node) and out.op == "call_module" and out.target == OUTPUT
    leaves, spec = pytree.tree_flatten(tuple(out.args) if structured else out)
    return leaves, spec, structured


def capture_joint(gm: fx.GraphModule, inputs: dict, compile_kwargs: dict | None = None) -> Joint:
    """The joint graph of `gm(**inputs)`'s forward and backward as Inductor partitions it
    (`gm` annotated: `annotated`). Raises what the compile raised if it stopped elsewhere."""
    keep = partitioner(_Keep())
    kwargs = {k: v for k, v in (compile_kwargs or {}).items() if k not in ("backend", "fullgraph")}
    compiled = torch.compile(gm, backend="inductor", fullgraph=True, **kwargs)
    t0 = time.process_time()
    with partitioner_installed(keep), autograd_cache_off(), torch.enable_grad():
        try:
            compiled(**inputs)
        except Exception as e:
            if not isinstance(compile_failure_cause(e), _Stop) and not isinstance(e, _Stop):
                raise
    if keep.joint is None:
        raise RuntimeError("torch.compile made no joint graph (no parameter or input requires grad?)")
    j = keep.joint
    users = sum(isinstance(a, fx.Node) for a in output_leaves(gm)[0])
    j.layout = (j.kwargs["num_fwd_outputs"] - users, users)
    j.seconds = time.process_time() - t0
    j.names = frozenset(n.meta.get("custom", {}).get(KEY) for n in j.gm.graph.nodes) - {None}
    return j

