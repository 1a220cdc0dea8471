"""The runtime's seams (issue 43, items 2 and 3): the step's facts read typed, in one place; the
budget resolved once; assert_fits without the CLI."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from remat.planner.budget import Budget
from remat.planner.errors import InfeasibleBudgetError
from remat.planner.facts import StepFacts
from remat.planner.result import Plan
from remat.runtime.budget import StepBudget

ROOT = Path(__file__).resolve().parents[1]
LOOKUP = re.compile(r"\bmeta\s*(\[\s*['\"]|\.get\(\s*['\"])")


def test_assert_fits_does_not_import_the_cli():
    code = ("import sys, remat.runtime.testing; "
            "print(sorted(m for m in sys.modules if m.startswith('remat.runtime.cli')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("where", ["runtime", "planner/result.py", "planner/solve/fit.py", "planner/distributed.py"])
def test_no_meta_string_lookups_outside_the_facts(where):
    files = sorted((ROOT / where).rglob("*.py")) if (ROOT / where).is_dir() else [ROOT / where]
    found = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in files
             for i, line in enumerate(f.read_text().splitlines(), 1)
             if LOOKUP.search(line.replace("node.meta", "").replace("n.meta", ""))]
    assert not found, "read StepFacts (Plan.facts) instead:\n" + "\n".join(found)


def test_facts_of_a_meta_dict():
    f = StepFacts.of({"mutated_buffers": ["bn.running_mean"], "deterministic_ops": ["my::op"],
                      "accumulation_steps": 4, "optimizer_state_bytes": 10, "workspace_bytes": 5,
                      "trace_attempts": [["fx", "data-dependent branch"]], "units": ["a", ""], "other": 1})
    assert f.mutated_buffers == frozenset({"bn.running_mean"}) and f.deterministic_ops == frozenset({"my::op"})
    assert f.accumulates and f.held_throughout_bytes == 15
    assert f.trace_attempts == (("fx", "data-dependent branch"),) and f.units == ("a", "")
    empty = StepFacts.of({})
    assert empty.mutated_buffers is None and empty.extra_kwargs == {} and not empty.accumulates
    assert StepFacts.of(f) is f


def test_noting_a_fact_keeps_the_json_and_refuses_a_misspelt_one():
    p = Plan((), 100, 50, 60, None, 0, 0, 0.0, 0.0, "none", "fits", 0.0, 0.0, meta={"trace_path": "torch.export"})
    timed = p.noting(timing={"text": "t"})
    assert timed.meta == {"trace_path": "torch.export", "timing": {"text": "t"}}
    assert Plan.from_json(timed.to_json()).facts.timing == {"text": "t"} and timed.facts.trace_path == "torch.export"
    assert "timed: t" in timed.summary()
    with pytest.raises(TypeError, match="not a step fact: timings"):
        p.noting(timings={})


def test_a_percent_budget_resolves_once():
    b = StepBudget.of("50%")
    assert b.budget == Budget("fraction", 0.5) and b.bytes is None
    assert b.resolve(1000) == 500 and b.resolve(4000) == 500
    assert b.budget == Budget("bytes", 500.0, None)
    gb = StepBudget.of(2)
    assert gb.resolve() == 2_000_000_000 and gb.budget == Budget("bytes", 2e9, "GB")


def test_an_infeasible_budget_is_said_in_the_users_unit_with_its_bytes():
    b = StepBudget.of("1GiB")
    with pytest.raises(InfeasibleBudgetError) as caught:
        with b.errors_spelled():
            raise InfeasibleBudgetError(2**30, 3 * 2**30, "the exact replay on fake tensors")
    e = caught.value
    assert (e.budget_bytes, e.min_feasible_bytes, e.unit) == (2**30, 3 * 2**30, "GiB")
    assert "budget 1.000 GiB" in str(e) and "at least 3.000 GiB" in str(e)
