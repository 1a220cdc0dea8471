import copy

import pytest
import torch

from planner import PlanOptions, SolveOptions, analyze, solve_plan
from runtime import examples

# Small solver limits keep the suite fast; planning quality is the benchmark's business.
FAST = PlanOptions(solve=SolveOptions(time_limit_s=4.0))


class Case:
    """One example model, analysed once: its unplanned and smallest feasible peaks."""

    def __init__(self, name: str):
        self.name = name
        self.example = examples.EXAMPLES[name]()
        self.analysis = analyze(self.example.model, self.example.inputs, None, self.example.loss_fn)
        cg = self.analysis.cost_graph
        self.unplanned = solve_plan(cg, 10**15, FAST).predicted_peak_bytes
        self.min_feasible = solve_plan(cg, self.unplanned - 1, FAST).min_feasible_bytes

    def budget(self, fraction: float) -> int:
        return int(self.min_feasible + fraction * (self.unplanned - self.min_feasible))

    def fresh(self):
        """Two identical copies of the model: a reference and one to wrap."""
        return copy.deepcopy(self.example.model), copy.deepcopy(self.example.model)


_CASES: dict[str, Case] = {}


@pytest.fixture(scope="session")
def case():
    def get(name: str) -> Case:
        if name not in _CASES:
            _CASES[name] = Case(name)
        return _CASES[name]
    return get


def train_step(model, example, seed=1):
    torch.manual_seed(seed)
    out = model(*example.inputs)
    loss = example.loss_fn(out)
    loss.backward()
    return out.detach(), loss.detach()
