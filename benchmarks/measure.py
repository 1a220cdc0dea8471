"""One training step of a strategy's model, its result checked against the unplanned eager step
(float32, and float64 for compiled code), and step times taken round-robin (median, and per
round the ratio to a reference strategy: its median and range). Peaks are
metered elsewhere: runtime.measure.peak_memory, or allocator_peak for compiled steps."""
from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass

import torch



def step(model, ex, seed=0) -> torch.Tensor:
    torch.manual_seed(seed)
    loss = ex.loss_fn(model(*ex.inputs))
    loss.backward()
    return loss.detach()


@dataclass(frozen=True)
class Reference:
    """One step of the unplanned eager model, in float32 (what every strategy must reproduce) and
    in float64 (to tell float32 rounding from real differences, for compiled code)."""
    loss: torch.Tensor
    grads: list[torch.Tensor]
    loss64: torch.Tensor
    grads64: list[torch.Tensor]


def _loss_and_grads(ex, dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model = copy.deepcopy(ex.model).to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in ex.inputs)
    loss = step(model, ex._replace(model=model, inputs=inputs))
    return loss, [p.grad.clone() for p in model.parameters()]


def reference(ex) -> Reference:
    return Reference(*_loss_and_grads(ex, torch.float32), *_loss_and_grads(ex, torch.float64))


def same_result(model, loss, ref: Reference) -> bool:
    """Loss and grads equal to the eager float32 step's, up to float32 noise."""
    return torch.allclose(loss, ref.loss) and all(
        torch.allclose(p.grad, g, rtol=1e-4, atol=1e-6) for p, g in zip(model.parameters(), ref.grads))


def _error(loss, grads, ref: Reference) -> float:
    """Largest difference to the float64 step: of the loss, and of each grad relative to its max."""
    errs = [abs(loss.double() - ref.loss64).item() / max(abs(ref.loss64.item()), 1e-12)]
    errs += [((g.double() - g64).abs().max() / g64.abs().max().clamp_min(1e-12)).item()
             for g, g64 in zip(grads, ref.grads64)]
    return max(errs)


def as_close_as_eager(model, loss, ref: Reference) -> bool:
    """For compiled code, which reorders float32 arithmetic: at most twice as far from the float64
    step as the eager float32 step is (plus 1e-5)."""
    grads = [p.grad for p in model.parameters()]
    return _error(loss, grads, ref) <= 2 * _error(ref.loss, ref.grads, ref) + 1e-5


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
# "cpu": the calling thread's CPU time. On CPU with one torch thread every kernel, the autograd
# engine's backward and Inductor's code run in the calling thread, so it is the step's compute
# without the time the machine's other jobs take it off the core (a shared machine's noise)


def _round_robin_s(models: dict, ex, repeats: int, clock: str = "wall") -> dict[str, list[float]]:
    """Each model's step seconds in each of `repeats` rounds (one step of each per round, after two
    warm-up steps each), so that a change of machine load hits every model alike; `clock`, a key
    of CLOCKS."""
    now = CLOCKS[clock]
    for model in models.values():
        for _ in range(2):
            step(model, ex)
    times: dict = {k: [] for k in models}
    for _ in range(repeats):
        for k, model in models.items():
            model.zero_grad(set_to_none=True)
            t0 = now()
            step(model, ex)
            times[k].append(now() - t0)
    return times


def median_step_s(models: dict, ex, repeats: int, clock: str = "wall") -> dict:
    """Median step seconds of each model, timed round-robin (`_round_robin_s`)."""
    times = _round_robin_s(models, ex, repeats, clock)
    return {k: statistics.median(v) for k, v in times.items()}


@dataclass(frozen=True)
class Ratio:
    """A strategy's step time as a ratio to the reference strategy's, from interleaved rounds."""
    median: float          # median over rounds of (its step / the reference's step in that round)
    low: float             # smallest and largest per-round ratio: the spread
    high: float

    def overlaps(self, other: "Ratio") -> bool:
        """The two spreads overlap: no ranking between them beyond the measurement's noise."""
        return self.low <= other.high and other.low <= self.high


def step_ratios(models: dict, ex, repeats: int, reference_key: str = "none", clock: str = "wall") -> dict[str, Ratio]:
    """Each model's step time against `models[reference_key]`'s, timed round-robin (one step of
    each per round, after two warm-up steps each): per-round ratios, their median and range."""
    times = _round_robin_s(models, ex, repeats, clock)
    base = times[reference_key]
    out = {}
    for k, v in times.items():
        r = [a / b for a, b in zip(v, base)]
        out[k] = Ratio(statistics.median(r), min(r), max(r))
    return out
