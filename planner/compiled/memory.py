"""The memory of a compiled step's forward and backward graphs, as Inductor runs them.

Inductor does not run the partitioned graphs op by op: pointwise ops fuse into the kernels that
read them and never own a buffer (NOTE [ what Inductor materializes ]). `graph_memory` replays one
graph's buffers in order, each allocated when its kernel runs and freed after the last kernel
that reads it, and gives the graph's peak and what it leaves (plain data, for the fake stand-in
of runtime/rewrite/compiled.py).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from remat.planner.compat import storage_key
from remat.planner.profile.graph import is_view

# NOTE [ what Inductor materializes ]
# A buffer exists for a kernel Inductor cannot fuse into its readers: extern kernels (matmuls,
# convolutions, scatters, concatenation, anything Inductor falls back to aten for) and reductions;
# and for a pointwise op (`torch.Tag.pointwise` and the few fusible ops below) only where its value
# must be whole in memory: a graph output (a saved tensor, a gradient), or the input of an extern
# kernel (directly or through views). Every other pointwise op is computed inside the kernels that
# read it, so what it reads stays live until they run. Views own nothing. This leaves out Inductor's
# in-place reuse of a dying input's buffer (it lowers the peak by at most that buffer: the replay
# errs high) and its realizing of a pointwise op read by many kernels (it raises the peak: checked
# against the allocator by tests/test_compiled_memory.py).
_FUSIBLE = frozenset({"convert_element_type", "inductor_random", "inductor_lookup_seed", "inductor_seeds", "clone",
                      "_to_copy", "full", "scalar_tensor", "where", "embedding", "index", "copy", "fma", "lift_fresh_copy",
                      "iota", "arange", "zeros_like", "ones_like", "full_like", "empty_like", "rand_like"})
# a pointwise op read by several kernels is computed once into a buffer when it is costly to
# compute again: torch/_inductor/ir.py `should_realize_on_reuse` (CPU) with config's thresholds
_HEAVY = frozenset({"exp", "log", "log10", "log1p", "log2", "sigmoid", "tanh"})
_OPCOUNT, _READS = 30, 4
_ALLOCATING = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default})
_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "var_mean", "var", "max", "min", "argmax", "argmin", "prod",
                         "any", "all", "logsumexp"})


def _name(n: fx.Node) -> str:
    t = n.target
    return getattr(getattr(t, "_overloadpacket", None), "__name__", None) or getattr(t, "__name__", str(t))


def kind(n: fx.Node) -> str:
    """'view' (aliases an input), 'pointwise' (fusible), 'reduction' or 'extern'."""
    t = n.target
    if t is operator.getitem:
        return "view"
    if is_view(t):
        return "view"
    if torch.Tag.pointwise in getattr(t, "tags", ()) or _name(n) in _FUSIBLE:
        return "pointwise"
    return "reduction" if _name(n) in _REDUCTIONS else "extern"


def _tensors(n: fx.Node) -> list[torch.Tensor]:
    v = n.meta.get("val")
    vals = v if isinstance(v, (list, tuple)) else [v]
    return [t for t in vals if isinstance(t, torch.Tensor)]


def _materialized(g: fx.Graph, outputs: set[fx.Node]) -> set[fx.Node]:
    """The ops Inductor gives a buffer (NOTE [ what Inductor materializes ])."""
    kinds = {n: kind(n) for n in g.nodes if n.op == "call_function"}
    needed: set[fx.Node] = set()          # values an extern kernel or the output reads whole
    for n in reversed(list(g.nodes)):
        if n in outputs or any(kinds.get(u) == "extern" or (kinds.get(u) == "view" and u in needed)
                               for u in n.users):
            needed.add(n)
    made = {n for n, k in kinds.items() if k in ("extern", "reduction") or (k == "pointwise" and n in needed)}
    inner: dict[fx.Node, tuple[frozenset, frozenset, int]] = {}     # an unmade op's reads, op names, op count
    for n in g.nodes:
        if kinds.get(n) == "pointwise" and n not in made:
            reads, ops, count = _inner(n, inner)
            if len(n.users) > 1 and (ops & _HEAVY or count > _OPCOUNT or len(reads) > _READS):
                made.add(n)
            else:
                inner[n] = (reads, ops, count)
        elif kinds.get(n) == "view" and n.all_input_nodes and n.all_input_nodes[0] in inner:
            inner[n] = inner[n.all_input_nodes[0]]
    return made


def _inner(n: fx.Node, inner: dict) -> tuple[frozenset, frozenset, int]:
    """What the kernel computing `n` inline reads (the nodes whose buffers it loads), the ops it
    runs and how many: `n`'s own, with those of the unmade ops it reads."""
    reads, ops, count = set(), {_name(n)}, 1
    for a in n.all_input_nodes:
        if a in inner:
            r, o, c = inner[a]
            reads |= r
            ops |= o
            count += c
        else:
            reads.add(a)
    return frozenset(reads), frozenset(ops), count


@dataclass(frozen=True)
class GraphMemory:
    """One graph's buffers, replayed: the bytes it counts (its counted inputs and what it makes) at
    its start, at its peak and at its end."""
    start_bytes: int
    peak_bytes: int
    end_bytes: int


def _kernels(g: fx.Graph, outputs: set[fx.Node], copied: frozenset) -> tuple[list[tuple[list, set]], set, dict]:
    """Per kernel, in order: the storages it makes and those it reads (through the unmade ops it
    computes inline); the storages the graph returns; each storage's (bytes, dtype). Placeholders
    whose storage is `copied` are copied first, by a kernel of their own (NOTE [ channels-last ])."""
    made = _materialized(g, outputs)
    reads: dict[fx.Node, set] = {}
    for n in g.nodes:
        if n.op == "placeholder" or n in made:
            reads[n] = {("copy", s) if s in copied else s for s in map(storage_key, _tensors(n))}
        elif n.target is operator.getitem and n.args[0] in made:      # one output of a kernel
            reads[n] = {storage_key(t) for t in _tensors(n)}
        elif n.op == "call_function":       # a view reads its base; an unmade op, what it is computed from
            ins = n.all_input_nodes[:1] if kind(n) == "view" else n.all_input_nodes
            reads[n] = set().union(*(reads.get(a, set()) for a in ins))
    key = {storage_key(t): (int(t.untyped_storage().nbytes()), t.dtype) for n in g.nodes for t in _tensors(n)}
    key.update({("copy", s): key[s] for s in copied})
    kernels = [([storage_key(t) for t in _tensors(k)], set().union(*(reads.get(a, set()) for a in k.all_input_nodes)), k)
               for k in g.nodes if k in made]
    return [([("copy", s) for s in copied], set(), None)] * bool(copied) + kernels, set().union(*(reads.get(a, set()) for a in outputs)), key


# NOTE [ channels-last ]
# On CPU, Inductor runs a training graph's convolutions channels-last (`inductor_layout_opt`): the
# forward graph first copies each convolution's weight and input that is not channels-last, reads
# the copies, and returns them as the saved tensors in place of the parameters; the backward reads
# and frees them, and returns the weights' gradients channels-last, which autograd copies into the
# parameters' layout as it accumulates them (planner/compiled/step.py).

# NOTE [ Inductor's buffer reuse ]
# (Kernels that allocate their own outputs, as aten's convolutions do, take over nothing.)
# Inductor's wrapper frees a dead buffer only if no later buffer of the same size and dtype takes
# it over: a kernel writes in place into an input it is the last to read, and otherwise a new
# buffer takes the most recently freed one of its size (torch/_inductor/codegen/wrapper.py,
# MemoryPlanningState: a LIFO pool per size). Until then the dead buffer stays allocated. `_reuse`
# plays that pool once, to know which deaths are taken over (held until then) and which buffers
# need no allocation; the saved tensors a backward is given are donated, and reused the same way.
def _reuse(kernels: list[tuple[list, set]], last: dict, keep: set, key: dict) -> tuple[dict, dict]:
    """(storage made -> the dead storage it takes over, dead storage -> kernel index that takes it)."""
    pool: dict = {}
    took, taken = {}, {}
    for i, (made, reads, node) in enumerate(kernels):
        dying = [s for s in reads if last.get(s) == i and s not in keep]
        for s in made:
            if s in took or (node is not None and node.target in _ALLOCATING):
                continue
            old = next((d for d in dying if key[d] == key[s] and d not in taken), None)
            if old is None and pool.get(key[s]):
                old = pool[key[s]].pop()
            if old is not None:
                took[s], taken[old] = old, i
        for d in dying:
            if d not in taken:
                pool.setdefault(key[d], []).append(d)
    return took, taken


def workspace(n: fx.Node | None) -> int:
    """Bytes a kernel holds while it runs beyond its outputs: oneDNN's channels-last convolution
    backward converts the weight's gradient through two weight-sized buffers (measured on torch 2.13.0, CPU)."""
    if n is None or n.target is not torch.ops.aten.convolution_backward.default or not n.args[-1][1]:
        return 0
    w = n.args[2].meta.get("val")
    return 2 * int(w.untyped_storage().nbytes()) if isinstance(w, torch.Tensor) else 0


def graph_memory(gm: fx.GraphModule, held: set, counted_inputs: set, copied: frozenset = frozenset(),
                 channels_last: bool = False) -> GraphMemory:
    """Replay `gm`'s buffers (NOTE [ what Inductor materializes ], NOTE [ Inductor's buffer reuse ]).
    Storages in `held` are never freed nor made by the graph (the forward's parameters, the
    tangents autograd holds); placeholders whose storage is in `counted_inputs` count from the
    start and are freed after their last read (the saved tensors a backward consumes); those in
    `copied` are read through a copy the graph makes first, and `channels_last` convolutions hold
    their workspace (NOTE [ channels-last ])."""
    g = gm.graph
    kernels, returned, key = _kernels(g, set(g.find_nodes(op="output")[0].all_input_nodes), copied)
    last = {s: i for i, (_, reads, _) in enumerate(kernels) for s in reads}
    keep = returned | set(held)
    took, taken = _reuse(kernels, last, keep, key)
    live = {s for s in counted_inputs if s in key}
    now = peak = base = sum(key[s][0] for s in live)
    for i, (made, reads, node) in enumerate(kernels):
        for s in made:
            if s not in live and s not in held:
                live.add(s)
                now += 0 if s in took else key[s][0]
        peak = max(peak, now + (workspace(node) if channels_last else 0))
        for s in [s for s in live if last.get(s, -1) <= i and s not in keep]:
            live.discard(s)
            now -= 0 if s in taken else key[s][0]      # taken over: its bytes pass to the new buffer
    return GraphMemory(base, peak, now)
