"""Every option of planning, with its one default (pure data, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field

from .rates import DeviceRates

@dataclass(frozen=True, kw_only=True)
class SolveOptions:
    time_limit_s: float = 6.0     # wall-clock limit of one CBC solve (a safety net; see max_nodes)
    max_nodes: int = 20_000       # branch-and-bound node limit: unlike time, it stops CBC at the
                                  # same point on every run, so plans are reproducible
    rel_gap: float = 0.02         # stop when the proven relative gap is below this
    max_cuts: int = 64            # cut positions a region may start or end at
    max_span: int = 10            # a region spans at most this many consecutive cuts
    sac: bool = True              # also offer regions that keep their matmul/conv outputs
    threads: int = 1              # CBC threads (1 keeps results deterministic)
    min_peak_nodes: int = 0       # node limit of the least-peak solve: its LP bound is weak, CBC
                                  # finds its plans early and would spend the rest proving them
    improve_evals: int = 10_000   # plans the local search (planner/improve.py) scores after a solve (at most improve.WORK / nodes)

@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    solve: SolveOptions = field(default_factory=SolveOptions)  # ILP limits and candidate shape
    safety_margin: float = 0.01     # a simulated prediction = simulated peak * (1 + margin)
    # a replayed prediction (exact replay, measured steps) = replayed peak * (1 + replay_margin);
    # None: 0 on CPU, where the replay meters what a real step's meter does, 1% on accelerators
    # (allocator rounding, library workspaces)
    replay_margin: float | None = None
    find_min_feasible: bool = True  # also solve for the smallest feasible budget (one more ILP)
    rates: DeviceRates | None = None  # device speed for recompute-time estimates (default: by device)
    # the device the step will train on, when planning elsewhere ("cuda" for a model built on
    # `meta` on a laptop): its rates and its replay margin; None: the example inputs' device
    target_device: str | None = None
    # how recompute time is estimated (planner/costs.py): "roofline" (`rates`), "measured" (each
    # distinct op timed once on the device, cached), "auto" (measured on a CUDA device that is
    # present, the roofline elsewhere: CPU timings swing with load, and CPU plans stay reproducible)
    cost_model: str = "auto"

    def device_rates(self) -> DeviceRates | None:
        """The rates to estimate recompute time with (None: the profile takes the inputs' device's)."""
        if self.rates is not None:
            return self.rates
        return DeviceRates.for_device(self.target_device) if self.target_device else None
    # The step is `loss_fn(model(x)).backward()`: the output is released once the loss is computed
    # (HF Trainer, Lightning). True if your loop holds the output through backward (`out = model(x);
    # loss_fn(out).backward()` with `out` still referenced): its bytes are then in the budget too.
    keep_output: bool = False
    # ops outside torch's namespaces ("mylib::fused_mlp") that draw no random numbers; any other
    # such op is treated as random: never kept by a SAC region
    deterministic_ops: frozenset = frozenset()
    # gradient accumulation: with k > 1 the step planned is a micro-step after the first, every
    # gradient live from its start (the optimizer, when given, steps after the last)
    accumulation_steps: int = 1
    # plan_and_wrap keeps each plan it makes on disk (runtime/plan_cache.py: REMAT_CACHE_DIR), and a
    # later run of the same model, inputs, budget, loss and options takes it from there; False: not
    # read or written (also off for every run with REMAT_CACHE=0)
    cache: bool = True
