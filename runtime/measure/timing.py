"""A plan's step time against the unplanned step, measured on real tensors: the loop closed.

The two steps are timed in interleaved rounds (one of each per round, after warm-up), so that a
change of machine load hits both alike; each round gives one ratio, planned over unplanned, and
the rounds give its median and its spread. What the plan predicted (Plan.recompute_s: the
recompute and the regions' fixed costs) stands beside what was measured; the callers add each
region's measured recompute (runtime.rewrite.RecomputeTimes, on while the steps run).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

ROUNDS = 7      # timed rounds (one step of each kind per round)
WARMUP = 2      # untimed steps of each kind first (first-call allocations, caches)


@dataclass(frozen=True)
class StepTiming:
    """Measured step times of a plan and of the unplanned step, and the plan's own estimate."""
    unplanned_s: float          # median seconds of the unplanned step
    planned_s: float            # median seconds of the planned step
    ratio: float                # median over rounds of planned / unplanned (each round's pair back to back)
    ratio_low: float            # the smallest and largest per-round ratio: the spread
    ratio_high: float
    rounds: int
    predicted_extra_s: float    # the plan's estimate of its extra time per step
    cost_model: str             # what made that estimate: "roofline" or "measured"
    # per region, the wall time of its recompute in backward, the fastest of the planned steps
    # (runtime.rewrite.RecomputeTimes; None: it never recomputed); () when not recorded
    region_recompute_s: tuple[float | None, ...] = ()

    @property
    def measured_extra_s(self) -> float:
        """Extra seconds per step, measured: (ratio - 1) times the unplanned step."""
        return (self.ratio - 1.0) * self.unplanned_s

    def to_dict(self) -> dict:
        """Its fields and its `text()` (what Plan.summary prints), for a plan's facts.timing."""
        return asdict(self) | {"text": self.text()}

    def text(self) -> str:
        """One line: measured and predicted overhead side by side."""
        pct = 100.0 * (self.ratio - 1.0)
        predicted_pct = 100.0 * self.predicted_extra_s / self.unplanned_s if self.unplanned_s else 0.0
        return (f"step {self.unplanned_s * 1e3:.1f} ms unplanned, {self.planned_s * 1e3:.1f} ms planned: "
                f"measured {pct:+.1f}% ({self.measured_extra_s * 1e3:+.1f} ms; per-round {self.ratio_low:.3f}.."
                f"{self.ratio_high:.3f}x, {self.rounds} rounds), predicted {predicted_pct:+.1f}% "
                f"({self.predicted_extra_s * 1e3:+.1f} ms, {self.cost_model})")


def interleaved_times(steps: list[Callable[[], object]], device: torch.device | str = "cpu",
                      rounds: int = ROUNDS, warmup: int = WARMUP) -> list[list[float]]:
    """Per step function, its seconds in each of `rounds` rounds (one call of each per round, in
    turn, the device synchronised around each), after `warmup` untimed calls of each."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for fn in steps:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(rounds):
        for k, fn in enumerate(steps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return times


def step_timing(unplanned: Callable[[], object], planned: Callable[[], object], predicted_extra_s: float,
                cost_model: str, device: torch.device | str = "cpu", rounds: int = ROUNDS) -> StepTiming:
    """Time two step functions (each a whole training step) against each other."""
    base, ours = interleaved_times([unplanned, planned], device, rounds)
    ratios = [b / a for a, b in zip(base, ours)]
    return StepTiming(statistics.median(base), statistics.median(ours), statistics.median(ratios),
                      min(ratios), max(ratios), rounds, predicted_extra_s, cost_model)
