"""plan_and_wrap(): the model a user trains, with checkpoint regions that fit the budget."""
from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import pickle
import sys
import time
import warnings
from dataclasses import replace
from typing import Callable, NamedTuple

import torch
from remat.planner.compat import disable_current_modes as _disable_current_modes
from remat.planner.compat import keystr, tree_flatten, tree_flatten_with_path, tree_map_with_path

from remat.planner import PlanOptions, analyze, solve_plan
from remat.planner.budget import Budget, as_budget
from remat.planner.api import analyze_for, input_signature
from remat.planner.errors import BudgetError, InfeasibleBudgetError, RematError, PlanMismatchError, TraceError
from remat.planner.facts import StepFacts
from remat.planner.fit import DEFAULT_ROUNDS, reuse_plan, unplanned_peak_bytes
from remat.planner.profile import compute_nodes
from remat.planner.result import Plan
from remat.planner.simulate import base_liveness
from remat.planner.rng import rng_preserved
from remat.planner.state import instance_forwards, mode_key, state_preserved, training_modes
from remat.planner.step import describe
from remat.planner.trace import Unflatten, cache_off, capture

from . import distributed, dropin, plan_cache
from .measure import dry_run_peak, preserved, training_loss
from .measure.timing import step_timing
from .rewrite import (REGION_PROBE, CompiledReplay, RecomputeTimes, checkpointing, plan_modules, rewrite,
                      rewrite_plan, view_replay)


log = logging.getLogger("remat.runtime")


class ExactReplay:
    """The `planner.fit.Measure` of eager plans: rewrite with the regions and dry-run the step on
    fake tensors (runtime.measure.replay).

    Opaque modules (fake tensors cannot run them, or an RNN's kernel holds memory they do not
    model) are stood in for by their measured behaviour, as in the profile (planner.opaque).
    """
    what = "the exact replay on fake tensors"
    rounds = DEFAULT_ROUNDS

    def __init__(self, model: torch.nn.Module, analysis, loss_fn):
        self.model, self.analysis, self.loss_fn = model, analysis, analysis.fake_loss or loss_fn
        self.opaque = tuple(m for m, _ in analysis.traced.opaque)
        self.names = tuple(c.name for c in analysis.cost_graph.nodes)
        self.peaks: dict[tuple, int] = {}       # regions -> replayed peak: each plan replayed once
        self.seconds = 0.0                      # spent replaying
        # the profile's metered peak of the step without checkpointing, as `_replay` would add to
        # it: planner.fit's guide to whether that step needs a replay (NOTE [ unplanned guess ]);
        # none with gradient accumulation (the replay's gradients exist from the start, the profile's do not)
        facts = self.facts = StepFacts.of(analysis.cost_graph.meta)
        self.unplanned_guess = None if facts.measured_peak_bytes is None or facts.accumulates else max(
            facts.measured_peak_bytes + facts.held_throughout_bytes, base_liveness(analysis.cost_graph).opt)

    def __call__(self, regions) -> int:
        key = tuple(regions)
        if key not in self.peaks:
            t0 = time.perf_counter()
            self.peaks[key] = self._replay(key)
            self.seconds += time.perf_counter() - t0
        return self.peaks[key]

    def _replay(self, regions) -> int:
        """The replayed peak of forward and backward (the optimizer's state, live throughout, added),
        or the optimizer's step when that is higher (the same under every plan)."""
        a, facts = self.analysis, self.facts
        with training_modes(self.model):             # the step planned is a training step (planner.state)
            gm = rewrite(self.model, a.traced.gm, regions, self.names, facts, self.opaque)
            replayed = dry_run_peak(gm, a.example_inputs, self.loss_fn, self.opaque, a.opaque_examples,
                                    keep_output=facts.keep_output, grads=facts.accumulates)
        # held throughout: the optimizer's state, the math libraries' workspaces (planner/workspace.py)
        return max(replayed + facts.held_throughout_bytes, base_liveness(a.cost_graph).opt)


def _shape_key(args: tuple, kwargs: dict, model: torch.nn.Module | None = None) -> tuple:
    """What a plan depends on: tensor shapes, dtypes, devices and requires_grad; other values (by
    value: `_value_key`); the autocast state (it changes activation dtypes, hence sizes); the
    modes the training step runs its modules in (a graph bakes them in)."""
    leaves, spec = tree_flatten((args, kwargs))
    key = [str(spec), _autocast_state(), mode_key(model) if model is not None else (),
           _parameter_key(model) if model is not None else ()]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append(_TensorKey(tuple(x.shape), x.dtype, x.device.type, x.requires_grad))
        else:
            key.append(_value_key(x))
    return tuple(key)


class _TensorKey(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool


def _covers(big: tuple, small: tuple) -> bool:
    """`big` and `small` (`_shape_key`s) differ only in tensor sizes, each of `small`'s at most
    `big`'s (NOTE [ covered shapes ] in Remat._covered)."""
    if len(big) != len(small):
        return False
    for b, s in zip(big, small):
        if isinstance(b, _TensorKey) and isinstance(s, _TensorKey):
            if b._replace(shape=()) != s._replace(shape=()) or len(b.shape) != len(s.shape) \
                    or any(j > i for i, j in zip(b.shape, s.shape)):
                return False
        elif b != s:
            return False
    return True


def _parameter_key(model: torch.nn.Module) -> tuple:
    """The parameters' dtypes and devices (`model.half()`, `.to(device)` change what a step holds)."""
    return tuple(sorted({(str(p.dtype), p.device.type) for p in model.parameters()}))


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type(Ellipsis))


def _value_key(x, depth: int = 0):
    """A non-tensor input by value: equal values share a plan, whatever their identity or repr.
    Plain values stand for themselves; containers by their items; an object with its own
    equality and hash by itself; any other object by its type and attributes (its default repr
    carries its address, which would re-plan on every call)."""
    if isinstance(x, _PLAIN) or depth > 4:
        return (type(x).__name__, x) if isinstance(x, _PLAIN) else (type(x).__qualname__, id(x))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_value_key(v, depth + 1) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((repr(k), _value_key(v, depth + 1)) for k, v in x.items()))
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
    cls = type(x)
    if cls.__eq__ is not object.__eq__ and cls.__hash__ is not None:
        try:
            hash(x)
            return (cls.__qualname__, x)
        except TypeError:
            pass
    attrs = getattr(x, "__dict__", None)
    if attrs is None:
        return (cls.__qualname__, repr(x))
    return (cls.__module__, cls.__qualname__, tuple(sorted((k, _value_key(v, depth + 1)) for k, v in attrs.items())))


def _autocast_state() -> tuple:
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


class Remat:
    """remat's state on a model it planned, as `model.remat` (runtime.dropin installs it).

    Plans are made per input signature (shapes, dtypes, keyword values, autocast, modes) and
    cached: `plan` is the plan of the latest training call, `plans` all of them. The budget is
    bytes, resolved once: a '%' budget becomes bytes at the first plan and stays fixed. A new
    signature whose graph is one already planned keeps that plan when it still fits there
    (planner.fit.reuse_plan: one prediction, no solve); only a plan that would not fit is made
    anew, and that is logged. In eval mode or without gradients the model's own forward runs.
    """

    def __init__(self, model: torch.nn.Module, budget: Budget, loss_fn: Callable | None,
                 options: PlanOptions, compile: dict | None = None, optimizer: torch.optim.Optimizer | None = None):
        self.model = model
        self.budget = budget                   # Budget("bytes", ...) once the first plan resolved it
        self._loss_fn, self._options = loss_fn, options
        self._compile = compile                # torch.compile kwargs: plans are for the compiled step
        self._optimizer = optimizer            # its state and step are in the budget
        self._plans: dict[tuple, tuple[Plan, torch.nn.Module, object]] = {}   # key -> plan, graph, Traced
        self._last: tuple | None = None
        self._bypass = 0                       # > 0 while remat itself runs the model (capture, timing)
        self._warned: set[str] = set()
        self.forward: dropin.PlannedForward | None = None   # set by dropin.install
        self.solves = 0                        # plans made by a solve (not kept from other inputs)
        """How many plans this run made by a solve (not those kept from other inputs or taken
        from the plan cache)."""
        self._largest: dict[str, tuple] = {}    # input (by keyword path) -> largest sizes planned for

    def __getstate__(self):
        """Pickled (torch.save) without its plans: they hold traced graphs, and are made again for
        the loaded model at its first training call. A loss_fn that cannot be pickled (a closure)
        is left out, with a warning: the loaded model then plans with the stand-in loss (room for
        a tensor of the output's size) until `set_loss_fn` gives it one."""
        state = dict(self.__dict__)
        state["_plans"], state["_last"], state["_bypass"], state["_largest"] = {}, None, 0, {}
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
        for spec in self._tree_specs():     # immutable, and torch warns when one is deep-copied
            memo[id(spec)] = spec
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if k == "_loss_fn" else copy.deepcopy(v, memo)
        return new

    def _tree_specs(self) -> list:
        """The pytree specs of the plans' exported graphs (inputs, and outputs as `Unflatten` holds them)."""
        out = []
        for _, gm, traced in self._plans.values():
            out += [traced.in_spec] if traced is not None and traced.in_spec is not None else []
            for g in (gm, traced and traced.gm):
                out += [m.spec for m in (g.modules() if g is not None else ()) if isinstance(m, Unflatten)]
        return out

    def set_loss_fn(self, loss_fn: Callable | None) -> None:
        """The loss the plans are made for; plans made for another loss are dropped."""
        self._loss_fn, self._plans, self._last = loss_fn, {}, None

    def remove(self) -> torch.nn.Module:
        """Take the plan out of the model, as `remat.remove(model)` does; returns the model as it was."""
        return dropin.remove(self.model)

    @property
    def plan(self) -> Plan:
        """The plan of the latest training call (or `plan_for`, `use_plan`); RuntimeError before
        the first."""
        if self._last is None:
            raise RuntimeError("no plan yet: the model plans at its first training call")
        return self._plans[self._last][0]

    @property
    def plans(self) -> dict[tuple, Plan]:
        """Every plan of this run, by input signature (shapes, dtypes, devices, keyword values,
        autocast and modes)."""
        return {k: v[0] for k, v in self._plans.items()}

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

    def plan_for(self, *args, **kwargs) -> Plan:
        """Plan (or fetch the cached plan) for inputs like these, without running the model."""
        model = self.model
        self._take_over()
        key = _shape_key(args, kwargs, model)
        if key not in self._plans:
            try:
                # planning inside a user's dispatch mode (a memory meter around the step) is not seen by it
                with self.bypassed(), _disable_current_modes():
                    self._plans[key] = self._covered(key, args, kwargs) or self._grown(key, args, kwargs) \
                        or self._make_plan(model, args, kwargs)
            except InfeasibleBudgetError as e:     # sizes in the unit the budget was written in
                raise e.in_unit(self.budget.unit) from None
        self._last = key
        return self._plans[key][0]

    def plan_up_front(self, args: tuple, kwargs: dict) -> Plan:
        """`plan_for` the example call, and the call Hugging Face's Trainer will make of it
        (`trainer_keywords`), so that a Trainer run trains on plans made here; `plan` stays the
        example call's."""
        plan = self.plan_for(*args, **kwargs)
        extra = trainer_keywords(self.model, kwargs)
        if extra:
            last = self._last
            try:
                self.plan_for(*args, **kwargs, **extra)
            except Exception as e:    # noqa: BLE001 - a call the user did not make: it plans when made, if ever
                log.info("%s: the call Trainer makes (%s) was not planned ahead (%s: %s)", type(self.model).__name__,
                         ", ".join(extra), type(e).__name__, e)
            self._last = last
        return plan

    def _covered(self, key: tuple, args: tuple, kwargs: dict) -> tuple | None:
        """The plan of a larger call of the same kind (every input dimension at least as large:
        the longest padded batch), applied to this one's graph, or None. NOTE [ covered shapes ]:
        every tensor of a step grows with its inputs' dimensions, so a plan that fits the larger
        call fits this one. A module-tree plan and an fx graph serve it as they are; an exported
        graph (its shapes baked in) is captured again. Nothing is profiled or solved."""
        model = self.model
        for big, (plan, gm, traced) in self._plans.items():
            if self._compile is not None or not _covers(big, key):
                continue
            if traced is None or traced.in_spec is None:   # the module tree, or fx (sizes read at run time)
                return plan, gm, traced
            if traced.shapes is not None and traced.shapes.admits(traced.inputs(model, args, kwargs)):
                return plan, gm, traced       # exported with dynamic sizes, these among them: no capture
            traced, _ = self._capture(args, kwargs)
            if [n.name for n in compute_nodes(traced.gm)] != list(plan.node_names[:-1]):
                return None        # another graph at this shape (a branch on a size): planned as new
            log.info("%s: inputs %s are covered by the plan made for larger ones: kept", type(model).__name__,
                     describe((args, kwargs)))
            return plan, rewrite_plan(model, traced.gm, plan), traced
        return None

    def _grown(self, key: tuple, args: tuple, kwargs: dict) -> tuple | None:
        """A call of a new kind (another keyword, autocast) at sizes below the largest this run has
        planned (a padded batch shorter than the longest): planned once at those largest sizes,
        then applied here as a covered call, so that the run's later batches of this kind keep it.
        None when no input grows, or the grown call's graph is not this one's."""
        g_args, g_kwargs = _grow(args, kwargs, self._largest)
        if g_args is None:
            return None
        g_key = _shape_key(g_args, g_kwargs, self.model)
        if g_key not in self._plans:
            try:
                self._plans[g_key] = self._make_plan(self.model, g_args, g_kwargs)
            except RematError as e:       # the grown call does not plan: this one is planned as it is
                log.info("%s: no plan at the run's largest sizes (%s); planning these inputs as they are",
                         type(self.model).__name__, e)
                return None
        return self._covered(key, args, kwargs)

    def _capture(self, args: tuple, kwargs: dict, opaque: dict | None = None, skip: dict | None = None):
        """(Traced, named inputs) of the model's own forward on these inputs, its state untouched;
        `opaque`: submodules to capture as opaque fx leaves (those of the plan the graph is for);
        `skip`: capture paths not to take."""
        model = self.model
        with self.bypassed(), rng_preserved(), training_modes(model), state_preserved(model):
            traced = capture(model, args, kwargs, opaque or None, skip)
            return traced, traced.inputs(model, args, kwargs)

    def use_plan(self, plan: Plan, *args, **kwargs) -> Plan:
        """Train inputs like these with `plan` (made elsewhere: `Plan.from_json`), without
        re-planning. Raises PlanMismatchError, saying what differs, when the model's graph or the
        inputs are not the ones the plan was made for."""
        model = self.model
        key = _shape_key(args, kwargs, model)
        if plan.trace_path == "module tree":
            missing = [n for n in plan.node_names if n not in dict(model.named_modules())]
            if missing:
                raise PlanMismatchError(f"the plan checkpoints submodules this model does not have: {missing[:5]}")
            self._plans[key] = (plan, None, None)
        else:
            # a plan's opaque modules are leaves again (the profile may have made some after capture)
            traced, named = self._capture(args, kwargs, dict(plan.opaque) if plan.trace_path.startswith("fx") else None)
            _check_matches(plan, traced, named)
            self._plans[key] = (plan, rewrite_plan(model, traced.gm, plan), traced)
        self._last = key
        return plan

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
        gm = self._plans[self._last][1]
        eager_graph = gm is not None and self._compile is None     # regions to time one by one
        # a training step, in the modes planned for (planner.state.training_modes)
        with training_modes(model), preserved(model), \
                RecomputeTimes(gm, device) if eager_graph else contextlib.nullcontext() as regions:
            timing = step_timing(step(False), step(True), plan.recompute_s, plan.cost_model, device)
        if regions is not None:
            timing = replace(timing, region_recompute_s=regions.fastest())
        plan = plan.noting(timing=timing.to_dict())
        self._plans[self._last] = (plan,) + self._plans[self._last][1:]
        return plan

    def _resolved(self, unplanned_bytes: int | None) -> int:
        """The budget in bytes; a '%' budget is resolved by the first plan and fixed from then on."""
        if self.budget.kind != "bytes":
            self.budget = Budget("bytes", float(self.budget.bytes_of(unplanned_bytes)), self.budget.unit)
        return int(self.budget.value)

    def _make_plan(self, model, args, kwargs) -> tuple:
        """(plan, graph to run or None for the module tree, Traced) for inputs like these; their
        sizes join the largest this run has planned for (`_grown`)."""
        made = self._new_plan(model, args, kwargs)
        for path, x in tree_flatten_with_path((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                name = keystr(path)
                old = self._largest.get(name)
                self._largest[name] = tuple(x.shape) if old is None or len(old) != x.dim() else \
                    tuple(max(a, b) for a, b in zip(old, x.shape))
        return made

    def _new_plan(self, model, args, kwargs) -> tuple:
        """(plan, graph, Traced) for inputs like these: from the plan cache (runtime/plan_cache.py)
        when this call was planned before, in any process, else made and cached."""
        if self._compile is not None or not plan_cache.enabled(self._options):
            return self._planned(model, args, kwargs)
        parts = plan_cache.key_parts(model, _shape_key(args, kwargs, model), self.budget, self._loss_fn,
                                     self._options, self._optimizer)
        cache = plan_cache.PlanCache()
        hit = cache.load(parts)
        if hit is not None:
            made = self._cached(hit[0], hit[1], args, kwargs)
            if made is not None:
                return made
        made = self._planned(model, args, kwargs)
        cache.store(parts, made[0], plan_cache.graph_hash(None if made[2] is None else made[2].gm))
        return made

    def _cached(self, plan: Plan, graph: str, args: tuple, kwargs: dict) -> tuple | None:
        """The cached `plan` on this call's graph, or None (logged) when the graph captured now is
        not the one it was made on."""
        model = self.model
        try:
            if plan.trace_path == "module tree":
                if graph != "module tree":
                    raise PlanMismatchError("the entry's plan is for the module tree, its graph is not")
                made = (plan, None, None)
            else:
                skip = {"fx": "the cached plan's graph"} if plan.trace_path == "torch.export" else None
                traced, named = self._capture(args, kwargs, dict(plan.opaque) if plan.trace_path.startswith("fx")
                                              else None, skip)
                if plan_cache.graph_hash(traced.gm) != graph:
                    raise PlanMismatchError("the graph captured now is not the one the plan was made on")
                _check_matches(plan, traced, named)
                made = (plan, rewrite_plan(model, traced.gm, plan), traced)
        except (RematError, PlanMismatchError) as e:
            log.warning("%s: plan cache entry not used (%s); planning anew", type(model).__name__, e)
            return None
        log.info("%s: plan taken from the plan cache (%s)", type(model).__name__, plan_cache.directory())
        self._resolved(plan.unplanned_peak_bytes)      # a '%' budget: the key held it, the plan resolved it
        return (plan.noting(cached=True),) + made[1:]

    def _planned(self, model, args, kwargs) -> tuple:
        try:
            a = analyze_for(model, args, kwargs, self._loss_fn, self._options, self._optimizer, REGION_PROBE)
        except TraceError as e:             # no graph at all: plan over the module tree
            if self._compile is not None:
                raise TraceError(e.where, f"{e.cause}; compile=True plans a captured graph: wrap without "
                                          "compile (the module tree is planned, eagerly)") from e
            log.warning("%s: no graph (%s); planning over its module tree, each choice measured with a real step",
                        type(model).__name__, e.cause)
            extra = cache_off(model, args, kwargs)      # as Hugging Face's own checkpointing does
            p = plan_modules(model, args, {**kwargs, **extra}, self._loss_fn, self.budget, self._options, e.cause,
                             self._optimizer)
            if extra:
                p = replace(p.noting(extra_kwargs=extra), notes=p.notes + ("called with use_cache=False, as Hugging Face does under gradient "
                                             "checkpointing: the output carries no key/value cache",))
            self.solves += 1
            self._resolved(p.unplanned_peak_bytes)
            return p, None, None
        budget_bytes = self._resolved(unplanned_peak_bytes(a.cost_graph, self._options))
        if self._compile is not None:
            self.solves += 1
            return _plan_compiled(model, a, budget_bytes, self._loss_fn, self._options, self._compile)
        measure = ExactReplay(model, a, self._loss_fn)
        for old, _, traced in list(self._plans.values()):
            if traced is not None and traced.path == a.traced.path:
                p = reuse_plan(a.cost_graph, old, budget_bytes, self._options, measure)
                if p is not None:
                    log.info("%s: the plan made at other inputs fits these (predicted %d of %d bytes): kept",
                             type(model).__name__, p.predicted_peak_bytes, budget_bytes)
                    return p, rewrite_plan(model, a.traced.gm, p), a.traced
        if self._plans:
            log.warning("%s: new inputs (%s) that no plan of this run fits: planning anew for %d bytes",
                        type(model).__name__, describe((args, kwargs)), budget_bytes)
        self.solves += 1
        t0 = time.perf_counter()
        p = solve_plan(a.cost_graph, budget_bytes, self._options, a.traced.opaque, measure=measure,
                       floor_if_needed=True)
        spent = {**a.times, "solve": time.perf_counter() - t0 - measure.seconds, "replay": measure.seconds}
        p = p.noting(plan_time={**{k: round(v, 3) for k, v in spent.items()}, "replays": len(measure.peaks)})
        return p, rewrite_plan(model, a.traced.gm, p), a.traced

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
        p, gm, traced = self._plans[self._last]
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


def _grow(args: tuple, kwargs: dict, largest: dict[str, tuple]) -> tuple:
    """(args, kwargs) with each tensor grown to the largest sizes its input (by keyword path) had
    in a planned call, repeating its last slice along each grown dimension (a padded batch stays
    one: masks keep their values' kind); (None, None) when none grows."""
    grew = False

    def grow(path, x):
        nonlocal grew
        big = largest.get(keystr(path)) if isinstance(x, torch.Tensor) else None
        if big is None or len(big) != x.dim() or any(b < n for b, n in zip(big, x.shape)):
            return x
        for d, (b, n) in enumerate(zip(big, x.shape)):
            if b > n and n > 0:
                grew = True
                x = x.index_select(d, torch.arange(b, device=x.device).clamp_(max=n - 1))
        return x
    out = tree_map_with_path(grow, (args, kwargs))
    return out if grew else (None, None)


def _check_matches(plan: Plan, traced, named: dict) -> None:
    """The captured graph and inputs are the plan's: same capture path, nodes (names, in order,
    and what they call) and input shapes and dtypes; else a PlanMismatchError naming the first
    difference."""
    if traced.path != plan.trace_path:
        raise PlanMismatchError(f"the plan was made on a graph captured by {plan.trace_path}; this model is "
                                f"captured by {traced.path}")
    names = [n.name for n in compute_nodes(traced.gm)]
    planned = list(plan.node_names[:len(plan.node_names) - 1])      # the last node is the loss
    for i, (a, b) in enumerate(zip(planned, names)):
        if a != b:
            raise PlanMismatchError(f"the graph differs from the plan's at node {i}: the plan has {a!r}, this "
                                    f"model {b!r} (another model, config or code version?)")
    if len(planned) != len(names):
        raise PlanMismatchError(f"the plan covers {len(planned)} nodes, this model's graph has {len(names)}")
    got = input_signature(named)
    for name, want in plan.facts.inputs.items():
        if "shape" in want and (got.get(name, {}).get("shape"), got.get(name, {}).get("dtype")) != \
                (want["shape"], want["dtype"]):
            have = got.get(name)
            raise PlanMismatchError(f"input {name!r}: the plan was made for shape {want['shape']} {want['dtype']}, "
                                    f"got {have and have.get('shape')} {have and have.get('dtype')}")


def _plan_compiled(model, a, budget_bytes, loss_fn, options, compile_kwargs):
    """A plan for the compiled step (runtime.rewrite.compiled): plain regions only (a SAC policy cannot be
    compiled into the graph), each plan tried measured compiled; (plan, compiled graph, Traced)."""
    replay = CompiledReplay(model, a, loss_fn, compile_kwargs)
    options = replace(options, solve=replace(options.solve, sac=False))
    p = solve_plan(a.cost_graph, budget_bytes, options, a.traced.opaque, measure=replay)
    return p, replay.module(p.regions), a.traced


def plan_and_wrap(model: torch.nn.Module, budget_gb=None, *, example_inputs=None, example_kwargs=None,
                  loss_fn: Callable | None = None, options: PlanOptions = PlanOptions(),
                  compile: bool | dict = False, optimizer: torch.optim.Optimizer | None = None,
                  time: bool = False, budget=None) -> torch.nn.Module:
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
    and trains with it: the rewritten graph is compiled whole (plain regions only), and each plan
    tried is compiled and measured with real steps on the example inputs, since Inductor decides
    what else to save; the plan's predicted peak is that measured peak.

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
    if budget_gb is not None and budget is not None:
        raise BudgetError("plan_and_wrap() takes one budget: budget_gb= or its older name budget=, not both")
    if budget_gb is None and budget is None:
        raise BudgetError("plan_and_wrap() needs a budget: budget_gb=24 (GB), or a string such as '24GB' or '40%'")
    budget = as_budget(budget_gb if budget is None else budget)
    _not_compiled(model)
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
