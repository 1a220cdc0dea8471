"""The plan lives in the user's own model: the same object back, its forward signature, instance
attributes and framework hooks kept, `remove` restoring it exactly; one plan serves a run."""
from __future__ import annotations

import copy
import functools
import inspect
import warnings

import pytest
import torch

from remat.planner.errors import InfeasibleBudgetError
from remat.planner.step.storage import LiveBytes
from remat.runtime import plan_and_wrap, remove
from remat.runtime import examples


def _mlp():
    return examples.mlp(batch=256, width=256, depth=6)


def _mean_square(out):
    return out.pow(2).mean()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_the_cards_call_returns_the_users_model():
    ex = _mlp()
    ref = copy.deepcopy(ex.model)
    before = dict(ex.model.__dict__)
    model = plan_and_wrap(ex.model, budget_gb=1.0, example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    assert model is ex.model and type(model) is type(ref)
    assert inspect.signature(model.forward) == inspect.signature(ref.forward)
    assert list(model.state_dict()) == list(ref.state_dict())
    assert set(model.__dict__) - set(before) == {"forward", "remat"}
    assert remove(model) is model and model.__dict__ == before
    with pytest.raises(ValueError, match="no remat plan to remove"):
        remove(model)


def test_a_failed_plan_leaves_the_model_as_it_was():
    ex = _mlp()
    before = dict(ex.model.__dict__)
    with pytest.raises(InfeasibleBudgetError):
        plan_and_wrap(ex.model, budget_gb=1e-6, example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    assert ex.model.__dict__ == before
    plan_and_wrap(ex.model, "85%", example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    planned = ex.model.remat
    with pytest.raises(InfeasibleBudgetError):             # re-planned too tight: the earlier plan stays
        plan_and_wrap(ex.model, budget_gb=1e-6, example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    assert ex.model.remat is planned and ex.model.forward.__self__ is ex.model
    ex.loss_fn(ex.model(*ex.inputs)).backward()
    assert ex.model.remat.plan is planned.plan


def test_a_budget_once_by_either_name():
    ex = _mlp()
    with pytest.raises(ValueError, match="not both"):
        plan_and_wrap(ex.model, budget_gb=1.0, budget=1.0)
    with pytest.raises(ValueError, match="needs a budget"):
        plan_and_wrap(ex.model)
    assert plan_and_wrap(ex.model, budget="1GB", example_inputs=ex.inputs).remat.plan.budget_bytes == 10**9


def test_a_framework_forward_and_hooks_are_kept_and_restored():
    ex = _mlp()
    model = ex.model
    calls = []
    own = model.forward

    @functools.wraps(own)
    def framework_forward(*args, **kwargs):      # as accelerate's hooks set one on the instance
        calls.append("framework")
        return own(*args, **kwargs)
    model.forward = framework_forward
    model.register_forward_hook(lambda m, i, o: calls.append("hook"))
    plan_and_wrap(model, "85%", example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    calls.clear()
    with torch.no_grad():
        model(*ex.inputs)                        # outside training: the framework's forward, then the hook
    assert calls == ["framework", "hook"]
    calls.clear()
    ex.loss_fn(model(*ex.inputs)).backward()     # training: the plan, inside the module's hooks
    assert calls == ["hook"] and model.remat.plan.regions
    model.remat.remove()
    assert model.forward is framework_forward


def test_training_matches_and_the_percent_budget_is_resolved_once():
    ex = _mlp()
    ref = copy.deepcopy(ex.model)
    model = plan_and_wrap(ex.model, "85%", example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    budget = model.remat.plan.budget_bytes
    assert model.remat.budget.kind == "bytes" and model.remat.budget.value == budget
    for m in (ref, model):
        ex.loss_fn(m(*ex.inputs)).backward()
    assert all(torch.equal(a, b) for a, b in zip(_grads(ref), _grads(model)))


def test_smaller_batches_keep_the_plan_made_for_the_largest():
    ex = _mlp()
    model = plan_and_wrap(ex.model, "85%", example_inputs=ex.inputs, loss_fn=_mean_square)
    plan = model.remat.plan
    for n in (200, 131, 256, 17):
        x = ex.inputs[0][:n]
        with LiveBytes(baseline=list(model.parameters()) + [x]) as meter:
            _mean_square(model(x)).backward()
        model.zero_grad(set_to_none=True)
        assert model.remat.plan is plan and meter.peak_bytes <= plan.budget_bytes
    assert model.remat.solves == 1 and len(model.remat.plans) == 4


def test_a_larger_batch_is_checked_and_planned_for_the_same_bytes():
    ex = _mlp()
    model = plan_and_wrap(ex.model, "90%", example_inputs=(ex.inputs[0][:128],), loss_fn=_mean_square)
    budget = model.remat.plan.budget_bytes
    x = ex.inputs[0][:136]
    with LiveBytes(baseline=list(model.parameters()) + [x]) as meter:
        _mean_square(model(x)).backward()
    assert meter.peak_bytes <= budget and model.remat.plan.budget_bytes == budget
    with pytest.raises(InfeasibleBudgetError, match="smallest feasible") as e:    # the bytes stay fixed
        model(torch.cat([x] * 2))
    assert e.value.budget_bytes == budget


def test_eval_mode_training_warns_once():
    ex = _mlp()
    model = plan_and_wrap(ex.model.eval(), "85%", example_inputs=ex.inputs, loss_fn=ex.loss_fn)
    with pytest.warns(UserWarning, match="eval mode with gradients enabled"):
        model(*ex.inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(*ex.inputs)                        # once
        with torch.no_grad():
            model(*ex.inputs)                    # inference: nothing to say
