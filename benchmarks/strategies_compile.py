"""torch.compile as a strategy: Inductor with AOTAutograd's activation memory budget.

`torch._functorch.config.activation_memory_budget` (a fraction: 1.0 saves what the default
partitioner saves, 0.0 recomputes all it can) steers the min-cut partitioner. Per model, we
compile the unplanned model at fractions from a grid, largest first, and take the largest whose
measured peak fits the budget. Each fraction is compiled once per model and its measurements
serve every budget; the planning time reported for a budget is what a search for that budget
alone compiles. Peaks are allocator peaks (benchmarks/measure.py): compiled code cannot be
metered under a TorchDispatchMode. Compile times are cold: the on-disk FX graph and AOTAutograd
caches are off. Inductor runs with `fallback_random=True`, so dropout draws the same masks as
eager and the result can be checked against the eager step (as close to float64 as eager
float32 is).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config
import torch.nn.functional as F

from remat.runtime.measure import allocator_peak

from .measure import as_close_as_eager, median_step_s, step

GRID = (1.0, 0.8, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)
QUICK_GRID = (1.0, 0.6, 0.3, 0.0)


@dataclass(frozen=True)
class Compiled:
    fraction: float     # activation_memory_budget it was compiled with
    peak: int           # allocator peak of one step, resident tensors included
    ratio: float        # median step time vs the eager unplanned model, timed round-robin
    compile_s: float    # first call: compilation of forward and backward, plus one step
    same: bool          # loss and grads as close to the float64 eager step as float32 eager's


def compiled_at(ex, fraction: float) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor, float]:
    """A fresh copy of the model, it compiled at `fraction` (its first step, which compiles, run),
    that step's loss and its seconds. The caller resets Dynamo when the model's forward may have
    been compiled at another fraction already."""
    model = copy.deepcopy(ex.model)
    compiled = torch.compile(model)
    t0 = time.perf_counter()
    with functorch_config.patch(activation_memory_budget=fraction, enable_autograd_cache=False), \
            inductor_config.patch(fallback_random=True, fx_graph_cache=False):
        loss = step(compiled, ex)
    return model, compiled, loss, time.perf_counter() - t0


def compile_at(ex, fraction: float, ref, repeats: int, clock: str = "wall") -> Compiled:
    torch._dynamo.reset()             # else Dynamo reuses the graph compiled at another fraction
    model, compiled, loss, compile_s = compiled_at(ex, fraction)
    same = as_close_as_eager(model, loss, ref)
    model.zero_grad(set_to_none=True)
    peak = allocator_peak(lambda: step(compiled, ex), model, *ex.inputs)
    model.zero_grad(set_to_none=True)
    secs = median_step_s({"compiled": compiled, "eager": copy.deepcopy(ex.model)}, ex, repeats, clock)
    ratio = secs["compiled"] / secs["eager"]
    return Compiled(fraction, peak, ratio, compile_s, same)


class CompileSearch:
    """The compile strategy for one model: compiles lazily, once per fraction."""

    def __init__(self, ex, ref, repeats: int, grid=GRID, clock: str = "wall"):
        self.ex, self.ref, self.repeats, self.grid, self.clock = ex, ref, repeats, grid, clock
        self.runs: dict[float, Compiled] = {}
        self.error: str | None = None    # why compiling failed on this machine

    def best(self, budget: int) -> tuple[Compiled | None, float]:
        """The largest fraction whose peak fits (else the least peak tried) and the compile
        seconds a search for this budget alone takes; (None, 0) when compiling fails."""
        tried = []
        for f in self.grid:
            run = self._run(f)
            if run is None:
                break
            tried.append(run)
            if run.peak <= budget:
                return run, sum(r.compile_s for r in tried)
        if not tried:
            return None, 0.0
        return min(tried, key=lambda r: r.peak), sum(r.compile_s for r in tried)

    def _run(self, fraction: float) -> Compiled | None:
        if fraction not in self.runs and self.error is None:
            try:
                self.runs[fraction] = compile_at(self.ex, fraction, self.ref, self.repeats, self.clock)
            except Exception as e:      # no C++ compiler, an Inductor bug, ...: report, don't crash
                self.error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        return self.runs.get(fraction)


def dropout_recompute_error(fraction: float) -> float:
    """How far a compiled toy's bias gradient is from the one implied by its forward's own dropout
    mask, at `fraction` with Inductor's default RNG: ~0 when the backward uses the forward's mask."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        lin, x = torch.nn.Linear(64, 64), torch.randn(256, 64)

        def toy(x):
            h = F.gelu(lin(x))
            return F.dropout(torch.sin(h) * h, 0.5, training=True)
        torch._dynamo.reset()
        with functorch_config.patch(activation_memory_budget=fraction, enable_autograd_cache=False), \
                inductor_config.patch(fx_graph_cache=False):
            out = torch.compile(toy)(x)
            out.sum().backward()
        pre = lin(x).detach().requires_grad_()
        h = F.gelu(pre)
        (torch.sin(h) * h * (out.detach() != 0) * 2.0).sum().backward()    # 2.0 = 1 / (1 - p)
    return (lin.bias.grad - pre.grad.sum(0)).abs().max().item()
