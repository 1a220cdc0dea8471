import copy
import functools
import os
import random
import tempfile
from unittest import mock

import pytest
import torch
from torch.utils._pytree import tree_leaves

from remat.planner import InfeasibleBudgetError, PlanOptions, SolveOptions, analyze, solve_plan
from remat.planner.solve import ilp_peak_bytes
from remat.runtime import examples, plan_and_wrap
from remat.runtime.measure import peak_memory, preserved

# One torch thread per xdist worker: two workers on two cores, not four threads fighting over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# Tests plan anew unless they test the plan cache (tests/test_plan_cache.py turns it on); nothing
# is written to the user's cache directory.
os.environ["REMAT_CACHE"] = "0"
os.environ["REMAT_CACHE_DIR"] = tempfile.mkdtemp(prefix="remat-test-cache-")
# kept_plans()' directory: one for the session, shared by the xdist workers (they inherit the
# controller's environment, set when it loads this file)
os.environ.setdefault("REMAT_TEST_KEPT_PLANS", tempfile.mkdtemp(prefix="remat-test-kept-plans-"))
# Solved ILPs are kept on disk for the session's workers and the CLI's subprocesses (planner/cbc.py,
# NOTE [ solved once ]): an ILP one test solved is not solved again by another, and the plan is the
# same (node-limited solves are a function of their input; results cut off by time are not kept).
os.environ["REMAT_SOLVE_CACHE"] = "1"
os.environ.setdefault("REMAT_SOLVE_CACHE_DIR", tempfile.mkdtemp(prefix="remat-test-solves-"))


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


_CASES: dict[tuple, Case] = {}


@pytest.fixture(scope="session")
def case():
    """name (and the factory's keyword arguments, for a variant) -> its Case, made once a session."""
    def get(name: str, **kwargs) -> Case:
        key = (name, tuple(sorted(kwargs.items())))
        if key not in _CASES:
            _CASES[key] = Case(name, **kwargs)
        return _CASES[key]
    return get


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
        return int(fixed + fraction * (self.unplanned.remat.plan.unplanned_peak_bytes - fixed))

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


_ZOO: dict[str, Planned] = {}


@pytest.fixture(scope="session")
def zoo_case():
    """benchmarks/zoo_models.py models, each planned once per budget for the whole session (test_zoo, test_accuracy)."""
    from benchmarks.zoo_models import ZOO

    def get(name: str) -> Planned:
        if name not in _ZOO:
            _ZOO[name] = Planned(name, ZOO[name]())
        return _ZOO[name]
    return get


_BUILTIN: dict[str, Planned] = {}


@pytest.fixture(scope="session")
def builtin(case):
    """runtime.examples models (the `case` fixture's, the default sizes), each planned once per budget
    for the whole session (test_wrap, test_accuracy)."""
    def get(name: str) -> Planned:
        if name not in _BUILTIN:
            _BUILTIN[name] = Planned(name, case(name).example)
        return _BUILTIN[name]
    return get


# Module-scoped fixtures that run many subprocesses or a whole job for their module's tests: each
# xdist worker that runs one of those tests runs the fixture again, so their tests go to one worker
# (with --dist loadgroup). In CI at 5101df5 both workers ran each of them: 30-110 s each time.
ONE_WORKER = frozenset({"bad_runs", "slow_runs", "quick_runs", "two_ranks", "dist"})


@pytest.hookimpl(wrapper=True)     # around xdist's worker, which appends each group to its node id
def pytest_collection_modifyitems(config, items):
    _mark(items)
    yield
    _check_groups(config, items)


def _mark(items):
    """The Hugging Face lane: every test on an hf-* zoo model is marked `hf` (pytest -m "not hf").
    Tests that take a session-planned model (`zoo_case`, `builtin`) by its name are grouped by it:
    with `-n 2 --dist loadgroup` one worker plans each such model once for all of them (test_zoo,
    test_accuracy and test_wrap share its plans at 50% and at the floor), where two would each plan it."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if any(isinstance(v, str) and v.startswith("hf-") for v in params.values()):
            item.add_marker(pytest.mark.hf)
        fixtures = getattr(item, "fixturenames", ())
        if isinstance(params.get("name"), str) and ("zoo_case" in fixtures or "builtin" in fixtures):
            item.add_marker(pytest.mark.xdist_group(("zoo-" if "zoo_case" in fixtures else "builtin-") + params["name"]))
        elif shared := [f for f in fixtures if f in ONE_WORKER]:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}-{shared[0]}"))


def _check_groups(config, items):
    """With --dist loadgroup, a grouped test's node id must end in its group, or the groups are
    ignored and each worker runs every shared fixture (pytest 9.2 with xdist 3.8: pyproject's pin)."""
    if not getattr(config.option, "loadgroup", False):
        return
    lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
    if lost:
        raise pytest.UsageError(f"--dist loadgroup lost the xdist groups of {len(lost)} tests (e.g. {lost[0]}): "
                                f"pytest {pytest.__version__} with this pytest-xdist; install pytest<9.2")
