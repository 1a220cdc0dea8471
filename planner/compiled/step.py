"""A compiled step under a plan, as plain data: what its forward and backward graphs allocate.

`compiled_step` partitions the captured joint graph under the plan's tags (planner/compiled/tags.py)
and replays each graph's buffers (planner/compiled/memory.py). The result is all the fake stand-in
of runtime/rewrite/compiled.py needs to replay the whole step (loss, optimizer and all) on fake
tensors, as the eager replay does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx as fx

from remat.planner.compat import inductor_layout_opt, storage_key
from remat.planner.workers import started

from .joint import Joint
from .memory import GraphMemory, graph_memory
from .tags import Decisions, partition
from .wrapper import checked_memory, convolves, donated, output_strides, restridable

Meta = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]      # shape, stride, dtype


def _meta(n: fx.Node | None) -> Meta | None:
    v = None if n is None else n.meta.get("val")
    return (tuple(map(int, v.shape)), tuple(map(int, v.stride())), v.dtype) if isinstance(v, torch.Tensor) else None


@dataclass(frozen=True)
class CompiledStep:
    """The forward's inputs (primals, in order), its user outputs, the saved tensors' storages,
    each graph's buffers (above what it is given) and the gradient of each primal."""
    primals: tuple[Meta | None, ...]
    outputs: tuple[Meta | None, ...]
    saved_bytes: tuple[int, ...]        # one per storage the forward makes and the backward reads
    forward: GraphMemory
    backward: GraphMemory               # counted from the saved tensors and the tangents
    tangent_bytes: int
    grads: tuple[Meta | None, ...]
    recomputed_ops: int                 # forward ops the backward graph runs again
    seconds: float                      # spent partitioning and replaying


def _tensor(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _channels_last(fw: fx.GraphModule, primals: list[fx.Node]) -> set[fx.Node]:
    """The forward's placeholders Inductor copies channels-last (NOTE [ channels-last ]): a
    convolution's 4-d input or weight not already laid out so, when Inductor lays the graph out so."""
    if not convolves(fw) or not inductor_layout_opt(fw):
        return set()
    read = {a for n in fw.graph.nodes if n.target is torch.ops.aten.convolution.default for a in n.args[:2]}
    return {n for n in primals if n in read and (t := _tensor(n)) is not None and restridable(t)}


def _cl(m: Meta | None) -> Meta | None:
    """A 4-d tensor's meta, channels-last."""
    n, c, h, w = m[0]
    return m[0], (c * h * w, 1, w * c, c), m[2]


def _saved(outs: list, first: int, skip: set) -> tuple[int, ...]:
    """The bytes of each storage the forward returns for the backward (from output `first` on),
    once, those in `skip` left out."""
    saved, seen = [], set(skip)
    for n in outs[first:]:
        t = _tensor(n)
        if t is not None and storage_key(t) not in seen:
            seen.add(storage_key(t))
            saved.append(int(t.untyped_storage().nbytes()))
    return tuple(saved)


class _Read(NamedTuple):
    """What both readings of a partition take from it (`compiled_step`, `check_started`)."""
    fw: fx.GraphModule
    bw: fx.GraphModule
    primals: list
    outs: list              # the forward's outputs
    copied: set             # the forward's placeholders Inductor copies channels-last
    static: set             # storages held throughout (parameters, buffers, inputs)
    visible: list[int]      # the forward's user outputs, by index
    counted: set            # the backward's inputs counted from its start (the saved tensors, tangents)
    tangents: list


def _read(joint: Joint, graphs: tuple[fx.GraphModule, fx.GraphModule]) -> _Read:
    fw, bw = graphs
    primals = [n for n in fw.graph.nodes if n.op == "placeholder"]
    copied = _channels_last(fw, primals)
    static = {storage_key(t) for n in primals if n not in copied and (t := _tensor(n)) is not None}
    mutated, users = joint.layout
    outs = list(fw.graph.find_nodes(op="output")[0].args[0])
    visible = [i for i in range(mutated, mutated + users) if isinstance(outs[i], fx.Node)]
    inputs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    tangents = [t for n in inputs if "tangents" in n.name and (t := _tensor(n)) is not None]
    counted = {storage_key(t) for t in map(_tensor, inputs) if t is not None} - static
    return _Read(fw, bw, primals, outs, copied, static, visible, counted, tangents)


def check_started(joint: Joint, graphs: tuple[fx.GraphModule, fx.GraphModule], alongside: bool = False,
                  laid_out: dict | None = None):
    """The check of a partition (Inductor's wrapper for each graph, planner/compiled/wrapper.py
    `checked_memory`), started: its `result()` is (forward, backward) GraphMemory (NOTE [ forked
    workers ]). `laid_out`: `layout_started`'s strides, of another partition of `joint`."""
    r = _read(joint, graphs)
    return checked_memory(r.fw, r.bw, r.static, r.counted, r.visible, bool(r.copied),
                          donated(r.fw, r.bw, joint.kwargs["num_fwd_outputs"]), alongside, laid_out)


def layout_started(joint: Joint, graphs: tuple[fx.GraphModule, fx.GraphModule]):
    """The partition's forward lowered in a worker (planner/compiled/wrapper.py NOTE [ the layout
    known ]): its `result()` is each output's strides as Inductor lays it out, by name; None where
    the forward has no convolution (its layout is as traced)."""
    r = _read(joint, graphs)
    return started(output_strides, r.fw, r.visible) if convolves(r.fw) else None


def compiled_step(joint: Joint, decided: Decisions, wrapper: bool = False,
                  graphs: tuple[fx.GraphModule, fx.GraphModule] | None = None, check=None) -> CompiledStep:
    """The compiled step's memory under `decided` (planner/compiled/tags.py `decisions`): each
    graph's buffers modelled (memory.py), or with `wrapper`, read from the wrapper Inductor
    generates (wrapper.py: the check of a plan, seconds a graph; `check`: that check, started
    before by `check_started`). `graphs`: `decided`'s partition, made before (neither reading
    changes it)."""
    t0 = time.process_time()
    r = _read(joint, graphs or partition(joint, decided))
    fw, bw, primals, outs, copied, static = r.fw, r.bw, r.primals, r.outs, r.copied, r.static
    mutated, users = joint.layout
    user_outs = outs[mutated:mutated + users]
    made_outs = {storage_key(t) for t in map(_tensor, user_outs) if t is not None}
    # the check frees the tangents as the backward's wrapper does (NOTE [ boxed gradients ] in
    # runtime/rewrite/compiled.py); the model holds them to the end: a guide, closer that way
    held = static | {storage_key(t) for t in r.tangents}
    grads = list(bw.graph.find_nodes(op="output")[0].args[0])[:len(primals)]
    if wrapper:
        forward, backward = (check or check_started(joint, (fw, bw))).result()
    else:
        copies = frozenset(storage_key(_tensor(n)) for n in copied)
        forward, backward = graph_memory(fw, static, set(), copies), graph_memory(bw, held, r.counted,
                                                                                   channels_last=bool(copied))
    return CompiledStep(
        primals=tuple(map(_meta, primals)), outputs=tuple(map(_meta, user_outs)),
        saved_bytes=_saved(outs, joint.kwargs["num_fwd_outputs"], static | made_outs),
        forward=forward, backward=backward,
        # a scalar's (a loss's, whose root gradient backward() holds too) is not taken off
        tangent_bytes=sum(int(t.untyped_storage().nbytes()) for t in r.tangents if t.dim()),
        grads=tuple(None if not isinstance(g, fx.Node) else _cl(_meta(g)) if p in copied else _meta(g)
                    for p, g in zip(primals, grads)),
        recomputed_ops=_recomputed(fw, bw), seconds=time.process_time() - t0)


def _recomputed(fw: fx.GraphModule, bw: fx.GraphModule) -> int:
    """Forward ops the backward graph runs again (by name, as the partitioner copies them)."""
    names = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    return sum(n.op == "call_function" and n.name in names for n in bw.graph.nodes)
