import copy
import random

import pulp

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


def ilp_peaks_of_random_plans(cg, cands, seed: int, p: float, rounds: int):
    """(regions, the least budget the ILP admits for them, in bytes) for random disjoint plans."""
    from planner.solve import _model
    rng = random.Random(seed)
    for _ in range(rounds):
        chosen, taken = [], set()
        for j in rng.sample(range(len(cands)), len(cands)):
            span = set(range(cands[j].region.start, cands[j].region.end + 1))
            if taken.isdisjoint(span) and rng.random() < p:
                chosen.append(j)
                taken |= span
        prob, x, B, _, _ = _model(cg, cands, None)
        prob += B
        for j, v in enumerate(x):
            prob += v == int(j in chosen)
        prob.solve(pulp.PULP_CBC_CMD(msg=False))
        yield tuple(sorted((cands[j].region for j in chosen), key=lambda r: r.start)), pulp.value(B) * 1e6
