"""plan(): trace -> profile -> CostGraph -> ILP -> simulated Plan, for reports and CI checks."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import torch
from remat.planner.compat import tree_flatten

from remat.planner.budget import as_budget
from remat.planner.costgraph import CostGraph, accumulating, with_optimizer, with_workspace
from remat.planner.profile.costs import OverheadProbe
from remat.planner.errors import InfeasibleBudgetError, TraceError
from remat.planner.solve.fit import PlanOptions, solve_plan, unplanned_peak_bytes
from remat.planner.profile.opaque import measured_loss, real_inputs
from remat.planner.step.optimizer import optimizer_memory
from remat.planner.profile.graph import LossValueDependent, ValueDependent, profile, step_device
from remat.planner.profile.rates import DeviceRates
from remat.planner.result import Plan
from remat.planner.step.rng import rng_preserved
from remat.planner.step.state import buffers_restored, mode_key, state_preserved, training_modes
from remat.planner.step.storage import region_state_bytes
from remat.planner.capture.check import check_capture, skipped
from remat.planner.capture.trace import Traced, capture
from remat.planner.step.workspace import workspace_bytes
from remat.planner.workers import forks_for, started

log = logging.getLogger("remat.planner")


@dataclass(frozen=True)
class Analysis:
    traced: Traced
    cost_graph: CostGraph
    analyze_s: float
    example_inputs: dict      # the graph's inputs by name, as given
    opaque_examples: dict = field(default_factory=dict)   # opaque module -> its real inputs
    fake_loss: object = None  # the loss as a fake step runs it, when fake tensors cannot run loss_fn
    times: dict = field(default_factory=dict)   # seconds: "capture", "check" (the capture check), "profile"


def analyze(model: torch.nn.Module, example_inputs=None, example_kwargs=None, loss_fn=None,
            rates: DeviceRates | None = None, *, keep_output: bool = False,
            deterministic_ops: frozenset = frozenset(), optimizer: torch.optim.Optimizer | None = None,
            accumulation_steps: int = 1, target_device: str | None = None, cost_model: str = "auto",
            overheads: OverheadProbe | None = None, beside=None) -> Analysis:
    """Trace and profile `model(*example_inputs, **example_kwargs)` (then `loss_fn`, backward,
    and `optimizer.step()` when an optimizer is given: its state and its step's temporaries are
    measured on fake tensors, planner/step/optimizer.py, for a step on `target_device`). With
    `accumulation_steps` > 1 the step planned is a micro-step after the first: every gradient
    exists from its start (costgraph.accumulating). `cost_model` (planner/profile/costs.py): "roofline",
    "measured" (each op timed on the device) or "auto" (measured on a CUDA device, else roofline);
    measured, a region's overheads are timed by `overheads` (the runtime passes its own regions',
    runtime.rewrite.overhead.REGION_PROBE), else DeviceRates' constants.

    The step planned is a training step, whatever mode the model is in: a model in eval mode
    is profiled as `model.train()` would leave it (dropout on, BatchNorm updating its
    statistics; a graph bakes the mode in), and its modes are restored afterwards. A model in
    train mode is profiled in the modes of its modules as they are (a BatchNorm frozen in eval
    stays frozen). Nothing of the user's model changes: RNG states, buffers and modes are as
    they were. `beside(gm, named inputs)`: work on the captured graph that runs here while a
    forked worker profiles it (NOTE [ the profile, beside ])."""
    args, kwargs = _checked_arguments(model, example_inputs, example_kwargs, accumulation_steps, optimizer)
    t0 = time.perf_counter()
    times = {"capture": 0.0, "check": 0.0, "profile": 0.0}
    with rng_preserved(), training_modes(model), state_preserved(model):   # planning leaves no trace
        traced, checked, named, examples, fake_loss, cg = _captured_and_profiled(
            model, args, kwargs, loss_fn, times, lambda gm, named, loss, opaque, examples, fixed: profile(
                gm, named, loss, rates, opaque, examples, keep_output, frozenset(deterministic_ops), cost_model,
                overheads, fixed), beside)
    _refuse_double_backward_through_opaque(traced, cg)
    _say_how(model, traced)
    if optimizer is not None:
        mem = optimizer_memory(optimizer, target_device)
        cg = with_optimizer(cg, mem.state_bytes, mem.step_bytes, mem.name)
    cg = with_workspace(cg, workspace_bytes(target_device or step_device(traced.gm, named), _step_dtypes(model)))
    if target_device is not None:       # a CUDA step's allocator does not hold the regions' host RNG states
        cg = replace(cg, region_state_bytes=region_state_bytes(torch.device(target_device)))
    cg = accumulating(cg, accumulation_steps)
    cg = replace(cg, meta={**cg.meta, "trace_path": traced.path, "modes": list(mode_key(model)),
                           "trace_attempts": [list(a) for a in traced.attempts], "capture_check": checked,
                           "inputs": input_signature(named), "targets": [c.target for c in cg.nodes]})
    return Analysis(traced, cg, time.perf_counter() - t0, named, examples, fake_loss, times)


def _refuse_double_backward_through_opaque(traced: Traced, cg: CostGraph) -> None:
    """An opaque module's stand-in (planner/profile/opaque.py) allocates what one backward through it holds;
    a loss that differentiates through the graph (`CostGraph.loss_differentiates`) runs two, and
    the first one's graph, held until the second, is not in the replay (fuzz seeds 5004 and 5010:
    20% and 1.7% under the measured peak). TraceError: the runtime plans over the module tree,
    each choice measured with a real step."""
    if cg.loss_differentiates and traced.opaque:
        module = traced.opaque[0][0]
        raise TraceError(module, f"the loss differentiates through the graph (autograd.grad with create_graph) and "
                                 f"{len(traced.opaque)} module(s) are opaque ({module}: {traced.opaque[0][1]}), whose "
                                 "stand-in models one backward")


def _checked_arguments(model, example_inputs, example_kwargs, accumulation_steps, optimizer) -> tuple[tuple, dict]:
    """`analyze`'s arguments checked (a typed error saying what is wrong); the example inputs as
    (args, kwargs)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args = tuple(example_inputs) if example_inputs is not None else ()
    kwargs = dict(example_kwargs or {})
    if not args and not kwargs:
        raise ValueError("no example inputs: pass example_inputs=(...) or example_kwargs={...}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters: there is no training step to plan")
    if int(accumulation_steps) != accumulation_steps or accumulation_steps < 1:
        raise ValueError(f"accumulation_steps must be a positive integer, got {accumulation_steps!r}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    return args, kwargs


def _timed(fn, *args):
    t0 = time.perf_counter()
    return fn(*args), time.perf_counter() - t0


# NOTE [ the profile, beside ]
# Compile mode captures the joint graph of the traced graph (planner/compiled/joint.py: seconds of
# AOTAutograd and Inductor's joint passes), which needs the traced graph only, not its profile. So
# where workers fork (planner/workers.py) the profile of a graph with no opaque module runs in a
# forked worker while `beside` (that capture) runs here: the profile is a pure function of the
# graph, its inputs and the loss, on fake tensors, and sends back a CostGraph (plain data). On 2
# cores, six pairs of fresh processes at issue 45's halfway budgets, with the collector's changes
# of planner/workers.py made at once (NOTE [ a worker collects nothing ]): the built-in GPT-2 of 6
# layers (a 0.9 s profile) planned in 11.7-13.0 s (median 12.5) before, 10.4-12.4 s (10.9) after,
# the ResNet (0.4 s) in 10.7-14.3 s (12.9) before, 9.7-12.6 s (11.0) after. A profile the
# worker could not finish (a loss or a module fake tensors cannot run) runs again here, as
# without a worker, and `beside` is the caller's to redo when the graph it was given is not the
# one analysed (`Analysis.traced.gm`).
def _profiled_beside(traced: Traced, named: dict, loss_fn, run_profile, beside, times: dict) -> CostGraph | None:
    """`run_profile` of `traced` in a forked worker while `beside(gm, named)` runs here (NOTE
    [ the profile, beside ]); None where it cannot or did not profile there (to run here)."""
    devices = {t.device.type for t in tree_flatten(named)[0] if isinstance(t, torch.Tensor)}
    if beside is None or traced.opaque or not forks_for(devices):
        return None
    job = started(_timed, run_profile, traced.gm, named, loss_fn, (), {}, dict(traced.fixed))
    beside(traced.gm, named)
    try:
        cg, times["profile"] = job.result()
    except Exception:       # noqa: BLE001  (a loss or module fake tensors cannot run: handled here, as without a worker)
        return None
    return cg


def _captured_and_profiled(model, args, kwargs, loss_fn, times: dict, run_profile, beside=None):
    """Capture (checked) and profile, until the profile runs: a loss fake tensors cannot run is
    measured for real, a module they cannot run becomes opaque (or the graph is captured again
    with it as a leaf). Returns (traced, check result, named inputs, opaque examples, the loss
    measured for real or None, the CostGraph); `times` gets each stage's seconds. `beside`: run
    on the first graph captured, beside its profile (NOTE [ the profile, beside ])."""
    fake_loss = None
    skip: dict[str, str] = {}      # capture paths whose graph failed the capture check, and why
    traced, checked = _checked_capture(model, args, kwargs, None, skip, times)
    named = traced.inputs(model, args, kwargs)
    cg = _profiled_beside(traced, named, loss_fn, run_profile, beside, times)
    if cg is not None:
        return traced, checked, named, {}, fake_loss, cg
    while True:
        opaque = tuple(m for m, _ in traced.opaque)
        examples = real_inputs(traced.gm, named, opaque) if opaque else {}
        t1 = time.perf_counter()
        try:
            cg = run_profile(traced.gm, named, loss_fn, opaque, examples, dict(traced.fixed))
            times["profile"] += time.perf_counter() - t1
            return traced, checked, named, examples, fake_loss, cg
        except LossValueDependent as e:    # the loss fake tensors cannot run: measured for real
            times["profile"] += time.perf_counter() - t1
            if fake_loss is not None:
                raise
            fake_loss = loss_fn = measured_loss(loss_fn, _real_output(traced.gm, named))
            log.info("%s: the loss is measured for real (%s)", type(model).__name__, e.why)
        except ValueDependent as e:    # a module fake tensors cannot run: profiled for real
            times["profile"] += time.perf_counter() - t1
            forced = _opaque_for(model, traced, e)
            if forced is None:
                traced = replace(traced, opaque=traced.opaque + ((e.module, _needs_values(e)),),
                                 path="fx with opaque leaves" if traced.path == "fx" else traced.path)
            else:
                traced, checked = _checked_capture(model, args, kwargs, forced, skip, times)
            named = traced.inputs(model, args, kwargs)


def _real_output(gm: torch.nn.Module, named: dict) -> list:
    """The graph's real output on the example inputs, flattened (a forward without grad: no
    activations kept; buffers and RNG restored)."""
    with buffers_restored(gm), torch.no_grad(), rng_preserved():
        return [x.detach() if isinstance(x, torch.Tensor) else x for x in tree_flatten(gm(**named))[0]]


def _needs_values(e: ValueDependent) -> str:
    if e.no_kernel:
        return f"has an op fake tensors cannot run ({e.why})"
    return f"needs tensor values, which fake tensors do not have ({e.why})"


def _opaque_for(model: torch.nn.Module, traced: Traced, e: ValueDependent) -> dict[str, str] | None:
    """Where fake tensors could not run a node (it needs tensor values: `.item()`, a data-dependent
    shape such as `nonzero` or a boolean mask), what runs for real instead: None when the node is
    a module (it becomes an opaque node as it is), else the opaque leaves to capture the graph again
    with, the module the node is in among them (torch.export has no leaves: fx takes it). In the
    root's own code there is no module to run alone: TraceError, and the runtime plans over the
    module tree."""
    if e.module in dict(traced.opaque):
        raise e
    if e.node is None:
        return None
    if not e.module:
        raise TraceError(f"{type(model).__name__}.forward", f"node {e.node} of its own code {_needs_values(e)}; "
                         "no submodule holds it, so no graph can be profiled")
    return {**dict(traced.opaque), e.module: _needs_values(e)}


def _checked_capture(model: torch.nn.Module, args: tuple, kwargs: dict, opaque: dict | None,
                     skip: dict[str, str], times: dict | None = None) -> tuple[Traced, str]:
    """`capture`, then the capture check (planner.capture.check): a graph that does not compute what the
    model does is not taken, and the next path is (`skip` records it; TraceError when no path is
    left: the runtime then plans over the module tree). Returns the graph and how it was checked."""
    why_not = skipped(args, kwargs, model)
    times = {"capture": 0.0, "check": 0.0} if times is None else times
    while True:
        t0 = time.perf_counter()
        traced = capture(model, args, kwargs, opaque, skip)
        times["capture"] += time.perf_counter() - t0
        if why_not:
            return traced, f"skipped: {why_not}"
        t0 = time.perf_counter()
        bad = check_capture(model, traced, args, kwargs)
        times["check"] += time.perf_counter() - t0
        if bad is None:
            return traced, "passed"
        log.warning("%s: the graph captured by %s does not compute what the model does (%s): not taken",
                    type(model).__name__, traced.path, bad)
        skip["torch.export" if traced.path == "torch.export" else "fx"] = f"capture check: {bad}"


def input_signature(named: dict) -> dict:
    """The graph's inputs by name as a plan records them (JSON): shape and dtype of tensors, the
    value of anything else; what a plan made elsewhere is checked against (runtime.apply)."""
    out = {}
    for k, v in named.items():
        if isinstance(v, torch.Tensor):
            out[k] = {"shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
        else:
            out[k] = {"value": repr(v)}
    return out


def _say_how(model: torch.nn.Module, traced: Traced) -> None:
    """Log what was not the plain path: another capture, opaque modules, use_cache turned off."""
    name = type(model).__name__
    if traced.path != "fx":
        log.info("%s: graph captured by %s; %s", name, traced.path,
                 "; ".join(f"{p} not taken ({why})" for p, why in traced.attempts))
    for p, why in traced.attempts:
        if "use_cache=False" in why:
            log.warning("%s: captured with use_cache=False, as Hugging Face does under gradient checkpointing: "
                        "the output carries no key/value cache", name)
    for module, why in traced.opaque:
        log.info("%s: %s is planned as one opaque node: %s", name, module, why)


def _step_dtypes(model: torch.nn.Module) -> set:
    """The dtypes a step's matmuls run in: the parameters', and autocast's on CUDA."""
    dtypes = {p.dtype for p in model.parameters()}
    return dtypes | {torch.get_autocast_dtype("cuda")} if torch.is_autocast_enabled("cuda") else dtypes


def analyze_for(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn, options: PlanOptions,
                optimizer: torch.optim.Optimizer | None = None, overheads: OverheadProbe | None = None,
                beside=None) -> Analysis:
    """`analyze` with what `options` says about the step (rates, output, ops, accumulation)."""
    return analyze(model, args, kwargs, loss_fn, options.device_rates(), keep_output=options.keep_output,
                   deterministic_ops=options.deterministic_ops, optimizer=optimizer,
                   accumulation_steps=options.accumulation_steps, target_device=options.target_device,
                   cost_model=options.cost_model, overheads=overheads, beside=beside)


def plan(model: torch.nn.Module, budget, *, example_inputs=None, example_kwargs=None,
         loss_fn=None, options: PlanOptions = PlanOptions(), optimizer: torch.optim.Optimizer | None = None) -> Plan:
    """Plan checkpoint regions so that one training step of `model` fits `budget`: a number of GB
    (10^9 bytes) or a string ('24GB', '8GiB', '40%' of the unplanned peak). With `optimizer`,
    the step includes `optimizer.step()` (its state and temporaries). Predicted by the simulator
    (plus `options.safety_margin`); `remat.plan_and_wrap` also replays the plan exactly.

    Examples:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        >>> p = plan(m, 1.0, example_inputs=(torch.randn(32, 64),))
        >>> p.regions, p.predicted_peak_bytes <= p.budget_bytes
        ((), True)
    """
    budget = as_budget(budget)
    a = analyze_for(model, example_inputs, example_kwargs, loss_fn, options, optimizer)
    try:
        return solve_plan(a.cost_graph, budget.bytes_of(unplanned_peak_bytes(a.cost_graph, options)), options,
                          a.traced.opaque)
    except InfeasibleBudgetError as e:
        raise e.in_unit(budget.unit) from None
