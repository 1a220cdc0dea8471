"""plan(): trace -> profile -> CostGraph -> ILP -> simulated Plan, for reports and CI checks."""
from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass, field, replace

import torch

from .baselines import known_plans
from .candidates import candidates
from .costgraph import CostGraph
from .errors import InfeasibleBudgetError
from .opaque import real_inputs
from .profile import DeviceRates, ValueDependent, profile
from .result import Plan
from .rng import rng_preserved
from .state import mode_key, state_preserved, training_modes
from .simulate import timeline
from .solve import SolveOptions, solve_ilp, solve_min_peak
from .trace import Traced, capture

GB = 10**9


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    solve: SolveOptions = field(default_factory=SolveOptions)  # ILP limits and candidate shape
    safety_margin: float = 0.01     # a simulated prediction = simulated peak * (1 + margin)
    # a replayed prediction (exact replay, measured steps) = replayed peak * (1 + replay_margin);
    # None: 0 on CPU, where the replay meters what a real step's meter does, 1% on accelerators
    # (allocator rounding, library workspaces)
    replay_margin: float | None = None
    find_min_feasible: bool = True  # also solve for the smallest feasible budget (one more ILP)
    rates: DeviceRates | None = None  # device speed for recompute-time estimates (default: by device)
    # The step is `loss_fn(model(x)).backward()`: the output is released once the loss is computed
    # (HF Trainer, Lightning). True if your loop holds the output through backward (`out = model(x);
    # loss_fn(out).backward()` with `out` still referenced): its bytes are then in the budget too.
    keep_output: bool = False
    # ops outside torch's namespaces ("mylib::fused_mlp") that draw no random numbers; any other
    # such op is treated as random: never kept by a SAC region
    deterministic_ops: frozenset = frozenset()


@dataclass(frozen=True)
class Analysis:
    traced: Traced
    cost_graph: CostGraph
    analyze_s: float
    example_inputs: dict      # the graph's inputs by name, as given
    opaque_examples: dict = field(default_factory=dict)   # opaque module -> its real inputs


def budget_to_bytes(budget_gb) -> int:
    """Validate a budget in GB (10^9 bytes) and convert it to bytes."""
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, numbers.Real):
        raise ValueError(f"budget must be a number of GB, got {budget_gb!r}")
    if math.isnan(budget_gb) or math.isinf(budget_gb) or budget_gb <= 0:
        raise ValueError(f"budget must be a positive, finite number of GB, got {budget_gb!r}")
    return int(round(budget_gb * GB))


def analyze(model: torch.nn.Module, example_inputs=None, example_kwargs=None, loss_fn=None,
            rates: DeviceRates | None = None, *, keep_output: bool = False,
            deterministic_ops: frozenset = frozenset()) -> Analysis:
    """Trace and profile `model(*example_inputs, **example_kwargs)` (then `loss_fn`, backward).

    The step planned is a training step, whatever mode the model is in: a model in eval mode
    is profiled as `model.train()` would leave it (dropout on, BatchNorm updating its
    statistics; a graph bakes the mode in), and its modes are restored afterwards. A model in
    train mode is profiled in the modes of its modules as they are (a BatchNorm frozen in eval
    stays frozen). Nothing of the user's model changes: RNG states, buffers and modes are as
    they were."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args = tuple(example_inputs) if example_inputs is not None else ()
    kwargs = dict(example_kwargs or {})
    if not args and not kwargs:
        raise ValueError("no example inputs: pass example_inputs=(...) or example_kwargs={...}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has no trainable parameters: there is no training step to plan")
    t0 = time.perf_counter()
    with rng_preserved(), training_modes(model), state_preserved(model):   # planning leaves no trace
        traced = capture(model, args, kwargs)
        named = traced.inputs(model, args, kwargs)
        while True:
            opaque = tuple(m for m, _ in traced.opaque)
            examples = real_inputs(traced.gm, named, opaque) if opaque else {}
            try:
                cg = profile(traced.gm, named, loss_fn, rates, opaque, examples, keep_output,
                             frozenset(deterministic_ops))
                break
            except ValueDependent as e:    # a module fake tensors cannot run: profiled for real
                if e.module in opaque:
                    raise
                traced = replace(traced, opaque=traced.opaque + ((e.module, f"needs tensor values, which fake tensors do not have ({e.why})"),),
                                 path="fx with opaque leaves" if traced.path == "fx" else traced.path)
    cg = replace(cg, meta={**cg.meta, "trace_path": traced.path, "modes": list(mode_key(model)),
                           "trace_attempts": [list(a) for a in traced.attempts]})
    return Analysis(traced, cg, time.perf_counter() - t0, named, examples)


def solve_plan(cg: CostGraph, budget_bytes: int, options: PlanOptions = PlanOptions(),
               opaque: tuple = (), measure=None) -> Plan:
    """Least-recompute Plan whose predicted peak is at most `budget_bytes`.

    `measure(regions) -> bytes`, when given, replays a plan exactly (runtime.verify's fake-tensor
    dry run, or runtime.compiled's measured compiled step); the replay is then the prediction, and
    the budget the ILP sees is corrected by it (see `_fit`), also when no regions seem needed.
    Without it the prediction is the simulator's. Raises InfeasibleBudgetError (with the smallest
    feasible budget) when no plan fits.
    """
    predict = lambda regions: math.ceil(timeline(cg, regions).peak_bytes * (1.0 + options.safety_margin))  # noqa: E731
    margin = 1.0 + replay_margin(options, cg.meta.get("device", "cpu"))
    unplanned = predict(())
    base = dict(budget_bytes=int(budget_bytes), unplanned_peak_bytes=unplanned, opaque=tuple(opaque),
                node_names=tuple(c.name for c in cg.nodes),
                total_flops=sum(c.flops for c in cg.nodes), forward_s=sum(c.cost_s for c in cg.nodes))
    # the simulator is exact on the unplanned step, except for what it does not model (compiled code)
    replay_unplanned = measure is not None and (unplanned <= budget_bytes or not getattr(measure, "eager", True))
    measured = math.ceil(measure(()) * margin) if replay_unplanned else None
    if unplanned <= budget_bytes and (measured is None or measured <= budget_bytes):
        return _finish(cg, Plan(regions=(), predicted_peak_bytes=measured or unplanned, min_feasible_bytes=None,
                                solver="none", status="fits without checkpointing", gap=0.0, solve_s=0.0,
                                recompute_flops=0, recompute_s=0.0, **base))
    t0 = time.perf_counter()
    cands = candidates(cg, options.solve.max_cuts, options.solve.max_span, options.solve.sac)
    # Known-feasible plans: the hand-made baselines, and (if asked) the ILP's least-peak plan.
    # They bound the smallest feasible budget and warm-start the ILP.
    known = known_plans(cg, options.solve.sac)
    if options.find_min_feasible:
        known["min-peak"] = solve_min_peak(cg, options.solve, cands).regions
    peaks = {name: predict(r) for name, r in known.items() if r}
    min_feasible = min(peaks.values()) if options.find_min_feasible and peaks else None
    regions, solver, status, gap, predicted, effective = _fit(cg, budget_bytes, options, cands, known, peaks,
                                                              predict, measure, margin)
    if min_feasible is not None:        # corrected as the budget was; never above a plan that fits
        min_feasible = min(min_feasible + max(0, budget_bytes - effective), predicted)
    tl = timeline(cg, regions)
    plan = _finish(cg, Plan(regions=regions, predicted_peak_bytes=predicted,
                            min_feasible_bytes=min_feasible, solver=solver, status=status, gap=gap,
                            solve_s=time.perf_counter() - t0, recompute_flops=tl.recompute_flops,
                            recompute_s=tl.recompute_s, **base))
    replay = getattr(measure, "what", "the exact replay on fake tensors") if measure else "simulated only (no exact replay)"
    added = margin - 1.0 if measure else options.safety_margin
    return replace(plan, notes=plan.notes + (f"predicted peak: {replay}" + (f", plus {added:.0%}" if added else ""),))


def replay_margin(options: PlanOptions, device: str) -> float:
    """The margin added to replayed peaks (PlanOptions.replay_margin; by the device type)."""
    if options.replay_margin is not None:
        return options.replay_margin
    return 0.0 if device in ("cpu", "meta") else 0.01


def _fit(cg, budget_bytes, options, cands, known, peaks, predict, measure, margin):
    """Solve against an effective budget, correct it by the exact replay, keep the cheapest fit.

    The simulator is conservative for some plans and the replay is exact, so the effective budget
    the ILP sees is tightened when a plan replays over budget and loosened when it lands well
    under; once one effective budget gave a plan over and another one under (or none at all),
    the next is halfway between. `measure.rounds` solves at most (4 by default)."""
    best, effective = None, budget_bytes
    under = over = predicted = None      # highest effective budget to go up from, lowest to go down from
    for _ in range(getattr(measure, "rounds", 4)):
        try:
            regions, solver, status, gap = _choose(cg, effective, options, cands, known, peaks, predict)
        except InfeasibleBudgetError as e:
            if best is None and over is None:
                return _known_or_raise(known, measure, margin, budget_bytes, predict, effective,
                                       e.min_feasible_bytes + max(0, budget_bytes - effective))
            go_up, step = True, 0              # no plan this tight: between here and `over`
        else:
            predicted = predict(regions) if measure is None else math.ceil(measure(regions) * margin)
            go_up, step = predicted <= budget_bytes, abs(budget_bytes - predicted)
            if go_up:
                cost = timeline(cg, regions).recompute_s
                if best is None or cost < best[0]:
                    best = (cost, (regions, solver, status, gap, predicted, effective))
                if measure is None or step < 0.01 * budget_bytes:
                    break
        if go_up:
            under = effective if under is None else max(under, effective)
        else:
            over = effective if over is None else min(over, effective)
        if under is not None and over is not None:
            if under >= over:                  # not monotone: keep the best found
                break
            nxt = (under + over) // 2
        else:
            nxt = effective + step if go_up else effective - step
        if abs(nxt - effective) < 0.002 * budget_bytes:
            break
        effective = nxt
    if best is None:
        return _known_or_raise(known, measure, margin, budget_bytes, predict, effective,
                               max(predicted or 0, min(peaks.values(), default=predicted or 0)))
    return best[1]


def _known_or_raise(known, measure, margin, budget_bytes, predict, effective, estimate):
    """No solved plan fits: a known plan that fits when replayed exactly, else InfeasibleBudgetError
    with the smallest feasible budget: a replayed known plan's peak (a budget then met for sure),
    or without a replay the simulator's `estimate`."""
    replayed = _replay_known(known, measure, margin)
    fits = [(predict(r), p, k) for k, (r, p) in replayed.items() if p <= budget_bytes]
    if fits:                                   # the simulator was too cautious: take the replay
        _, p, k = min(fits)
        return known[k], k, "known plan that fits when replayed exactly", float("nan"), p, effective
    floor = min((p for _, p in replayed.values()), default=estimate)
    raise InfeasibleBudgetError(budget_bytes, floor) from None


def _replay_known(known, measure, margin) -> dict:
    """Exact replays of the known plans: name -> (regions, predicted bytes); {} without replay."""
    if measure is None:
        return {}
    return {k: (r, math.ceil(measure(r) * margin)) for k, r in known.items() if r}


def _choose(cg, budget_bytes, options, cands, known, peaks, predict):
    """The cheapest plan whose simulated peak fits: the ILP's, or a known plan if it is cheaper."""
    fitting = sorted((timeline(cg, known[k]).recompute_s, k) for k, p in peaks.items() if p <= budget_bytes)
    if options.find_min_feasible and not fitting:
        raise InfeasibleBudgetError(budget_bytes, min(peaks.values(), default=predict(())))
    warm = known[fitting[0][1]] if fitting else ()
    target = int(budget_bytes / (1.0 + options.safety_margin))
    for _ in range(4):   # the ILP bounds the simulated peak; re-solve tighter if rounding says no
        sol = solve_ilp(cg, target, options.solve, warm_start=warm, cands=cands)
        if sol is None or predict(sol.regions) <= budget_bytes:
            break
        target -= predict(sol.regions) - budget_bytes
    ilp_ok = sol is not None and predict(sol.regions) <= budget_bytes
    if fitting and (not ilp_ok or fitting[0][0] < timeline(cg, sol.regions).recompute_s):
        name = fitting[0][1]
        return known[name], name, "cheaper than the best plan the ILP found within its limits", float("nan")
    if ilp_ok:
        return sol.regions, "ilp", sol.status, sol.gap
    floor = known.get("min-peak") or solve_min_peak(cg, options.solve, cands).regions
    raise InfeasibleBudgetError(budget_bytes, min([predict(floor)] + list(peaks.values())))


def _finish(cg: CostGraph, p: Plan) -> Plan:
    notes = [f"{c.name}: not recomputable ({c.why_not})" for c in cg.nodes[:-1] if not c.recomputable]
    if cg.meta.get("loss") == "stand-in":
        notes.append("no loss_fn given: room is reserved for a loss that keeps one tensor of the output's size")
    return replace(p, notes=tuple(notes), meta=dict(cg.meta))


def plan(model: torch.nn.Module, budget_gb: float, *, example_inputs=None, example_kwargs=None,
         loss_fn=None, options: PlanOptions = PlanOptions()) -> Plan:
    """Plan checkpoint regions so that one training step of `model` fits `budget_gb` (10^9 bytes).

    >>> import torch
    >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    >>> p = plan(m, 1.0, example_inputs=(torch.randn(32, 64),))
    >>> p.regions, p.predicted_peak_bytes <= p.budget_bytes
    ((), True)
    """
    budget = budget_to_bytes(budget_gb)
    a = analyze(model, example_inputs, example_kwargs, loss_fn, options.rates, keep_output=options.keep_output,
                deterministic_ops=options.deterministic_ops)
    return solve_plan(a.cost_graph, budget, options, a.traced.opaque)
