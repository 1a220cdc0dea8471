"""The math libraries' workspaces are in the budget (issue 41, item 4): on CUDA a plan counts the
cuBLAS/cuBLASLt workspace a step leaves allocated as live throughout (planner/step/workspace.py); on a
CPU there is none. The accounting is checked here with a stand-in measurement (no GPU in CI):
every peak the plan reports grows by exactly the workspace, and the plan still fits."""
from __future__ import annotations

import torch

import remat.planner.api as planner_api
from remat.planner.step.workspace import workspace_bytes
from remat.runtime import examples, plan_and_wrap

MIB = 1 << 20


def test_a_cpu_step_has_no_library_workspace():
    assert workspace_bytes("cpu", {torch.float32, torch.bfloat16}) == 0
    assert workspace_bytes("meta", {torch.float32}) == 0


def _plan(monkeypatch, workspace: int, budget):
    monkeypatch.setattr(planner_api, "workspace_bytes", lambda device, dtypes: workspace)
    ex = examples.mlp(batch=128, width=128, depth=4)
    return plan_and_wrap(ex.model, budget, example_inputs=ex.inputs, loss_fn=ex.loss_fn,
                         options=planner_api.PlanOptions(cache=False)).remat.plan


def test_the_workspace_is_live_throughout_every_peak_the_plan_reports(monkeypatch):
    plain = _plan(monkeypatch, 0, "75%")
    assert plain.regions and "workspace_bytes" not in plain.meta
    # the same step with a workspace, at a budget larger by it (and the replay's margin on it, <= 2%)
    held = _plan(monkeypatch, 2 * MIB, (plain.budget_bytes + 2.04 * MIB) / 1e9)
    assert held.meta["workspace_bytes"] == 2 * MIB
    assert 2 * MIB <= held.unplanned_peak_bytes - plain.unplanned_peak_bytes <= 2.04 * MIB
    assert held.predicted_peak_bytes <= held.budget_bytes and held.recompute_flops <= plain.recompute_flops
    if held.regions == plain.regions:
        assert 2 * MIB <= held.predicted_peak_bytes - plain.predicted_peak_bytes <= 2.04 * MIB
    # at the plain budget, the workspace leaves less room: more is recomputed, or nothing fits
    try:
        tight = _plan(monkeypatch, 2 * MIB, plain.budget_bytes / 1e9)
    except planner_api.InfeasibleBudgetError as e:
        assert e.min_feasible_bytes > plain.budget_bytes
    else:
        assert tight.predicted_peak_bytes <= plain.budget_bytes and tight.recompute_flops > plain.recompute_flops
