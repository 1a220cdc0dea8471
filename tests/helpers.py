"""What tests share that is not a fixture: solver limits (FAST), the plan cache kept for a session
(kept_plans), an example model analysed once (Case), real training steps and their measures, and
a model planned once per budget (Planned). The fixtures that hand these out, the environment a
test session runs in and its collection hooks are in conftest.py."""
import copy
import functools
import os
import random
from unittest import mock

import torch

from remat.planner import InfeasibleBudgetError, PlanOptions, SolveOptions, TraceError, analyze, solve_plan
from remat.planner.api import analyze_for
from remat.planner.compat import tree_leaves
from remat.planner.solve.ilp import ilp_peak_bytes
from remat.runtime import apply, examples, plan_and_wrap
from remat.runtime.api import ExactReplay
from remat.runtime.rewrite import REGION_PROBE
from remat.runtime.measure import peak_memory, preserved


def kept_plans():
    """plan_and_wrap with the plan cache on (runtime/plan_cache.py), in a directory the session's
    workers share: for tests whose subject is what a wrapped model does (autocast, no_grad, state
    dicts, tied weights, a new shape), not how its plan was found, a plan another test made for the
    same model, inputs, budget and options is taken from disk, as a user's second run takes it.
    Plans made inside the test body (a re-plan for autocast or a new shape) are made anew."""
    return mock.patch.dict(os.environ, REMAT_CACHE="1", REMAT_CACHE_DIR=os.environ["REMAT_TEST_KEPT_PLANS"])

# Small solver limits keep the suite fast; planning quality is the benchmark's business.
FAST = PlanOptions(solve=SolveOptions(time_limit_s=4.0))


class Case:
    """One example model, analysed once: its unplanned and smallest feasible peaks (each solved
    when first asked for: tests that only need the analysis never pay for the solves)."""

    def __init__(self, name: str, **kwargs):
        self.name = name
        self.example = examples.EXAMPLES[name](**kwargs)
        self.analysis = analyze(self.example.model, self.example.inputs, None, self.example.loss_fn)

    @functools.cached_property
    def unplanned(self) -> int:
        return solve_plan(self.analysis.cost_graph, 10**15, FAST).predicted_peak_bytes

    @functools.cached_property
    def min_feasible(self) -> int:
        """The floor a refusal names: the least-peak search alone (a plan just under the unplanned
        peak would search it too, after an ILP solve of its own: 14.5 CPU s against 8.4 on gpt2)."""
        try:
            solve_plan(self.analysis.cost_graph, 1, FAST)
        except InfeasibleBudgetError as e:
            return e.min_feasible_bytes
        raise AssertionError(f"{self.name}: a budget of one byte was met")

    def budget(self, fraction: float) -> int:
        return int(self.min_feasible + fraction * (self.unplanned - self.min_feasible))

    def fresh(self):
        """Two identical copies of the model: a reference and one to wrap."""
        return copy.deepcopy(self.example.model), copy.deepcopy(self.example.model)


def train_step(model, example, seed=1, keep_output=True):
    """One training step; (output, loss). Without `keep_output` it is the step remat plans,
    `loss_fn(model(x)).backward()` (the output released before backward), and returns (None, loss):
    measure that one."""
    torch.manual_seed(seed)
    if not keep_output:
        loss = example.loss_fn(model(*example.inputs))
        loss.backward()
        return None, loss.detach()
    out = model(*example.inputs)
    loss = example.loss_fn(out)
    loss.backward()
    return out.detach(), loss.detach()


def ilp_peaks_of_random_plans(cg, cands, seed: int, p: float, rounds: int):
    """(regions, the least budget the ILP admits for them, in bytes) for random disjoint plans."""
    rng = random.Random(seed)
    for _ in range(rounds):
        chosen, taken = [], set()
        for j in rng.sample(range(len(cands)), len(cands)):
            span = set(range(cands[j].region.start, cands[j].region.end + 1))
            if taken.isdisjoint(span) and rng.random() < p:
                chosen.append(j)
                taken |= span
        regions = tuple(sorted((cands[j].region for j in chosen), key=lambda r: r.start))
        yield regions, ilp_peak_bytes(cg, cands, regions)


# ------------------------------------------------------------------ planned models, real steps
def step(model, example, seed=1):
    """One training step of `model` called like `example.model` (positional and keyword inputs):
    the output's tensors and the loss, detached, and the RNG state after it."""
    torch.manual_seed(seed)
    out = model(*example.inputs, **(example.kwargs or {}))
    loss = example.loss_fn(out)
    loss.backward()
    return [t.detach() for t in tree_leaves(out) if isinstance(t, torch.Tensor)] + [loss.detach()], torch.get_rng_state()


def planned_step(model, example, seed=1) -> None:
    """The step remat plans, `loss_fn(model(...)).backward()`: the output released once the loss
    is computed (PlanOptions.keep_output is off). Measure this one."""
    torch.manual_seed(seed)
    example.loss_fn(model(*example.inputs, **(example.kwargs or {}))).backward()


def max_diff(a: list, b: list) -> float:
    return max((float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True)),
               default=0.0)


def measured_peak(model, example) -> int:
    """Peak live bytes of one real training step of `model` (runtime.measure.peak_memory: its
    parameters, buffers, grads and the inputs count), the second of two (the first warms up), from
    no grads. Grads, buffers and the RNG are left as they were."""
    with preserved(model):
        for p in model.parameters():
            p.grad = None
        planned_step(model, example)
        for p in model.parameters():
            p.grad = None
        return peak_memory(lambda: planned_step(model, example), model, example.inputs, example.kwargs or {})


def _storage_bytes(ts) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())


def fixed_bytes(model, example) -> int:
    """Parameters, their grads, buffers and inputs: what no plan can drop."""
    params = list(model.parameters())
    inputs = [t for t in tree_leaves((example.inputs, example.kwargs or {})) if isinstance(t, torch.Tensor)]
    return (_storage_bytes(params) + _storage_bytes([p for p in params if p.requires_grad])
            + _storage_bytes(list(model.buffers())) + _storage_bytes(inputs))


UNPLANNED = 10**15      # a budget (bytes) above every model's unplanned peak: 1e6 GB


class Planned:
    """One example model wrapped by plan_and_wrap at the budgets asked for, each from an untouched
    copy, cached for the session (planning is what costs): the wrapped model, or the
    InfeasibleBudgetError. Steps run on them must leave them as they were (measured_peak does)."""

    def __init__(self, name: str, example):
        self.name, self.example = name, example
        self.pristine = copy.deepcopy(example.model)     # never stepped: references and baselines copy it
        self._at: dict[int, object] = {}

    def at(self, budget_bytes: int):
        if budget_bytes not in self._at:
            ex = self.example
            try:
                self._at[budget_bytes] = plan_and_wrap(copy.deepcopy(self.pristine), budget_bytes / 1e9,
                                                       example_inputs=ex.inputs, example_kwargs=ex.kwargs,
                                                       loss_fn=ex.loss_fn, options=FAST)
            except InfeasibleBudgetError as e:
                self._at[budget_bytes] = e
        return self._at[budget_bytes]

    def fitted(self, budget_bytes: int):
        """(wrapped, the budget it was planned at): `budget_bytes`, or where no plan fits it, the
        smallest feasible budget the error names."""
        w = self.at(budget_bytes)
        if isinstance(w, InfeasibleBudgetError):
            budget_bytes = w.min_feasible_bytes
            w = self.at(budget_bytes)
        if isinstance(w, InfeasibleBudgetError):
            raise AssertionError(f"{self.name}: the smallest feasible budget {budget_bytes} B that remat reported"
                                 f" is infeasible too (it now says {w.min_feasible_bytes} B)")
        return w, budget_bytes

    @property
    def unplanned(self):
        return self.at(UNPLANNED)

    def activation_budget(self, fraction: float) -> int:
        """Parameters, grads, buffers and inputs plus `fraction` of the activation memory (the
        unplanned peak beyond them), as benchmarks/zoo.py plans the zoo."""
        fixed = fixed_bytes(self.pristine, self.example)
        unplanned = self.unplanned.remat.plan if self.once is None else self.once.plan(UNPLANNED)
        return int(fixed + fraction * (unplanned.unplanned_peak_bytes - fixed))

    def floor(self, fraction: float = 0.5) -> int:
        """The smallest feasible budget remat reports, planning at `activation_budget(fraction)`:
        the InfeasibleBudgetError's; where that budget fits (plan_and_wrap then searches no floor:
        fit.py NOTE [ floor if needed ]), the refusal of a budget of one byte names it."""
        w = self.at(self.activation_budget(fraction))
        return w.min_feasible_bytes if isinstance(w, InfeasibleBudgetError) else self.refused_floor()

    def refused_floor(self) -> int:
        """The smallest feasible budget named by the refusal of a budget of one byte."""
        w = self.at(1)
        assert isinstance(w, InfeasibleBudgetError), f"{self.name}: a budget of one byte was met"
        return w.min_feasible_bytes

    @functools.cached_property
    def once(self) -> "OneAnalysis | None":
        """The model analysed once for every budget (NOTE [ one analysis, several budgets ]); None
        when it has no graph (plan_and_wrap plans it over its module tree: `at` serves it)."""
        try:
            return OneAnalysis(copy.deepcopy(self.pristine), self.example)
        except TraceError:
            return None

    def installed(self, budget_bytes: int):
        """(wrapped, the budget it was planned at), as `fitted`, the plan made by `once` and installed
        by remat.apply into an untouched copy; `fitted`'s own where the model has no graph."""
        if self.once is None:
            return self.fitted(budget_bytes)
        plan = self.once.plan(budget_bytes)
        if isinstance(plan, InfeasibleBudgetError):
            budget_bytes = plan.min_feasible_bytes
            plan = self.once.plan(budget_bytes)
        assert not isinstance(plan, InfeasibleBudgetError), \
            f"{self.name}: the smallest feasible budget {budget_bytes} B is infeasible too ({plan})"
        ex = self.example
        return apply(copy.deepcopy(self.pristine), plan, example_inputs=ex.inputs, example_kwargs=ex.kwargs,
                     loss_fn=ex.loss_fn, options=FAST), budget_bytes

    def floor_once(self, budget_bytes: int = 1) -> int:
        """The smallest feasible budget remat reports planning at `budget_bytes` (`floor`'s, by
        `once`'s plans): the refusal's; where that budget fits, the refusal of one byte's."""
        plan = self.at if self.once is None else self.once.plan
        w = plan(budget_bytes)
        if not isinstance(w, InfeasibleBudgetError):
            w = plan(1)
        assert isinstance(w, InfeasibleBudgetError), f"{self.name}: a budget of one byte was met"
        return w.min_feasible_bytes


# NOTE [ one analysis, several budgets ]
# plan_and_wrap captures and profiles the model at each call and replays the plans it tries in an
# ExactReplay of its own: test_accuracy planned each model so at the unplanned budget, 50%, one
# byte (the floor's search) and the floor, four captures, the floor's plans replayed twice (a
# zoo case 15-32 s of a CI run). `OneAnalysis` analyses the model once as plan_and_wrap does
# (analyze_for, the region probe) and solves each budget as runtime/planning.py's `_solved` does
# (solve_plan with the exact replay, floor_if_needed), one ExactReplay for every budget: a plan's
# replayed peak is a function of the analysis and its regions. Each plan is installed by
# remat.apply into an untouched copy (a capture; no profile, no solve): the step measured is the
# wrapped model's, as a user runs it. test_accuracy checks that this path and plan_and_wrap make
# the same plan at 50%, so the two cannot drift apart unseen.
class OneAnalysis:
    """A model analysed once; its plans by budget (bytes), or the InfeasibleBudgetError."""

    def __init__(self, model, example):
        self.model = model          # analysed and replayed; never wrapped
        self.analysis = analyze_for(model, tuple(example.inputs), dict(example.kwargs or {}), example.loss_fn,
                                    FAST, None, REGION_PROBE)
        self.replay = ExactReplay(model, self.analysis, example.loss_fn)
        self._plans: dict[int, object] = {}

    def plan(self, budget_bytes: int):
        if budget_bytes not in self._plans:
            a = self.analysis
            try:
                self._plans[budget_bytes] = solve_plan(a.cost_graph, budget_bytes, FAST, a.traced.opaque,
                                                       measure=self.replay, floor_if_needed=True)
            except InfeasibleBudgetError as e:
                self._plans[budget_bytes] = e
        return self._plans[budget_bytes]


def ctc_loss(out):
    """A loss fake tensors cannot run (ctc_loss has no fake kernel) for an output of (8, 100, 20):
    the profile measures it for real."""
    targets = torch.randint(1, 20, (8, 30), generator=torch.Generator().manual_seed(1))
    return torch.nn.functional.ctc_loss(out.log_softmax(-1).transpose(0, 1), targets, torch.full((8,), 100),
                                        torch.full((8,), 20))
