"""Errors carry the budget both as bytes and as the user wrote it (issue 43, item 2)."""
from __future__ import annotations

import pickle

import pytest
import torch

from remat.planner import InfeasibleBudgetError
from remat.runtime import plan_and_wrap


def test_a_percent_budget_too_small_is_named_as_written_and_in_bytes():
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_and_wrap(m, "1%", example_inputs=(torch.randn(32, 64),))
    e = info.value
    assert str(e).startswith("budget 1% (") and e.asked == "1%" and 0 < e.budget_bytes < e.min_feasible_bytes
    again = pickle.loads(pickle.dumps(e))
    assert str(again) == str(e) and again.asked == "1%"


def test_a_bytes_budget_is_named_in_its_unit_alone():
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_and_wrap(m, 1e-6, example_inputs=(torch.randn(32, 64),))
    assert str(info.value).startswith("budget 0.000001000 GB is below") and info.value.asked == ""
