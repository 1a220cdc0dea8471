"""Trust: what remat promises is what a real training step measures.

Accuracy contract: for every built-in (runtime.examples) and zoo (benchmarks/zoo_models.py) model, at every
budget the tests plan at, and unplanned,
    measured peak <= predicted peak <= 1.05 * measured peak,
predicted = the plan's `predicted_peak_bytes`, measured = runtime.measure.peak_memory of one real
training step of the wrapped model (helpers.measured_peak, as benchmarks/zoo.py measures).
Budgets: unplanned (a budget above the unplanned peak), 50% (built-ins: halfway from the smallest
feasible to the unplanned peak, as tests/test_wrap.py, which checks the same at 30% and 70%; the
zoo: fixed bytes plus 50% of the activations, as tests/test_zoo.py) and the smallest feasible
budget remat reports there.

Floor contract: the smallest feasible budget remat reports (plan.min_feasible_bytes, or the
InfeasibleBudgetError's) is never above the measured peak of a baseline the user could apply
instead: every block checkpointed (planner.solve.baselines.every_block, through the same rewriter), and
for Hugging Face models their own `gradient_checkpointing_enable()` (per-block checkpointing).
"""
import copy
import importlib.util
import warnings

import pytest
import torch

from remat.planner.solve.baselines import every_block
from remat.runtime.examples import EXAMPLES
from remat.runtime.rewrite import rewrite
from benchmarks.zoo_models import ZOO

from helpers import UNPLANNED, Planned, measured_peak

pytestmark = pytest.mark.slow

HAS_HF = importlib.util.find_spec("transformers") is not None
HF = [n for n in ZOO if n.startswith("hf-")]
# zoo models with a graph and repeated blocks (lstm-lm, dyn-loop: no blocks; early-exit: no graph)
WITH_BLOCKS = [n for n in ZOO if n not in ("lstm-lm", "dyn-loop", "early-exit")]
TOLERANCE = 1.05

def _needs(name: str):
    if name.startswith("hf-") and not HAS_HF:
        pytest.skip("transformers is not installed (pip install -e '.[hf]')")


def _mb(n: int) -> str:
    return f"{n / 1e6:.3f} MB"


def _check(c: Planned, budgets: dict[str, tuple]) -> None:
    """Plan at each budget (label -> (how: Planned.fitted or .installed, bytes); where none fits, at
    the floor the error names), measure, assert the accuracy contract at all of them at once: the
    failure lists every budget's numbers."""
    rows, bad = [], []
    for label, (how, budget) in budgets.items():
        wrapped, planned_at = how(budget)
        predicted = wrapped.remat.plan.predicted_peak_bytes
        measured = measured_peak(wrapped, c.example)
        ok = measured <= predicted <= TOLERANCE * measured
        at = "" if planned_at == budget else f", planned at the smallest feasible {_mb(planned_at)}"
        rows.append(f"  {label} ({_mb(budget)}{at}): predicted {_mb(predicted)}, measured {_mb(measured)}, "
                    f"predicted - measured {predicted - measured:+d} B ({predicted / measured - 1:+.2%})"
                    + ("" if ok else "  <-- VIOLATED"))
        bad += [] if ok else [label]
    print(f"{c.name}:\n" + "\n".join(rows))     # pytest -rP shows every model's numbers
    assert not bad, (f"{c.name}: accuracy contract (measured <= predicted <= {TOLERANCE} x measured) violated at "
                     f"{', '.join(bad)}:\n" + "\n".join(rows))


def _same_plan(c: Planned, budget: int) -> None:
    """plan_and_wrap and helpers.OneAnalysis make the same plan (NOTE [ one analysis, several
    budgets ]): the other budgets are planned the second way."""
    if c.once is None:
        return
    mine, theirs = c.once.plan(budget), c.at(budget)
    if isinstance(theirs, Exception):
        assert isinstance(mine, Exception) and mine.min_feasible_bytes == theirs.min_feasible_bytes, (mine, theirs)
        return
    theirs = theirs.remat.plan
    assert not isinstance(mine, Exception), mine
    assert (mine.regions, mine.predicted_peak_bytes) == (theirs.regions, theirs.predicted_peak_bytes), \
        f"{c.name}: plan_and_wrap planned {theirs.summary()}\nhelpers.OneAnalysis planned {mine.summary()}"


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builtin_predicted_peak_is_the_measured_peak(case, builtin, name):
    c, b = case(name), builtin(name)
    half = b.at(c.budget(0.5))
    assert not isinstance(half, Exception), half
    _same_plan(b, c.budget(0.5))
    _check(b, {"unplanned": (b.installed, UNPLANNED), "50%": (b.fitted, c.budget(0.5)),
               "smallest feasible": (b.installed, b.floor_once())})


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_predicted_peak_is_the_measured_peak(zoo_case, name):
    _needs(name)
    c = zoo_case(name)
    half = c.activation_budget(0.5)
    _same_plan(c, half)
    _check(c, {"unplanned": (c.installed, UNPLANNED), "50% act.": (c.fitted, half),
               "smallest feasible": (c.installed, c.floor_once(half))})


class _Graph(torch.nn.Module):
    """A rewritten graph, called like the model it was captured from."""

    def __init__(self, model, gm, traced):
        super().__init__()
        self.gm, self.traced, self.model = gm, traced, model

    def forward(self, *args, **kwargs):
        return self.gm(**self.traced.inputs(self.model, args, kwargs))


def every_block_peak(c: Planned) -> int:
    """Measured peak of the model with every block checkpointed: the every_block baseline, rewritten
    on the model's one analysis (helpers.OneAnalysis)."""
    a, model = c.once.analysis, c.once.model
    regions = every_block(a.cost_graph)
    assert regions, "the model has repeated blocks"
    gm = rewrite(model, a.traced.gm, regions, tuple(n.name for n in a.cost_graph.nodes))
    return measured_peak(_Graph(model, gm, a.traced), c.example)


def hf_per_block_peak(model, example) -> int:
    """Measured peak of a Hugging Face model with its own per-block checkpointing turned on."""
    with warnings.catch_warnings():   # transformers 5: a deprecated alias of activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return measured_peak(model, example)


def _check_floor(name: str, floor: int, baselines: dict[str, int]) -> None:
    above = {k: v for k, v in baselines.items() if floor > v}
    print(f"{name}: floor {_mb(floor)}; " + "; ".join(f"{k} {_mb(v)}" for k, v in baselines.items()))
    assert not above, (f"{name}: remat's smallest feasible budget {_mb(floor)} is above what the user gets instead: "
                       + "; ".join(f"{k} measures {_mb(v)} ({floor - v:+d} B, {floor / v - 1:+.2%})"
                                   for k, v in above.items()))


@pytest.mark.parametrize("name", WITH_BLOCKS)
def test_zoo_floor_is_not_above_checkpointing_every_block(zoo_case, name):
    _needs(name)
    c = zoo_case(name)
    baselines = {"every block checkpointed": every_block_peak(c)}
    if name in HF:
        baselines["HF gradient_checkpointing_enable()"] = hf_per_block_peak(copy.deepcopy(c.pristine), c.example)
    _check_floor(name, c.floor_once(c.activation_budget(0.5)), baselines)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builtin_floor_is_not_above_checkpointing_every_block(builtin, name):
    b = builtin(name)
    _check_floor(name, b.floor_once(), {"every block checkpointed": every_block_peak(b)})
