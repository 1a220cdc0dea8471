"""Profile one training step of a traced model on fake tensors: no activation memory is allocated.

An fx.Interpreter runs the graph under FakeTensorMode with three instruments:
- `_ProfileMode` (a LiveBytes dispatch mode) attributes each new storage to the node that made
  it, records which nodes read which storages (through any view), and the peak during each node;
- saved-tensor hooks record which storages autograd saves, and for which node;
- FlopCounterMode (compat.TotalFlops: no module tracker) counts FLOPs per node.
The loss runs as a final node (reading the model's tensors as the graph's fake copies, wherever it
reads them from: planner/step/fake.py, NOTE [ one fake per real tensor ]), then backward runs on the
fake tensors with gradient hooks on every node's outputs, so the backward working memory of each
node is measured, not guessed. Those measurements calibrate the simulator (NOTE [ liveness ] in
simulate.py): `*_extra_bytes` are what the measured peak holds beyond what the liveness model
explains for the unplanned step.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass, replace

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from remat.planner.compat import (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException,
                     tree_flatten)
from remat.planner.compat import TotalFlops

from remat.planner.costgraph import CostGraph, NodeCost, StorageCost
from remat.planner.errors import LossFnError, RematError
from remat.planner.step.kernels import FLOP_FORMULAS
from remat.planner.profile.costs import MeasuredCosts, OpCall, OverheadProbe, cost_model_for, measured_costs
from remat.planner.profile.opaque import stand_in, step_held
from remat.planner.profile.rates import DeviceRates
from remat.planner.solve.simulate import timeline
from remat.planner.step.state import assign_attribute
from remat.planner.step.fake import FakeState, describe, fake_step, model_loss, run_step, training_loss
from remat.planner.step.storage import LiveBytes, fake_twin, region_state_bytes, tensors_in, unlinked
from remat.planner.capture.trace import placeholder_values

LOSS = "loss"
# What fake tensors raise where code needs a value (`float(t)`, `t.nonzero()`, a branch on `t`)
VALUE_DEPENDENT = (DataDependentOutputException, DynamicOutputShapeException, GuardOnDataDependentSymNode)


def fake_cannot_run(e: BaseException) -> bool:
    """Fake tensors cannot run the op: it needs values (VALUE_DEPENDENT), or it has no fake or
    meta kernel (a custom op without `register_fake`, an op without a meta kernel)."""
    return isinstance(e, VALUE_DEPENDENT + (NotImplementedError, UnsupportedOperatorException)) or \
        (isinstance(e, RuntimeError) and "no fake impl" in str(e))


class ValueDependent(RuntimeError):
    """A module's forward needs tensor values, which fake tensors do not have (BatchNorm with
    `momentum=None` reads `float(num_batches_tracked)`): it must be profiled as an opaque
    module, run for real."""

    def __init__(self, module: str, cause: BaseException, node: str | None = None):
        self.module = module        # "" for the root's own code
        self.node = node            # the graph node inside `module` (None: the module is a node itself)
        self.why = f"{type(cause).__name__}: {str(cause).strip().split(chr(10))[0][:200]}"
        self.no_kernel = not isinstance(cause, VALUE_DEPENDENT)   # no fake kernel, rather than needing values
        super().__init__(f"{module or 'the model'}{f' (node {node})' if node else ''}: {self.why}")
_OPAQUE_FLOPS = "opaque module"   # FlopCounterMode key for FLOPs measured outside the fake run


# Namespaces whose ops torch itself defines and tags: an untagged op there draws no random numbers.
# (The namespaces torch 2.13 registers itself, rngprims aside: its ops draw random numbers.)
TORCH_NAMESPACES = frozenset({
    "aten", "prim", "prims", "quantized", "_quantized", "quantization", "symm_mem", "static_runtime", "c10d",
    "c10d_functional", "_c10d_functional", "_c10d_functional_autograd", "onednn", "mkldnn", "mkldnn_prepacked",
    "mkl", "sparse", "inductor", "inductor_prims", "profiler", "debugprims", "_native", "debug_mode_ops", "export",
    "_dtensor"})


# ATen ops that write some of their arguments without saying so in their schema (no alias
# annotation): name -> (positions of the arguments written, position of the flag that says they
# are: BatchNorm's running statistics, when training). tests/test_wrap.py checks BatchNorm's
# buffers against the unwrapped model's.
UNDECLARED_WRITES = {"aten::native_batch_norm": ((3, 4), 5), "aten::cudnn_batch_norm": ((3, 4), 5),
                     "aten::miopen_batch_norm": ((3, 4), 5)}


def written_args(func, args, kwargs) -> set[int]:
    """ids of the tensors `func` writes in place: its schema's `(a!)` arguments, and the ones it
    writes undeclared (`UNDECLARED_WRITES`)."""
    schema = func._schema.arguments
    written = {id(t) for a, t in zip(schema, args) if a.alias_info is not None and a.alias_info.is_write
               and isinstance(t, torch.Tensor)}
    written |= {id(kwargs[a.name]) for a in schema if a.alias_info is not None and a.alias_info.is_write
                and isinstance((kwargs or {}).get(a.name), torch.Tensor)}
    positions, flag = UNDECLARED_WRITES.get(func._schema.name, ((), None))
    if positions and len(args) > flag and args[flag]:
        written |= {id(args[k]) for k in positions if isinstance(args[k], torch.Tensor)}
    return written


def op_name(func) -> str:
    return f"{func.namespace}::{func._schema.name.split('::')[-1]}"


def is_view(op) -> bool:
    """The op returns an alias of an input without writing it (view, transpose, expand...)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def draws_random(func, args, kwargs, deterministic_ops: frozenset[str] = frozenset()) -> bool:
    """The op consumes the RNG: seeded ops (torch's `nondeterministic_seeded` tag), except those
    with a `dropout_p` of 0 (attention kernels carry the tag whether or not they drop out); and
    any op from outside torch's own namespaces (a `torch.library` or Triton kernel may draw and
    need not say so) unless the user declared it deterministic ("namespace::name")."""
    if func.namespace not in TORCH_NAMESPACES:
        return op_name(func) not in deterministic_ops
    if torch.Tag.nondeterministic_seeded not in func.tags:
        return False
    for k, a in enumerate(func._schema.arguments):
        if a.name == "dropout_p":
            p = (kwargs or {}).get("dropout_p", args[k] if k < len(args) else a.default_value)
            return bool(p)
    return True


class _ProfileMode(LiveBytes):
    """LiveBytes that also maps storages to ids and records per-node reads and bytes moved."""

    def __init__(self, baseline, deterministic_ops: frozenset[str] = frozenset(), record_calls: bool = False):
        self.deterministic_ops = deterministic_ops
        self.calls: dict[int, list[OpCall]] | None = defaultdict(list) if record_calls else None
        self.sid: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.bytes: list[int] = []
        self.producer: list[int] = []
        self.users: dict[int, set[int]] = defaultdict(set)
        self.fixed_users: dict[int, set[int]] = defaultdict(set)   # fixed storage index -> nodes
        self.mutated: dict[int, set[int]] = defaultdict(set)       # storage id -> nodes writing it
        self.fixed_mutated: dict[int, set[int]] = defaultdict(set)
        self.moved: dict[int, int] = defaultdict(int)
        self.ops: dict[int, int] = defaultdict(int)
        self.random: set[int] = set()     # nodes that draw random numbers
        self.writes_views: set[int] = set()   # nodes with an in-place op on a view (`narrow(...).relu_()`)
        self.node = -1          # current node index; -1 = not recording
        self.fixed_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.fixed_storages: list = []
        super().__init__(baseline)

    def track_fixed(self, storages, real_storages) -> None:
        """`storages`: the fixed (fake) storages; `real_storages`: the real storage each one was
        made from (a loss that closes over a real parameter reads the fixed one)."""
        self.fixed_storages = list(storages)
        self.fixed_ids = weakref.WeakKeyDictionary({st: i for i, st in enumerate(storages)})
        for i, st in enumerate(real_storages):
            self.fixed_ids.setdefault(st, i)

    def read(self, t) -> bool:
        """A tensor no op made and no fixed tensor holds (a loss target, a mask the step closes
        over): fixed too, live the whole step, counted once."""
        st = t.untyped_storage()
        if st in self._sizes or st in self.fixed_ids:
            return False
        self.fixed_ids[st] = len(self.fixed_storages)
        twin = fake_twin(t)             # the fake copy ops compute on: the same fixed storage
        if twin is not None:
            self.fixed_ids[twin.untyped_storage()] = len(self.fixed_storages)
        self.fixed_storages.append(st)
        return True

    def add(self, t, nbytes: int | None = None):
        if t.untyped_storage() in self.fixed_ids:       # a view of a fixed tensor read by the step
            return False
        if not super().add(t, nbytes) or self.node < 0:
            return False
        st = t.untyped_storage()
        self.sid[st] = len(self.bytes)
        self.bytes.append(st.nbytes() if nbytes is None else nbytes)
        self.producer.append(self.node)
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.node >= 0:
            self.ops[self.node] += 1
            if self.calls is not None:      # each op as the measured cost model times it (planner/profile/costs.py)
                self.calls[self.node].append(OpCall.of(func, args, kwargs))
            if draws_random(func, args, kwargs, self.deterministic_ops):
                self.random.add(self.node)
            written = written_args(func, args, kwargs)
            for t in tensors_in((args, kwargs)):
                self._read(t, id(t) in written)
                if id(t) in written and t._is_view():
                    self.writes_views.add(self.node)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _read(self, t: torch.Tensor, write: bool) -> None:
        st = t.untyped_storage()
        self.moved[self.node] += t.numel() * t.element_size()
        if st in self.sid:
            self.users[self.sid[st]].add(self.node)
            if write:
                self.mutated[self.sid[st]].add(self.node)
        elif st in self.fixed_ids:
            self.fixed_users[self.fixed_ids[st]].add(self.node)
            if write:
                self.fixed_mutated[self.fixed_ids[st]].add(self.node)


class _Runner(fx.Interpreter):
    """Runs the graph node by node, recording per-node forward measurements."""

    def __init__(self, gm: fx.GraphModule, mode: _ProfileMode, flops: TotalFlops,
                 opaque: dict[str, dict[str, torch.Tensor]], examples: dict[str, list], fixed: dict[str, str]):
        super().__init__(gm)
        self.opaque = opaque            # opaque module name -> its real parameters and buffers
        self.index = {n: i for i, n in enumerate(compute_nodes(gm))}
        # opaque nodes a recompute would get wrong (or that hold their own checkpoint), and why
        self.not_recomputable: dict[int, str] = {i: fixed[n.target] for n, i in self.index.items()
                                                 if n.op == "call_module" and n.target in fixed}
        self.host_random: set[int] = set()      # those of them that draw Python/numpy random numbers
        self.examples = examples        # opaque module name -> its real inputs (opaque.real_inputs)
        self.mode, self.flops = mode, flops
        self.holders: dict[int, set[int]] = defaultdict(set)
        self.saved_count: dict[int, int] = defaultdict(int)    # node -> tensors its autograd saved
        self.rec: dict[int, dict] = {}
        self.loss_i = len(self.index)
        # id of each autograd node the nodes run so far made -> its pre-hook's handle (holding the
        # autograd node would keep what it saved alive: a handle does not; a dead node's hook dies
        # with it, so an id reused later needs no removal of the handle it replaces)
        self.hooks: dict[int, object] = {}
        self.out_sids: dict[int, set[int]] = {}  # node -> storages its outputs live in
        self.bwd_peaks: dict[int, int] = {}     # node -> peak while its backward ran
        self.bwd_node = self.loss_i
        self.loss_kind = "stand-in"       # or the model's own loss (planner.step.fake.model_loss)
        self.loss_differentiates = False  # the loss ran a backward through the graph (CostGraph field)

    def on_backward(self, i: int):
        """Pre-hook of an autograd node node i's forward made: node i's backward runs while it does."""
        def hook(_grad_outputs):
            if self.mode.node == self.loss_i:       # the loss differentiates through the graph
                self.loss_differentiates = True
            if self.bwd_node != i:
                self.close_bwd_interval()
                self.bwd_node = i
        return hook

    # NOTE [ whose backward ]
    # The backward peak of node i (`bwd_peaks`, calibrating its bwd_extra_bytes) is metered while
    # the autograd nodes i's forward made run: a pre-hook on each (reached from i's outputs, up to
    # the autograd nodes earlier nodes made, leaves excluded) makes i the node metered. It was a
    # hook on the gradients of i's outputs, which took the wrong node twice: a node passing a
    # tensor on as it got it (an Identity, a tuple's item, an output container) had its hook fire
    # after the producer's and took the producer's backward (hf-llama's cross-entropy backward
    # metered at the output container: the least-peak plan simulated 15% under its replay, and
    # the floor was 13% too high); and grads completed by one backward op fired hooks in an order
    # of their own. The handles are kept by the autograd node's id: holding the autograd node
    # itself would keep alive what a branch without a gradient saved (16 KB on hf-moe).
    def own_backward(self, i: int, outs: list) -> None:
        """Node i meters the backward of every autograd node its forward made (NOTE [ whose backward ])."""
        todo = [t.grad_fn for t in outs if t.grad_fn is not None]
        while todo:
            fn = todo.pop()
            seen = self.hooks.get(id(fn))
            if (seen is not None and seen.hooks_dict_ref() is not None) or hasattr(fn, "variable"):
                continue                       # an earlier node's (alive: its id is its own), or a leaf's
            self.hooks[id(fn)] = fn.register_prehook(self.on_backward(i))
            todo += [nxt for nxt, _ in fn.next_functions if nxt is not None]

    def close_bwd_interval(self) -> None:
        peaks, mode = self.bwd_peaks, self.mode
        peaks[self.bwd_node] = max(peaks.get(self.bwd_node, 0), mode.peak_bytes)
        mode.reset_peak()

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if self.mode.node >= 0:
            self.saved_count[self.mode.node] += 1
        if st in self.mode.sid and self.mode.node >= 0:
            self.holders[self.mode.sid[st]].add(self.mode.node)
        return unlinked(t)

    def run_node(self, n: fx.Node):
        i = self.index.get(n)
        if i is None:
            return super().run_node(n)
        # A node reads what its graph inputs live in even if it runs no op on them (an Identity
        # passing a tensor on): a checkpoint region containing it keeps that tensor as an input.
        for a in n.all_input_nodes:
            for sid in self.out_sids.get(self.index.get(a, -1), ()):
                self.mode.users[sid].add(i)
        if n.op == "call_module" and n.target in self.opaque:
            return self.measure(i, lambda: self.run_opaque(n))
        if n.op == "call_function" and n.target is assign_attribute:
            self.not_recomputable[i] = "stores a tensor on a module (an auxiliary loss), once per step"
        try:
            return self.measure(i, lambda: super(_Runner, self).run_node(n))
        except Exception as e:     # run for real instead: this module, or the one the node is in
            if not fake_cannot_run(e):
                raise
            if n.op == "call_module":
                raise ValueDependent(n.target, e) from e
            raise ValueDependent(_module_of(n), e, n.name) from e

    def run_opaque(self, n: fx.Node):
        """An opaque module: measured for real in isolation, stood in for on fake tensors."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        out, cost = stand_in(self.module.get_submodule(n.target), self.opaque[n.target], args, kwargs,
                             self.examples.get(n.target))
        self.flops.flop_counts["Global"][_OPAQUE_FLOPS] += cost.flops
        if cost.writes_state:
            self.not_recomputable[self.index[n]] = ("writes a tensor attribute of its own in place, which a recompute "
                                               "would write again")
        if cost.host_random:
            self.host_random.add(self.index[n])
            self.not_recomputable[self.index[n]] = ("draws Python or numpy random numbers, which a recompute "
                                               "would draw again (checkpoint replays only torch's RNG)")
        return out

    def measure(self, i: int, fn):
        mode = self.mode
        mode.node, start = i, mode.live_bytes
        mode.reset_peak()
        f0 = self.flops.get_total_flops()
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            out = fn()
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        new = [t for t in outs if mode.sid.get(t.untyped_storage(), -1) >= 0
               and mode.producer[mode.sid[t.untyped_storage()]] == i]
        self.rec[i] = dict(
            start=start,
            extra=mode.peak_bytes - start,
            flops=self.flops.get_total_flops() - f0,
            grad_bytes=sum(t.numel() * t.element_size() for t in new if t.requires_grad),
        )
        self.own_backward(i, outs)
        self.out_sids[i] = {mode.sid[t.untyped_storage()] for t in outs if t.untyped_storage() in mode.sid}
        mode.node = -1
        return out


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that do work, in execution order (everything but inputs, attributes, output)."""
    return [n for n in gm.graph.nodes if n.op in ("call_module", "call_function", "call_method")]


def _target_name(gm: fx.GraphModule, n: fx.Node) -> str:
    if n.op == "call_module":
        return f"{type(gm.get_submodule(n.target)).__name__}({n.target})"
    return getattr(n.target, "__name__", str(n.target))


def _module_of(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return n.target if n.op == "call_module" else path


def profile(gm: fx.GraphModule, inputs: dict, loss_fn=None, rates: DeviceRates | None = None,
            opaque: tuple[str, ...] = (), examples: dict[str, list] | None = None,
            keep_output: bool = False, deterministic_ops: frozenset[str] = frozenset(),
            cost_model: str = "auto", overheads: OverheadProbe | None = None,
            fixed: dict[str, str] | None = None) -> CostGraph:
    """Profile `gm(**inputs)` followed by `loss_fn(output)` and backward, on fake tensors.

    Without `loss_fn`, the loss is the stand-in of `step.training_loss`, so the plan leaves
    room for a loss. The step is `loss_fn(gm(**inputs)).backward()`: the output is released
    once the loss is computed (what the loss saves stays), unless `keep_output` (the caller
    holds it through backward). Ops outside torch's own namespaces draw random numbers unless
    named in `deterministic_ops` ("namespace::name").

    `cost_model` says how a node's recompute time is estimated (planner/profile/costs.py): "roofline"
    (`rates`), "measured" (its ops timed on the device), "auto" (measured on a CUDA device that
    is present, else the roofline); `meta["cost_model"]` says which one made the costs. Measured,
    a region's overheads are what `overheads` measures (the runtime's regions), else `rates`'.
    `fixed`: opaque modules never recomputed (they hold their own checkpoint), by name -> why.
    """
    device = step_device(gm, inputs)
    rates = rates or DeviceRates.for_device(device)
    cost_model = cost_model_for(cost_model, device)
    run = _run(gm, inputs, loss_fn, opaque, examples or {}, keep_output, deterministic_ops, cost_model == "measured",
               fixed or {})
    measured = measured_costs(_calls_by_node(run), device, overheads, rates) if cost_model == "measured" else None
    cg = CostGraph(
        nodes=_node_costs(gm, run, rates, measured), storages=_storage_costs(run),
        fixed_bytes=_unique_bytes(run.mode.fixed_storages),
        region_s=measured.region_s if measured else rates.region_s,
        sac_op_s=measured.sac_op_s if measured else rates.sac_op_s,
        param_bytes=_unique_bytes(p.untyped_storage() for p in run.grad_params.values()),
        loss_differentiates=run.runner.loss_differentiates, region_state_bytes=region_state_bytes(device),
        meta={"torch": torch.__version__, "nodes": len(run.runner.index),
              "loss": "given" if loss_fn is not None else run.runner.loss_kind,
              "mutated_buffers": _mutated_buffers(gm, run, opaque), "keep_output": keep_output,
              "deterministic_ops": sorted(deterministic_ops), "device": device.type,
              "cost_model": cost_model, **({"costs": measured.meta} if measured else {})},
    )
    return _calibrated(cg, run)


def step_device(gm: fx.GraphModule, inputs: dict) -> torch.device:
    """The device the step runs on: the parameters' (meta when any input is on meta: nothing real)."""
    device = next(iter(gm.parameters()), torch.empty(0)).device
    metas = [t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor) and t.device.type == "meta"]
    return metas[0].device if metas else device


def _calls_by_node(run: "_Run") -> list[list[OpCall] | None]:
    """Per node, the ops it dispatched; None for opaque modules (they ran out of sight: roofline)."""
    runner = run.runner
    opaque = {i for n, i in runner.index.items() if n.op == "call_module" and n.target in runner.opaque}
    return [None if i in opaque else run.mode.calls.get(i, []) for i in range(runner.loss_i + 1)]


@dataclass(frozen=True)
class _Run:
    """What the fake step measured."""
    runner: _Runner
    fake: FakeState
    grad_params: dict[int, torch.Tensor]   # id of its fixed storage -> each fixed tensor that gets a gradient
    bwd: dict[int, int]        # node -> peak while its backward ran
    held: set[int]             # storages held to the end: the output kept, storages outliving the step

    @property
    def mode(self) -> _ProfileMode:
        return self.runner.mode


def _run(gm: fx.GraphModule, inputs: dict, loss_fn, opaque: tuple[str, ...], examples: dict[str, list],
         keep_output: bool, deterministic_ops: frozenset[str], record_calls: bool = False,
         fixed: dict[str, str] | None = None) -> _Run:
    """The step on fake tensors, metered node by node: forward, the loss as one more node, backward."""
    with fake_step(gm, inputs) as fake:
        mode = _ProfileMode(baseline=fake.fixed, deterministic_ops=deterministic_ops, record_calls=record_calls)
        mode.track_fixed([t.untyped_storage() for t in fake.fixed], [t.untyped_storage() for t in fake.made_from])
        opaque_state = {m: {k[len(m) + 1:]: v for k, v in fake.real.items() if k.startswith(m + ".")} for m in opaque}
        flops = TotalFlops(display=False, custom_mapping=FLOP_FORMULAS)
        runner = _Runner(gm, mode, flops, opaque_state, examples, fixed or {})
        with flops, mode:
            with step_held():
                bwd, kept = run_step(lambda: _forward(gm, runner, fake.inputs), lambda out: _loss(runner, out, loss_fn),
                                     lambda loss: _backward(loss, runner), keep_output, fake.reads)
            # storages the step made that outlive it (the output when kept: `kept` holds it; a module
            # attribute set in forward, such as the weight spectral_norm's pre-hook computes; a cache)
            held = set(mode.sid.values())
    return _Run(runner, fake, _grad_params(mode, fake), bwd, held)


def _grad_params(mode: _ProfileMode, fake: FakeState) -> dict[int, torch.Tensor]:
    """id of its fixed storage -> each fixed tensor that gets a gradient: the graph's, and those
    only the loss read (`FakeState.late`: fixed from their first read)."""
    late = [t for _, t in fake.late.values()]
    return {id(mode.fixed_storages[mode.fixed_ids[t.untyped_storage()]]): t for t in fake.fixed + late
            if t.requires_grad and t.is_leaf and t.untyped_storage() in mode.fixed_ids}


class LossValueDependent(ValueDependent):
    """The loss cannot run on fake tensors (no fake kernel: `ctc_loss`; a value-dependent shape):
    it is measured for real instead (planner.profile.opaque.measured_loss)."""


def _loss(runner: _Runner, out, loss_fn):
    runner.loss_kind = "stand-in" if loss_fn is None and model_loss(out) is None else "the model's own (out.loss)"
    try:
        return runner.measure(runner.loss_i, lambda: training_loss(out, loss_fn))
    except Exception as e:
        if loss_fn is None or isinstance(e, RematError):
            raise
        if not fake_cannot_run(e):
            raise LossFnError(describe(out), e) from e
        raise LossValueDependent("", e, LOSS) from e


def _forward(gm: fx.GraphModule, runner: _Runner, fake_inputs: dict):
    """The profiled forward: the graph run node by node on the fake inputs; the interpreter's
    environment is dropped after, so only what autograd and the output hold stays alive."""
    out = runner.run(*placeholder_values(gm, fake_inputs))
    runner.env.clear()
    return out


def _unique_bytes(storages) -> int:
    """Bytes of `storages`, each storage once."""
    return sum(st.nbytes() for st in {id(s): s for s in storages}.values())


def _param_grad_bytes(run: _Run) -> list[int]:
    """Per node, the bytes of the parameter gradients its backward makes last."""
    fixed, grad_params = run.mode.fixed_storages, run.grad_params
    param_grad = [0] * (len(run.runner.index) + 1)
    for fid, users in run.mode.fixed_users.items():
        st = fixed[fid]
        if id(st) in grad_params and users:
            param_grad[max(users)] += st.nbytes()
    return param_grad


def _buffer_storage_ids(gm: fx.GraphModule, run: _Run) -> dict[str, int]:
    """Each buffer's name -> the id of its fake storage."""
    return {k: id(run.fake.state[k].untyped_storage()) for k, _ in gm.named_buffers(remove_duplicate=False)}


def _writes_fixed(gm: fx.GraphModule, run: _Run) -> dict[int, str]:
    """The nodes that write a parameter or an input in place: they must not run twice."""
    fixed, buffer_ids = run.mode.fixed_storages, set(_buffer_storage_ids(gm, run).values())
    return {w: "writes a parameter or an input in place" for fid, writers in run.mode.fixed_mutated.items()
            if id(fixed[fid]) not in buffer_ids for w in writers}


def _mutated_buffers(gm: fx.GraphModule, run: _Run, opaque: tuple[str, ...]) -> list[str]:
    """The buffers the step writes in place, which a region's recompute must see as its forward
    did; an opaque module ran for real, out of sight, so each of its buffers may be written."""
    mutated = {id(run.mode.fixed_storages[fid]) for fid in run.mode.fixed_mutated}
    return sorted(k for k, sid in _buffer_storage_ids(gm, run).items()
                  if sid in mutated or any(k.startswith(m + ".") for m in opaque))


def _grad_last_users(run: _Run) -> list[int]:
    """Per node, the last node (the loss where none) that uses its output: its gradient is complete there."""
    index, loss_i = run.runner.index, run.runner.loss_i
    grad_last = [loss_i] * (loss_i + 1)
    for n, i in index.items():
        grad_last[i] = max((index.get(u, loss_i) for u in n.users), default=i)
    return grad_last


def _double_backward_why(run: _Run, i: int) -> str:
    """Why node i is not recomputed under a loss that differentiates through the graph: torch's
    non-reentrant checkpoint unpacks a tensor an in-place op on a view saved twice in one double
    backward, and refuses (CheckpointError; fuzz seed 5010)."""
    if run.runner.loss_differentiates and i in run.mode.writes_views:
        return ("writes a view in place, which torch's checkpoint cannot recompute under a loss that "
                "differentiates through it (autograd.grad with create_graph)")
    return ""


def _node_costs(gm: fx.GraphModule, run: _Run, rates: DeviceRates,
                measured: MeasuredCosts | None = None) -> tuple[NodeCost, ...]:
    """Per node: what it makes, reads and saves, and its recompute time: measured where it was
    (its ops, plus checkpoint's hooks on the tensors it saves), else the roofline of its FLOPs,
    bytes moved and ops."""
    runner, mode = run.runner, run.mode
    nodes, loss_i = list(runner.index), runner.loss_i
    writes_fixed, param_grad, grad_last = _writes_fixed(gm, run), _param_grad_bytes(run), _grad_last_users(run)
    costs = []
    for i in range(loss_i + 1):
        r, is_loss = runner.rec[i], i == loss_i
        why = "the loss is never recomputed" if is_loss else writes_fixed.get(i, "") or runner.not_recomputable.get(i, "") \
            or _double_backward_why(run, i)
        roofline = r["flops"] / rates.flops_per_s + mode.moved[i] / rates.bytes_per_s + mode.ops[i] * rates.op_s
        timed = measured.node_s[i] if measured and mode.ops[i] else None
        if timed is not None:       # recomputed in a region, its saved tensors pass checkpoint's hooks
            timed += measured.saved_tensor_s * runner.saved_count[i]
        costs.append(NodeCost(
            name=LOSS if is_loss else nodes[i].name,
            target=LOSS if is_loss else _target_name(gm, nodes[i]),
            module="" if is_loss else _module_of(nodes[i]),
            flops=int(r["flops"]),
            cost_s=roofline if timed is None else timed,
            ops=mode.ops[i], random=i in mode.random or i in runner.host_random,
            opaque=not is_loss and nodes[i].op == "call_module" and nodes[i].target in runner.opaque,
            fwd_extra_bytes=int(r["extra"]), bwd_extra_bytes=0,
            grad_bytes=int(r["grad_bytes"]), grad_last_user=grad_last[i],
            param_grad_bytes=param_grad[i], recomputable=not why, why_not=why,
        ))
    return tuple(costs)


def _storage_costs(run: _Run) -> tuple[StorageCost, ...]:
    mode, holders = run.mode, run.runner.holders
    return tuple(
        StorageCost(b, p, tuple(sorted(mode.users.get(s, ()))), tuple(sorted(holders.get(s, ()))),
                    s in run.held, tuple(sorted(mode.mutated.get(s, ()))))
        for s, (b, p) in enumerate(zip(mode.bytes, mode.producer))
    )


def _calibrated(cg: CostGraph, run: _Run) -> CostGraph:
    """Whatever the measured backward peak of a node holds beyond the model's account becomes its
    `bwd_extra_bytes`. The meter counted the tensors the step read but did not make (`late`)
    only from their first read."""
    late = cg.fixed_bytes - _unique_bytes(run.mode.fixed_storages[:len(run.fake.fixed)])
    model_bwd = timeline(cg, ()).bwd
    nodes = tuple(replace(c, bwd_extra_bytes=max(0, run.bwd.get(i, 0) + late - model_bwd[i]))
                  for i, c in enumerate(cg.nodes))
    measured = max(run.mode.peak_bytes, max(run.bwd.values(), default=0)) + late
    return replace(cg, nodes=nodes, meta={**cg.meta, "measured_peak_bytes": measured})


def _backward(loss: torch.Tensor, runner: _Runner) -> dict[int, int]:
    """Run backward, returning the peak live bytes measured while each node's backward ran."""
    if not loss.requires_grad:
        raise ValueError("the loss does not require grad: no trainable parameter or input reaches it")
    runner.mode.reset_peak()
    loss.backward()
    runner.close_bwd_interval()
    for h in runner.hooks.values():
        h.remove()
    runner.hooks.clear()
    return runner.bwd_peaks
