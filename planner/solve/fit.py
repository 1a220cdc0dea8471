"""solve_plan(): from a CostGraph and a budget to the Plan that fits it (pure, no torch).

The simulator (planner/solve/simulate.py) predicts every plan; the ILP (planner/solve/ilp.py) and the
hand-made plans (planner/solve/baselines.py) propose them. When the caller can also measure a plan
exactly (a `Measure`: the rewritten step replayed on fake tensors, or the compiled step run for
real), that measurement is the prediction, and the budget the ILP sees is corrected by it:
NOTE [ budget correction ] below.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import replace
from typing import NamedTuple, Protocol, runtime_checkable

from remat.planner.solve import hierarchy
from remat.planner.solve.baselines import known_plans
from remat.planner.solve.candidates import Candidate, candidates
from remat.planner.costgraph import CostGraph
from remat.planner.errors import InfeasibleBudgetError
from remat.planner.facts import StepFacts
from remat.planner.solve.improve import Search, search
from remat.planner.options import PlanOptions, SolveOptions
from remat.planner.result import Plan, Region
from remat.planner.solve.simulate import timeline
from remat.planner.solve.ilp import BlockSolver, solve_ilp, solve_min_peak

SIMULATED = "the simulator, no exact replay"
log = logging.getLogger("remat.planner")


@runtime_checkable
class Measure(Protocol):
    """The exact peak of one step under a plan, for `solve_plan` (runtime.api.ExactReplay,
    runtime.rewrite.CompiledReplay)."""
    what: str       # how it measures: the plan's notes say so
    rounds: int     # at most this many solves in the budget correction

    def __call__(self, regions: tuple[Region, ...]) -> int: ...


class Choice(NamedTuple):
    """A plan chosen for an effective budget, before its numbers are filled in."""
    regions: tuple[Region, ...]
    solver: str              # "ilp" or a known plan's name
    status: str
    gap: float
    predicted: int = 0       # bytes: measured (times the margin) or simulated (times the safety margin)
    effective: int = 0       # the budget the ILP was given
    why: str = ""            # why it uses less than USED of the budget (`_why_unused`), else ""


class _Problem(NamedTuple):
    """What every step of the budget correction shares for one solve_plan call."""
    cg: CostGraph
    budget: int
    options: PlanOptions
    cands: list[Candidate]
    ctx: Search | None                     # the graph's search space and judge, shared by every solve
    known: dict[str, tuple[Region, ...]]   # hand-made plans (and the least-peak one)
    peaks: dict[str, int]                  # their simulated predictions
    measure: Measure | None
    margin: float                          # 1 + replay margin
    hier: BlockSolver | None = None        # hierarchy.HierarchicalSolver, or None: the flat ILP

    def predict(self, regions) -> int:
        """The simulator's prediction: the simulated peak plus the safety margin."""
        return math.ceil(timeline(self.cg, regions).peak_bytes * (1.0 + self.options.safety_margin))

    def measured(self, regions) -> int:
        return math.ceil(self.measure(regions) * self.margin)

    def guessed_unplanned(self) -> int:
        """The step without checkpointing as measured: the measure's own cheap figure for it where
        it has one (`unplanned_guess`, NOTE [ unplanned guess ]), else its replay."""
        guess = getattr(self.measure, "unplanned_guess", None)
        return self.measured(()) if guess is None else math.ceil(guess * self.margin)

    @property
    def source(self) -> str:
        return self.measure.what if self.measure is not None else SIMULATED


def replay_margin(options: PlanOptions, device: str) -> float:
    """The margin added to replayed peaks (PlanOptions.replay_margin; by the target device's type)."""
    if options.replay_margin is not None:
        return options.replay_margin
    return 0.0 if (options.target_device or device) in ("cpu", "meta") else 0.01


def unplanned_peak_bytes(cg: CostGraph, options: PlanOptions = PlanOptions()) -> int:
    """The simulator's prediction of the step without checkpointing: what '40%' is a fraction of."""
    return math.ceil(timeline(cg, ()).peak_bytes * (1.0 + options.safety_margin))


def solve_plan(cg: CostGraph, budget_bytes: int, options: PlanOptions = PlanOptions(),
               opaque: tuple = (), measure: Measure | None = None, floor_if_needed: bool = False) -> Plan:
    """Least-recompute Plan whose predicted peak is at most `budget_bytes`.

    `measure`, when given, replays a plan exactly; the replay is then the prediction, and the
    budget the ILP sees is corrected by it (NOTE [ budget correction ]), also when no regions
    seem needed. Without it the prediction is the simulator's. Raises InfeasibleBudgetError (with
    the smallest feasible budget and the prediction it comes from) when no plan fits.
    `floor_if_needed` (plan_and_wrap): the smallest feasible budget (`options.find_min_feasible`)
    is searched only when the budget is not met without it, so a plan that fits has
    `min_feasible_bytes` None (NOTE [ floor if needed ]).
    """
    if floor_if_needed and options.find_min_feasible and not _near_floor(cg, budget_bytes):
        try:
            return solve_plan(cg, budget_bytes, replace(options, find_min_feasible=False), opaque, measure)
        except InfeasibleBudgetError:
            pass                               # again with the floor search: the error names the floor
    if not options.find_min_feasible:           # its refusals name no searched floor: not a guide
        return _solve_plan(cg, budget_bytes, options, opaque, measure)
    try:
        plan = _solve_plan(cg, budget_bytes, options, opaque, measure)
    except InfeasibleBudgetError as e:
        _saw_floor(cg, e.min_feasible_bytes)
        raise
    _saw_floor(cg, plan.min_feasible_bytes)
    return plan


# NOTE [ floor if needed ]
# The least-peak search behind `Plan.min_feasible_bytes` (a least-peak ILP, or the hierarchical
# solver's least-peak chain, its refinements and polishing) was a third of a plan's time on the
# built-in gpt2 (5.9 of 16.4 s of solve at u=0.5 on 2 cores, timed around each phase), and
# a plan that fits does not need it. Without it the least-peak plan is not among the known plans
# a solve may pick, which matters only at budgets near the floor: there the solve without it fails
# and the solve with it (the full search, as before) runs: a refused budget is solved twice.
# Two budgets go straight to the full search, where the solve without it would only fail first:
# one below the bytes no plan can drop (`CostGraph.fixed_bytes`), and one within NEAR_FLOOR of a
# floor this process has already found for the same graph (FLOORS: a refusal, then a plan at the
# floor it named: the CLI's, the tests', a user's retry). FLOORS is a guide to which search runs
# first, never a result: whatever it holds, the plan is the full search's (hf-llama at its
# floor: 63 s -> 36 s on a loaded machine; the solve without the search took 38 s to fail).
NEAR_FLOOR = 0.02
FLOOR_ENTRIES = 256
FLOORS: OrderedDict[int, int] = OrderedDict()     # graph_key(cg) -> the least floor found for it
_FLOORS_LOCK = threading.Lock()


def graph_key(cg: CostGraph) -> int:
    """What a floor depends on: the graph's nodes, storages and fixed bytes (in-process hash)."""
    return hash((cg.nodes, cg.storages, cg.fixed_bytes, cg.param_bytes, cg.optimizer_step_bytes,
                 cg.region_s, cg.sac_op_s))


def _near_floor(cg: CostGraph, budget_bytes: int) -> bool:
    if budget_bytes < cg.fixed_bytes:
        return True
    with _FLOORS_LOCK:
        floor = FLOORS.get(graph_key(cg))
    return floor is not None and budget_bytes <= floor * (1.0 + NEAR_FLOOR)


def _saw_floor(cg: CostGraph, floor: int | None) -> None:
    if floor is None:
        return
    k = graph_key(cg)
    with _FLOORS_LOCK:
        FLOORS[k] = min(floor, FLOORS.get(k, floor))
        FLOORS.move_to_end(k)
        while len(FLOORS) > FLOOR_ENTRIES:
            FLOORS.popitem(last=False)


def _solve_plan(cg: CostGraph, budget_bytes: int, options: PlanOptions, opaque: tuple,
                measure: Measure | None) -> Plan:
    budget_bytes = int(budget_bytes)
    margin = 1.0 + replay_margin(options, StepFacts.of(cg.meta).device)
    pb = _Problem(cg, budget_bytes, options, [], None, {}, {}, measure, margin)
    unplanned = pb.predict(())
    base = _base(cg, budget_bytes, unplanned, opaque)
    # with a measure, the step without checkpointing is measured too (NOTE [ one floor ]): where the
    # simulator is cautious (a peak of parameters and gradients) the measure decides; not replayed
    # when its guess is well over the budget (NOTE [ unplanned guess ])
    if measure is None:
        predicted = unplanned
    elif pb.guessed_unplanned() > budget_bytes * (1.0 + GUESS_SLACK):
        predicted = None                       # too far over to fit: not replayed
    else:
        predicted = pb.measured(())
    if predicted is not None and predicted <= budget_bytes:
        return _finish(cg, Plan(regions=(), predicted_peak_bytes=predicted, min_feasible_bytes=None,
                                solver="none", status="fits without checkpointing", gap=0.0, solve_s=0.0,
                                recompute_flops=0, recompute_s=0.0, **base))
    t0 = time.perf_counter()
    ctx = search(cg, options.solve.sac)
    # Large graphs of repeated blocks: the hierarchical solve (planner/solve/hierarchy.py) stands in for
    # the flat candidates and ILP, here and in _choose; None (any other graph): the flat path.
    # (a pipeline rank's too: its chain weighs what the other micro-batches in flight retain)
    hier = hierarchy.for_graph(cg, options.solve, ctx)
    cands = candidates(cg, options.solve, ctx.space) if hier is None else []
    # Known-feasible plans: the hand-made baselines, and (if asked) the ILP's least-peak plan.
    # They bound the smallest feasible budget and warm-start the ILP.
    known = known_plans(cg, options.solve.sac)
    if options.find_min_feasible:
        known["min-peak"] = (hier.min_peak() if hier else solve_min_peak(cg, options.solve, cands, ctx)).regions
    peaks = {name: pb.predict(r) for name, r in known.items() if r}
    pb = pb._replace(cands=cands, ctx=ctx, known=known, peaks=peaks, hier=hier)
    min_feasible = min(peaks.values()) if options.find_min_feasible and peaks else None
    try:
        choice = _fit(pb)
    except InfeasibleBudgetError as e:
        raise InfeasibleBudgetError(e.budget_bytes, e.min_feasible_bytes, e.source or pb.source,
                                    floor_plans=e.floor_plans) from None
    if min_feasible is not None and measure is not None:     # one replayed number: NOTE [ one floor ]
        min_feasible = min(choice.predicted, _replayed_floor(pb))
    elif min_feasible is not None:      # the simulator's, corrected as the budget was; never above a plan that fits
        min_feasible = min(min_feasible + max(0, budget_bytes - choice.effective), choice.predicted)
    tl = timeline(cg, choice.regions)
    plan = _finish(cg, Plan(regions=choice.regions, predicted_peak_bytes=choice.predicted,
                            min_feasible_bytes=min_feasible, solver=choice.solver, status=choice.status,
                            gap=choice.gap, solve_s=time.perf_counter() - t0, recompute_flops=tl.recompute_flops,
                            recompute_s=tl.recompute_s, **base))
    if choice.why:
        plan = replace(plan, notes=plan.notes + (choice.why,))
    if choice.solver not in ("ilp", "none"):
        log.info("plan for %d bytes: the hand-made plan %r (%s)", budget_bytes, choice.solver, choice.status)
    return _noted(plan, pb)


def _base(cg: CostGraph, budget_bytes: int, unplanned: int, opaque) -> dict:
    """The Plan fields that depend on the graph and the budget, not on the regions."""
    return dict(budget_bytes=budget_bytes, unplanned_peak_bytes=unplanned, opaque=tuple(opaque),
                node_names=tuple(c.name for c in cg.nodes),
                total_flops=sum(c.flops for c in cg.nodes), forward_s=sum(c.cost_s for c in cg.nodes))


def _noted(plan: Plan, pb: _Problem) -> Plan:
    """`plan` with a note on where its predicted peak comes from, and the margin added to it."""
    added = pb.margin - 1.0 if pb.measure else pb.options.safety_margin
    return replace(plan, notes=plan.notes + (f"predicted peak: {pb.source}" + (f", plus {added:.0%}" if added else ""),))


# NOTE [ budget correction ]
# The simulator is conservative for some plans and the replay is exact, so the effective budget
# the ILP sees (a bound on the simulator's prediction) is corrected by how far the last plan's
# simulated peak missed its replay: the next bound on the simulated peak is the budget plus that
# plan's simulated - replayed (the effective budget: that, plus the safety margin). A plan that
# replays over budget is then excluded (the next bound is below its prediction); after a plan
# that fits, the next solve is worth its time only when that bound is above the last one (the
# simulator overstated the plan's replay by more than the room it left under the budget): every
# plan cheaper than the last has a prediction over the last bound, and fits only where the
# simulator overstates it too. (Stepping up by the room the replay left under
# the budget, as before, re-solved 15 of the 30 rows of benchmarks/plan_time.py, and 13 of those
# solves found no cheaper plan that fits: the room was the ILP's granularity, not the simulator's
# caution.) Once one effective budget gave a plan over and another one under (or none at all),
# the next is halfway between. It stops after `Measure.rounds` solves (DEFAULT_ROUNDS without a
# measure), or when the next step would move the effective budget by less than MIN_STEP of the
# budget. The first effective budget is the budget scaled by how the simulator's prediction of
# the step without checkpointing compares to its replay (the simulator adds its safety margin,
# and is cautious where the replay is exact), within FIRST_SCALE either way: most plans then
# replay within CLOSE_ENOUGH of the budget at the first solve. Once a plan fits, AFTER_FIT more
# solves at most look for a cheaper one.
DEFAULT_ROUNDS = 4
FIRST_SCALE = 1.05
AFTER_FIT = 1             # solves tried above the first plan that fits (it is rarely bettered twice);
                          # a measure may ask for more (`after_fit`: the compiled step's, runtime.rewrite.compiled)
CLOSE_ENOUGH = 0.005      # ... or less (`close_enough`: the compiled step's, NOTE [ the compiled fit ])
MIN_STEP = 0.002
ROUNDING_RESOLVES = 4     # re-solves tighter when the ILP's plan misses by the simulator's rounding


def _first_effective(pb: _Problem) -> int:
    """The first effective budget: the budget, scaled with a measure by how the simulator's
    prediction of the step without checkpointing compares to the measure's, within FIRST_SCALE
    either way (up to the measure's `first_scale` where the simulator overstates)."""
    if pb.measure is None:
        return pb.budget
    up = getattr(pb.measure, "first_scale", FIRST_SCALE)
    return int(pb.budget * min(up, max(1 / FIRST_SCALE, pb.predict(()) / max(1, pb.guessed_unplanned()))))


def _fit(pb: _Problem) -> Choice:
    """Solve against an effective budget, correct it by the exact replay, keep the cheapest fit."""
    budget, close = pb.budget, getattr(pb.measure, "close_enough", CLOSE_ENOUGH)
    best: tuple[float, Choice] | None = None
    effective = _first_effective(pb)
    under = over = predicted = None      # highest effective budget to go up from, lowest to go down from
    tries_left = None                    # solves left once a plan fits (AFTER_FIT)
    tried: list[tuple[float, int]] = []  # (recompute seconds, prediction) of every plan solved
    for _ in range(pb.measure.rounds if pb.measure is not None else DEFAULT_ROUNDS):
        if tries_left is not None:
            if tries_left == 0:
                break
            tries_left -= 1
        try:
            choice = _choose(pb, effective)
        except InfeasibleBudgetError as e:
            if best is None and over is None:
                return _known_or_raise(pb, effective, e.min_feasible_bytes + max(0, budget - effective))
            go_up, corrected = True, effective  # no plan this tight: between here and `over`
        else:
            tl = timeline(pb.cg, choice.regions)
            predicted = pb.predict(choice.regions) if pb.measure is None else pb.measured(choice.regions)
            tried.append((tl.recompute_s, predicted))
            # the simulated peak that would replay at the budget, were this plan's overstatement
            # everyone's, as the effective budget (a bound on the simulator's prediction: margin on)
            go_up = predicted <= budget
            corrected = math.ceil((budget + tl.peak_bytes - predicted) * (1.0 + pb.options.safety_margin))
            if go_up:
                if best is None or tl.recompute_s < best[0]:
                    best = (tl.recompute_s, choice._replace(predicted=predicted, effective=effective))
                    getattr(pb.measure, "fitting", _nothing)(choice.regions)    # NOTE [ the best so far ]
                # close enough, unless CBC stopped at a limit (another effective budget may do better:
                # up by the room left); else nothing cheaper to expect below the corrected bound
                limited = "limit" in choice.status
                if pb.measure is None or (budget - predicted < close * budget and not limited):
                    break
                if limited or getattr(pb.measure, "step_up", False):   # a measure may always ask it
                    corrected = max(corrected, effective + budget - predicted)
                elif corrected <= effective:
                    break
                if tries_left is None:
                    tries_left = getattr(pb.measure, "after_fit", AFTER_FIT)
        if go_up:
            under = effective if under is None else max(under, effective)
        else:
            over = effective if over is None else min(over, effective)
        if under is not None and over is not None:
            if under >= over:                  # not monotone: keep the best found
                break
            nxt = (under + over) // 2
        else:
            nxt = corrected
        if abs(nxt - effective) < MIN_STEP * budget:
            break
        effective = nxt
    if best is None:
        return _known_or_raise(pb, effective, max(predicted or 0, min(pb.peaks.values(), default=predicted or 0)))
    return best[1]._replace(why=_why_unused(pb, best[1], best[0], tried))


def _nothing(regions) -> None:
    pass


# NOTE [ the best so far ]
# A measure may want to know the plan the fit would return were it to stop now (`fitting`): the
# best fitting plan so far, each time it changes. Compile mode checks that plan with Inductor's
# own memory plan after the fit (runtime/planning.py NOTE [ the compiled check ]), and starts that
# check at once, in forked workers, while the fit goes on: the plan the fit ends with is, more
# often than not, one it found rounds before.


# NOTE [ budget used ]
# A plan whose prediction leaves more than 5% of its budget unused says why in its notes (issue
# 45: use the budget, or name why not): the plans recomputing less that the fit solved and found
# over the budget (the closest named), or, where it solved none, that the solver found no plan
# recomputing less whose simulated peak fits. Regions are whole: the next cheaper plan may hold a
# block's activations more, a step larger than the room left.
USED = 0.95


def _why_unused(pb: _Problem, choice: Choice, recompute_s: float, tried: list[tuple[float, int]]) -> str:
    used = choice.predicted / pb.budget
    if used >= USED:
        return ""
    over = [p for s, p in tried if s < recompute_s and p > pb.budget]
    head = f"uses {used:.1%} of the budget ({pb.source}): the cheapest plan found that fits;"
    if over:
        return (f"{head} {len(over)} plan(s) recomputing less were tried and peak over it, the closest at "
                f"{min(over) / pb.budget:.1%} of it")
    return f"{head} the solver found no plan recomputing less whose simulated peak fits"


# NOTE [ one floor ]
# With a replay, the smallest feasible budget a plan reports (`Plan.min_feasible_bytes`, the CLI's,
# InfeasibleBudgetError's) is always a replayed peak: of the plan chosen, of the step without
# checkpointing, or of a known plan (the least-peak ILP's among them). Typed back as the budget, it
# is met: the plan chosen fits it, and `_known_or_raise` replays the others (the empty plan too)
# before it refuses. The simulator's least peak is only a guide to which plans to replay.


def _replayed_floor(pb: _Problem) -> float:
    """With a replay, the least replayed peak of the known plans the simulator cannot tell from
    the least (within its safety margin): plans it ties can replay apart (hf-t5: every block and
    the least-peak plan simulate to one peak and replay 0.7% apart); and of the step without
    checkpointing unless its guess is well above those (NOTE [ unplanned guess ]). Each plan is
    replayed once."""
    if pb.measure is None:
        return math.inf
    tie = min(pb.peaks.values(), default=0) * (1.0 + pb.options.safety_margin)
    known = [pb.measured(pb.known[k]) for k, p in pb.peaks.items() if p <= tie]
    if not known or pb.guessed_unplanned() <= min(known) * (1.0 + GUESS_SLACK):
        known.append(pb.measured(()))
    return min(known)


# NOTE [ unplanned guess ]
# The exact replay of the step without checkpointing (a fake-tensor step: 5 s of a Llama-2-7B
# report's 35) repeats what the profile metered already: the same graph on the same fake tensors
# under the same meter (planner/profile/graph.py, `measured_peak_bytes`). The replay's measure offers
# that figure as `unplanned_guess` (equal to the replay to the byte on 9 of the zoo's 10 models,
# 4 bytes above it on hf-moe). It is a guide, never a prediction: the step is replayed wherever
# the answer could turn on it, and a wrong guess only costs a replay or is cautious: the step
# whose guess is more than GUESS_SLACK over the budget is taken not to fit unplanned (a guess too
# high plans regions a step that fits would not need), and the floor replays the step only when
# its guess is within GUESS_SLACK of the known plans' replayed least (a guess too high leaves a
# floor that is still met: a replayed plan's peak). `_known_or_raise` replays it always.
GUESS_SLACK = 0.01


def _known_or_raise(pb: _Problem, effective: int, estimate: int) -> Choice:
    """No solved plan fits: a known plan that fits when replayed exactly, else InfeasibleBudgetError
    with the smallest feasible budget: a replayed known plan's peak (a budget then met for sure),
    or without a replay the simulator's `estimate`."""
    plans = {"none": (), **{k: r for k, r in pb.known.items() if r}}   # the step without checkpointing too
    replayed = {k: (r, pb.measured(r)) for k, r in plans.items()} if pb.measure is not None else {}
    fits = [(pb.predict(r), p, k) for k, (r, p) in replayed.items() if p <= pb.budget]
    if fits:                                   # the simulator was too cautious: take the replay
        _, p, k = min(fits)
        if k == "none":
            return Choice((), "none", "fits without checkpointing when replayed exactly", 0.0, p, effective)
        return Choice(pb.known[k], k, "known plan that fits when replayed exactly", float("nan"), p, effective)
    floors = tuple(sorted(((p, r) for r, p in replayed.values()), key=lambda pr: pr[0]))
    raise InfeasibleBudgetError(pb.budget, floors[0][0] if floors else estimate, pb.source, floor_plans=floors)


def _choose(pb: _Problem, budget_bytes: int) -> Choice:
    """The cheapest plan whose simulated peak fits: the ILP's, or a known plan if it is cheaper."""
    cg, known, peaks = pb.cg, pb.known, pb.peaks
    fitting = sorted((timeline(cg, known[k]).recompute_s, k) for k, p in peaks.items() if p <= budget_bytes)
    if pb.options.find_min_feasible and not fitting:
        raise InfeasibleBudgetError(budget_bytes, min(peaks.values(), default=pb.predict(())), SIMULATED)
    warm = known[fitting[0][1]] if fitting else ()
    target = int(budget_bytes / (1.0 + pb.options.safety_margin))
    for _ in range(ROUNDING_RESOLVES):   # the ILP bounds the simulated peak; re-solve tighter if rounding says no
        sol = (pb.hier.solve if pb.hier else solve_ilp)(cg, target, pb.options.solve, warm_start=warm,
                                                        cands=pb.cands, ctx=pb.ctx)
        if sol is None or pb.predict(sol.regions) <= budget_bytes:
            break
        target -= pb.predict(sol.regions) - budget_bytes
    ilp_ok = sol is not None and pb.predict(sol.regions) <= budget_bytes
    if fitting and (not ilp_ok or fitting[0][0] < timeline(cg, sol.regions).recompute_s):
        name = fitting[0][1]
        return Choice(known[name], name, "cheaper than the best plan the ILP found within its limits", float("nan"))
    if ilp_ok:
        return Choice(sol.regions, "ilp", sol.status, sol.gap)
    if pb.measure is not None and "min-peak" not in known:   # `_fit` replays the known plans for the floor
        raise InfeasibleBudgetError(budget_bytes, min([pb.predict(())] + list(peaks.values())), SIMULATED)
    floor = known.get("min-peak") or (pb.hier.min_peak() if pb.hier
                                      else solve_min_peak(cg, pb.options.solve, pb.cands, pb.ctx)).regions
    raise InfeasibleBudgetError(budget_bytes, min([pb.predict(floor)] + list(peaks.values())), SIMULATED)


def _not_recomputable(cg: CostGraph, listed: int = 3) -> list[str]:
    """One note per node that may not be recomputed; a reason shared by more than `listed` nodes
    (the root's own nodes under FSDP2) is one note, naming the first few."""
    by_why: dict[str, list[str]] = {}
    for c in cg.nodes[:-1]:
        if not c.recomputable:
            by_why.setdefault(c.why_not, []).append(c.name)
    notes = []
    for why, names in by_why.items():
        if len(names) <= listed:
            notes += [f"{n}: not recomputable ({why})" for n in names]
        else:
            notes.append(f"{len(names)} nodes not recomputable ({why}): {', '.join(names[:listed])}, ...")
    return notes


def _finish(cg: CostGraph, p: Plan) -> Plan:
    notes, facts = _not_recomputable(cg), StepFacts.of(cg.meta)
    if facts.loss == "stand-in":
        notes.append("no loss_fn given: room is reserved for a loss that keeps one tensor of the output's size")
    if cg.optimizer_step_bytes is not None:
        optimizer = facts.optimizer if facts.optimizer is not None else "the optimizer"
        notes.append(f"the step ends with {optimizer}.step(): its state "
                     f"({facts.optimizer_state_bytes} bytes) is live throughout")
    if facts.accumulates:
        notes.append(f"a micro-step of {facts.accumulation_steps}-step gradient accumulation: every gradient "
                     "is live from its start")
    return replace(p, notes=tuple(notes), meta=StepFacts.noted(cg.meta, peak_phase=timeline(cg, p.regions).phase))


def reuse_plan(cg: CostGraph, plan: Plan, budget_bytes: int, options: PlanOptions = PlanOptions(),
               measure: Measure | None = None) -> Plan | None:
    """`plan`'s regions on `cg` (the same graph, by node names, at other input shapes, dtypes or
    keyword values; or one that differs only after the last region, as a loss divided by
    Trainer's num_items_in_batch does), predicted as `solve_plan` predicts them (the measure,
    else the simulator), when that fits `budget_bytes`; None when the graph differs or the
    regions do not fit there. One prediction, no solve: a run's later shapes keep its plan
    (runtime.api)."""
    if not same_where_planned(tuple(c.name for c in cg.nodes), plan):
        return None
    margin = 1.0 + replay_margin(options, StepFacts.of(cg.meta).device)
    pb = _Problem(cg, int(budget_bytes), options, [], None, {}, {}, measure, margin)
    predicted = pb.measured(plan.regions) if measure is not None else pb.predict(plan.regions)
    if predicted > budget_bytes:
        return None
    tl = timeline(cg, plan.regions)
    return _noted(_finish(cg, Plan(regions=plan.regions, predicted_peak_bytes=predicted, min_feasible_bytes=None,
                                   solver=plan.solver, status="reused: the plan made at other inputs fits these",
                                   gap=plan.gap, solve_s=0.0, recompute_flops=tl.recompute_flops,
                                   recompute_s=tl.recompute_s, **_base(cg, int(budget_bytes), pb.predict(()),
                                                                      plan.opaque))), pb)


def same_where_planned(names: tuple[str, ...], plan: Plan) -> bool:
    """`names` (a graph's nodes) are `plan.node_names` up to the node after its last region, and
    the loss (the last node) is in no region: the regions mean the same there."""
    if names == plan.node_names:
        return True
    end = max((r.end for r in plan.regions), default=-1) + 2
    return end < min(len(names), len(plan.node_names)) and names[:end] == plan.node_names[:end]
