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

from remat.planner import analyze
from remat.planner.solve.baselines import every_block
from remat.planner.result import Plan
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


def _check(c: Planned, budgets: dict[str, int]) -> None:
    """Plan at each budget (where none fits, at the floor the error names), measure, assert the
    accuracy contract at all of them at once: the failure lists every budget's numbers."""
    rows, bad = [], []
    for label, budget in budgets.items():
        wrapped, planned_at = c.fitted(budget)
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


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builtin_predicted_peak_is_the_measured_peak(case, builtin, name):
    c, b = case(name), builtin(name)
    half = b.at(c.budget(0.5))
    assert not isinstance(half, Exception), half
    _check(b, {"unplanned": UNPLANNED, "50%": c.budget(0.5), "smallest feasible": b.refused_floor()})


@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_predicted_peak_is_the_measured_peak(zoo_case, name):
    _needs(name)
    c = zoo_case(name)
    _check(c, {"unplanned": UNPLANNED, "50% act.": c.activation_budget(0.5), "smallest feasible": c.floor(0.5)})


class _Graph(torch.nn.Module):
    """A rewritten graph, called like the model it was captured from."""

    def __init__(self, model, gm, traced):
        super().__init__()
        self.gm, self.traced, self.model = gm, traced, model

    def forward(self, *args, **kwargs):
        return self.gm(**self.traced.inputs(self.model, args, kwargs))


def every_block_peak(model, example) -> int:
    """Measured peak of `model` with every block checkpointed: the every_block baseline, rewritten."""
    a = analyze(model, example.inputs, example.kwargs, example.loss_fn)
    regions = every_block(a.cost_graph)
    assert regions, "the model has repeated blocks"
    gm = rewrite(model, a.traced.gm, regions, tuple(c.name for c in a.cost_graph.nodes))
    return measured_peak(_Graph(model, gm, a.traced), example)


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
    baselines = {"every block checkpointed": every_block_peak(copy.deepcopy(c.pristine), c.example)}
    if name in HF:
        baselines["HF gradient_checkpointing_enable()"] = hf_per_block_peak(copy.deepcopy(c.pristine), c.example)
    _check_floor(name, c.floor(0.5), baselines)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builtin_floor_is_not_above_checkpointing_every_block(case, builtin, name):
    c, b = case(name), builtin(name)
    floor = b.refused_floor()
    _check_floor(name, floor, {"every block checkpointed": every_block_peak(copy.deepcopy(b.pristine), b.example)})
