"""Every private torch API the planner and the runtime use, in one place (checked on torch 2.13.0,
the version CI installs; pyproject's lower bound). A torch upgrade that moves one breaks here, at
import, with its name, not deep inside a plan. FSDP2's private state is read in
runtime/distributed/fsdp.py alone (its docstring). Public torch APIs are imported where used.
tests/test_private_api.py holds every other file of planner/ and runtime/ to it.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import unittest.mock

import torch
import torch.utils.flop_counter
from torch._prims_common import compute_required_storage_length, make_contiguous_strides_for, suggest_memory_format
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode, UnsupportedOperatorException)
from torch._C._profiler import _EventType as ProfilerEventType
from torch._subclasses.functional_tensor import FunctionalTensor
from torch.fx import _pytree as fx_pytree
from torch.nn.utils.stateless import _reparametrize_module as reparametrize_module
from torch.utils import _pytree as pytree
from torch.utils.checkpoint import _CachedTorchDispatchMode as CachedTorchDispatchMode
from torch.utils.checkpoint import _CachingTorchDispatchMode as CachingTorchDispatchMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._pytree import (keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_map,
                                 tree_map_with_path, tree_unflatten)

CHECKED_ON = "2.13.0"

__all__ = ["CHECKED_ON", "CachedTorchDispatchMode", "CachingTorchDispatchMode", "ProfilerEventType", "fx_pytree",
           "pytree", "reparametrize_module", "DataDependentOutputException", "DynamicOutputShapeException", "FakeTensor", "FakeTensorMode",
           "FunctionalTensor",
           "TorchDispatchMode", "UnsupportedOperatorException", "compute_required_storage_length",
           "TotalFlops", "clear_cublas_workspaces", "current_fake_mode", "fake_cache_off", "disable_current_modes", "schedule_microbatches", "schedule_stages", "schedule_rank_order", "stage_backward_input", "stage_backward_weight", "stage_input_metas", "fake_store", "force_original_view_tracking", "functorch_active", "tensor_use_count", "storage_use_count", "view_base",
           "is_custom_op_class", "keystr", "make_contiguous_strides_for", "suggest_memory_format", "tree_flatten",
           "tree_flatten_with_path", "tree_leaves", "tree_map", "tree_map_with_path", "tree_unflatten",
           "partitioner", "inductor_compile", "inductor_mode_options", "min_cut_partition", "lazy_graph_module", "autograd_cache_off", "storage_key", "compile_failure_cause",
           "inductor_layout_opt", "inductor_wrapper", "KernelsUnwritten", "kernels_unwritten", "allocation_events"]


def clear_cublas_workspaces() -> None:
    """Release the cuBLAS/cuBLASLt workspaces torch holds (made again by the next matmul)."""
    torch._C._cuda_clearCublasWorkspaces()


def current_fake_mode():
    """The FakeTensorMode active on the dispatch mode stack, or None."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


_FAKE_CACHE = {"depth": 0, "saved": True}     # `fake_cache_off`: threads inside it, the setting found
_FAKE_CACHE_LOCK = threading.Lock()


@contextlib.contextmanager
def fake_cache_off():
    """FakeTensorModes made inside it cache no op's output (torch._dynamo's
    `fake_tensor_cache_enabled`, put back when the last thread inside leaves: two threads exporting
    at once leave it as found). An export with dynamic sizes rebuilt every cached output's
    symbolic sizes and strides (`set_`): a 2-layer Mamba2's export 6.9 -> 3.5 CPU s without it,
    the same graph (planner/capture/trace.py `_export`)."""
    import torch._dynamo.config as config
    with _FAKE_CACHE_LOCK:
        if not _FAKE_CACHE["depth"]:
            _FAKE_CACHE["saved"] = config.fake_tensor_cache_enabled
            config.fake_tensor_cache_enabled = False
        _FAKE_CACHE["depth"] += 1
    try:
        yield
    finally:
        with _FAKE_CACHE_LOCK:
            _FAKE_CACHE["depth"] -= 1
            if not _FAKE_CACHE["depth"]:
                config.fake_tensor_cache_enabled = _FAKE_CACHE["saved"]


def tensor_use_count(t: torch.Tensor) -> int:
    """How many references hold `t`'s TensorImpl: its Python object's one, and each C++ holder's
    (an autograd node's saved tensor, a collective's work)."""
    return t._use_count()


def storage_use_count(st: torch.UntypedStorage) -> int:
    """How many references hold the storage `st`: its Python object's one, and each tensor's on it."""
    return torch._C._storage_Use_Count(st._cdata)


def view_base(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor `t` is a view of (its `_base`, which its view holds a reference to), or None."""
    return t._base


def functorch_active() -> bool:
    """A functorch transform (vmap, grad, functionalize) is running."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def force_original_view_tracking(mode: bool):
    """Autograd replays views instead of tracking them as as_strided (a context manager)."""
    return torch.autograd._force_original_view_tracking(mode)


def is_custom_op_class(cls: type) -> bool:
    """A class torch.library's custom ops define (their autograd Functions)."""
    return cls.__module__.startswith("torch._library")


def fake_store():
    """The in-memory store of torch's `fake` process group (torch.testing's, private): imported
    when a job is planned from one process, not before."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    return FakeStore()


class _NoModules:
    """What FlopCounterMode's counting reads of its module tracker when only the total is wanted."""
    parents = frozenset({"Global"})

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return None


class TotalFlops(torch.utils.flop_counter.FlopCounterMode):
    """FlopCounterMode counting the step's total only (`get_total_flops`), without its module
    tracker (its private `mod_tracker`): that tracker puts a multi-grad hook on every module's
    outputs, which holds the gradients of all of them until the last is complete. A model whose
    forward returns its loss, logits and router logits then held the logits' gradient through most
    of backward while the profile metered it: 1 MB the real step frees after the head's backward
    (hf-moe: every plan's prediction up to 1 MB high there)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mod_tracker = _NoModules()


def schedule_stages(schedule) -> list:
    """The stages a torch.distributed.pipelining schedule runs on this rank (one, or an
    interleaved schedule's several)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def schedule_microbatches(schedule) -> int:
    """The micro-batches one `schedule.step` splits its batch into."""
    return int(schedule._n_microbatches)


def schedule_rank_order(schedule, fsdp: bool = False) -> tuple[tuple[str, int, int | None], ...] | None:
    """The computations a multi-stage schedule (`_PipelineScheduleRuntime`: interleaved 1F1B,
    looped BFS, zero bubble, DualPipeV) runs on this rank, in its order: (kind, stage index,
    micro-batch), kind "F" (forward), "B" (full backward), "I" / "W" (backward split into its
    input and weight parts), sends and receives left out; the list `_step_microbatches` walks
    (`pipeline_order_with_comms`). With `fsdp`, also the actions its lowering adds for stages
    under FSDP2 (`_add_unshard_reshard`, `_add_reduce_grad`): "UNSHARD", "RESHARD" and
    "REDUCE_GRAD", micro-batch None. None for a one-stage schedule."""
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not order:
        return None
    kinds = ("F", "B", "I", "W") + (("UNSHARD", "RESHARD", "REDUCE_GRAD") if fsdp else ())
    out = []
    for a in order[schedule.rank]:
        for c in (a.sub_actions or ()) if a.computation_type.value == "OVERLAP_F_B" else (a,):
            if c.computation_type.value in kinds:
                out.append((c.computation_type.value, c.stage_index, c.microbatch_index))
    return tuple(out)


def stage_backward_input(outputs: list, output_grads: list | None, inputs: list, weights) -> list:
    """A zero-bubble backward's input part, as torch's pipelining runtime runs it
    (torch.distributed.pipelining._backward.stage_backward_input: the inputs' gradients into their
    `.grad`, the graph kept for the weight part, the outputs detached): its param groups, for
    `stage_backward_weight`."""
    from torch.distributed.pipelining._backward import stage_backward_input as run
    return run(outputs, output_grads, inputs, weights)[1]


def stage_backward_weight(weights, param_groups: list) -> None:
    """A zero-bubble backward's weight part (torch.distributed.pipelining._backward.stage_backward_weight):
    the parameters' gradients from what the input part kept."""
    from torch.distributed.pipelining._backward import stage_backward_weight as run
    run(weights, param_groups)


def stage_input_metas(stage) -> tuple[tuple[torch.Size, torch.dtype], ...] | None:
    """The (shape, dtype) of each of one micro-batch's inputs of a PipelineStage, as its receive
    buffers are made from them (its `input_args`, or what its first step inferred); None while unknown."""
    metas = stage._stage_meta.inputs or stage._user_meta.inputs
    return None if metas is None else tuple((m.shape, m.dtype) for m in metas)


def held_elsewhere(t: torch.Tensor) -> bool:
    """Whether something besides the caller's `t` holds its memory: another reference to the same
    tensor (autograd handing one grad to two nodes) or another tensor on its storage. The caller's
    `t` (one reference) and the storage object looked at here are its own."""
    return t._use_count() > 1 or torch._C._storage_Use_Count(t.untyped_storage()._cdata) > 2


# ----------------------------------------------------------------------------- torch.compile's partitioner
# (planner/compiled/: the joint graph Inductor partitions, remat's decisions as its recompute tags)
def inductor_mode_options(mode: str, dynamic: bool | None) -> dict:
    """Inductor's config for torch.compile's `mode` (torch._inductor.list_mode_options)."""
    import torch._inductor
    return torch._inductor.list_mode_options(mode, dynamic)


def partitioner(fn):
    """`fn` (a callable with `uuid()`) as Inductor's custom partitioner, which it calls on the joint
    graph after its own joint-graph passes (Inductor's config `custom_partitioner_fn`):
    its class registered as a torch._inductor.custom_graph_pass.CustomPartitionerFn, which Inductor
    asserts. Registered at use, not subclassed, so that importing remat does not import Inductor
    (0.35 s of every process's start)."""
    from torch._inductor.custom_graph_pass import CustomPartitionerFn
    CustomPartitionerFn.register(type(fn))
    return fn


def inductor_compile(gm, inputs: list, options: dict):
    """`gm` (its parameters and buffers its own: AOTAutograd lifts them as the joint graph's first
    inputs, in `named_parameters(remove_duplicate=False)` then `named_buffers` order) compiled by
    Inductor for `inputs`, with Inductor's config `options` (a partitioner among them): what
    torch.compile's Inductor backend does with the graph Dynamo captures
    (torch._inductor.compile_fx.compile_fx), on a graph that needs no Dynamo capture. Returns the
    compiled callable, called with the inputs, returning the graph's outputs."""
    from torch._inductor.compile_fx import compile_fx
    return compile_fx(gm, inputs, config_patches=options)


def min_cut_partition(gm, joint_inputs, **kwargs):
    """torch._functorch.partitioners.min_cut_rematerialization_partition: the forward and backward
    graphs AOTAutograd makes of a joint graph, honouring its nodes' `recompute` tags. The graph
    modules it makes along the way are fx's lazy ones, as Inductor's compile makes them (their
    Python code generated at a first call, which the planner never makes); the two it returns are
    plain GraphModules, as in the training compile (planner/compiled/tags.py `partition` makes
    the planner's lazy)."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    with _use_lazy_graph_module(True):
        return min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)


def lazy_graph_module(root, graph):
    """`fx.GraphModule(root, graph)` whose Python code is generated at its first call
    (torch.fx._lazy_graph_module._LazyGraphModule)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule
    return _LazyGraphModule(root, graph)


def autograd_cache_off():
    """AOTAutograd's compile cache off (a context manager): a compile stopped at its partitioner
    caches nothing, and the cache's key (a hash of torch's sources and the graph) is its cost."""
    import torch._functorch.config as functorch_config
    return functorch_config.patch(enable_autograd_cache=False)


def storage_key(t: torch.Tensor):
    """A hashable key of `t`'s storage (torch.multiprocessing.reductions.StorageWeakRef): tensors on
    one storage (views) share it, fake ones included."""
    from torch.multiprocessing.reductions import StorageWeakRef
    return StorageWeakRef(t.untyped_storage())


def compile_failure_cause(e: BaseException) -> BaseException | None:
    """The exception a torch.compile backend raised, from the BackendCompilerFailed wrapping it."""
    return getattr(e, "inner_exception", None) or e.__cause__



def inductor_layout_opt(gm) -> bool:
    """Whether Inductor lays a training graph's convolutions out channels-last
    (torch._inductor.graph.GraphLowering.decide_layout_opt: on CPU with mkldnn, nearly always)."""
    from torch._inductor.graph import GraphLowering
    return GraphLowering.decide_layout_opt(gm, is_inference=False)


@contextlib.contextmanager
def kineto_quiet():
    """Inside, KINETO_LOG_LEVEL is 6 unless the user set it: kineto's USDT start/stop lines off on
    stderr (it reads the level when the profiler is first used). After, the environment is as it
    was: a process (and the processes it starts) does not inherit the setting."""
    before = os.environ.get("KINETO_LOG_LEVEL")
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("KINETO_LOG_LEVEL", None)


def allocation_events(fn) -> tuple[object, list[tuple[int, int, int, float, bool]]]:
    """`fn()`'s result, and the profiler's memory events while it ran, in time order: (time,
    address, bytes (< 0: a free), end of the top-level event around it, made inside a c10d op);
    an allocation outside any event has no such end (inf). What a kernel allocates inside itself
    is among them, as the CPU allocator sees it (runtime/measure/peak.py NOTE [ unseen frees ])."""
    from torch.profiler import ProfilerActivity, profile
    with kineto_quiet(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    out, stack = [], [(root, None, False) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        ev, top_end, c10d = stack.pop()
        if ev.tag == ProfilerEventType.Allocation:
            out.append((ev.start_time_ns, ev.extra_fields.ptr, ev.extra_fields.alloc_size,
                        math.inf if top_end is None else top_end, c10d))
        c10d = c10d or ev.name.startswith("c10d::")
        stack += [(c, ev.end_time_ns if top_end is None else top_end, c10d) for c in ev.children]
    return result, sorted(out, key=lambda e: e[0])


def inductor_wrapper(gm, inputs: list, visible: list[int] | None, donated: tuple[int, ...] = (),
                     codegen: bool = True, sources: bool = False) -> tuple[str, dict[str, int], list]:
    """The Python wrapper Inductor generates for a partitioned graph, without compiling a kernel:
    the steps of torch._inductor.compile_fx's codegen (fake propagation, post-grad passes,
    GraphLowering, its scheduler's fusion, the kernels and the wrapper's memory plan) on
    `gm` (changed in place) and its fake `inputs`; with each buffer's and input's storage bytes,
    and each output's strides as Inductor lays it out (None: not a tensor).
    A forward graph's `visible` outputs (the user's) keep their strides, as compile_fx_forward
    marks them; None: a backward graph, marked as compile_fx_backward does. A backward graph's
    `donated` inputs (by position) are buffers it may reuse, as AOTAutograd's donated saved tensors
    are (`bw_donated_idxs`, which Inductor reads from the tracing context we do not run under).
    Without `codegen`, only the lowering runs: no code and no sizes, the outputs' strides. Without
    `sources`, the C++ kernels' bodies are not written (`kernels_unwritten`: the same wrapper's
    memory plan); KernelsUnwritten where that cannot be done for this graph (run it with `sources`)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import (_recursive_post_grad_passes, _recursive_record_original_output_strides,
                                            fake_tensor_prop)
    from torch._inductor.fx_passes.post_grad import view_to_reshape
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V
    from torch._guards import detect_fake_mode
    fake_mode = detect_fake_mode(inputs)
    # a real tensor among them (eager RNG's saved state, under Inductor's fallback_random) made fake
    inputs = [fake_mode.from_tensor(t) if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor) else t
              for t in inputs]
    out, is_backward = gm.graph.find_nodes(op="output")[0], visible is None
    if is_backward:
        leaves = pytree.arg_tree_leaves(*out.args)
        visible = [i for i, n in enumerate(leaves) if isinstance(n, torch.fx.Node)] \
            if inductor_config.bw_outputs_user_visible else []
    out.meta["user_visible_output_idxs"] = visible
    with _reading(fake_mode, sources):
        view_to_reshape(gm)
        if (traced := _as_traced(gm, inputs)) is not None:     # NOTE [ the values as traced ]
            inputs = traced
        else:
            with torch.no_grad():
                fake_tensor_prop(gm, inputs)
        _recursive_record_original_output_strides(gm)
        _recursive_post_grad_passes(gm, is_inference=False)
        graph = GraphLowering(gm, example_inputs=inputs, shape_env=fake_mode.shape_env, graph_id=0,
                              is_inference=False, is_backward=is_backward)
        if is_backward and donated:
            graph.bw_donated_idxs = list(donated)
        with V.set_graph_handler(graph):
            graph.run(*inputs)
            strides = [tuple(map(int, o.get_layout().stride)) if o.has_tensor_output() else None
                       for o in graph.graph_outputs]
            if not codegen:
                return "", {}, strides
            code, _ = graph.codegen()
            sizes = _buffer_sizes(graph)
    return code.value, sizes, strides


@contextlib.contextmanager
def _reading(fake_mode, sources: bool):
    """Inductor set up for `inductor_wrapper`: its fake mode and debug context; no vector code (the
    wrapper's buffers are the same) and no bodies unless `sources` (NOTE [ the kernels unwritten
    ]); no vector instructions, so none to find (the check of the CPU's, a C++ compiler run, is 3
    s of a fresh process: pick_vec_isa finds none where simdlen is 0, and is told so here); no walk
    for size symbols in a static graph (NOTE [ no symbols sought ]); graph modules made lazy, as
    compile_fx_inner makes them (their Python code generated at a first call, never here)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa
    from torch._inductor.debug import DebugContext
    from torch._inductor.virtualized import V
    from torch.fx._lazy_graph_module import _use_lazy_graph_module
    with V.set_fake_mode(fake_mode), DebugContext(), inductor_config.patch({"cpp.simdlen": 0}), \
            unittest.mock.patch.object(cpu_vec_isa, "pick_vec_isa", lambda: cpu_vec_isa.invalid_vec_isa), \
            contextlib.nullcontext() if sources else kernels_unwritten(), no_symbols_sought(), \
            _use_lazy_graph_module(True):
        yield


# NOTE [ the values as traced ]
# Inductor propagates fake tensors through the graph it is given before its post-grad passes, so
# that each node's value (`meta["val"]`) is made from the example inputs. A partitioned graph's
# values were made so already, by AOTAutograd's trace of the joint graph, from the inputs' values
# as traced; where the check's inputs are laid out as those (a backward not restrided by layout
# optimization, every forward), the check takes the graph's own input values and propagates
# nothing: the same wrapper on all 28 graphs of 7 models read both ways (forward and backward,
# without checkpointing and under a plan each; 18 of them as traced), 0.2-0.3 s less of each such
# graph's 2-4 s. A restrided backward is propagated, as Inductor does, and so is a graph with an op
# of no value.
def _as_traced(gm, inputs) -> list | None:
    """`gm`'s own input values, where each of `inputs` is laid out as the value it stands for and
    every op of `gm` has a value; else None (NOTE [ the values as traced ])."""
    values = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    if len(values) != len(inputs) or not all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function"):
        return None
    for v, t in zip(values, inputs):
        if isinstance(t, torch.Tensor) != isinstance(v, torch.Tensor):
            return None
        if isinstance(t, torch.Tensor) and (t.shape, t.stride(), t.storage_offset(), t.dtype, t.device) != \
                (v.shape, v.stride(), v.storage_offset(), v.dtype, v.device):
            return None
    return values


# NOTE [ no symbols sought ]
# Inductor's scheduler asks, for each partition of the graph it codegens (`graph_partition`, on by
# default), which size symbols the partition must be given: it walks every node's indexing and
# layout for free symbols, and keeps those of the shape environment's kinds (sizes, floats,
# unbacked). A graph of static shapes has none: its shape environment made no symbol. That walk
# was 5-8% of a check's graph (the built-in GPT-2 of 6 layers' backward: 0.17-0.29 s of 3.5-4.8 s,
# one process), and the check skips it where the environment holds no symbol; a graph with one
# is walked as Inductor walks it.
@contextlib.contextmanager
def no_symbols_sought():
    """Inside, a graph partition of a graph whose shape environment made no symbol is given none
    without Inductor's walk for them (NOTE [ no symbols sought ])."""
    from torch._inductor.scheduler import Scheduler
    from torch._inductor.virtualized import V
    from torch.utils._ordered_set import OrderedSet
    sought = Scheduler.get_graph_partition_symbol_inputs

    def symbol_inputs(self, partition, input_nodes):
        env = V.graph.sizevars.shape_env
        if env is not None and not env.var_to_range:     # no symbol made: none of the kinds kept
            return OrderedSet()
        return sought(self, partition, input_nodes)
    with unittest.mock.patch.object(Scheduler, "get_graph_partition_symbol_inputs", symbol_inputs):
        yield


# NOTE [ the kernels unwritten ]
# The check reads the wrapper's memory plan, not the kernels' C++. What of the plan a C++ kernel's
# codegen decides: which buffers its nodes register as the kernel's inputs and outputs (a load of a
# buffer stored earlier in the same kernel reads the store: no input), which of its stores die
# inside it and are removed (`remove_kernel_local_buffers`, at the kernel's exit), which output
# takes over a dying input's buffer (`decide_inplace_update`, then `mark_run`'s allocation), and
# the kernel group's argument count (a flush, and its frees, past MAX_FUSED_KERNEL_ARGS_NUM).
# `kernels_unwritten` makes those decisions from each node's read and write dependencies, in the
# codegen's order, and writes no loop body: 16-30% less time per graph (the built-in GPT-2 of 6
# layers: a backward 4.4 -> 3.6 s in one process). The wrapper's allocation, reuse, alias and free
# lines and every buffer's size were the same as with the bodies written for all 54 graphs read
# (forward and backward of the built-in MLP, ResNet, U-Net, GPT-2 of 2 and 6 layers and the HF
# GPT-2 and Llama of benchmarks/compile.py, without checkpointing and under 2-3 plans each);
# tests/test_compiled_memory.py keeps that so. A kernel whose codegen decides more is written as
# Inductor writes it: outer-loop fusion's kernel-local buffers, a masked load (its sub-blocks may
# invalidate the store cache and keep a buffer), vector code (the check makes none). An error
# inside raises KernelsUnwritten, and the graph is read again with the bodies written.
class KernelsUnwritten(Exception):
    """The C++ kernels could not be left unwritten for this graph (NOTE [ the kernels unwritten ])."""


@contextlib.contextmanager
def kernels_unwritten():
    """Inside, Inductor's C++ backend writes no kernel body (NOTE [ the kernels unwritten ])."""
    from torch._inductor.codegen import cpp
    written = cpp.CppKernelProxy.codegen_nodes

    def codegen_nodes(self, nodes):
        if _must_write(self, nodes):
            return written(self, nodes)
        try:
            _register(self, nodes)
        except Exception as e:
            raise KernelsUnwritten(f"{type(e).__name__}: {e}") from e
    with unittest.mock.patch.object(cpp.CppKernelProxy, "codegen_nodes", codegen_nodes):
        yield


def _must_write(proxy, nodes) -> bool:
    from torch._inductor.codegen.cpp import LocalBufferContext
    from torch._inductor.loop_body import LoopBody
    from torch._inductor.virtualized import V
    local = V.local_buffer_context
    return bool(proxy.picked_vec_isa) or (isinstance(local, LocalBufferContext) and bool(local.local_buffers)) or \
        any(not isinstance(getattr(n, "_body", None), LoopBody) or n._body.subblocks for n in nodes)


def _register(proxy, nodes) -> None:
    """CppKernelProxy.codegen_nodes without the bodies: the scalar kernel's inputs, outputs, stores
    and in-place updates registered from the nodes' dependencies, in the codegen's order."""
    from torch._inductor.codegen.cpp import LoopNest
    from torch._inductor.dependencies import WeakDep
    from torch._inductor.virtualized import V
    group, reduction_group = max((n.group[1] for n in nodes), key=lambda sizes: len(sizes[1]))
    proxy.set_ranges(group, reduction_group)
    with proxy.kernel_group.new_kernel(proxy.kernel_cls) as kernel:
        kernel.set_ranges(group, reduction_group)
        cached: set[str] = set()            # stored in this kernel: a later load reads the store
        for node in nodes:
            node.decide_inplace_update()
            node.mark_run()
            for dep in node.read_writes.reads:
                if not isinstance(dep, WeakDep) and dep.name not in cached:
                    kernel.args.input(dep.name)
            for dep in node.read_writes.writes:
                kernel.store_buffer_names.add(dep.name)
                if getattr(dep, "mode", None) != "atomic_add":
                    cached.add(dep.name)
                if dep.name not in V.graph.removed_buffers:
                    kernel.args.output(dep.name)
    V.graph.removed_buffers |= kernel.removed_buffers
    V.graph.inplaced_to_remove |= kernel.inplaced_to_remove
    proxy.loop_nest = LoopNest.build(kernel)
    proxy.kernels = [kernel]
    proxy.aggregate_reduction_buffers(False, None)
    proxy.loop_nest.set_kernel(proxy)


def donates_buffers(fw, bw) -> bool:
    """Whether AOTAutograd donates saved tensors to the backward of this partition: functorch's
    `donated_buffer` on, and neither graph mutating a tensor's metadata (as
    collect_bw_donated_buffer_idxs decides)."""
    import torch._functorch.config as functorch_config
    from torch._functorch._aot_autograd.utils import contain_metadata_mutation_ops
    return functorch_config.donated_buffer and not (contain_metadata_mutation_ops(fw) or contain_metadata_mutation_ops(bw))


def _buffer_sizes(graph) -> dict[str, int]:
    """Each buffer's and input tensor's storage bytes in Inductor's lowered `graph`."""
    from torch._inductor.ir import Layout
    # a buffer's own layout (a kernel's several outputs share none: each output has its own), an
    # input tensor's (a symbol has none)
    layouts = {name: buf.get_layout() for name, buf in graph.graph_inputs.items() if hasattr(buf, "get_layout")}
    layouts.update({name: buf.layout for name, buf in graph.name_to_buffer.items()})
    # a size still symbolic (the joint graph's dynamic dimensions, before any guard made it
    # concrete) at the example's value, as the step runs it
    sizes = {name: graph.sizevars.optimization_hint(lay.storage_size()) * lay.dtype.itemsize
             for name, lay in layouts.items() if isinstance(lay, Layout)}
    # a fallback kernel of one output returns it itself (`bufN = torch.ops...`, then `bufM =
    # bufN`): its size is its output's (its own layout says only "outputs")
    for name, buf in graph.name_to_buffer.items():
        outs = getattr(buf, "outputs", None)
        if name not in sizes and isinstance(outs, list) and len(outs) == 1:
            sizes[name] = sizes.get(outs[0].get_name(), 0)
    return sizes
