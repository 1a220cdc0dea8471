"""Quiet (issue 41, item 2): remat's own calls into PuLP raise none of PuLP's warnings where a
user's pytest shows them (planner/solve/cbc.py, NOTE [ PuLP's deprecation warnings ]). Every test
records with every warning shown, as pytest does; before, each PuLP variable remat made warned."""
import warnings
from pathlib import Path

import pulp
import pytest
import torch
import torch.nn as nn

import remat
from remat.planner.solve import cbc
from remat.planner.profile.modules import ModuleProfile, Unit, solve_units
from remat.runtime import plan_and_wrap
from remat.runtime.examples import EXAMPLES

ROOT = Path(remat.__file__).resolve().parent


def third_party(records) -> list[str]:
    """The recorded warnings not raised from remat's own files (PuLP's, torch's, the standard
    library's), as 'file:line: message'."""
    def own(filename: str) -> bool:
        path = Path(filename).resolve()
        return path.is_relative_to(ROOT) and "site-packages" not in path.parts
    return [f"{w.filename}:{w.lineno}: {w.message}" for w in records if not own(w.filename)]


class recorded(warnings.catch_warnings):
    """Every warning raised in the block recorded, none filtered (as pytest shows them)."""

    def __init__(self):
        super().__init__(record=True)

    def __enter__(self):
        records = super().__enter__()
        warnings.simplefilter("always")
        return records


def _profile() -> ModuleProfile:
    return ModuleProfile((Unit("a", 1, 400, 0, 50, 0.01), Unit("b", 1, 300, 10, 20, 0.02),
                          Unit("c", 1, 200, 0, 10, 0.005)), peak_bytes=1000, forward_s=0.1)


def test_the_module_tree_ilp_warns_nothing():
    with recorded() as w:
        assert solve_units(_profile(), 700) == (0,)
    assert not w, [str(x.message) for x in w]


def test_the_cbc_helpers_warn_nothing_and_keep_the_problems_apart():
    """`cbc_command`, `variable`, `constraints_of` and `problem_key` (which reads the constraints):
    none warns; the key still tells problems apart by each constraint and their order."""
    def problem(constant: float, swap: bool = False):
        prob = pulp.LpProblem("p", pulp.LpMinimize)
        x, y = cbc.variable(prob, "x", 0, 1, pulp.LpBinary), cbc.variable(prob, "y", low=0)
        prob += x + 2 * y
        rows = [x + y >= constant, x - y <= 1]
        for row in rows[::-1] if swap else rows:
            prob += row
        return prob
    with recorded() as w:
        solver = cbc.cbc_command(timeLimit=5)
        keys = [cbc.problem_key(problem(c, s), solver) for c, s in ((1, False), (1, False), (2, False), (1, True))]
        names = [name for name, _ in cbc.constraints_of(problem(1))]
    assert not w, [str(x.message) for x in w]
    assert keys[0] == keys[1] and len(set(keys)) == 3
    assert len(names) == 2


def test_quiet_hides_pulps_deprecations_only_and_only_in_its_block():
    before = list(warnings.filters)
    with recorded() as inside:
        with cbc.quiet():
            pulp.LpVariable("v")                                 # PuLP's own: hidden
            warnings.warn("not PuLP's", DeprecationWarning)      # this file's: shown
    with recorded() as outside:
        pulp.LpVariable("v")                                     # outside the block: shown again
    assert [str(x.message) for x in inside] == ["not PuLP's"]
    deprecates = hasattr(pulp.LpProblem, "add_variable")        # PuLP >= 3.3: LpVariable(...) warns
    assert [x.category for x in outside] == ([DeprecationWarning] if deprecates else [])
    assert warnings.filters == before


class _Round(torch.autograd.Function):
    """Round forward, identity backward: no graph keeps it, so the model plans over its modules."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 2) / 2

    @staticmethod
    def backward(ctx, g):
        return g


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


class RoundedBlocks(nn.Module):
    def __init__(self, d: int = 32, n: int = 4):
        super().__init__()
        self.blocks = nn.ModuleList([_Block(d) for _ in range(n)])

    def forward(self, x):
        for b in self.blocks:
            x = _Round.apply(b(x))
        return x


@pytest.mark.slow
def test_a_module_tree_plan_warns_nothing_from_third_parties():
    """plan_and_wrap through the module tree, its ILP solved: no warning from PuLP, or any module
    not remat's, reaches the user."""
    torch.manual_seed(0)
    with recorded() as w:
        wrapped = plan_and_wrap(RoundedBlocks(), "90%", example_inputs=(torch.randn(16, 32, 32),))
    plan = wrapped.remat.plan
    assert plan.trace_path == "module tree" and plan.solver == "ilp" and plan.regions
    assert not third_party(w), third_party(w)


@pytest.mark.slow
def test_a_graph_plan_warns_nothing_from_pulp():
    ex = EXAMPLES["mlp"]()
    with recorded() as w:
        plan_and_wrap(ex.model, "60%", example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    assert not third_party(w), sorted(set(third_party(w)))[:5]
