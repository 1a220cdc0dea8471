"""Every option of planning, with its one default (pure data, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field

from remat.planner.profile.rates import DeviceRates

@dataclass(frozen=True, kw_only=True)
class SolveOptions:
    """The limits of the integer program (CBC) and the shape of its candidate regions:
    `PlanOptions(solve=SolveOptions(...))`. Every field is keyword-only.

    Examples:
        >>> from remat import PlanOptions, SolveOptions
        >>> options = PlanOptions(solve=SolveOptions(time_limit_s=30))
        >>> options.solve.time_limit_s, options.solve.max_nodes
        (30, 20000)
    """

    time_limit_s: float = 10.0
    """Wall-clock limit of one CBC solve, in seconds: 10 s by default, the one default of every
    entry point (`remat.plan_and_wrap`, `remat.apply`, `remat.plan`, `remat.assert_fits`'s
    `time_limit_s` and the CLI's `--time-limit`). It is a safety net: `max_nodes` stops CBC at
    the same point on every run; only when the time limit triggers first can two runs' plans
    differ."""
    max_nodes: int = 20_000
    """Branch-and-bound node limit: unlike time, it stops CBC at the same point on every run, so
    plans are reproducible."""
    rel_gap: float = 0.02
    """Stop when the proven relative gap is below this."""
    max_cuts: int = 64
    """Cut positions a region may start or end at (a graph with more boundaries keeps those
    where the fewest activation bytes cross)."""
    max_span: int = 10
    """A region spans at most this many consecutive cuts."""
    sac: bool = True
    """Also offer regions that keep their matmul/conv outputs (selective activation
    checkpointing); in compile mode, the kept nodes are MUST_SAVE tags (planner/compiled/tags.py)."""
    threads: int = 1
    """CBC threads (1 keeps results deterministic)."""
    min_peak_nodes: int = 0
    """Node limit of the least-peak solve (the search for the smallest feasible budget): its LP
    bound is weak, CBC finds its plans early and would spend the rest proving them. With no plan
    found within it, the solve goes on to `max_nodes`."""
    improve_evals: int = 10_000
    """Plans the local search (planner/solve/improve.py) scores after a solve (at most its work limit
    divided by the graph's node count); 0: no local search."""
    polish: bool = True
    """The hierarchical solve's plan for a budget polished by the flat ILP on small graphs
    (planner/solve/hierarchy.py); compile mode's fit does without (NOTE [ the compiled fit ] in
    runtime/planning.py)."""

@dataclass(frozen=True)
class PipelineRank:
    """What one rank of a pipeline-parallel job runs in a `schedule.step` (torch.distributed.pipelining),
    as plain data: plan_and_wrap(stage_module, ..., schedule=schedule) reads it off the schedule
    (runtime/distributed/pipeline.py) into `PlanOptions.pipeline`; the step planned is then the
    rank's whole schedule.step, each of its micro-batches run by the stage module."""

    actions: tuple[tuple[str, int], ...]
    """The rank's forward ("F") and backward ("B") of each micro-batch, in the schedule's order;
    under zero bubble a backward is split into its input part ("I") and its weight part ("W"),
    the micro-batch in flight until its "W"."""
    n_microbatches: int
    first: bool
    """The first stage: its inputs are the batch's micro-batches (no gradients); a later stage
    receives each micro-batch's activations into a buffer of its own that takes a gradient."""
    last: bool
    """The last stage computes each micro-batch's loss (the plan's `loss_fn`), and keeps each
    output to the step's end, where the schedule merges them (`return_outputs`)."""
    keeps_outputs: bool = True
    sends: tuple[tuple[int, int], ...] = ()
    """Outputs the schedule's pending sends hold past their backward (gloo's send works keep the
    tensor they send): (micro-batch, the backward after which the send is dropped; n_microbatches:
    the step's end)."""
    keeps_input_grads: bool = False
    """A later stage's input gradients (sent back, then dropped from the buffers) are held by
    their pending sends to the step's end (GPipe); False: each until the next backward ends (1F1B)."""
    holds_latest: bool = True
    """The schedule holds the latest forward's output until the next forward returns (a local of
    the one-stage schedules' loop); False: the multi-stage runtime drops it when the forward ends."""

    @classmethod
    def one_stage(cls, schedule: str, stage: int, n_stages: int, n_microbatches: int) -> "PipelineRank":
        """The order torch's one-stage schedules run a stage's micro-batches in: "gpipe" (every
        forward, then every backward) or "1f1b" (min(micro-batches, stages - stage) forwards, then
        a backward and a forward in turn; torch.distributed.pipelining's Schedule1F1B)."""
        n, last = n_microbatches, stage == n_stages - 1
        if schedule == "gpipe":         # every forward's send is waited for, and kept, to the step's end
            acts = [("F", m) for m in range(n)] + [("B", m) for m in range(n)]
            sends = () if last else tuple((m, n) for m in range(n))
        elif schedule == "1f1b":
            warm = min(n, n_stages - stage)
            acts = [("F", m) for m in range(warm)]
            for b in range(n):
                acts.append(("B", b))
                if warm + b < n:
                    acts.append(("F", warm + b))
            # the warmup's last fired send (micro-batch warm - 2) is kept until the 1B1F loop ends
            sends = () if last or warm < 2 else ((warm - 2, max(n - warm, warm - 2)),)
        else:
            raise ValueError(f"schedule {schedule!r}: 'gpipe' or '1f1b'")
        return cls(tuple(acts), n, stage == 0, last, sends=sends, keeps_input_grads=schedule == "gpipe")

    @classmethod
    def of_rank_order(cls, order: tuple[tuple[str, int, int], ...], stage: int, n_stages: int,
                      n_microbatches: int) -> "PipelineRank":
        """Stage `stage`'s part of a rank's order under torch's multi-stage runtime (interleaved
        1F1B: (kind, stage index, micro-batch) per forward "F" and backward "B", or input "I" and
        weight "W" backward parts under zero bubble; several stages on the rank): every send is
        waited for, and kept, to the step's end (forwards' outputs, backwards' input gradients),
        and the latest output is not held past its forward."""
        n, last = n_microbatches, stage == n_stages - 1
        acts = tuple((kind, m) for kind, s, m in order if s == stage)
        sends = () if last else tuple((m, n) for m in range(n))
        return cls(acts, n, stage == 0, last, sends=sends, keeps_input_grads=True, holds_latest=False)

    def in_flight(self) -> int:
        """The most micro-batches between their forward and their backward at once."""
        live, most = 0, 0
        for kind, _ in self.actions:
            live += {"F": 1, "I": 0}.get(kind, -1)
            most = max(most, live)
        return most

    def others_in_flight(self) -> tuple[int, int, int, int]:
        """The most *other* micro-batches in flight during a forward before any backward, a forward
        after one, the first backward, a later backward; -1 where there is no such action
        (CostGraph.inflight). A split backward counts as one at its weight part ("W"), the
        micro-batch in flight until then (its input part, "I", holds no fewer others)."""
        most = [-1, -1, -1, -1]
        live, backwards = 0, 0
        for kind, _ in self.actions:
            if kind == "I":
                continue
            if kind == "F":
                k = 0 if backwards == 0 else 1
                most[k] = max(most[k], live)
                live += 1
            else:
                k = 2 if backwards == 0 else 3
                live -= 1
                most[k] = max(most[k], live)
                backwards += 1
        return tuple(most)


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """How a step is planned: `plan_and_wrap(model, ..., options=PlanOptions(...))`, and the
    same for `remat.apply` (for the plans it makes for other shapes) and `remat.plan`. Every
    field is keyword-only and has a default; the ILP's own limits are in `solve`.

    Examples:
        >>> from remat import PlanOptions
        >>> options = PlanOptions(keep_output=True, accumulation_steps=4)
        >>> options.keep_output, options.solve.time_limit_s
        (True, 6.0)
    """

    solve: SolveOptions = field(default_factory=SolveOptions)
    """ILP limits and candidate shape (`SolveOptions`)."""
    safety_margin: float = 0.01
    """A simulated prediction is the simulated peak * (1 + `safety_margin`)."""
    replay_margin: float | None = None
    """A replayed prediction (exact replay, measured steps) is the replayed peak * (1 +
    `replay_margin`). None: 0 on CPU, where the replay meters what a real step's meter does, 1%
    on accelerators (allocator rounding, library workspaces)."""
    find_min_feasible: bool = True
    """Also solve for the smallest feasible budget (one more ILP): `Plan.min_feasible_bytes`,
    and the floor an `InfeasibleBudgetError` names (without it, that floor is not a searched
    one). `plan_and_wrap` searches it only when the budget is not met without it, so a plan of
    its that fits has `min_feasible_bytes` None."""
    rates: DeviceRates | None = None
    """Device speed for recompute-time estimates (None: by device, `target_device` or the
    example inputs')."""
    target_device: str | None = None
    """The device the step will train on, when planning elsewhere (`"cuda"` for a model built
    on `meta` on a laptop): its rates and its replay margin. None: the example inputs' device."""
    cost_model: str = "auto"
    """How recompute time is estimated (planner/profile/costs.py): `"roofline"` (`rates`), `"measured"`
    (each distinct op timed once on the device, cached), `"auto"` (measured on a CUDA device
    that is present, the roofline elsewhere: CPU timings swing with load, and CPU plans stay
    reproducible)."""

    def device_rates(self) -> DeviceRates | None:
        """The rates to estimate recompute time with (None: the profile takes the inputs' device's)."""
        if self.rates is not None:
            return self.rates
        return DeviceRates.for_device(self.target_device) if self.target_device else None
    keep_output: bool = False
    """The step planned is `loss_fn(model(x)).backward()`: the output is released once the loss
    is computed (Hugging Face Trainer, Lightning). True if your loop holds the output through
    backward (`out = model(x); loss_fn(out).backward()` with `out` still referenced): its bytes
    are then in the budget too."""
    deterministic_ops: frozenset = frozenset()
    """Ops outside torch's namespaces (`"mylib::fused_mlp"`) that draw no random numbers; any
    other such op is treated as random: never kept by a SAC region."""
    accumulation_steps: int = 1
    """Gradient accumulation: with k > 1 the step planned is a micro-step after the first, every
    gradient live from its start (the optimizer, when given, steps after the last)."""
    pipeline_outputs: bool = True
    """A pipeline's last stage keeps every micro-batch's output to the end of `schedule.step`
    (torch's `return_outputs=True`, its default); False if you call `schedule.step(...,
    return_outputs=False)`."""
    pipeline: PipelineRank | None = None
    """The step planned is one rank's whole pipeline `schedule.step` (`PipelineRank`): set by
    `plan_and_wrap(..., schedule=schedule)`. None: one forward and backward."""
    cache: bool = True
    """`plan_and_wrap` keeps each plan it makes on disk (runtime/plan_cache.py:
    `REMAT_CACHE_DIR`), and a later run of the same model, inputs, budget, loss and options
    takes it from there. False: not read or written (also off for every run with
    `REMAT_CACHE=0`)."""
