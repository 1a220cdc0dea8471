"""The joint forward/backward graph Inductor partitions, captured on fake tensors.

`annotated(gm)` is the traced model with each node's ops named after it: every node runs inside
`torch.fx.traceback.annotate({"remat": name})`, which AOTAutograd carries to the aten nodes of the
joint graph as `node.meta["custom"]["remat"]`. A plan's decisions, made over the traced graph's
nodes, are then tags on the joint graph's nodes (planner/compiled/tags.py).

`compiled(gm, inputs, compile_kwargs, partitioner)` is how compile mode compiles the traced graph,
for training and for planning alike: Inductor's backend called on the annotated graph itself, with
no Dynamo capture (NOTE [ one compile, no Dynamo ]). `capture_joint` is that compile with a
partitioner that keeps the joint graph and its partitioner arguments, then stops it (NOTE [ the
joint graph, captured ]).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from remat.planner.compat import (autograd_cache_off, compile_failure_cause, inductor_compile, inductor_mode_options,
                                  partitioner, pytree)
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
    # the traced graph's submodules, parameters and buffers, as its own (the same objects, in its order)
    out._modules, out._parameters, out._buffers = dict(gm._modules), dict(gm._parameters), dict(gm._buffers)
    out._non_persistent_buffers_set = set(gm._non_persistent_buffers_set)
    out.meta = dict(getattr(gm, "meta", {}))
    return out


# NOTE [ one compile, no Dynamo ]
# The traced graph is already a whole graph of the step (planner/capture), so compile mode hands it
# to Inductor's backend itself (planner.compat `inductor_compile`: compile_fx, AOTAutograd then
# Inductor), as torch.compile does with the graph Dynamo captures, without Dynamo's capture of it
# again: 2.5-3 s of the built-in GPT-2 of 6 layers' 6.7-7.7 s capture on 2 cores. The graph given
# is `flat(gm, inputs)`: the annotated graph with the example's non-tensor inputs as constants (a
# compile specializes them; a call with others is planned as another call), returning its
# output's tensors as a tuple (the output's structure is rebuilt around the compiled call); its
# parameters and buffers are the joint graph's first inputs, in `named_parameters(remove_duplicate=
# False)` then `named_buffers` order (a tied weight twice: each use's gradient its own output,
# summed as autograd accumulates them). The plan's capture (`capture_joint`) and the training
# model (runtime/rewrite/compiled.py) both compile through `compiled`: the joint graph planned is
# the joint graph trained, by construction.
def tensor_inputs(gm: fx.GraphModule, inputs: dict) -> list[str]:
    """The names of `gm`'s inputs whose value in `inputs` is a tensor, in order: the compiled step's
    inputs (NOTE [ one compile, no Dynamo ])."""
    return [n.target for n in gm.graph.find_nodes(op="placeholder") if isinstance(inputs.get(n.target), torch.Tensor)]


def flat(gm: fx.GraphModule, inputs: dict) -> fx.GraphModule:
    """`annotated(gm)` as compile mode compiles it (NOTE [ one compile, no Dynamo ]): its inputs
    `tensor_inputs(gm, inputs)`."""
    out = annotated(gm)
    g = out.graph
    kept = set(tensor_inputs(gm, inputs))
    for n in list(g.find_nodes(op="placeholder")):
        if n.target in kept:
            continue
        v = inputs.get(n.target)
        for u in list(n.users):
            u.args, u.kwargs = fx.node.map_arg((u.args, u.kwargs), lambda a: v if a is n else a)
        g.erase_node(n)
    leaves, _, structured = output_leaves(out)
    end = g.find_nodes(op="output")[0]
    made = end.args[0]
    with g.inserting_before(end):
        g.output(tuple(x for x in leaves if isinstance(x, fx.Node)))
    g.erase_node(end)
    if structured:
        g.erase_node(made)
    out.recompile()
    return out


def options(compile_kwargs: dict | None) -> dict:
    """Inductor's config for `compile_kwargs` (torch.compile's keywords: `mode`'s options, then
    `options`); ValueError for another backend. `dynamic` and `fullgraph` change nothing: the graph
    is whole, its sizes the call's (each call's sizes are planned and compiled on their own)."""
    kwargs = dict(compile_kwargs or {})
    backend = kwargs.pop("backend", "inductor")
    if backend != "inductor":
        raise ValueError(f"compile mode compiles with Inductor, not backend={backend!r}: drop the backend argument")
    unknown = set(kwargs) - {"mode", "options", "dynamic", "fullgraph"}
    if unknown:
        raise ValueError(f"compile mode takes torch.compile's mode, options, dynamic and fullgraph, not {sorted(unknown)}")
    mode = kwargs.get("mode")
    return {**(inductor_mode_options(mode, kwargs.get("dynamic")) if mode else {}),
            **(kwargs.get("options") or {})}


def compiled(gm: fx.GraphModule, inputs: dict, compile_kwargs: dict | None, partition):
    """The traced graph `gm` compiled by Inductor for `inputs` (by name), `partition` its
    partitioner (NOTE [ one compile, no Dynamo ]): the compiled callable, called with the inputs
    `tensor_inputs(gm, inputs)`, in order, and returning the tuple of the output's tensors
    (`output_leaves`)."""
    config = {**options(compile_kwargs), "custom_partitioner_fn": partitioner(partition)}
    with torch.enable_grad():
        return inductor_compile(flat(gm, inputs), [inputs[k] for k in tensor_inputs(gm, inputs)], config)


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


def output_leaves(gm: fx.GraphModule) -> tuple[list, object, bool]:
    """The leaves of `gm`'s output, their pytree spec, and whether the output is an exported graph's
    structure (the `OUTPUT` module, planner/capture/trace.py), whose arguments the leaves are:
    what the compiled graph returns, in order, after its mutated inputs."""
    out = gm.graph.find_nodes(op="output")[0].args[0]
    structured = isinstance(out, fx.Node) and out.op == "call_module" and out.target == OUTPUT
    leaves, spec = pytree.tree_flatten(tuple(out.args) if structured else out)
    return leaves, spec, structured


# NOTE [ the joint graph, captured ]
# The partitioner sees the graph Inductor compiles: AOTAutograd's joint trace of the traced graph
# with Inductor's decompositions, and Inductor's joint-graph passes (pattern rewrites; dropout's
# draws become `inductor_random` of a seed, so a recompute draws the same numbers). Capturing it
# through Inductor's own hook, rather than tracing with our own decompositions, makes the graph we
# plan on the graph the training compile partitions. AOTAutograd traces on fake tensors made from
# the model's: nothing runs, and no memory of the step is needed. The compile is stopped by an
# exception from the partitioner, caught here.
def capture_joint(gm: fx.GraphModule, inputs: dict, compile_kwargs: dict | None = None) -> Joint:
    """The joint graph of the traced graph `gm`'s forward and backward on `inputs` (by name), as
    Inductor partitions it (`compiled`). Raises what the compile raised if it stopped elsewhere."""
    keep = _Keep()
    t0 = time.process_time()
    with autograd_cache_off():
        try:
            compiled(gm, inputs, compile_kwargs, keep)
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
