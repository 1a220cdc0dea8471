"""Plans for torch.compile: the step that runs is Inductor's, partitioned under the plan's tags.

The compiled model is the traced graph, each node's ops annotated with its name, compiled by
Inductor's backend with no Dynamo capture (planner/compiled/joint.py `compiled`, NOTE [ one
compile, no Dynamo ]: the plan's capture compiles the same way) with a partitioner that tags the
joint graph by the plan before torch's min-cut partitioner runs (planner/compiled/tags.py `Tagged`): regions and
selective-checkpointing policies alike become MUST_RECOMPUTE / MUST_SAVE tags, so the compiled
step saves what the plan says.

`CompiledPrediction` makes the `measure` for `solve_plan` in compile mode (runtime.planning
`compiled_measure`). It captures the joint graph once, on fake tensors (no real step), and for
each plan tried partitions it as the compile will; the eager replay then runs the whole step on
fake tensors with the compiled forward and backward stood in for by an autograd.Function that
allocates what the partitioned graphs' buffers do (planner/compiled/memory.py), and the loss,
optimizer and everything else as for an eager plan (NOTE [ the compiled step's stand-in ]).
`CompiledReplay` measures instead, with real compiled steps: the opt-in check (`remat check
--compiled`, the tests).
"""
from __future__ import annotations

import torch
import torch.fx as fx

from remat.planner.capture.trace import OUTPUT
from remat.planner.compat import pytree
from remat.planner.solve.fit import USED
from remat.planner.compiled.joint import Joint, capture_joint, compiled, output_leaves, tensor_inputs
from remat.planner.compiled.step import CompiledStep, check_started, compiled_step, layout_started
from remat.planner.compiled.tags import decisions, partition, tagged
from remat.planner.step.state import training_modes
from remat.planner.workers import cores, forks_for

from ..measure import peak_memory, preserved, training_loss


def compiled_module(model: torch.nn.Module, analysis, regions, names: tuple[str, ...],
                    compile_kwargs: dict | None = None) -> torch.nn.Module:
    """The model's traced graph compiled by Inductor under the plan `regions`, at its first call
    (planner/compiled/joint.py `compiled`, as the plan's capture compiles it): a GraphModule on
    the model's own parameters, buffers and children, called with the traced graph's inputs."""
    gm, example = analysis.traced.gm, analysis.example_inputs
    tensors = tensor_inputs(gm, example)
    constants = {k: v for k, v in example.items() if k not in tensors}
    return _around(gm, _Compiled(gm, tagged(decisions(tuple(regions), names)), compile_kwargs, tensors, constants),
                   [f"input:{k}" for k in tensors])


class _Compiled:
    """A plan's compiled step, compiled at its first call: called with the traced graph's tensor
    inputs `tensors` (by name, in order), the example's `constants` its other inputs."""

    def __init__(self, gm: fx.GraphModule, partition, compile_kwargs: dict | None, tensors: list, constants: dict):
        self.gm, self.partition, self.compile_kwargs = gm, partition, compile_kwargs
        self.tensors, self.constants = tensors, constants
        self.fn = None
        self.__name__ = "remat_compiled_step"         # its node's name in the graph around it

    def __call__(self, *tensors):
        if self.fn is None:
            inputs = {**self.constants, **dict(zip(self.tensors, tensors))}
            self.fn = compiled(self.gm, inputs, self.compile_kwargs, self.partition)
        return self.fn(*tensors)


# NOTE [ the compiled step's stand-in ]
# AOTAutograd runs a compiled graph as one autograd.Function: its forward returns the user's outputs
# and keeps the saved tensors; its backward, given the outputs' gradients, frees each saved tensor
# and each gradient given after its last read (NOTE [ boxed gradients ]) and returns the inputs'
# gradients. `_Stand` is that Function on fake tensors, with the partitioned graphs' memory:
# forward, a buffer of the forward graph's peak (freed), then the outputs and the saved storages;
# backward, the saved storages dropped, a buffer of the backward graph's peak above the tangents
# (freed), the tangents let go, then the gradients, laid out as the graph returns them (autograd
# copies a gradient whose layout is not its parameter's as it accumulates it, in the replay as
# for real). The stand-in's module holds every parameter and buffer of the model, the ones the
# compiled graph takes as constants too (resident all the same: the HF Llama's rotary inv_freq,
# whose 64 B it left out, checked 64 B under its allocator peak).
#
# NOTE [ boxed gradients ]
# torch 2.13's compiled Function is called with its outputs' gradients boxed in a list
# (`boxed_grads_call`): AOTAutograd clears the list, and the backward's wrapper frees each tangent
# at its last read, as it frees a saved tensor. A gradient no one else holds (a gradient autograd
# made of zeros for an output the loss does not read: a Hugging Face model's logits beside its
# loss) is then gone early in the backward. Held to the backward's end instead, as the stand-in and
# the check did before, the HF GPT-2 of benchmarks/compile.py (loss from labels) read 6.6% over its
# allocator peak under per-block checkpointing (17,043,520 vs 15,994,944 B: one logits' gradient).
# `_Stand` is boxed too, and lets its tangents go after its peak.
class _Stand(torch.autograd.Function):
    boxed_grads_call = True

    @staticmethod
    def forward(ctx, step: CompiledStep, *primals):
        device = next((p.device for p in primals if isinstance(p, torch.Tensor)), torch.device("cpu"))
        peak = torch.empty(step.forward.peak_bytes, dtype=torch.uint8, device=device)
        del peak
        ctx.step, ctx.device = step, device
        ctx.kept = [torch.empty(n, dtype=torch.uint8, device=device) for n in step.saved_bytes]
        return tuple(torch.empty_strided(m[0], m[1], dtype=m[2], device=device) for m in step.outputs)

    @staticmethod
    def backward(ctx, grads: list):
        step = ctx.step
        ctx.kept.clear()
        peak = torch.empty(max(0, step.backward.peak_bytes - step.tangent_bytes), dtype=torch.uint8, device=ctx.device)
        del peak
        grads.clear()           # NOTE [ boxed gradients ]
        return (None, *(None if m is None else torch.empty_strided(m[0], m[1], dtype=m[2], device=ctx.device)
                        for m in step.grads))


def _runner(step: CompiledStep):
    def run(*primals):
        return _Stand.apply(step, *primals)
    run.__name__ = run.__qualname__ = "remat_compiled_step"
    return run


def _sources(gm: fx.GraphModule, step: CompiledStep, inputs: dict) -> list[str]:
    """Which parameter, buffer or input each of the compiled forward's inputs is, by name: AOTAutograd's
    order (NOTE [ one compile, no Dynamo ] in planner/compiled/joint.py), the inputs 'input:name'."""
    out = [k for k, _ in gm.named_parameters(remove_duplicate=False)] + \
        [k for k, _ in gm.named_buffers(remove_duplicate=False)] + [f"input:{k}" for k in tensor_inputs(gm, inputs)]
    if len(out) != len(step.primals):
        raise NotImplementedError(f"the compiled graph takes {len(step.primals)} inputs, not the model's {len(out)} "
                                  "parameters, buffers and tensor inputs")
    return out


def stand_in(gm: fx.GraphModule, step: CompiledStep, inputs: dict) -> fx.GraphModule:
    """A GraphModule on `gm`'s parameters and inputs whose forward and backward are `_Stand`'s."""
    return _around(gm, _runner(step), _sources(gm, step, inputs))


def _around(gm: fx.GraphModule, call, sources: list[str]) -> fx.GraphModule:
    """A GraphModule with `gm`'s inputs, parameters and buffers that calls `call` on `sources` (names of
    parameters or buffers, 'input:name' for an input) and returns its outputs as `gm` returns
    its output's tensors (planner/compiled/joint.py `output_leaves`: the rest as they are)."""
    g = fx.Graph()
    env = {n.target: g.node_copy(n, lambda a: None) for n in gm.graph.nodes if n.op == "placeholder"}
    args = [env[s[6:]] if s.startswith("input:") else g.get_attr(s) for s in sources]
    made = g.call_function(call, tuple(args))
    leaves, spec, structured = output_leaves(gm)
    n = iter(range(len(leaves)))
    outs = pytree.tree_unflatten([g.call_function(_item, (made, next(n))) if isinstance(x, fx.Node) else x
                                  for x in leaves], spec)
    g.output(g.call_module(OUTPUT, tuple(outs)) if structured else outs)     # an exported graph's structure
    return fx.GraphModule(gm, g)


def _item(outs, i: int):
    return outs[i]


class CompiledPrediction:
    """The joint graph of a traced model, captured once; per plan, its compiled step (plain data)
    and the stand-in the eager replay runs in its place."""

    what = "the compiled step's partition, replayed on fake tensors"
    # the simulator models the eager step: the compiled one (min-cut recomputing cheap ops between
    # regions) departs from it plan by plan, so the budget correction takes more steps
    rounds, after_fit, first_scale, step_up = 8, 2, 1.3, True
    close_enough = 1 - USED         # a plan using the budget as the issue asks ends the search (NOTE [ the compiled fit ])

    def __init__(self, replay, compile_kwargs: dict | None = None, joint: Joint | None = None):
        self.replay = replay                        # the eager ExactReplay of the same analysis
        a = replay.analysis
        self.joint = joint or capture_joint(a.traced.gm, a.example_inputs, compile_kwargs)    # `joint`: captured before
        self.steps: dict[tuple, CompiledStep] = {}
        self.partitions: dict[tuple, tuple[fx.GraphModule, fx.GraphModule]] = {}
        self.checks: dict[tuple, int] = {}
        self.started: dict[tuple, object] = {}      # checks running (NOTE [ forked workers ])
        self.forks = forks_for({t.device.type for t in self.joint.inputs if isinstance(t, torch.Tensor)})
        self.laying = None                          # the forward's layout, found beside the fit

    def _partition(self, regions: tuple) -> tuple[fx.GraphModule, fx.GraphModule]:
        if regions not in self.partitions:
            self.partitions[regions] = partition(self.joint, decisions(regions, self.replay.names))
            if regions == () and self.forks:       # planner/compiled/wrapper.py NOTE [ the layout known ]
                self.laying = layout_started(self.joint, self.partitions[()])
        return self.partitions[regions]

    def _check(self, regions: tuple, alongside: bool = False):
        """The check of `regions`, started, the saved tensors laid out as the forward without
        checkpointing lays them out where that is known (NOTE [ the layout known ])."""
        laid_out = None
        if self.laying is not None and not alongside:
            try:
                laid_out = self.laying.result()
            except Exception:       # noqa: BLE001  (the check then lowers the forward itself)
                self.laying = None
        return check_started(self.joint, self._partition(regions), alongside=alongside, laid_out=laid_out)

    def start(self, regions, alongside: bool = True) -> None:
        """The check of `regions` started, to run while this process goes on (in forked workers,
        where it can: planner.workers; `alongside`: in one of them); `checked` collects it."""
        regions = tuple(regions)
        if regions not in self.started and (regions, True) not in self.steps:
            self.started[regions] = self._check(regions, alongside)

    def speculate(self, regions) -> None:
        """The check of `regions`, the fit's best plan so far, started (NOTE [ the best so far ]
        in planner/solve/fit.py), in two workers beside the fit; the check of an earlier best, still
        running, stopped. Only where checks fork (on CPU, with two cores or more): the workers run
        below the fit's priority (planner/workers.py NOTE [ forked workers ])."""
        regions = tuple(regions)
        if not self.forks:
            return
        for r in [r for r in self.started if r not in ((), regions)]:
            self.started.pop(r).cancel()
        self.start(regions, alongside=False)

    def step(self, regions, wrapper: bool = False) -> CompiledStep:
        """The plan's compiled step, its buffers modelled, or with `wrapper` checked (NOTE [ the
        compiled check ]); one partition for both."""
        regions = tuple(regions)
        if (regions, wrapper) not in self.steps:
            decided = decisions(regions, self.replay.names)
            check = (self.started.pop(regions, None) or self._check(regions)) if wrapper else None
            self.steps[regions, wrapper] = compiled_step(self.joint, decided, wrapper, self._partition(regions), check)
        return self.steps[regions, wrapper]

    def module(self, regions, wrapper: bool = False) -> fx.GraphModule:
        a = self.replay.analysis
        return stand_in(a.traced.gm, self.step(regions, wrapper), a.example_inputs)

    def checked(self, regions) -> int:
        """The whole step's replayed peak with the compile's own memory plan (seconds a plan)."""
        key = tuple(regions)
        if key not in self.checks:
            self.checks[key] = self.replay.replayed(key, lambda r: self.module(r, wrapper=True))
        return self.checks[key]

    def checked_at_once(self, plans: list) -> list[int]:
        """`checked` of each of `plans`, as many checks running at a time as this process may use
        cores (each check reads its two graphs in two workers, NOTE [ forked workers ]): the
        floor plans a refusal names (runtime.planning NOTE [ far below the floor ])."""
        ahead = max(1, cores())
        for regions in plans[:ahead]:
            self.start(regions, alongside=False)
        out = []
        for i, regions in enumerate(plans):
            out.append(self.checked(regions))
            if i + ahead < len(plans):
                self.start(plans[i + ahead], alongside=False)
        return out


class JointBeside:
    """`capture_joint` of the traced graph, as `analyze`'s `beside` (planner/api.py NOTE [ the
    profile, beside ]): run while a worker profiles the graph; what it raised, raised at `of`."""

    def __init__(self, compile_kwargs: dict | None):
        self.compile_kwargs = compile_kwargs
        self.gm = self.joint = self.error = None

    def __call__(self, gm: fx.GraphModule, named: dict) -> None:
        self.gm = gm
        try:
            self.joint = capture_joint(gm, named, self.compile_kwargs)
        except Exception as e:          # noqa: BLE001  (raised at `of`, after the profile's own errors)
            self.error = e

    def of(self, gm: fx.GraphModule) -> Joint | None:
        """The joint graph captured of `gm`, or None (none was, or of another graph)."""
        if self.gm is not gm:
            return None
        if self.error is not None:
            raise self.error
        return self.joint


class Checked:
    """The measure of compiled plans with each plan checked by the compile's own memory plan
    (`CompiledPrediction.checked`; runtime.planning NOTE [ the compiled check ])."""

    what = "the compiled step's own memory plan (Inductor's wrapper, generated without compiling), replayed"
    rounds, after_fit = 6, 1
    close_enough = 1 - USED

    def __init__(self, prediction: CompiledPrediction):
        self.prediction = prediction

    def __call__(self, regions) -> int:
        return self.prediction.checked(regions)


class CompiledReplay:
    """measure(regions) -> peak bytes of the compiled step, measured at the allocator (real steps)."""

    what = "the compiled step, measured at the allocator (a real step per plan tried)"
    rounds = 6          # solves the budget correction may take (planner.solve.fit, NOTE [ budget correction ])

    def __init__(self, model: torch.nn.Module, analysis, loss_fn, compile_kwargs: dict):
        self.model, self.analysis, self.loss_fn = model, analysis, loss_fn
        self.compile_kwargs = compile_kwargs
        self.compiled: dict[tuple, torch.nn.Module] = {}
        self.peaks: dict[tuple, int] = {}
        self.names = tuple(c.name for c in analysis.cost_graph.nodes)

    def module(self, regions) -> torch.nn.Module:
        """The compiled model under `regions` (compiled once per plan)."""
        key = tuple(regions)
        if key not in self.compiled:
            self.compiled[key] = compiled_module(self.model, self.analysis, key, self.names, self.compile_kwargs)
        return self.compiled[key]

    def _step(self, compiled) -> None:
        training_loss(compiled(**self.analysis.example_inputs), self.loss_fn).backward()

    def __call__(self, regions) -> int:
        key = tuple(regions)
        if key not in self.peaks:
            compiled = self.module(key)
            inputs = [x for x in self.analysis.example_inputs.values() if isinstance(x, torch.Tensor)]
            device = next((x.device for x in inputs), torch.device("cpu"))
            with preserved(self.model), training_modes(self.model):
                compiled.train()
                for p in self.model.parameters():
                    p.grad = None
                self._step(compiled)                    # compiles (forward and backward graphs)
                for p in self.model.parameters():
                    p.grad = None
                self.peaks[key] = peak_memory(lambda: self._step(compiled), self.model, *inputs,
                                              device=device, allocator=True)
        return self.peaks[key]
