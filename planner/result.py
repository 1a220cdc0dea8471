"""What a plan is: checkpoint regions over the CostGraph's node order, and their predicted effect.

Pure data (no torch): solvers return it, the simulator replays it, the rewriter applies it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from remat.planner.errors import gb
from remat.planner.facts import StepFacts


@dataclass(frozen=True)
class Region:
    """Nodes start..end (inclusive) run under one checkpoint; `saved` nodes keep their outputs
    (SAC MUST_SAVE) instead of being recomputed.

    Examples:
        >>> from remat import Region
        >>> r = Region(4, 9, saved=(6,))
        >>> 4 in r, 10 in r
        (True, False)
    """
    start: int
    """The first node of the region (an index into `Plan.node_names`)."""
    end: int
    """The last node of the region, inclusive."""
    saved: tuple[int, ...] = ()
    """Nodes inside the region whose outputs are kept rather than recomputed (a selective
    checkpointing region); empty: everything inside is recomputed."""

    def __contains__(self, i: int) -> bool:
        return self.start <= i <= self.end


@dataclass(frozen=True)
class Plan:
    """Checkpoint regions over the step's graph (its nodes in execution order) and their
    predicted effect. `model.remat.plan`, `remat.plan` and `remat.assert_fits` give one;
    `to_json` and `from_json` carry it to another machine, where `remat.apply` installs it.
    Sizes are bytes, times seconds.

    Examples:
        >>> import torch
        >>> from remat import Plan, plan
        >>> m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
        >>> p = plan(m, 1.0, example_inputs=(torch.randn(32, 64),))
        >>> p.predicted_peak_bytes <= p.budget_bytes, Plan.from_json(p.to_json()) == p
        (True, True)
    """
    regions: tuple[Region, ...]
    """The checkpoint regions, in node order; empty when the step fits without checkpointing."""
    budget_bytes: int
    """The budget the plan was made for, in bytes (a `'%'` budget resolved)."""
    predicted_peak_bytes: int
    """The step's predicted peak under this plan, its margin included (`PlanOptions.safety_margin`,
    `PlanOptions.replay_margin`): simulated by `remat.plan`; `plan_and_wrap` and the CLI replay
    the rewritten step exactly on fake tensors (in compile mode, they measure it); `notes` says
    which."""
    unplanned_peak_bytes: int
    """The simulated peak of the step without checkpointing."""
    min_feasible_bytes: int | None
    """The smallest peak any plan reaches: the smallest budget that fits. None: not computed
    (`PlanOptions.find_min_feasible`)."""
    recompute_flops: int
    """Forward FLOPs run again in backward under this plan."""
    total_flops: int
    """Forward FLOPs of one step (the loss included)."""
    recompute_s: float
    """Estimated extra time of one step: the recompute, by `cost_model`."""
    forward_s: float
    """Estimated forward time of one step, by the same estimate."""
    solver: str
    """What made the plan: `"none"` (the step fits without checkpointing), `"ilp"`, or the name
    of the hand-made plan that won (`"every_block"`, `"sqrt"`, `"sac_every_block"`)."""
    status: str
    """The solver's status: `"optimal"`, `"feasible (node or time limit)"`, ..."""
    gap: float
    """The relative optimality gap the solver proved (NaN: none proven; `gap_text`)."""
    solve_s: float
    """Seconds the solve took."""
    node_names: tuple[str, ...] = ()
    """The names of the graph's nodes, in order (`Region.start` and `end` index them; the last
    is the loss); a module-tree plan's are its submodules' names."""
    opaque: tuple[tuple[str, str], ...] = ()
    """Untraceable submodules planned as single nodes: (module name, why)."""
    notes: tuple[str, ...] = ()
    """What the plan's numbers rest on, in words (which prediction, which fallbacks)."""
    meta: dict = field(default_factory=dict)
    """What the capture, profile and runtime recorded: the graph's provenance (`trace_path`,
    `device`, input shapes), `peak_phase`, `cost_model`, and with `time=True` the measured
    `timing`; its serialized form: read it typed as `facts`, and through the properties below."""

    @property
    def facts(self) -> StepFacts:
        """`meta`, typed (planner/facts.py): what the capture, profile and runtime recorded."""
        return StepFacts.of(self.meta)

    def noting(self, **facts) -> "Plan":
        """This plan with `facts` (StepFacts' field names) recorded in its meta."""
        return replace(self, meta=StepFacts.noted(self.meta, **facts))

    @property
    def trace_path(self) -> str:
        """How the graph was captured: "fx", "fx with opaque leaves", "torch.export", "module tree"."""
        return self.facts.trace_path

    @property
    def peak_phase(self) -> str:
        """The part of the step that holds the peak (simulated): forward, backward or optimizer step."""
        return self.facts.peak_phase

    @property
    def cost_model(self) -> str:
        """What estimated `recompute_s`: "roofline" (nominal rates) or "measured" (each op timed on
        the device: planner/profile/costs.py; a module-tree plan's are its units' forwards, timed)."""
        facts = self.facts
        return facts.cost_model or ("measured" if facts.trace_path == "module tree" else "roofline")

    @property
    def extra_compute_pct(self) -> float:
        """The estimated recompute as a percentage of the estimated forward:
        100 * `recompute_s` / `forward_s` (0 when `forward_s` is 0)."""
        return 100.0 * self.recompute_s / self.forward_s if self.forward_s else 0.0

    def to_json(self) -> str:
        """The plan as JSON text, every field included; `Plan.from_json` reads it back."""
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """The plan `to_json` wrote (install it with `remat.apply`)."""
        d = json.loads(text)
        d["regions"] = tuple(Region(r["start"], r["end"], tuple(r["saved"])) for r in d["regions"])
        for k in ("node_names", "notes"):
            d[k] = tuple(d[k])
        d["opaque"] = tuple(tuple(x) for x in d["opaque"])
        return cls(**d)

    @property
    def gap_text(self) -> str:
        """The proven optimality gap as printed: 'gap 2.0%', or that no bound was proven (the
        hand-made plans, the least-peak search and the hierarchical solve prove none)."""
        return "no proven bound" if self.gap != self.gap else f"gap {self.gap:.1%}"

    def summary(self) -> str:
        """The plan in lines of text: budget and predicted peak (unplanned, smallest feasible,
        the phase that holds it), recompute and its estimated share of the forward, the solver,
        how the graph was captured, then one line per region, opaque module and note, and the
        measured timing when the plan was timed."""
        lines = [
            f"budget {gb(self.budget_bytes)} | predicted peak {gb(self.predicted_peak_bytes)}"
            f" (unplanned {gb(self.unplanned_peak_bytes)}"
            + (f", smallest feasible {gb(self.min_feasible_bytes)}" if self.min_feasible_bytes else "")
            + ")" + (f", held by the {self.peak_phase}" if self.peak_phase else ""),
            f"recompute {self.recompute_flops / 1e9:.2f} GFLOP of {self.total_flops / 1e9:.2f} GFLOP forward;"
            f" estimated extra compute {self.extra_compute_pct:.1f}% of the forward ({self.cost_model} costs)",
            f"solver {self.solver}: {self.status}, {self.gap_text}, {self.solve_s:.2f} s",
            f"graph: {self.trace_path}" + "".join(f"; {p} not taken ({why})"
                                                  for p, why in self.facts.trace_attempts),
        ]
        if not self.regions:
            lines.append("no checkpoint regions: the step fits the budget as it is")
        for k, r in enumerate(self.regions):
            names = self.node_names[r.start:r.end + 1]
            kept = [self.node_names[i] for i in r.saved]
            lines.append(f"  region {k}: nodes {r.start}..{r.end} ({names[0]} .. {names[-1]}, {len(names)} nodes)"
                         + (f", keeps {', '.join(kept)}" if kept else ""))
        for mod, why in self.opaque:
            lines.append(f"  opaque module {mod}: {why}")
        lines.extend(f"  note: {n}" for n in self.notes)
        timing = self.facts.timing
        if timing is not None:                   # runtime.measure.timing, with plan_and_wrap(time=True)
            lines.append(f"timed: {timing['text']}")
        return "\n".join(lines)
