"""Ours, compiled: `plan_and_wrap(model, budget, compile=True)`, called as a user calls it.

In compile mode the planner plans plain regions only, the rewritten graph compiles whole (each
region is Dynamo's checkpoint op: no graph breaks), and every plan it tries is compiled and
measured with real steps, since Inductor's partitioner decides what else the step saves
(runtime.rewrite.compiled). Inductor runs with its defaults plus, as for the torch.compile strategy,
`fallback_random=True` and the FX graph / AOTAutograd caches off, so dropout draws eager's masks,
the result can be checked against the float64 eager step, and compile times are cold ones.
Planning time here includes every compile.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from torch._dynamo.utils import counters

from remat.planner import InfeasibleBudgetError, PlanOptions
from remat.planner.profile.graph import compute_nodes
from remat.planner.result import Plan, Region
from remat.planner.capture.trace import capture
from remat.runtime.api import plan_and_wrap
from remat.runtime.measure import allocator_peak
from remat.runtime.rewrite import rewrite, rewrite_plan

from .measure import as_close_as_eager, same_result, step


class Called(torch.nn.Module):
    """A rewritten graph called like the model: positional inputs mapped onto its placeholders."""

    def __init__(self, gm: torch.nn.Module, inputs):
        super().__init__()
        self.gm, self.inputs = gm, inputs

    def forward(self, *args):
        return self.gm(**self.inputs(args))


def rewritten(ex, plan: Plan) -> tuple[torch.nn.Module, torch.fx.GraphModule, object]:
    """A fresh copy of the model, its graph rewritten with `plan`'s regions, and the capture."""
    model = copy.deepcopy(ex.model)
    traced = capture(model, ex.inputs, {})
    return model, rewrite_plan(model, traced.gm, plan), traced


def _cold():
    return (functorch_config.patch(enable_autograd_cache=False),
            inductor_config.patch(fallback_random=True, fx_graph_cache=False))


@dataclass
class RematCompiled:
    module: torch.nn.Module     # the wrapped model, its compiled plan inside
    plan: Plan
    peak: int                   # allocator peak of one step, resident tensors included
    plan_s: float               # plan_and_wrap: capture, profile, solve, and every compile it ran
    same: bool                  # as close to the float64 eager step as float32 eager is, or (when not)
                                # the same plan compiled in float64 equals the float64 eager step
    exact: bool                 # equal to the eager float32 step up to float32 noise (stricter)
    error64: float | None       # float64 check, run only when the float32 check fails
    graphs: int                 # graphs Dynamo compiled while planning (one per plan measured)
    breaks: tuple[str, ...]     # distinct graph-break reasons (first line each)


def remat_compiled(ex, budget: int, opts: PlanOptions, ref) -> RematCompiled | InfeasibleBudgetError:
    """plan_and_wrap(..., compile=True) on a fresh copy at `budget` bytes; its step checked and
    metered. No `torch._dynamo.reset()` here: the caller resets once per budget."""
    graphs0, breaks0 = counters["stats"]["unique_graphs"], dict(counters["graph_break"])
    model = copy.deepcopy(ex.model)
    t0 = time.perf_counter()
    a, b = _cold()
    with a, b:
        try:
            wrapped = plan_and_wrap(model, budget / 1e9, example_inputs=ex.inputs, loss_fn=ex.loss_fn,
                                    options=opts, compile=True)
        except InfeasibleBudgetError as e:
            return e
        plan_s = time.perf_counter() - t0
        loss = step(wrapped, ex)
    same, exact = as_close_as_eager(model, loss, ref), same_result(model, loss, ref)
    model.zero_grad(set_to_none=True)
    peak = allocator_peak(lambda: step(wrapped, ex), model, *ex.inputs)
    model.zero_grad(set_to_none=True)
    breaks = tuple(sorted({k.strip().splitlines()[0][:120] for k, v in counters["graph_break"].items()
                           if v > breaks0.get(k, 0)}))
    graphs = counters["stats"]["unique_graphs"] - graphs0
    error64 = None if same else float64_error(ex, wrapped.remat.plan, ref)
    return RematCompiled(wrapped, wrapped.remat.plan, peak, plan_s, same or error64 <= MAX_ERROR64, exact, error64,
                         graphs, breaks)


MAX_ERROR64 = 1e-8


def float64_error(ex, plan: Plan, ref) -> float:
    """The plan compiled in float64: its largest difference to the float64 eager step (loss
    relative, each grad relative to its max), as measure._error. A float32 run can fail the
    as-close-as-eager check on an ill-conditioned gradient (a conv weight in front of a
    BatchNorm: float32 eager is already 2% off there on unet) when eager and compiled float32
    arithmetic mix; in float64 a correct plan is within ~1e-12 of the reference and a wrong one
    (another dropout mask, a stale buffer) is not."""
    model = copy.deepcopy(ex.model).double()
    ex64 = ex._replace(model=model, inputs=tuple(x.double() if x.is_floating_point() else x for x in ex.inputs))
    model, gm, traced = rewritten(ex64, plan)      # node names do not depend on the dtype
    called = Called(torch.compile(gm), lambda args: traced.inputs(model, args, {}))
    a, b = _cold()
    with a, b:
        loss = step(called, ex64)
    errs = [abs(loss - ref.loss64).item() / max(abs(ref.loss64.item()), 1e-12)]
    errs += [((p.grad - g64).abs().max() / g64.abs().max().clamp_min(1e-12)).item()
             for p, g64 in zip(model.parameters(), ref.grads64)]
    return max(errs)


def graphs_now() -> int:
    """Graphs Dynamo compiled so far (to see whether timing recompiled anything)."""
    return counters["stats"]["unique_graphs"]


def dropout_region_error(fallback_random: bool) -> float:
    """A toy, Linear-GELU-Dropout(0.5), rewritten with one region over all of it (so the dropout
    is recomputed in the backward), compiled: largest error of the bias gradient against the one
    implied by the forward's own mask. ~0 when the recompute draws the forward's mask."""

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(64, 64)

        def forward(self, x):
            h = F.gelu(self.lin(x))
            return F.dropout(torch.sin(h) * h, 0.5, training=True)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        toy, x = Toy(), torch.randn(256, 64)
        loss_fn = lambda out: out.sum()     # noqa: E731
        traced = capture(toy, (x,), {})
        nodes = compute_nodes(traced.gm)
        region = Region(0, len(nodes) - 1)
        gm = rewrite(toy, traced.gm, (region,), tuple(n.name for n in nodes))
        torch._dynamo.reset()
        with functorch_config.patch(enable_autograd_cache=False), \
                inductor_config.patch(fallback_random=fallback_random, fx_graph_cache=False):
            out = torch.compile(gm)(**traced.inputs(toy, (x,), {}))
            out = out[0] if isinstance(out, tuple) else out
            loss_fn(out).backward()
        lin = toy.lin
        pre = lin(x).detach().requires_grad_()
        h = F.gelu(pre)
        (torch.sin(h) * h * (out.detach() != 0) * 2.0).sum().backward()    # 2.0 = 1 / (1 - p)
    torch._dynamo.reset()
    return (lin.bias.grad - pre.grad.sum(0)).abs().max().item()
