"""Clear errors at the seams (issue 41, item 3 and 5's smaller points): a loss_fn that cannot take a
new batch is named as the cause; a model torch.compile already wrapped gets a TypeError that says
what to do; a deepcopy of a planned model keeps its plans and loss_fn and plans nothing again; an
event warns once."""
from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from remat import LossFnError, plan_and_wrap, remove


def _readme_model():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(3)],
                         nn.Linear(32, 10))


def test_a_loss_fn_closing_over_the_example_targets_is_named_on_a_larger_batch():
    model = _readme_model()
    x, y = torch.randn(64, 32), torch.randint(10, (64,))
    plan_and_wrap(model, 0.01, example_inputs=(x,), loss_fn=lambda out: F.cross_entropy(out, y))   # room
    F.cross_entropy(model(x[:32]), y[:32]).backward()          # a smaller batch keeps the plan
    with pytest.raises(LossFnError) as e:
        model(torch.randn(128, 32))
    said = str(e.value)
    assert "loss_fn" in said and "(128, 10)" in said and "set_loss_fn" in said
    assert isinstance(e.value.cause, ValueError)             # F.cross_entropy's own error, kept
    # the way out it names works: the loss of the new batch, then the call plans
    y2 = torch.randint(10, (128,))
    model.remat.set_loss_fn(lambda out: F.cross_entropy(out, y2))
    x2 = torch.randn(128, 32)
    F.cross_entropy(model(x2), y2).backward()
    assert model.remat.plan.predicted_peak_bytes <= model.remat.plan.budget_bytes


def test_a_compiled_model_gets_a_type_error_that_says_what_to_do():
    model = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.Linear(8, 2)))
    with pytest.raises(TypeError, match="compile=True"):
        plan_and_wrap(model, "50%", example_inputs=(torch.randn(16, 8),))
    assert "remat" not in model._orig_mod.__dict__ and "remat" not in model.__dict__


def test_a_deep_copy_keeps_its_plans_and_loss_fn_and_trains_like_the_original():
    model = _readme_model()
    x, y = torch.randn(64, 32), torch.randint(10, (64,))
    loss_fn = lambda out: F.cross_entropy(out, y)  # noqa: E731 - a closure, as the README's
    ref = copy.deepcopy(model)
    plan_and_wrap(model, "80%", example_inputs=(x,), loss_fn=loss_fn)
    assert model.remat.plan.regions
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        twin = copy.deepcopy(model)
    assert not w, [str(m.message) for m in w]
    assert twin.remat.model is twin and twin.remat._loss_fn is loss_fn
    assert twin.remat.plans == model.remat.plans and twin.remat.solves == model.remat.solves
    F.cross_entropy(twin(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    assert twin.remat.solves == model.remat.solves              # trained on the copied plan
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(twin.parameters(), ref.parameters()))
    assert all(p.grad is None for p in model.parameters())     # the original is untouched
    assert all(a is not b for a, b in zip(twin.parameters(), model.parameters()))


def test_an_eval_mode_backward_warns_once_and_is_not_printed_twice(caplog):
    model = _readme_model()
    x = torch.randn(64, 32)
    plan_and_wrap(model, 1.0, example_inputs=(x,))
    model.eval()
    with warnings.catch_warnings(record=True) as w, caplog.at_level(logging.WARNING, logger="remat"):
        warnings.simplefilter("always")
        model(x).sum().backward()
        model(x).sum().backward()
    assert len([m for m in w if "eval mode" in str(m.message)]) == 1
    assert not [r for r in caplog.records if "eval mode" in r.getMessage()]   # not a second, logged copy


def test_removing_twice_raises_the_documented_value_error():
    model = _readme_model()
    plan_and_wrap(model, 1.0, example_inputs=(torch.randn(8, 32),))
    remove(model)
    assert "ValueError" in remove.__doc__
    with pytest.raises(ValueError, match="no remat plan"):
        remove(model)
