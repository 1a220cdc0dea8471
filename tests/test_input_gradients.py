"""Losses that differentiate with respect to the inputs (issue 42, item 3): a physics-informed
residual `autograd.grad(u, t, create_graph=True)`, a gradient penalty. The loss closes over the
example inputs, as the user's step does; the fake step reads them as the graph's fake copies.

Under such a loss a region is recomputed once per backward that reads it (twice: the loss's
autograd.grad, then loss.backward()). A plain region runs its recompute context again
(runtime/rewrite/graph.py `Reusable`); a region that keeps outputs (SAC) cannot, torch allows one
backward through it, so the planner keeps nothing where the loss differentiates
(`CostGraph.loss_differentiates`) and the runtime says so if a plan made for another loss meets one.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import remat
from remat.planner import analyze
from remat.planner.solve.baselines import every_block, sac_every_block
from remat.planner.errors import InfeasibleBudgetError, UnsafePlanError
from remat.runtime.measure import peak_memory
from remat.runtime.rewrite import rewrite

from test_whole_step import fakes_in


class TrunkHead(nn.Module):
    """x runs through a deep trunk; t joins at the head: du/dt differentiates through the head only."""

    def __init__(self, width: int = 128, depth: int = 6):
        super().__init__()
        self.trunk = nn.Sequential(*[nn.Sequential(nn.Linear(1 if i == 0 else width, width), nn.Tanh())
                                     for i in range(depth)])
        self.head = nn.Sequential(nn.Linear(width + 1, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, x, t):
        return self.head(torch.cat([self.trunk(x), t], -1))


def residual(u, t):
    """du/dt = u, as a physics-informed loss writes it."""
    ut, = torch.autograd.grad(u.sum(), t, create_graph=True)
    return (ut - u).pow(2).mean()


class Critic(nn.Module):
    """Blocks with BatchNorm and dropout: a gradient penalty differentiates through all of them."""

    def __init__(self, width: int = 64, depth: int = 4):
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.Tanh(),
                                                    nn.Dropout(0.1)) for _ in range(depth)])
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        return self.out(self.blocks(x))


def penalty(score, x):
    """WGAN-GP: (|d score / d x| - 1)^2, plus the score itself."""
    g, = torch.autograd.grad(score.sum(), x, create_graph=True)
    return (g.norm(dim=1) - 1).pow(2).mean() + score.mean()


def _same_grads(a: nn.Module, b: nn.Module) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_a_loss_differentiating_by_an_input_plans_trains_identically_and_fits():
    torch.manual_seed(0)
    model = TrunkHead()
    x, t = torch.rand(1024, 1), torch.rand(1024, 1).requires_grad_()
    oracle = copy.deepcopy(model)
    unplanned = peak_memory(lambda: residual(oracle(x, t), t).backward(), oracle, x, t)
    oracle.zero_grad(set_to_none=True)
    t.grad = None

    assert analyze(model, (x, t), {}, loss_fn=lambda u: residual(u, t)).cost_graph.loss_differentiates
    assert not analyze(model, (x, t), {}, loss_fn=lambda u: u.pow(2).mean()).cost_graph.loss_differentiates
    wrapped = remat.plan_and_wrap(model, "60%", example_inputs=(x, t), loss_fn=lambda u: residual(u, t))
    plan = wrapped.remat.plan
    assert plan.regions, "a budget of 60% needs regions"
    assert not any(r.saved for r in plan.regions), "a region the loss differentiates through keeps nothing"
    assert t.grad is None and not fakes_in(wrapped)

    for step in range(2):
        measured = peak_memory(lambda: residual(wrapped(x, t), t).backward(), wrapped, x, t)
        residual(oracle(x, t), t).backward()
        _same_grads(oracle, wrapped)
        if step == 0:
            assert measured <= plan.budget_bytes < unplanned
            assert measured <= plan.predicted_peak_bytes <= 1.05 * measured, (plan.predicted_peak_bytes, measured)
        for m in (oracle, wrapped):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.01 * p.grad
            m.zero_grad(set_to_none=True)


def test_the_floor_of_a_loss_differentiating_through_the_whole_model_is_measured():
    """Every region of a residual taken by the model's first input is recomputed in the loss and
    held by its graph until backward: the floor is what the exact replay measures, and a plan at
    the floor fits."""
    torch.manual_seed(0)
    model = TrunkHead(depth=4)
    t = torch.rand(512, 1).requires_grad_()
    x = t      # the trunk reads t too: du/dt differentiates through everything

    def loss_fn(u):
        return residual(u, t)
    with pytest.raises(InfeasibleBudgetError) as e:
        remat.plan_and_wrap(copy.deepcopy(model), "50%", example_inputs=(x, t), loss_fn=loss_fn)
    floor = e.value.min_feasible_bytes
    wrapped = remat.plan_and_wrap(model, floor / 1e9, example_inputs=(x, t), loss_fn=loss_fn)
    measured = peak_memory(lambda: loss_fn(wrapped(x, t)).backward(), wrapped, x)
    assert measured <= wrapped.remat.plan.budget_bytes


@pytest.mark.parametrize("regions", [every_block, sac_every_block])
def test_regions_under_double_backward(regions):
    """Every block checkpointed, a gradient penalty differentiating through each: plain regions
    recompute twice with the forward's dropout masks and BatchNorm statistics (gradients, running
    stats and the RNG equal the unwrapped model's); regions that keep outputs raise a typed error
    that says what to do."""
    torch.manual_seed(0)
    model, x = Critic(), torch.randn(256, 64)
    a = analyze(model, (x,), {}, loss_fn=lambda s: s.sum())
    chosen = regions(a.cost_graph)
    assert chosen and all(r.saved for r in chosen) == (regions is sac_every_block)
    gm = rewrite(model, a.traced.gm, chosen, tuple(c.name for c in a.cost_graph.nodes), a.cost_graph.meta)
    oracle = copy.deepcopy(model)

    def step(m):
        xr = x.clone().requires_grad_()
        penalty(m(xr), xr).backward()
        return xr.grad

    def planned(xr):
        return gm(**a.traced.inputs(model, (xr,), {}))
    torch.manual_seed(1)
    want = step(oracle)
    rng = torch.get_rng_state()
    torch.manual_seed(1)
    if regions is sac_every_block:
        with pytest.raises(UnsafePlanError, match="create_graph=True"):
            step(planned)
        return
    got = step(planned)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(want, got)
    _same_grads(oracle, model)
    for (n, b), (_, c) in zip(oracle.named_buffers(), model.named_buffers()):
        assert torch.equal(b, c), n


def test_a_snapshot_restores_batchnorm_statistics_the_kernel_wrote_without_a_version():
    """BatchNorm's CPU kernel writes its running statistics without moving their version counters
    (fuzz seed 5009: a real run planning made changed them for good); state_preserved restores them."""
    from remat.planner.step.state import state_preserved
    bn, x = nn.BatchNorm2d(8), torch.randn(4, 8, 5, 5) + 3
    before = bn.running_mean.clone()
    with torch.no_grad(), state_preserved(bn):
        bn(x)
    assert torch.equal(bn.running_mean, before)
    version = bn.running_mean._version
    with torch.no_grad():
        bn(x)
    assert bn.running_mean._version == version and not torch.equal(bn.running_mean, before), \
        "the kernel moves the counter now: the snapshot's value check is no longer needed"


def test_an_in_place_op_on_a_view_is_not_recomputed_under_a_double_backward():
    """torch's checkpoint unpacks a tensor `narrow(...).relu_()` saved twice in one double backward
    (CheckpointError, fuzz seed 5010): such a node stays out of regions when the loss differentiates."""
    class NarrowRelu(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))

        def forward(self, x):
            for lin in self.blocks:
                h = lin(x)
                h.narrow(-1, 0, 16).relu_()
                x = x + torch.tanh(h)
            return x

    torch.manual_seed(0)
    model, x = NarrowRelu(), torch.randn(64, 32).requires_grad_()

    def relu_(loss_fn) -> list[str]:
        cg = analyze(model, (x,), {}, loss_fn=loss_fn).cost_graph
        return [c.why_not for c in cg.nodes if c.name.startswith("relu_")]
    assert relu_(lambda s: s.square().mean()) == [""] * 4
    assert all("differentiates" in why for why in relu_(lambda s: penalty(s, x))) and len(relu_(lambda s: penalty(s, x))) == 4
