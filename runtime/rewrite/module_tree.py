"""Module-tree plans: checkpoint whole submodule calls of a model no tracer captures.

planner.profile.modules profiles the units and picks them; this module applies the choice (each chosen
module's forward runs under non-reentrant checkpoint while the wrapped model runs) and measures
a choice with one real step, which is the prediction this path reports.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time

import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

from remat.planner import PlanOptions
from remat.planner.step.optimizer import optimizer_memory
from remat.planner.errors import InfeasibleBudgetError
from remat.planner.solve.fit import replay_margin
from remat.planner.profile.modules import ModuleProfile, block_units, profile_modules, solve_units
from remat.planner.result import Plan, Region
from remat.planner.step.state import instance_forwards, step_preserved, training_modes
from remat.planner.step.fake import run_step, training_loss

from ..budget import StepBudget
from ..measure import peak_memory
from .graph import rewinding

PATH = "module tree"
log = logging.getLogger("remat.runtime")


def _checkpointed(module: torch.nn.Module, forward):
    def run(*args, **kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return forward(*args, **kwargs)
        contexts = lambda: (contextlib.nullcontext(), rewinding(list(module.buffers())))  # noqa: E731
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts, **kwargs)
    return run


@contextlib.contextmanager
def checkpointing(model: torch.nn.Module, names: list[str]):
    """While inside, each named submodule's forward runs under checkpoint (BN buffers restored
    after a recompute); outside, the model is untouched."""
    mods = [model.get_submodule(n) for n in names]
    with instance_forwards({m: _checkpointed(m, m.forward) for m in mods}):
        yield


def measure_step(model, args, kwargs, loss_fn, names, grads: bool = False, keep_output: bool = False) -> int:
    """Peak live bytes of one real step with `names` checkpointed (grads, buffers, RNG restored);
    `grads`: every trainable parameter starts with a gradient (gradient accumulation);
    `keep_output`: the output is held through backward (PlanOptions.keep_output)."""
    def step():
        # a step in a fresh autocast context: the weight casts an outer one cached during earlier
        # measured steps would be made (and counted) in the user's step (fuzz seed 20649)
        torch.clear_autocast_cache()
        run_step(lambda: model(*args, **kwargs), lambda out: training_loss(out, loss_fn), keep_output=keep_output)
    with step_preserved(model, (args, kwargs)), checkpointing(model, names):
        for p in model.parameters():
            # the step's own grads are counted, not the ones it started with (but for accumulation)
            p.grad = torch.zeros_like(p) if grads and p.requires_grad else None
        return peak_memory(step, model, *args, *kwargs.values())


SEEDS = 8     # a step whose peak depends on its random draws (layer drop) is measured under this many seeds


def seeded_peak(measure) -> int:
    """`measure()` (one real step's peak) under fixed torch seeds, so that it is the same in every
    run: seeds 0 and 1, and when they differ (the step's memory depends on its draws: layer
    drop skips blocks at random) the most of SEEDS seeds. The global RNG is left as it was."""
    peaks = []
    for seed in range(SEEDS):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            peaks.append(measure())
        if seed == 1 and peaks[0] == peaks[1]:
            break
    return max(peaks)


def _optimizer_phase(model, args, kwargs, optimizer, options: PlanOptions) -> tuple[int, int]:
    """(the optimizer's state bytes, the peak of its step: parameters, buffers, inputs, grads,
    state and its temporaries), or (0, 0) without an optimizer."""
    if optimizer is None:
        return 0, 0
    mem = optimizer_memory(optimizer, options.target_device)
    tensors = [*model.parameters(), *model.buffers(), *(x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor))]
    fixed = sum({id(t.untyped_storage()): t.untyped_storage().nbytes() for t in tensors}.values())
    grads = sum({id(p.untyped_storage()): p.untyped_storage().nbytes() for p in model.parameters()
                 if p.requires_grad}.values())
    return mem.state_bytes, fixed + grads + mem.state_bytes + mem.step_bytes


def _refuses(step) -> bool:
    """`step()` raises torch's CheckpointError (a unit holding an in-place op on a view, under a
    loss that differentiates through it: torch unpacks one saved tensor twice; fuzz seed 5010)."""
    try:
        step()
    except CheckpointError:
        return True
    return False


def plan_modules(model, args: tuple, kwargs: dict, loss_fn, budget: StepBudget, options: PlanOptions,
                 why: str, optimizer=None) -> Plan:
    """A Plan over the module tree: units chosen by planner.profile.modules, each choice measured, in
    the modes of the training step (planner.step.state). A '%' `budget` is resolved at the measured
    unplanned step (runtime.budget). With `optimizer`, its state is added to each
    measured step and its step (planner.step.optimizer) is a phase of its own."""
    with training_modes(model):
        return _plan_modules(model, args, kwargs, loss_fn, budget, options, why, optimizer)


class _UnitSteps:
    """Real steps of the model with some of its units checkpointed: `measure` a choice (its peak,
    the optimizer's state and step counted, the replay margin on it); `measured` leaves out the
    units torch's checkpoint refuses in this step (`refused`, found when a step raises)."""

    def __init__(self, model, args, kwargs, loss_fn, names: list[str], options: PlanOptions, optimizer):
        self.model, self.args, self.kwargs, self.loss_fn, self.names = model, args, kwargs, loss_fn, names
        self.grads, self.keep_output = options.accumulation_steps > 1, options.keep_output
        self.margin = 1.0 + replay_margin(options, next(model.parameters()).device.type)
        self.state, self.opt_peak = _optimizer_phase(model, args, kwargs, optimizer, options)
        self.refused: set[int] = set()      # units torch's checkpoint cannot run in this step

    def measure(self, chosen) -> int:
        step = seeded_peak(lambda: measure_step(self.model, self.args, self.kwargs, self.loss_fn,
                                                [self.names[i] for i in chosen], self.grads, self.keep_output))
        return math.ceil(max(step + self.state, self.opt_peak) * self.margin)

    def measured(self, chosen) -> tuple[tuple[int, ...], int]:
        """(the units of `chosen` a real step can checkpoint, that step's peak)."""
        chosen = tuple(i for i in chosen if i not in self.refused)
        try:
            return chosen, self.measure(chosen)
        except CheckpointError:
            bad = {i for i in chosen if _refuses(lambda i=i: self.measure((i,)))}
            if not bad:
                raise
            log.info("%s: not checkpointed, torch's checkpoint refuses them in this step: %s",
                     type(self.model).__name__, ", ".join(self.names[i] for i in sorted(bad)))
            self.refused.update(bad)
            return self.measured(chosen)


def _plan_modules(model, args: tuple, kwargs: dict, loss_fn, budget: StepBudget, options: PlanOptions,
                  why: str, optimizer=None) -> Plan:
    t0 = time.perf_counter()
    with torch.random.fork_rng(devices=[]):     # the same profile in every run (planner.profile.modules)
        torch.manual_seed(0)
        prof: ModuleProfile = profile_modules(model, args, kwargs, loss_fn)
    names = [u.name for u in prof.units]
    steps = _UnitSteps(model, args, kwargs, loss_fn, names, options, optimizer)
    unplanned = steps.measure(())      # the plain step, measured (the profile's instrumented step holds more)
    budget_bytes = budget.resolve(unplanned)
    base = dict(budget_bytes=budget_bytes, unplanned_peak_bytes=unplanned, recompute_flops=0, total_flops=0,
                forward_s=prof.forward_s, node_names=tuple(names),
                meta={"trace_path": PATH, "trace_attempts": [["fx and torch.export", why]]},
                notes=(f"no graph ({why}); planned over {len(names)} submodules, each checkpointed whole;"
                       " peaks measured with a real step",))
    if unplanned <= budget_bytes:
        return Plan(regions=(), predicted_peak_bytes=unplanned, min_feasible_bytes=None, recompute_s=0.0,
                    solver="none", status="fits without checkpointing", gap=0.0, solve_s=0.0, **base)
    chosen, peak, floor = _choose(model, prof, steps, budget_bytes, options)
    return Plan(regions=tuple(Region(i, i) for i in chosen), predicted_peak_bytes=peak,
                min_feasible_bytes=min(floor, peak), recompute_s=sum(prof.units[i].time_s for i in chosen),
                solver="ilp", status="module tree, measured", gap=float("nan"), solve_s=time.perf_counter() - t0,
                **base)


def _choose(model, prof: ModuleProfile, steps: _UnitSteps, budget_bytes: int,
            options: PlanOptions) -> tuple[tuple[int, ...], int, int]:
    """(the units to checkpoint, their measured peak, the floor): the least-time units the ILP
    picks whose measured step fits (the ILP's budget tightened by each miss), else the floor, the
    lesser of every unit checkpointed and every block (per-block checkpointing, Hugging Face's
    gradient_checkpointing_enable(); checkpointing an embedding or a head whose recompute lands
    on the backward's peak can cost more than it frees). InfeasibleBudgetError below the floor."""
    names = steps.names
    floors = {"every submodule": tuple(range(len(names))), "every block": block_units(model, names)}
    floors = {k: steps.measured(c) for k, c in floors.items() if c}
    floor_name, (floor_chosen, floor) = min(floors.items(), key=lambda kv: kv[1][1])
    target = budget_bytes
    for _ in range(4):
        chosen = solve_units(prof, int(target / steps.margin), options.solve.time_limit_s, frozenset(steps.refused))
        if chosen is None:
            break
        chosen, peak = steps.measured(chosen)
        if peak <= budget_bytes:
            return chosen, peak, floor
        target -= peak - budget_bytes
    if floor > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, floor, f"a real step with {floor_name} checkpointed")
    return floor_chosen, floor, floor
