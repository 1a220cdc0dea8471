"""One captured graph for every padded length (issue 41, item 1): a Hugging Face model is exported
once with dynamic batch and sequence sizes, and a later batch the graph admits runs the plan with
no capture and no solve; Trainer's `num_items_in_batch` is planned by `plan_and_wrap`. The oracle
is the unwrapped model: losses and gradients bitwise equal, measured peak within the budget."""
from __future__ import annotations

import copy

import pytest
import torch

from remat.planner.solve.fit import same_where_planned
from remat.planner.result import Plan, Region
from remat.planner.step.storage import LiveBytes
from remat.planner.capture.trace import Shapes
from remat.runtime import plan_and_wrap


def test_shapes_admit_sizes_within_their_symbols_ranges_and_bindings():
    s = Shapes(dims=(("ids", ("b", "t")), ("mask", ("b", "t")), ("pos", (1, "t"))),
               ranges=(("b", 2, float("inf")), ("t", 2, 512)))
    ok = {"ids": torch.zeros(4, 9), "mask": torch.zeros(4, 9), "pos": torch.zeros(1, 9)}
    assert s.admits(ok)
    assert not s.admits({**ok, "mask": torch.zeros(4, 8)})        # t bound to 9 by ids
    assert not s.admits({**ok, "pos": torch.zeros(2, 9)})         # a fixed size
    assert not s.admits({k: v[:1] if k != "pos" else v for k, v in ok.items()})   # b = 1 < 2
    assert not s.admits({"ids": torch.zeros(4, 600), "mask": torch.zeros(4, 600), "pos": torch.zeros(1, 600)})
    assert not s.admits({**ok, "ids": torch.zeros(4, 9, 1)})     # another rank
    assert not s.admits({"mask": ok["mask"], "pos": ok["pos"]})  # an input missing


def _plan(names, regions):
    return Plan(regions=tuple(regions), predicted_peak_bytes=1, min_feasible_bytes=None, solver="ilp", status="",
                gap=None, solve_s=0.0, recompute_flops=0.0, recompute_s=0.0, budget_bytes=1, unplanned_peak_bytes=1,
                opaque=(), node_names=tuple(names), total_flops=0.0, forward_s=0.0)


def test_a_plan_is_the_same_on_a_graph_that_differs_only_after_its_last_region():
    plan = _plan(["a", "b", "c", "d", "loss"], [Region(0, 1)])
    assert same_where_planned(("a", "b", "c", "d", "loss"), plan)
    assert same_where_planned(("a", "b", "c", "x", "div", "loss"), plan)      # Trainer's divided loss
    assert not same_where_planned(("a", "b", "x", "d", "loss"), plan)         # the node after the region
    assert not same_where_planned(("a", "x", "c", "d", "loss"), plan)
    last = _plan(["a", "b", "c", "loss"], [Region(1, 2)])                     # a region up to the loss
    assert not same_where_planned(("a", "b", "c", "div", "loss"), last)


transformers = pytest.importorskip("transformers")


def _llama():
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(cfg).train()


def _batch(lengths: list[int], seed: int = 0) -> dict:
    """The docs' collator: padded to the longest row, labels -100 on the pads."""
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    ids = torch.zeros(len(lengths), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, k in enumerate(lengths):
        ids[i, :k] = torch.randint(4, 512, (k,), generator=g)
        mask[i, :k] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class _Exports:
    def __init__(self, monkeypatch):
        self.calls = 0
        real = torch.export.export

        def counted(*a, **k):
            self.calls += 1
            return real(*a, **k)
        monkeypatch.setattr(torch.export, "export", counted)


@pytest.mark.slow
@pytest.mark.hf
def test_padded_lengths_and_batch_sizes_run_the_one_exported_graph(monkeypatch):
    model, ref = _llama(), _llama()
    plan_and_wrap(model, "60%", example_kwargs=_batch([96] * 4))
    plan = model.remat.plan
    assert plan.trace_path == "torch.export" and plan.regions
    exports, solves = _Exports(monkeypatch), model.remat.solves
    for k, lengths in enumerate([[40, 17, 33, 12], [96, 5, 60], [8, 8], [71, 70, 3, 64]]):
        batch = _batch(lengths, seed=k)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        with LiveBytes(baseline=list(model.parameters()) + list(model.buffers())) as meter:
            loss = model(**batch).loss
            loss.backward()
        want = ref(**batch).loss
        want.backward()
        assert torch.equal(loss, want), lengths
        assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters())), lengths
        assert meter.peak_bytes <= plan.budget_bytes, (lengths, meter.peak_bytes, plan.budget_bytes)
    assert exports.calls == 0 and model.remat.solves == solves
    # a batch of one is outside what the graph admits (export specialises sizes 0 and 1): captured anew, correct
    one = _batch([30])
    model.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    model(**one).loss.backward()
    ref(**one).loss.backward()
    assert exports.calls >= 1
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.slow
@pytest.mark.hf
def test_trainers_num_items_in_batch_is_planned_by_plan_and_wrap(monkeypatch):
    from transformers import Trainer  # noqa: F401 - a Trainer run has loaded it
    model = _llama()
    ref = copy.deepcopy(model)
    plan_and_wrap(model, "60%", example_kwargs=_batch([80] * 4))
    assert model.remat.solves == 1 and len(model.remat.plans) == 2      # the second kept without a solve
    exports = _Exports(monkeypatch)
    batch = _batch([50, 20, 44, 9], seed=3)
    n = batch["labels"][..., 1:].ne(-100).sum() / 1                    # as Trainer (transformers 5) counts
    loss = model(**batch, num_items_in_batch=n).loss                   # and calls it
    loss.backward()
    want = ref(**batch, num_items_in_batch=n).loss
    want.backward()
    assert exports.calls == 0 and model.remat.solves == 1
    assert torch.equal(loss, want)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), ref.parameters()))


@pytest.mark.slow
@pytest.mark.hf
def test_without_trainer_loaded_only_the_example_call_is_planned(monkeypatch):
    import sys
    monkeypatch.delitem(sys.modules, "transformers.trainer", raising=False)
    model = _llama()
    plan_and_wrap(model, "60%", example_kwargs=_batch([40] * 4))
    assert len(model.remat.plans) == 1 and model.remat.solves == 1


def test_a_model_that_refuses_trainers_keyword_still_plans_its_own_call():
    from transformers import Trainer  # noqa: F401 - loaded: plan_and_wrap tries Trainer's call
    class Strict(torch.nn.Module):        # a **kwargs forward that rejects what it does not know
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

        def forward(self, x, labels=None, **kwargs):
            if kwargs:
                raise TypeError(f"unexpected {sorted(kwargs)}")
            return ((self.b(self.a(x).relu()) - labels) ** 2).mean()
    model = Strict()
    x = torch.randn(32, 16)
    plan_and_wrap(model, 1.0, example_kwargs={"x": x, "labels": x})
    assert len(model.remat.plans) == 1 and model.remat.plan.predicted_peak_bytes <= model.remat.plan.budget_bytes
