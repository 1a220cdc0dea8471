"""plan_and_wrap(): the model a user trains, with checkpoint regions that fit the budget.

`Remat` (as `model.remat`) is the facade over the parts with one job each: the plans by input
signature (runtime.book, keyed by runtime.signature), making a plan (runtime.planning), the
budget resolved once (runtime.budget), and the forward runtime.dropin installs (`Remat.__call__`).
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import pickle
import sys
import warnings
from dataclasses import replace
from typing import Callable

import torch
from remat.planner.compat import disable_current_modes as _disable_current_modes
from remat.planner.compat import tree_flatten

from remat.planner import PlanOptions
from remat.planner.budget import Budget, as_budget
from remat.planner.errors import BudgetError
from remat.planner.result import Plan
from remat.planner.step.state import instance_forwards, training_modes

from . import distributed, dropin
from .distributed import interleaved, pipeline
from .book import PlanBook
from .budget import StepBudget
from .measure import preserved, training_loss
from .measure.timing import step_timing
from .planning import ExactReplay, Setting, from_plan, plan_call
from .rewrite import RecomputeTimes, checkpointing, view_replay
from .signature import call_key

__all__ = ["Remat", "plan_and_wrap", "apply", "remove", "trainer_keywords", "ExactReplay"]

log = logging.getLogger("remat.runtime")


class Remat:
    """remat's state on a model it planned, as `model.remat` (runtime.dropin installs it).

    Plans are made per input signature (shapes, dtypes, keyword values, autocast, modes) and
    cached: `plan` is the plan of the latest training call, `plans` all of them. The budget is
    bytes, resolved once: a '%' budget becomes bytes at the first plan and stays fixed. A new
    signature whose graph is one already planned keeps that plan when it still fits there
    (planner.solve.fit.reuse_plan: one prediction, no solve); only a plan that would not fit is made
    anew, and that is logged. In eval mode or without gradients the model's own forward runs.
    """

    def __init__(self, model: torch.nn.Module, budget: Budget | StepBudget, loss_fn: Callable | None,
                 options: PlanOptions, compile: dict | None = None, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self._budget = StepBudget.of(budget)
        self._loss_fn, self._options = loss_fn, options
        self._compile = compile                # torch.compile kwargs: plans are for the compiled step
        self._optimizer = optimizer            # its state and step are in the budget
        self._book = PlanBook()                # the plans, by input signature
        self._bypass = 0                       # > 0 while remat itself runs the model (capture, timing)
        self._warned: set[str] = set()
        self.forward: dropin.PlannedForward | None = None   # set by dropin.install

    @property
    def budget(self) -> Budget:
        """The budget: as given, a '%' one as bytes once the first plan resolved it."""
        return self._budget.budget

    @property
    def solves(self) -> int:
        """How many plans this run made by a solve (not those kept from other inputs or taken
        from the plan cache)."""
        return self._book.solves

    def __getstate__(self):
        """Pickled (torch.save) without its plans: they hold traced graphs, and are made again for
        the loaded model at its first training call. A loss_fn that cannot be pickled (a closure)
        is left out, with a warning: the loaded model then plans with the stand-in loss (room for
        a tensor of the output's size) until `set_loss_fn` gives it one."""
        state = dict(self.__dict__)
        state["_book"], state["_bypass"] = PlanBook(self._book.solves), 0
        if self._loss_fn is not None:
            try:
                pickle.dumps(self._loss_fn)
            except Exception as e:
                warnings.warn(f"the remat plan is pickled without its loss_fn ({type(e).__name__}: {e}); after "
                              "loading, pass it again with model.remat.set_loss_fn(loss_fn)", stacklevel=2)
                state["_loss_fn"] = None
        return state

    def __deepcopy__(self, memo: dict) -> "Remat":
        """A copy for the copied model (`copy.deepcopy(model)`), its plans and loss_fn kept: its
        graphs run the copy's parameters (deepcopy's memo maps them), so the copy trains on the
        plans made here, with no capture and no solve."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for spec in self._book.tree_specs():     # immutable, and torch warns when one is deep-copied
            memo[id(spec)] = spec
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if k == "_loss_fn" else copy.deepcopy(v, memo)
        return new

    def set_loss_fn(self, loss_fn: Callable | None) -> None:
        """The loss the plans are made for; plans made for another loss are dropped."""
        self._loss_fn = loss_fn
        self._book.forget()

    def remove(self) -> torch.nn.Module:
        """Take the plan out of the model, as `remat.remove(model)` does; returns the model as it was."""
        return dropin.remove(self.model)

    @property
    def plan(self) -> Plan:
        """The plan of the latest training call (or `plan_for`, `use_plan`); RuntimeError before
        the first."""
        return self._book.current.plan

    @property
    def plans(self) -> dict[tuple, Plan]:
        """Every plan of this run, by input signature (shapes, dtypes, devices, keyword values,
        autocast and modes)."""
        return self._book.plans()

    @contextlib.contextmanager
    def bypassed(self):
        """Inside, `model(...)` runs the model's own forward, as it was before remat installed its
        own (remat capturing or timing it: a tracer sees the user's forward, not remat's)."""
        self._bypass += 1
        try:
            with instance_forwards({self.model: self.forward.inner}):
                yield
        finally:
            self._bypass -= 1

    def _setting(self) -> Setting:
        return Setting(self.model, self._loss_fn, self._options, self._compile, self._optimizer, self.bypassed)

    def plan_for(self, *args, **kwargs) -> Plan:
        """Plan (or fetch the cached plan) for inputs like these, without running the model."""
        self._take_over()
        key = call_key(args, kwargs, self.model)
        if key not in self._book:
            # planning inside a user's dispatch mode (a memory meter around the step) is not seen by it;
            # an infeasible budget's sizes in the unit the budget was written in
            with self._budget.errors_spelled(), self.bypassed(), _disable_current_modes():
                self._book.add(key, plan_call(self._setting(), self._budget, self._book, key, args, kwargs))
        return self._book.use(key)

    def plan_up_front(self, args: tuple, kwargs: dict) -> Plan:
        """`plan_for` the example call, and the call Hugging Face's Trainer will make of it
        (`trainer_keywords`), so that a Trainer run trains on plans made here; `plan` stays the
        example call's."""
        plan = self.plan_for(*args, **kwargs)
        extra = trainer_keywords(self.model, kwargs)
        if extra:
            last = self._book.last
            try:
                self.plan_for(*args, **kwargs, **extra)
            except Exception as e:    # noqa: BLE001 - a call the user did not make: it plans when made, if ever
                log.info("%s: the call Trainer makes (%s) was not planned ahead (%s: %s)", type(self.model).__name__,
                         ", ".join(extra), type(e).__name__, e)
            self._book.last = last
        return plan

    def use_plan(self, plan: Plan, *args, **kwargs) -> Plan:
        """Train inputs like these with `plan` (made elsewhere: `Plan.from_json`), without
        re-planning. Raises PlanMismatchError, saying what differs, when the model's graph or the
        inputs are not the ones the plan was made for."""
        key = call_key(args, kwargs, self.model)
        self._book.add(key, from_plan(self._setting(), plan, args, kwargs))
        return self._book.use(key)

    def time_plan(self, *args, **kwargs) -> Plan:
        """Time a training step under the plan for inputs like these against the unplanned step,
        on these inputs (runtime.measure.timing: interleaved rounds, medians, spread); the plan,
        with the measured and the predicted overhead in `facts.timing` (and, for an eager graph,
        each region's measured recompute), is returned and cached.
        Gradients, buffers and RNG states are as they were before."""
        plan = self.plan_for(*args, **kwargs)
        model, loss_fn = self.model, self._loss_fn
        params = list(model.parameters())

        def step(planned: bool):
            def run():
                for p in params:
                    p.grad = None
                with contextlib.nullcontext() if planned else self.bypassed():
                    out = model(*args, **kwargs)
                training_loss(out, loss_fn).backward()
            return run
        device = next((t.device for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)), "cpu")
        gm = self._book.current.gm
        eager_graph = gm is not None and self._compile is None     # regions to time one by one
        # a training step, in the modes planned for (planner.step.state.training_modes)
        with training_modes(model), preserved(model), \
                RecomputeTimes(gm, device) if eager_graph else contextlib.nullcontext() as regions:
            timing = step_timing(step(False), step(True), plan.recompute_s, plan.cost_model, device)
        if regions is not None:
            timing = replace(timing, region_recompute_s=regions.fastest())
        plan = plan.noting(timing=timing.to_dict())
        self._book.retimed(plan)
        return plan

    def _warn_once(self, what: str, message: str) -> None:
        """`message` once per run and kind of event, as one Python warning (a user's pytest and
        warnings filters see it; the log has it at INFO, so it is not printed twice)."""
        if what not in self._warned:
            self._warned.add(what)
            log.info(message)
            warnings.warn(message, stacklevel=4)

    def _take_over(self) -> None:
        """Hugging Face's own gradient checkpointing (gradient_checkpointing_enable(), Trainer's
        gradient_checkpointing=True), enabled before or after remat, is turned off, once said: the
        plan is made for the model without it and fits the budget; both at once would recompute
        twice, and a capture through it would count a peak the step never has."""
        model = self.model
        name = "activation" if hasattr(type(model), "is_activation_checkpointing") else "gradient"   # transformers 5
        if getattr(model, f"is_{name}_checkpointing", False):
            getattr(model, f"{name}_checkpointing_disable")()
            self._warn_once("hf", f"{type(model).__name__}: Hugging Face gradient checkpointing was enabled; remat "
                                  "turned it off and checkpoints by its own plan, which fits the budget")

    def __call__(self, args: tuple, kwargs: dict):
        """The installed forward (runtime.dropin): the planned graph in a training step, else the
        model's own forward."""
        model = self.model
        original = self.forward.original
        if self._bypass or not torch.is_grad_enabled():
            return original(*args, **kwargs)
        if not model.training:
            self._warn_once("eval", f"{type(model).__name__} is in eval mode with gradients enabled: remat runs its "
                                    "own forward without a plan, so a backward here is not held to the budget. Call "
                                    "model.train() to train, or run inference under torch.no_grad()")
            return original(*args, **kwargs)
        self.plan_for(*args, **kwargs)
        p, gm, traced = self._book.current
        if gm is None:
            with checkpointing(model, [p.node_names[r.start] for r in p.regions]):
                return original(*args, **{**p.facts.extra_kwargs, **kwargs})
        if gm.training != model.training:
            gm.train(model.training)
        with view_replay() if self._compile is None else contextlib.nullcontext():   # compiled: functional views
            return gm(**traced.inputs(model, args, kwargs))


def trainer_keywords(model: torch.nn.Module, kwargs: dict) -> dict:
    """The keywords Hugging Face's Trainer adds to a call with `labels` of a model that accepts
    loss keywords (its `accepts_loss_kwargs`, else a `**kwargs` forward), when the process has
    loaded Trainer (`from transformers import Trainer`: a run that does not use it pays no second
    capture), as its `compute_loss` does: `num_items_in_batch`, the labels' count of positions not
    ignored (-100) divided by the parallel degrees (transformers 5: a 0-dim tensor of the default
    float dtype on their device; its value is not part of a plan). {} for other calls."""
    labels = kwargs.get("labels")
    if not isinstance(labels, torch.Tensor) or "num_items_in_batch" in kwargs \
            or "transformers.trainer" not in sys.modules:
        return {}
    accepts = getattr(model, "accepts_loss_kwargs", None)
    if accepts is None:
        accepts = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())
    return {"num_items_in_batch": labels.ne(-100).sum().to(torch.get_default_dtype())} if accepts else {}


def plan_and_wrap(model: torch.nn.Module, budget_gb=None, *, example_inputs=None, example_kwargs=None,
                  loss_fn: Callable | None = None, options: PlanOptions = PlanOptions(),
                  compile: bool | dict = False, optimizer: torch.optim.Optimizer | None = None,
                  time: bool = False, budget=None, schedule=None) -> torch.nn.Module:
    """Plan activation checkpointing into `model` so that one training step fits `budget_gb`, at
    the least recompute, and return `model` itself (the same object: its class, attributes,
    methods, forward signature, hooks, parameters and `state_dict()` are unchanged).

    `budget_gb`: a number of GB (10^9 bytes) or a string as the CLI takes it ('24GB', '8GiB',
    '500MB', or '40%' of the step's unplanned peak); `budget=` is the same argument by its older
    name. The budget is bytes, resolved once: a '%' budget becomes bytes at the first plan and
    serves the whole run. `model.remat` holds the plans (`model.remat.plan`); `model.remat.remove()`
    (or `remat.remove(model)`) takes the plan out. In eval mode or under no_grad (evaluation,
    `generate`) the model's own forward runs.

    With example inputs the plan is made now (errors surface here): pass the largest batch the
    run will see (the longest padded length); later shapes keep that plan while it fits them
    (checked by one prediction, no solve). Without example inputs the model plans at its first
    training call. The budget covers parameters, gradients, inputs, activations and the loss:
    pass `loss_fn` (output -> scalar) to have the loss planned exactly, else room is left for a
    loss that keeps one tensor of the output's size (a Hugging Face model's `out.loss` is found by
    itself). Pass `optimizer` (over the model's parameters, configured as it will train) to budget
    the whole step: its state, live throughout, and `optimizer.step()`'s temporaries after
    backward, measured on fake tensors. `options.accumulation_steps` > 1 plans a micro-step of
    gradient accumulation (every gradient live from its start).

    `compile=True` (or a dict of `torch.compile` keyword arguments) plans for the compiled step
    and trains with it: the traced graph compiled whole by Inductor, the plan as its partitioner's
    tags; plans are predicted on fake tensors and checked by Inductor's memory plan (docs/compile.md). `schedule` (GPipe, 1F1B,
    interleaved, zero bubble, V; `model` runs a stage of it): the rank's step is planned (docs/pipeline.md).

    `time=True` (with example inputs) also times the planned step against the unplanned one on
    them (`Remat.time_plan`): `plan.facts.timing`, and a line of `plan.summary()`, give the
    measured overhead beside the predicted one.

    Examples:
        >>> import torch
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        >>> w = plan_and_wrap(m, budget_gb=1.0, example_inputs=(torch.randn(32, 64),))
        >>> w is m, w.remat.plan.regions
        (True, ())
    """
    budget = _one_budget(budget_gb, budget)
    _not_compiled(model)
    if schedule is not None:    # a pipeline stage, or a rank's several (runtime/distributed/pipeline.py)
        return plan_pipeline(model, budget, schedule, example_inputs, example_kwargs, loss_fn, options, compile,
                             optimizer, time)
    if distributed.engine(model) is not None:     # FSDP2 / DDP: planned per rank (runtime/distributed/)
        return distributed.wrap_model(model, budget, example_inputs, example_kwargs, loss_fn, options,
                                      compile, optimizer)
    if time and example_inputs is None and example_kwargs is None:
        raise ValueError("time=True times the plan on the example inputs: pass example_inputs or example_kwargs")
    compile_kwargs = ({} if compile is True else dict(compile)) if compile else None
    with _installed(model, Remat(model, budget, loss_fn, options, compile_kwargs, optimizer)) as state:
        if example_inputs is not None or example_kwargs is not None:
            state.plan_up_front(tuple(example_inputs or ()), dict(example_kwargs or {}))
            if time:
                state.time_plan(*(example_inputs or ()), **(example_kwargs or {}))
    return model


def _one_budget(budget_gb, budget) -> Budget:
    if budget_gb is not None and budget is not None:
        raise BudgetError("plan_and_wrap() takes one budget: budget_gb= or its older name budget=, not both")
    if budget_gb is None and budget is None:
        raise BudgetError("plan_and_wrap() needs a budget: budget_gb=24 (GB), or a string such as '24GB' or '40%'")
    return as_budget(budget_gb if budget is None else budget)


def plan_pipeline(model: torch.nn.Module, budget: Budget, schedule, example_inputs, example_kwargs, loss_fn,
                  options: PlanOptions, compile, optimizer, time: bool) -> torch.nn.Module:
    """plan_and_wrap(model, ..., schedule=schedule): a rank running several stages (interleaved) has
    them all planned together (`pipeline_rank`); a rank's one stage is planned as a model whose
    step is its rank's whole `schedule.step` (`pipeline_stage`)."""
    if pipeline.runs_several(schedule):
        return pipeline_rank(model, schedule, budget, example_inputs, example_kwargs, loss_fn, options, compile,
                             optimizer)
    if distributed.engine(model) == "fsdp":       # PP x FSDP2 (runtime/distributed/pipeline_fsdp.py)
        from .distributed import pipeline_fsdp
        _pipeline_checks(model, example_inputs, example_kwargs, compile, fsdp=True)
        return pipeline_fsdp.wrap_stage(model, budget, schedule, example_inputs, example_kwargs, loss_fn, options,
                                        optimizer)
    options, args, kwargs, loss_fn = pipeline_stage(model, schedule, options, example_inputs, example_kwargs,
                                                    compile, loss_fn)
    return plan_and_wrap(model, budget, example_inputs=args, example_kwargs=kwargs, loss_fn=loss_fn, options=options,
                         compile=compile, optimizer=optimizer, time=time)


def pipeline_stage(model: torch.nn.Module, schedule, options: PlanOptions, example_inputs, example_kwargs,
                   compile, loss_fn) -> tuple[PlanOptions, tuple, dict, Callable | None]:
    """The options, example inputs and loss of a pipeline stage's plan (runtime/distributed/pipeline.py):
    its output is held from its forward to its backward (`keep_output`); a stage before the last
    has no loss of its own, its backward starts from the gradient it receives."""
    _pipeline_checks(model, example_inputs, example_kwargs, compile)
    rank = replace(pipeline.rank_of(schedule, model), keeps_outputs=options.pipeline_outputs)
    args, kwargs = pipeline.stage_inputs(tuple(example_inputs or ()), dict(example_kwargs or {}), rank)
    return (replace(options, pipeline=rank, keep_output=True), args, kwargs,
            loss_fn if rank.last else pipeline.received_grad_loss)


def _pipeline_checks(model: torch.nn.Module, example_inputs, example_kwargs, compile, fsdp: bool = False) -> None:
    """A stage planned up front, eager; under FSDP2 only where `fsdp` (every stage of the rank), never under DDP."""
    if example_inputs is None and example_kwargs is None:
        raise ValueError("a pipeline stage is planned up front: pass example_inputs (one micro-batch's inputs "
                         "of this stage)")
    if compile:
        raise pipeline.PipelineScheduleError("a pipeline stage is planned eager so far: plan it without compile=")
    if not fsdp and distributed.engine(model) is not None:
        raise pipeline.PipelineScheduleError(
            "a pipeline stage under DDP, or a rank whose stages are not all under FSDP2, is not planned yet: plan "
            "it before DDP, or shard every stage of the rank with fully_shard")


def pipeline_rank(model: torch.nn.Module, schedule, budget: Budget, example_inputs, example_kwargs, loss_fn,
                  options: PlanOptions, compile, optimizer) -> torch.nn.Module:
    """A rank running several stages of `schedule` (interleaved 1F1B), `model` one of their modules:
    every stage module of the rank planned together for the rank's one budget
    (runtime/distributed/interleaved.py), each plan installed in its own module; returns `model`.
    `example_inputs` are `model`'s; `loss_fn` is the last stage's, if the rank holds it."""
    rs = pipeline.rank_stages(schedule, model)
    engines = {distributed.engine(st.submod) for st in rs.stages}
    if engines == {"fsdp"}:      # every stage under FSDP2 (runtime/distributed/interleaved_fsdp.py)
        from .distributed import interleaved_fsdp
        for st in rs.stages:
            _pipeline_checks(st.submod, example_inputs, example_kwargs, compile, fsdp=True)
        return interleaved_fsdp.wrap_rank(model, schedule, budget, tuple(example_inputs or ()),
                                          dict(example_kwargs or {}), loss_fn, options, optimizer)
    settings = interleaved.stage_settings(rs, model, tuple(example_inputs or ()), dict(example_kwargs or {}),
                                          loss_fn, options)
    for s in settings:
        _pipeline_checks(s.module, example_inputs, example_kwargs, compile)
        _not_compiled(s.module)
        if dropin.installed(s.module) is not None:      # planned before: the rank is planned anew, whole
            dropin.remove(s.module)
    step_budget = StepBudget.of(budget)
    with step_budget.errors_spelled():
        plans = interleaved.plan_rank(settings, rs.order, step_budget, optimizer, rs.handovers)
    for s, p in zip(settings, plans):
        state = Remat(s.module, Budget("bytes", float(p.budget_bytes)), s.loss_fn, s.options, None, optimizer)
        with _installed(s.module, state):
            state.use_plan(p, *s.args, **s.kwargs)
    return model


def _not_compiled(model: torch.nn.Module) -> None:
    """A TypeError that says what to do for a model torch.compile already wrapped: its compiled
    step is not the one an eager plan is made and checked for."""
    if isinstance(getattr(model, "_orig_mod", None), torch.nn.Module) and hasattr(model, "dynamo_ctx"):
        raise TypeError(f"{type(model._orig_mod).__name__} is already wrapped by torch.compile: remat plans the eager "
                        "model. Plan it before compiling, with compile=True to have remat compile the planned step "
                        "and keep its budget (plan_and_wrap(model, budget, ..., compile=True)); a model compiled "
                        "after planning trains correctly but its peak is not the one planned")


@contextlib.contextmanager
def _installed(model: torch.nn.Module, state: Remat):
    """`state` installed in `model` (runtime.dropin) for the block and after it; if the block
    raises (a budget no plan fits), the model is left as it was: its earlier plan, or none."""
    earlier = dropin.installed(model)
    state.forward = dropin.install(model, state)
    try:
        yield state
    except BaseException:
        if isinstance(earlier, Remat):
            dropin.install(model, earlier)
        else:
            dropin.remove(model)
        raise


def apply(model: torch.nn.Module, plan: Plan, *, example_inputs=None, example_kwargs=None,
          loss_fn: Callable | None = None, options: PlanOptions = PlanOptions()) -> torch.nn.Module:
    """Install a plan made elsewhere (on a laptop, on a `meta` copy of the model: see
    `Plan.to_json` / `Plan.from_json`) into `model`, for inputs shaped like the plan's; no
    re-planning; returns `model`. The example inputs (real, fake or meta tensors of the training
    shapes) are traced to check that graph and inputs are the plan's (PlanMismatchError
    otherwise). Inputs of other shapes keep the plan while it fits them, else are planned as
    plan_and_wrap does, for the plan's budget."""
    _not_compiled(model)
    with _installed(model, Remat(model, Budget("bytes", float(plan.budget_bytes)), loss_fn, options)) as state:
        state.use_plan(plan, *(example_inputs or ()), **(example_kwargs or {}))
    return model


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Take remat's plan out of `model`: it runs as before plan_and_wrap; returns `model`.
    Raises ValueError when `model` has no plan (never planned, or removed already)."""
    return dropin.remove(model)
