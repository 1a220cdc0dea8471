"""Making a run's plans (runtime.api.Remat's planning steps): capture and profile the call
(planner.analyze_for), then keep a plan made at other inputs that still fits (planner.solve.fit.reuse_plan),
else solve, every candidate replayed exactly on fake tensors (`ExactReplay`); the plan cache
(runtime/plan_cache.py) first; the module tree when there is no graph (runtime.rewrite.module_tree);
the compiled step in compile mode (runtime.rewrite.compiled). Each returns an `Entry`
(runtime.book) and whether a solve made it."""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace
from typing import Callable, ContextManager, NamedTuple

import torch

from remat.planner import PlanOptions, solve_plan
from remat.planner.options import PipelineRank
from remat.planner.api import Analysis, analyze_for, input_signature
from remat.planner.errors import InfeasibleBudgetError, PlanMismatchError, RematError, TraceError
from remat.planner.facts import StepFacts
from remat.planner.solve.fit import DEFAULT_ROUNDS, reuse_plan, unplanned_peak_bytes
from remat.planner.profile.graph import compute_nodes
from remat.planner.result import Plan
from remat.planner.step.rng import rng_preserved
from remat.planner.workers import cores, heap_frozen
from remat.planner.solve.simulate import base_liveness
from remat.planner.step.state import state_preserved, training_modes
from remat.planner.step.fake import describe
from remat.planner.capture.trace import Traced, cache_off, capture

from . import plan_cache
from .book import Entry, PlanBook
from .budget import StepBudget
from .distributed.pipeline import rank_graph, rank_peak
from .measure import dry_run_peak
from .rewrite import REGION_PROBE, plan_modules, rewrite, rewrite_plan
from .rewrite.compiled import Checked, CompiledPrediction, JointBeside, compiled_module
from .signature import call_key

log = logging.getLogger("remat.runtime")


class Setting(NamedTuple):
    """What a run's plans are made for besides the call (runtime.api.Remat's settings)."""
    model: torch.nn.Module
    loss_fn: Callable | None
    options: PlanOptions
    compile: dict | None
    """torch.compile's keyword arguments: plans are for the compiled step; None: eager."""
    optimizer: torch.optim.Optimizer | None
    """Its state and step are in the budget."""
    bypassed: Callable[[], ContextManager]
    """Inside it, `model(...)` runs the model's own forward (Remat.bypassed)."""


def plan_call(s: Setting, budget: StepBudget, book: PlanBook, key: tuple, args: tuple, kwargs: dict) -> Entry:
    """The entry for a call of signature `key` (not in `book`): a larger call's plan (`covered`),
    one made at the run's largest sizes (`grown`), else a plan of its own (`make`)."""
    return covered(s, book, key, args, kwargs) or _grown(s, budget, book, key, args, kwargs) \
        or make(s, budget, book, args, kwargs)


def covered(s: Setting, book: PlanBook, key: tuple, args: tuple, kwargs: dict) -> Entry | None:
    """The plan of a larger call of the same kind (NOTE [ covered shapes ] in runtime.book),
    applied to this one's graph, or None. A module-tree plan and an fx graph serve it as they are;
    an exported graph (its shapes baked in) is captured again. Nothing is profiled or solved."""
    if s.compile is not None:
        return None
    model = s.model
    for e in book.larger(key):
        plan, traced = e.plan, e.traced
        if traced is None or traced.in_spec is None:   # the module tree, or fx (sizes read at run time)
            return e
        if traced.shapes is not None and traced.shapes.admits(traced.inputs(model, args, kwargs)):
            return e                  # exported with dynamic sizes, these among them: no capture
        traced, _ = capture_call(s, args, kwargs)
        if [n.name for n in compute_nodes(traced.gm)] != list(plan.node_names[:-1]):
            return None        # another graph at this shape (a branch on a size): planned as new
        log.info("%s: inputs %s are covered by the plan made for larger ones: kept", type(model).__name__,
                 describe((args, kwargs)))
        return Entry(plan, rewrite_plan(model, traced.gm, plan), traced)
    return None


def _grown(s: Setting, budget: StepBudget, book: PlanBook, key: tuple, args: tuple, kwargs: dict) -> Entry | None:
    """A call of a new kind (another keyword, autocast) at sizes below the largest this run has
    planned (a padded batch shorter than the longest): planned once at those largest sizes,
    then applied here as a covered call, so that the run's later batches of this kind keep it.
    None when no input grows, or the grown call's graph is not this one's."""
    g_args, g_kwargs = book.grown(args, kwargs)
    if g_args is None:
        return None
    g_key = call_key(g_args, g_kwargs, s.model)
    if g_key not in book:
        try:
            book.add(g_key, make(s, budget, book, g_args, g_kwargs))
        except RematError as e:       # the grown call does not plan: this one is planned as it is
            log.info("%s: no plan at the run's largest sizes (%s); planning these inputs as they are",
                     type(s.model).__name__, e)
            return None
    return covered(s, book, key, args, kwargs)


def capture_call(s: Setting, args: tuple, kwargs: dict, opaque: dict | None = None,
                 skip: dict | None = None) -> tuple[Traced, dict]:
    """(Traced, named inputs) of the model's own forward on these inputs, its state untouched;
    `opaque`: submodules to capture as opaque fx leaves (those of the plan the graph is for);
    `skip`: capture paths not to take."""
    model = s.model
    with s.bypassed(), rng_preserved(), training_modes(model), state_preserved(model):
        traced = capture(model, args, kwargs, opaque or None, skip)
        return traced, traced.inputs(model, args, kwargs)


def from_plan(s: Setting, plan: Plan, args: tuple, kwargs: dict) -> Entry:
    """`plan` (made elsewhere: `Plan.from_json`) on this call's graph; PlanMismatchError, saying
    what differs, when the model's graph or the inputs are not the ones it was made for."""
    model = s.model
    if plan.trace_path == "module tree":
        missing = [n for n in plan.node_names if n not in dict(model.named_modules())]
        if missing:
            raise PlanMismatchError(f"the plan checkpoints submodules this model does not have: {missing[:5]}")
        return Entry(plan, None, None)
    # a plan's opaque modules are leaves again (the profile may have made some after capture)
    traced, named = capture_call(s, args, kwargs, dict(plan.opaque) if plan.trace_path.startswith("fx") else None)
    check_matches(plan, traced, named)
    return Entry(plan, rewrite_plan(model, traced.gm, plan), traced)


def make(s: Setting, budget: StepBudget, book: PlanBook, args: tuple, kwargs: dict) -> Entry:
    """The entry for inputs like these: from the plan cache (runtime/plan_cache.py) when this
    call was planned before, in any process, else made (and cached); their sizes join the
    largest this run has planned for (`_grown`)."""
    entry = _from_cache(s, budget, book, args, kwargs)
    book.note_sizes(args, kwargs)
    return entry


def _from_cache(s: Setting, budget: StepBudget, book: PlanBook, args: tuple, kwargs: dict) -> Entry:
    if s.compile is not None or not plan_cache.enabled(s.options):
        return _planned(s, budget, book, args, kwargs)
    parts = plan_cache.key_parts(s.model, call_key(args, kwargs, s.model), budget.budget, s.loss_fn,
                                 s.options, s.optimizer)
    cache = plan_cache.PlanCache()
    hit = cache.load(parts)
    if hit is not None:
        entry = _cached(s, budget, hit[0], hit[1], args, kwargs)
        if entry is not None:
            return entry
    entry = _planned(s, budget, book, args, kwargs)
    cache.store(parts, entry.plan, plan_cache.graph_hash(None if entry.traced is None else entry.traced.gm))
    return entry


def _cached(s: Setting, budget: StepBudget, plan: Plan, graph: str, args: tuple, kwargs: dict) -> Entry | None:
    """The cached `plan` on this call's graph, or None (logged) when the graph captured now is
    not the one it was made on."""
    model = s.model
    try:
        if plan.trace_path == "module tree":
            if graph != "module tree":
                raise PlanMismatchError("the entry's plan is for the module tree, its graph is not")
            entry = Entry(plan, None, None)
        else:
            skip = {"fx": "the cached plan's graph"} if plan.trace_path == "torch.export" else None
            traced, named = capture_call(s, args, kwargs, dict(plan.opaque) if plan.trace_path.startswith("fx")
                                         else None, skip)
            if plan_cache.graph_hash(traced.gm) != graph:
                raise PlanMismatchError("the graph captured now is not the one the plan was made on")
            check_matches(plan, traced, named)
            entry = Entry(plan, rewrite_plan(model, traced.gm, plan), traced)
    except (RematError, PlanMismatchError) as e:
        log.warning("%s: plan cache entry not used (%s); planning anew", type(model).__name__, e)
        return None
    log.info("%s: plan taken from the plan cache (%s)", type(model).__name__, plan_cache.directory())
    budget.resolve(plan.unplanned_peak_bytes)      # a '%' budget: the key held it, the plan resolved it
    return entry._replace(plan=plan.noting(cached=True))


def _planned(s: Setting, budget: StepBudget, book: PlanBook, args: tuple, kwargs: dict) -> Entry:
    """A plan made for this call: over its captured graph, else over the module tree. In compile
    mode the joint graph is captured while the graph is profiled (NOTE [ the profile, beside ] in
    planner/api.py), with the heap frozen (NOTE [ the heap frozen ])."""
    joint = None if s.compile is None else JointBeside(s.compile)
    with contextlib.nullcontext() if joint is None else heap_frozen():
        try:
            a = analyze_for(s.model, args, kwargs, s.loss_fn, s.options, s.optimizer, REGION_PROBE, beside=joint)
        except TraceError as e:             # no graph at all: plan over the module tree
            return _over_module_tree(s, budget, book, args, kwargs, e)
        if s.options.pipeline is not None:      # the other micro-batches in flight (runtime/distributed/pipeline.py)
            a = replace(a, cost_graph=rank_graph(a.cost_graph, s.options.pipeline, a.example_inputs))
        measure = ExactReplay(s.model, a, s.loss_fn, s.options.pipeline)
        if joint is not None:       # '%' of the compiled step without checkpointing, predicted
            return _compiled(s, budget, book, a, compiled_measure(measure, s.compile, joint))
    # '%' of the step without checkpointing: a pipeline rank's is its whole schedule.step, replayed
    budget_bytes = budget.resolve(measure(()) if s.options.pipeline else unplanned_peak_bytes(a.cost_graph, s.options))
    return _solved(s, book, a, budget_bytes, args, kwargs, measure)


def _over_module_tree(s: Setting, budget: StepBudget, book: PlanBook, args: tuple, kwargs: dict,
                      e: TraceError) -> Entry:
    """A plan over the module tree (runtime.rewrite.module_tree), each choice measured with a real step."""
    model = s.model
    if s.compile is not None:
        raise TraceError(e.where, f"{e.cause}; compile=True plans a captured graph: wrap without "
                                  "compile (the module tree is planned, eagerly)") from e
    log.warning("%s: no graph (%s); planning over its module tree, each choice measured with a real step",
                type(model).__name__, e.cause)
    extra = cache_off(model, args, kwargs)      # as Hugging Face's own checkpointing does
    p = plan_modules(model, args, {**kwargs, **extra}, s.loss_fn, budget, s.options, e.cause, s.optimizer)
    if extra:
        p = replace(p.noting(extra_kwargs=extra), notes=p.notes + (
            "called with use_cache=False, as Hugging Face does under gradient checkpointing: the output "
            "carries no key/value cache",))
    book.solves += 1
    return Entry(p, None, None)


def _solved(s: Setting, book: PlanBook, a: Analysis, budget_bytes: int, args: tuple, kwargs: dict,
            measure: "ExactReplay") -> Entry:
    """A plan made at other inputs on the same graph when it still fits (one prediction, no
    solve), else a solve, every candidate replayed exactly (`measure`)."""
    model = s.model
    for e in book.on_path(a.traced.path):
        p = reuse_plan(a.cost_graph, e.plan, budget_bytes, s.options, measure)
        if p is not None:
            log.info("%s: the plan made at other inputs fits these (predicted %d of %d bytes): kept",
                     type(model).__name__, p.predicted_peak_bytes, budget_bytes)
            return Entry(p, rewrite_plan(model, a.traced.gm, p), a.traced)
    if book.entries:
        log.warning("%s: new inputs (%s) that no plan of this run fits: planning anew for %d bytes",
                    type(model).__name__, describe((args, kwargs)), budget_bytes)
    book.solves += 1
    t0 = time.perf_counter()
    p = solve_plan(a.cost_graph, budget_bytes, s.options, a.traced.opaque, measure=measure, floor_if_needed=True)
    spent = {**a.times, "solve": time.perf_counter() - t0 - measure.seconds, "replay": measure.seconds}
    p = p.noting(plan_time={**{k: round(v, 3) for k, v in spent.items()}, "replays": len(measure.peaks)})
    return Entry(p, rewrite_plan(model, a.traced.gm, p), a.traced)


def compiled_measure(replay: "ExactReplay", compile_kwargs: dict | None, beside: JointBeside | None = None) -> "ExactReplay":
    """`replay` made the measure of compiled plans: each plan's compiled step partitioned and
    replayed on fake tensors (runtime.rewrite.compiled `CompiledPrediction`), no real step.
    `beside`: the joint graph's capture, run beside the profile (NOTE [ the profile, beside ])."""
    a = replay.analysis
    if any(t.device.type == "meta" for t in [*replay.model.parameters(), *a.example_inputs.values()]
           if isinstance(t, torch.Tensor)):
        raise ValueError("compile=True plans with the model's real tensors (Inductor's joint-graph passes do not "
                         "keep a graph on meta): plan a meta model without compile=")
    prediction = CompiledPrediction(replay, compile_kwargs, beside.of(a.traced.gm) if beside else None)
    replay.stand_in, replay.compiled = prediction.module, prediction
    replay.what, replay.unplanned_guess = prediction.what, None     # the profile's metered peak is eager's
    for knob in ("rounds", "after_fit", "close_enough", "first_scale", "step_up"):
        setattr(replay, knob, getattr(prediction, knob))
    return replay


# NOTE [ the compiled check ]
# The fit (planner.solve.fit) replays each plan it tries with the compiled step's buffers modelled
# from the partitioned graphs (planner/compiled/memory.py: a fraction of a second a plan). The model
# misses what Inductor's lowering and fusion alone decide: a random draw recomputed in the backward
# is a buffer of its own there, kept until the dropout's backward reads it (the built-in GPT-2 of 6
# layers, three blocks a region, read 6% under the allocator; a one-block GPT-2 recomputing its
# attention's dropout, 12% under). So the plan the fit returns is checked with the compile's own
# memory plan: the wrapper Inductor generates for each partitioned graph (planner/compiled/wrapper.py:
# lowering and fusion, the kernels' bodies unwritten, no kernel compiled; seconds a plan), replayed on fake
# tensors, within 0.01% of the CPU allocator on the built-in ResNet and that GPT under four plans
# each. The checked peak is the plan's prediction. Where the check finds the plan over the budget,
# or the model finds none that fits, the fit runs again with every plan checked (`Checked`): slower,
# and what the plan and its refusal promise is the compile's own.


# NOTE [ the compiled fit ]
# The fit's budget correction (planner/solve/fit.py NOTE [ budget correction ]) runs more rounds for
# the compiled step (`CompiledPrediction.rounds`, `after_fit`): the compiled peak departs from the
# simulator's plan by plan. These make it cheaper:
# - No polish by the flat ILP after the hierarchical solve (`SolveOptions.polish`): its CBC run was
#   most of each round (the built-in GPT-2 of 6 layers: 38 -> 27 s at 50%, 39 -> 26.5 at 70%, 34 ->
#   23 at 90% on a 2-core machine), and it changed none of the plans of that GPT-2 at 50/70/90%, the
#   ResNet at 70/90% or the MLP at 70%: each round's plan is judged by the compiled step, and what the
#   polish moves is within the simulator's own error there.
# - No local search after a solve (`SolveOptions.improve_evals`, planner/solve/improve.py), for
#   the same reason: the moves it makes are cheaper by the eager simulator. Without it, in one
#   process each: the same plans at 50/70/90% of the ResNet, MLP, U-Net, 2-layer GPT-2 (and
#   the HF GPT-2 and Llama at 90%), and at 50/60/70/90% and halfway of the 6-layer GPT-2, whose
#   solves took half the time (0.7 -> 0.3 s at halfway); at 80% of that GPT-2 and 70% of the HF
#   Llama, cheaper plans using more of the budget (94.4 -> 97.5% and 98.8 -> 99.4%), the Llama's
#   in 10.5 s, not 19.5 s. The floors refusals name moved by -2.4% (the ResNet at 50%) to +0.3%
#   (the Llama): each still a plan's checked peak.
# - A plan that fits using at least USED (95%) of the budget ends the search (`close_enough`), the
#   bar of NOTE [ budget used ]: rounds after it would look for a cheaper plan in the last 5%,
#   where compiled peaks step by a block's activations (the ResNet at 70%: three more rounds,
#   none fitting). Two rounds at most after the first plan that fits (`after_fit`): the third never
#   found a cheaper plan on the GPT-2 of 6 layers or the ResNet at 50/70/90%.
# - The first effective budget is the budget scaled by the simulated/modelled ratio of the step
#   without checkpointing, up to 30% over (`first_scale`; 5% for eager plans) and 5% under: where
#   the compiled step saves less than the eager one the simulator models (fusion), it does so by
#   much the same share under most plans (the GPT-2 of 6 layers: 1.15 unplanned, its plans'
#   1.13-1.25; at 50% and 90% the first round's plan fits using 99.8% and 97.8% of the budget,
#   where within 5% took 3 rounds to 95.8% and 5 rounds to 95.0%); where it saves more, much of
#   that is held under every plan (the ResNet's channels-last copies: 0.875 unplanned, its plans'
#   0.88-0.95), and scaling by it took a round more at 70% and at 90%.
# - After a plan that fits using less than 95% of the budget, the next effective budget is at
#   least this one plus the room left (`step_up`), as after a solve CBC stopped at a limit: the
#   simulator's error is the plan's own here, so its correction alone can say "nothing cheaper"
#   too early (the 2-layer GPT-2 at 70%, first scaled 1.12: stopped at 90.3% of the budget;
#   stepping up, 97.4%).
# - Each plan that becomes the best so far has its check started at once, in workers beside the
#   fit (`CompiledPrediction.speculate`, planner/solve/fit.py NOTE [ the best so far ]).


def compiled_unplanned(measure: "ExactReplay") -> int:
    """The compiled step's peak without checkpointing, checked (what a '%' budget is a share of)."""
    return measure.compiled.checked(())


def solve_compiled(cg, budget_bytes: int, options: PlanOptions, opaque, measure: "ExactReplay") -> Plan:
    """`solve_plan` for the compiled step: fitted on the modelled buffers and checked by Inductor's
    own memory plan, or fitted on that (NOTE [ the compiled check ]). The compiled step runs no
    checkpoint: its regions keep no host RNG state (the partition replays the forward's seeds)."""
    cg = replace(cg, region_state_bytes=0)
    options = replace(options, solve=replace(options.solve, polish=False, improve_evals=0))   # NOTE [ the compiled fit ]
    try:
        p = solve_plan(cg, budget_bytes, options, opaque, measure=measure, floor_if_needed=True)
        peak = measure.compiled.checked(p.regions)
        if peak <= budget_bytes:
            return replace(p, predicted_peak_bytes=peak, notes=p.notes + (f"checked: {Checked.what}",))
    except InfeasibleBudgetError as e:
        _refuse_far_below(e, budget_bytes, measure)
    return solve_plan(cg, budget_bytes, options, opaque, measure=Checked(measure.compiled), floor_if_needed=True)


# NOTE [ far below the floor ]
# Where the modelled fit finds no plan, the fit runs again with every plan checked (NOTE [ the
# compiled check ]): the model can overstate a plan (the 2-layer GPT-2's last-half plan, 5.1% over
# its check), so a plan it puts just over the budget may fit. A budget more than FAR_BELOW under
# the least peak the model finds is past what that can turn: the plans the modelled floor search
# measured (the known plans: every block, the least-peak plan, ...) are checked instead, and the
# least checked peak, over the budget, is the floor the refusal names, as the fit with every plan
# checked would name it (the model ranks them differently: the U-Net's least modelled plan checks
# at 15.25 MB, another at 13.83). The ResNet at 50% on 2 cores, in a fresh process: refused in
# 39.7 s with every plan checked, in 27.6 s so (benchmarks/results/compile-plan-time.md). Those
# checks run as many at a time as there are cores (`CompiledPrediction.checked_at_once`): its four
# floor plans' checks, one after another, 5.6-5.8 s of its 11.8-12.2 s refusal; two at a time,
# 4.9-5.2 s (each check's two graphs are read in two workers already: the cores are mostly busy).
FAR_BELOW = 0.1


def _refuse_far_below(e: InfeasibleBudgetError, budget_bytes: int, measure: "ExactReplay") -> None:
    """Raise the refusal at once where `budget_bytes` is far below the modelled floor `e` names
    (NOTE [ far below the floor ]); return where the fit with every plan checked must decide."""
    plans = [r for _, r in e.floor_plans if r]
    if not plans or e.min_feasible_bytes <= budget_bytes * (1 + FAR_BELOW):
        return
    floors = tuple(sorted(zip(measure.compiled.checked_at_once(plans), plans), key=lambda pr: pr[0]))
    if floors[0][0] > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, floors[0][0], Checked.what, floor_plans=floors)


def _compiled(s: Setting, budget: StepBudget, book: PlanBook, a: Analysis, measure: "ExactReplay") -> Entry:
    """A plan for the compiled step (runtime.rewrite.compiled): regions and selective-checkpointing
    policies as the partitioner's tags, each plan tried predicted on fake tensors; the chosen plan's
    model compiled (lazily: at its first call). A '%' budget is a share of the step without
    checkpointing, checked while the fit runs (NOTE [ the unplanned check, alongside ]); a budget in
    bytes needs no such check: the plan reports that step's modelled peak."""
    book.solves += 1
    t0 = time.perf_counter()
    share = budget.bytes is None            # a '%' budget, not resolved yet
    if share:
        measure.compiled.start(())
        guess = budget.asked.bytes_of(measure(()) if cores() > 1 else compiled_unplanned(measure))
    else:
        guess = budget.bytes
    try:
        p = solve_compiled(a.cost_graph, guess, s.options, a.traced.opaque, measure)
    except InfeasibleBudgetError as e:
        p, refused = None, e
    budget_bytes = budget.resolve(compiled_unplanned(measure)) if share else guess
    if p is not None and guess > budget_bytes >= p.predicted_peak_bytes:
        p = replace(p, budget_bytes=budget_bytes)       # the cheapest under more room fits: the cheapest here
    elif budget_bytes != guess:       # the check moved a '%' budget: the fit again, at the budget
        log.info("%s: the compiled step without checkpointing checked at %d bytes, modelled at %d: "
                 "planning again for %d bytes", type(s.model).__name__, compiled_unplanned(measure),
                 measure(()), budget_bytes)
        p = solve_compiled(a.cost_graph, budget_bytes, s.options, a.traced.opaque, measure)
    elif p is None:
        raise refused
    spent = {**a.times, "joint": measure.compiled.joint.seconds,
             "solve": time.perf_counter() - t0 - measure.seconds, "replay": measure.seconds}
    p = _unplanned_noted(p, measure).noting(
        plan_time={**{k: round(v, 3) for k, v in spent.items()}, "replays": len(measure.peaks)})
    return Entry(p, compiled_module(s.model, a, p.regions, measure.names, s.compile), a.traced)


def _unplanned_noted(p: Plan, measure: "ExactReplay") -> Plan:
    """`p` with the step without checkpointing's peak: checked where it was (a '%' budget, or a plan
    of no regions), else modelled, and a note saying so."""
    if () in measure.compiled.checks:
        return replace(p, unplanned_peak_bytes=compiled_unplanned(measure))
    return replace(p, unplanned_peak_bytes=measure(()),
                   notes=p.notes + ("unplanned peak: modelled (the compiled step's partition, not checked)",))


# NOTE [ the unplanned check, alongside ]
# A '%' budget is a share of the compiled step without checkpointing as its check finds it (NOTE
# [ the compiled check ]): seconds of Inductor's lowering the fit would wait for. Where workers
# fork (planner/workers.py), that check runs in one of them while the fit runs at the budget the
# modelled step gives (the same bytes on the built-in GPT-2s and MLP, 1.5 kB over on the ResNet, 3-7%
# under on the Hugging Face models). A plan fitted with more room than the checked budget gives that
# fits it too is its plan (no plan recomputing less fits more room); else the fit runs again at the
# checked budget, the replays and checks of its plans kept: the plan is the one the checked budget
# gives either way. A budget in bytes (or a '%' one resolved by an earlier plan) needs no such
# check, and none runs: the plan's `unplanned_peak_bytes` is then the modelled step's, and its
# notes say so (the check of the step is two of a plan's four Inductor wrappers).


def check_matches(plan: Plan, traced, named: dict) -> None:
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


PIPELINE_ROUNDS = 8


class ExactReplay:
    """The `planner.solve.fit.Measure` of eager plans: rewrite with the regions and dry-run the step on
    fake tensors (runtime.measure.replay).

    Opaque modules (fake tensors cannot run them, or an RNN's kernel holds memory they do not
    model) are stood in for by their measured behaviour, as in the profile (planner.profile.opaque).
    """
    what = "the exact replay on fake tensors"
    rounds = DEFAULT_ROUNDS

    def __init__(self, model: torch.nn.Module, analysis, loss_fn, pipeline: PipelineRank | None = None):
        self.model, self.analysis, self.loss_fn = model, analysis, analysis.fake_loss or loss_fn
        self.pipeline = pipeline                # a pipeline rank: its whole schedule.step is replayed
        self.stand_in = None                    # compile mode: regions -> the compiled step's stand-in
        self.compiled = None                    # compile mode: its CompiledPrediction
        self.opaque = tuple(m for m, _ in analysis.traced.opaque)
        self.names = tuple(c.name for c in analysis.cost_graph.nodes)
        self.peaks: dict[tuple, int] = {}       # regions -> replayed peak: each plan replayed once
        self.opaque_costs: dict = {}            # each opaque module measured once (planner.profile.opaque)
        self.seconds = 0.0                      # spent replaying
        # the profile's metered peak of the step without checkpointing, as `_replay` would add to
        # it: planner.solve.fit's guide to whether that step needs a replay (NOTE [ unplanned guess ]);
        # none with gradient accumulation (the replay's gradients exist from the start, the profile's do not)
        facts = self.facts = StepFacts.of(analysis.cost_graph.meta)
        self.unplanned_guess = None if facts.measured_peak_bytes is None or facts.accumulates or pipeline else max(
            facts.measured_peak_bytes + facts.held_throughout_bytes, base_liveness(analysis.cost_graph).opt)
        if pipeline is not None:    # the buffers a rank's schedule keeps are the replay's alone: more corrections
            self.rounds = PIPELINE_ROUNDS

    def fitting(self, regions) -> None:
        """The fit's best plan so far (planner/solve/fit.py NOTE [ the best so far ]): compile
        mode starts its check."""
        if self.compiled is not None:
            self.compiled.speculate(regions)

    def __call__(self, regions) -> int:
        key = tuple(regions)
        if key not in self.peaks:
            t0 = time.perf_counter()
            self.peaks[key] = self._replay(key)
            self.seconds += time.perf_counter() - t0
        return self.peaks[key]

    def replayed(self, regions, stand_in) -> int:
        """`regions` replayed with `stand_in` for the compiled step, timed (not kept in `peaks`)."""
        t0 = time.perf_counter()
        try:
            return self._replay(tuple(regions), stand_in)
        finally:
            self.seconds += time.perf_counter() - t0

    def _replay(self, regions, stand_in=None) -> int:
        """The replayed peak of forward and backward (the optimizer's state, live throughout, added),
        or the optimizer's step when that is higher (the same under every plan)."""
        a, facts = self.analysis, self.facts
        stand_in = stand_in or self.stand_in
        with training_modes(self.model):             # the step planned is a training step (planner.step.state)
            if stand_in is not None:                # compile mode: the compiled step's stand-in (runtime.rewrite.compiled)
                gm, opaque = stand_in(regions), ()
            else:
                gm, opaque = rewrite(self.model, a.traced.gm, regions, self.names, facts, self.opaque), self.opaque
            if self.pipeline is not None:
                return self._rank(gm)
            replayed = dry_run_peak(gm, a.example_inputs, self.loss_fn, opaque, a.opaque_examples,
                                    keep_output=facts.keep_output, grads=facts.accumulates, memo=self.opaque_costs)
        # held throughout: the optimizer's state, the math libraries' workspaces (planner/step/workspace.py)
        return max(replayed + facts.held_throughout_bytes, base_liveness(a.cost_graph).opt)

    def _rank(self, gm) -> int:
        """A pipeline rank's whole schedule.step replayed (runtime/distributed/pipeline.py), the
        optimizer's state added; its step, when planned, on what the schedule leaves live."""
        a, facts = self.analysis, self.facts
        peak, end = rank_peak(gm, a.example_inputs, self.loss_fn, self.pipeline, self.opaque, a.opaque_examples)
        cg = a.cost_graph
        step = cg.optimizer_step_bytes
        return max(peak, end if step is None else end + step) + facts.held_throughout_bytes
