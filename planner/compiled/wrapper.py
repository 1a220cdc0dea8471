"""The compile's own memory plan: a partitioned graph's buffers read from the wrapper Inductor
generates for it (planner.compat `inductor_wrapper`: lowering, fusion, the kernels' bodies
unwritten, no kernel compiled), replayed line by line (NOTE [ the wrapper's memory plan ]).

memory.py models the same buffers from the graph alone, in a fraction of the time; this is what
a plan's prediction is checked against (runtime.planning `solve_compiled`)."""
from __future__ import annotations

import copy
import functools
import re
from typing import NamedTuple

import torch
import torch.fx as fx

from remat.planner.compat import (KernelsUnwritten, allocation_events, compute_required_storage_length,
                                  donates_buffers, inductor_wrapper, storage_key)
from remat.planner.workers import forks_for, started

from .memory import GraphMemory, workspace

# NOTE [ the wrapper's memory plan ]
# Inductor's wrapper (its `call`) allocates each buffer as `bufN = empty_strided_cpu(...)`, hands a
# dead one to a new one as `bufM = reinterpret_tensor(bufN, ...); del bufN  # reuse`, views one as
# `bufM = reinterpret_tensor(bufN, ...)  # alias`, lets a fallback kernel allocate its own outputs
# (`bufN = torch.ops...(...)`, `bufM = bufN[i]` for one of several, `bufM = bufN` for its only
# one: the call's output is that buffer, `bufN` its first name) and frees with `del bufN`; the
# graph's inputs are freed the same way (the saved tensors AOTAutograd hands the backward and
# clears). Kernels fused into one (and their kernel-local buffers) allocate nothing. A storage is
# freed when its last name is deleted; `held` storages (parameters, tangents) never are.
_ALLOC = re.compile(r"(buf\d+) = empty_strided_\w+\(")
_REUSE = re.compile(r"(buf\d+) = (?:reinterpret_tensor\()?(\w+)\b.*; del \2\s+# reuse")
_ALIAS = re.compile(r"(buf\d+) = reinterpret_tensor\((\w+),")
_ITEM = re.compile(r"(buf\d+) = (buf\d+)\[\d+\]")
_SAME = re.compile(r"(buf\d+) = (buf\d+)$")          # a fallback's one output, named
_CALL = re.compile(r"(buf\d+) = (?!reinterpret_tensor|empty_strided)[\w.]+\(")
_DEL = re.compile(r"del (\w+(?:, \w+)*)")


class Live:
    """Names bound to storages, the bytes of the storages live (each counted once)."""

    def __init__(self, held: set):
        self.held, self.storage, self.refs, self.size = held, {}, {}, {}
        self.now = self.peak = 0

    def bind(self, name: str, key, nbytes: int) -> None:
        self.storage[name] = key
        if self.refs.get(key, 0) == 0:
            self.size[key] = nbytes
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1

    def drop(self, name: str) -> None:
        key = self.storage.pop(name, None)
        if key is None:
            return
        self.refs[key] -= 1
        if self.refs[key] == 0 and key not in self.held:
            self.now -= self.size[key]


def _line(live: Live, line: str, sizes: dict[str, int], items: dict[str, list[str]]) -> None:
    if m := _ITEM.match(line):
        if m.group(1) not in live.storage:
            live.bind(m.group(1), ("buf", m.group(1)), sizes.get(m.group(1), 0))
    elif m := _REUSE.match(line):
        new, old = m.groups()
        if old in live.storage:
            live.bind(new, live.storage[old], 0)
        live.drop(old)
    elif m := (_ALIAS.match(line) or _SAME.match(line)):
        if m.group(2) in live.storage:
            live.bind(m.group(1), live.storage[m.group(2)], 0)
    elif m := (_ALLOC.match(line) or _CALL.match(line)):
        live.bind(m.group(1), ("buf", m.group(1)), sizes.get(m.group(1), 0))
        for item in items.get(m.group(1), ()):        # a kernel's several outputs, allocated by its call
            live.bind(item, ("buf", item), sizes.get(item, 0))
    else:
        for part in line.split("#")[0].split(";"):
            if m := _DEL.fullmatch(part.strip()):
                for name in m.group(1).split(", "):
                    live.drop(name)


def checked_memory(fw: fx.GraphModule, bw: fx.GraphModule, static: set, counted: set, visible: list[int],
                   channels_last: bool, donated: tuple[int, ...], alongside: bool = False, laid_out: dict | None = None):
    """The forward's and the backward's buffers as Inductor's wrappers allocate them
    (`wrapper_memory`), started: `result()` gives (forward, backward). On CPU with two cores or
    more the two graphs are read at once, in forked workers (NOTE [ forked workers ]): the
    backward's saved inputs laid out as traced where the forward has no convolution (Inductor
    keeps those strides: checked when both are done, the backward read again here if one moved),
    else as the forward's lowering lays them out: as `laid_out` says (an earlier lowering of a
    forward of the same joint graph, by name; checked against the forward's own reading as the
    traced strides are, NOTE [ the layout known ]), or, without it, as the backward's worker finds
    by lowering the forward first; without workers, one after the other, here. `alongside`: a
    check this process goes on beside (NOTE [ the unplanned check, alongside ] in
    runtime/planning.py), read in one worker, one graph after the other, leaving the other core to
    this process."""
    kernels = _attention_workspaces(fw), _attention_workspaces(bw)    # the parent's thread count
    devices = {t.device.type for g in (fw, bw) for n in g.graph.find_nodes(op="placeholder")
               if isinstance(t := n.meta.get("val"), torch.Tensor)}
    again = functools.partial(wrapper_memory, bw, static, counted, None, channels_last, donated=donated,
                              kernels=kernels[1])

    def both():
        forward, strides = wrapper_memory(fw, static, set(), visible, kernels=kernels[0])
        return forward, again(strides)[0]
    here = not forks_for(devices)
    if here or alongside:
        return started(both, here=here)
    fwd = started(wrapper_memory, fw, static, set(), visible, False, None, (), kernels[0])
    outs = {n.name: n.meta["val"] for n in fw.graph.find_nodes(op="output")[0].args[0]
            if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)}
    traced = {k: tuple(t.stride()) for k, t in outs.items()}
    if not convolves(fw):
        return _Both(fwd, started(again, None), (traced, again))
    if laid_out is None or any(k not in laid_out and restridable(t) for k, t in outs.items()):
        # layout optimization, the layout not known: the backward's worker lowers the forward first
        return _Both(fwd, started(_backward_memory, fw, bw, static, counted, visible, channels_last, donated,
                                  kernels[1]), None)
    guess = {k: laid_out.get(k, v) for k, v in traced.items()}
    return _Both(fwd, started(again, guess), (guess, again))


def convolves(gm: fx.GraphModule) -> bool:
    """Whether `gm` has a convolution: where Inductor may lay its graph out channels-last."""
    return any(n.target is torch.ops.aten.convolution.default for n in gm.graph.nodes)


def restridable(t: torch.Tensor) -> bool:
    """A 4-d tensor layout optimization may lay out channels-last, not already so."""
    return t.dim() == 4 and not t.is_contiguous(memory_format=torch.channels_last)


class _Both:
    """The forward's and the backward's readings, running; `guessed`: the backward's was started
    with the forward's outputs laid out as guessed, (those strides by name, the backward's reading
    again)."""

    def __init__(self, fwd, bwd, guessed):
        self.fwd, self.bwd, self.guessed = fwd, bwd, guessed

    def cancel(self) -> None:
        self.fwd.cancel()
        self.bwd.cancel()

    def result(self) -> tuple[GraphMemory, GraphMemory]:
        (forward, strides), backward = self.fwd.result(), self.bwd.result()
        if self.guessed is None:
            return forward, backward[0]
        guess, again = self.guessed
        if any(guess.get(k, v) != v for k, v in strides.items()):
            return forward, again(strides)[0]
        return forward, backward[0]


# NOTE [ the layout known ]
# Under layout optimization (a forward with a convolution) Inductor lays saved tensors out
# channels-last, and the backward is read with its saved inputs so restrided: the backward's
# worker lowered the forward first, on the check's path (the built-in ResNet: a
# backward's 1.6 s check after 0.9-1.5 s of the forward's lowering). A saved tensor's layout is its
# forward node's, whichever plan saves it: the ResNet's forward lowered without checkpointing laid
# out every output of four plans' forwards as they lay them out (72-83 outputs each, 30-36
# restrided). So the fit lowers the forward without checkpointing once, in a worker beside it
# (runtime/rewrite/compiled.py `CompiledPrediction`), and a plan's backward is read at once with
# its saved inputs laid out so; the forward's own reading says how they are laid out, and a
# backward read with another layout is read again. A saved tensor that forward did not save is
# guessed as traced only where layout optimization cannot move it (not 4-d, or channels-last
# already: the parameters and per-channel statistics a plan saves); a 4-d activation it did not
# save (the U-Net's relu_1 under a 3-region plan, laid out channels-last) is not guessed: that
# plan's backward waits for the forward's lowering, as before.
def _backward_memory(fw, bw, static, counted, visible, channels_last, donated, kernels) -> tuple[GraphMemory, dict]:
    """The backward's `wrapper_memory`, its saved inputs restrided as the forward's lowering lays them out."""
    return wrapper_memory(bw, static, counted, None, channels_last, output_strides(fw, visible), donated, kernels)


def output_strides(gm: fx.GraphModule, visible: list[int] | None) -> dict:
    """Each output's strides as Inductor lays it out, by name (lowering only, no code generated)."""
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    _, _, laid_out = inductor_wrapper(copy.deepcopy(gm), inputs, visible, codegen=False)
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    return {n.name: st for n, st in zip(outs, laid_out) if isinstance(n, fx.Node) and st is not None}


def wrapper_memory(gm: fx.GraphModule, held: set, counted_inputs: set, visible: list[int] | None,
                   channels_last: bool = False, strides: dict | None = None,
                   donated: tuple[int, ...] = (), kernels: list | None = None) -> tuple[GraphMemory, dict]:
    """`gm`'s buffers as Inductor's wrapper allocates and frees them, counted as memory.graph_memory
    counts them (placeholders whose storage is in `counted_inputs` from the start, `held` ones
    never freed, oneDNN's workspace at a channels-last convolution's backward). `visible`: the
    forward's user outputs (by index), None for a backward graph (planner.compat `inductor_wrapper`).
    Returns also each output's strides as Inductor lays it out, by name: a backward graph is given
    its forward's `strides`, as AOTAutograd restrides the saved tensors (layout optimization), and
    its `donated` inputs (NOTE [ donated buffers ]). `kernels`: `_attention_workspaces(gm)`, found
    before (None: found here)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    convolutions = [n for n in gm.graph.nodes if n.target is torch.ops.aten.convolution_backward.default]
    inputs = [_restrided(n.meta["val"], (strides or {}).get(n.name)) for n in placeholders]
    try:
        code, sizes, laid_out = inductor_wrapper(copy.deepcopy(gm), inputs, visible, donated)
    except KernelsUnwritten:            # read again with the kernels written (NOTE [ the kernels unwritten ])
        code, sizes, laid_out = inductor_wrapper(copy.deepcopy(gm), inputs, visible, donated, sources=True)
    outs = gm.graph.find_nodes(op="output")[0].args[0]
    live = Live(held)
    for n in placeholders:
        t = n.meta["val"]
        if isinstance(t, torch.Tensor) and storage_key(t) in counted_inputs:
            live.bind(n.name, storage_key(t), int(t.untyped_storage().nbytes()))
    start = live.now
    replay(code, sizes, live, [workspace(n) for n in convolutions] if channels_last else [],
           _attention_workspaces(gm) if kernels is None else kernels)
    return GraphMemory(start, live.peak, live.now), {
        n.name: st for n, st in zip(outs, laid_out) if isinstance(n, fx.Node) and st is not None}


# NOTE [ donated buffers ]
# AOTAutograd donates to the compiled backward each saved tensor that no forward input, user output
# or backward output shares a storage with (`collect_bw_donated_buffer_idxs`, functorch's
# `donated_buffer`, on by default), and Inductor may then reuse it for a buffer of its own once it
# is last read (`bufN = mm_12; del mm_12  # reuse`). Inductor finds the donated inputs in the
# tracing context, which the check does not run under: it reused none, and the tiny HF Llama of
# benchmarks/compile.py at 90% checked 3.6% over its allocator peak (a fresh buffer of the MLP's
# size where the compile reuses a saved one, four times live at once). `donated` (step.py) are the
# same positions, found as AOTAutograd finds them.
def donated(fw: fx.GraphModule, bw: fx.GraphModule, user_outputs: int) -> tuple[int, ...]:
    """The backward's inputs AOTAutograd donates (NOTE [ donated buffers ]), by position: the saved
    tensors whose storage no forward input, none of the forward's first `user_outputs` outputs
    and no backward output shares; none where it donates none (planner.compat `donates_buffers`)."""
    if not donates_buffers(fw, bw):
        return ()

    def val(n):
        t = n.meta.get("val") if isinstance(n, fx.Node) else None
        return t if isinstance(t, torch.Tensor) else None
    outs = list(fw.graph.find_nodes(op="output")[0].args[0])
    shared = {storage_key(t) for n in (*fw.graph.find_nodes(op="placeholder"), *outs[:user_outputs],
                                       *bw.graph.find_nodes(op="output")[0].args[0]) if (t := val(n)) is not None}
    saved = {storage_key(t) for n in outs[user_outputs:] if (t := val(n)) is not None}
    return tuple(i for i, n in enumerate(bw.graph.find_nodes(op="placeholder"))
                 if (t := val(n)) is not None and "tangents" not in n.name and storage_key(t) in saved - shared)


def replay(code: str, sizes: dict[str, int], live: Live, workspaces: list[int] = (),
           kernels: list[tuple[str, int]] = ()) -> None:
    """Play the `call` of wrapper `code` on `live` (NOTE [ the wrapper's memory plan ]): `sizes`,
    each buffer's bytes; `workspaces`, the bytes each convolution backward holds while it runs;
    `kernels`, (op, bytes) each call of such an op holds while it runs, in the calls' order."""
    body = code[code.index("def call(self, args)"):]
    lines = list(map(str.strip, body[:body.index("\n        return")].splitlines()))
    items: dict[str, list[str]] = {}
    for m in filter(None, map(_ITEM.match, lines)):
        items.setdefault(m.group(2), []).append(m.group(1))
    pending, inside = list(workspaces), list(kernels)
    for line in lines:
        _line(live, line, sizes, items)
        if pending and _CALL.match(line) and "convolution_backward" in line:
            live.peak = max(live.peak, live.now + pending.pop(0))
        if inside and re.search(rf"torch\.ops\.aten\.{inside[0][0]}\.default[(,]", line):   # a recompute: in run_with_rng_state
            live.peak = max(live.peak, live.now + inside.pop(0)[1])


# NOTE [ attention's workspace ]
# The CPU flash attention kernels (forward, and the backward the compiled backward calls) allocate
# per-thread buffers of query and key blocks inside themselves (a dispatcher meter never sees them;
# the allocator does). The backward's held 65,664 B for a tiny HF Llama on 2 threads, and the
# compiled step peaked inside it: replayed without it, 0.55% under its allocator peak. Each is
# measured once for real on zeros of its inputs' layouts (their size depends on the thread
# count and the split sizes the kernel picks), and held over the call in the replay.
_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward")


def _attention_workspaces(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """(op name, workspace bytes) of each CPU flash attention call of `gm`, in graph order."""
    out = []
    for n in gm.graph.nodes:
        op, args = n.target, n.args
        if op is torch.ops.higher_order.run_with_rng_state:         # a recompute's draw replayed
            op, args = args[1], args[2:]
        name = getattr(getattr(op, "_overloadpacket", None), "__name__", "")
        if n.op == "call_function" and name in _ATTENTION:
            vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
            if all(v.device.type == "cpu" for v in vals if isinstance(v, torch.Tensor)):
                out.append((name, _workspace(op, tuple(_layout(v) for v in vals), torch.get_num_threads())))
    return out


class _Layout(NamedTuple):
    """A tensor argument as the real run needs it: its shape, strides and dtype."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


def _layout(v):
    return _Layout(tuple(map(int, v.shape)), tuple(map(int, v.stride())), v.dtype) if isinstance(v, torch.Tensor) else v


@functools.lru_cache(maxsize=64)
def _workspace(op, layouts: tuple, threads: int) -> int:
    """Bytes `op` holds at its peak beyond what it returns, run for real on zeros of `layouts`
    (each on a storage as large as its strides reach) with `threads` torch threads."""
    args = [torch.zeros(compute_required_storage_length(a.shape, a.stride, 0), dtype=a.dtype).as_strided(a.shape, a.stride)
            if isinstance(a, _Layout) else a for a in layouts]
    _, events = allocation_events(lambda: op(*args))
    running = peak = 0
    for _, _, nbytes, _, _ in events:
        running += nbytes
        peak = max(peak, running)
    return max(0, peak - running)


def _restrided(t, stride):
    """The fake tensor `t` with `stride` (AOTAutograd's restride of a saved tensor)."""
    if not isinstance(t, torch.Tensor) or stride is None or tuple(t.stride()) == tuple(stride):
        return t
    with t.fake_mode:
        return t.as_strided(t.size(), stride)
