"""What a plan is: checkpoint regions over the CostGraph's node order, and their predicted effect.

Pure data (no torch): solvers return it, the simulator replays it, the rewriter applies it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from .errors import gb


@dataclass(frozen=True)
class Region:
    """Nodes start..end (inclusive) run under one checkpoint; `saved` nodes keep their outputs
    (SAC MUST_SAVE) instead of being recomputed."""
    start: int
    end: int
    saved: tuple[int, ...] = ()

    def __contains__(self, i: int) -> bool:
        return self.start <= i <= self.end


@dataclass(frozen=True)
class Plan:
    regions: tuple[Region, ...]
    budget_bytes: int
    predicted_peak_bytes: int          # simulated peak of the step under this plan
    unplanned_peak_bytes: int          # simulated peak without checkpointing
    min_feasible_bytes: int | None     # smallest peak any plan reaches (None: not computed)
    recompute_flops: int
    total_flops: int                   # forward FLOPs of one step (the loss included)
    recompute_s: float                 # estimated extra time (roofline estimate)
    forward_s: float                   # estimated forward time, same estimate
    solver: str                        # "none" (fits unplanned), "ilp", or a baseline's name
    status: str                        # solver status: "optimal", "feasible (node or time limit)"
    gap: float                         # relative optimality gap the solver proved
    solve_s: float
    node_names: tuple[str, ...] = ()
    opaque: tuple[tuple[str, str], ...] = ()   # untraceable modules planned as single nodes
    notes: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)

    @property
    def trace_path(self) -> str:
        """How the graph was captured: "fx", "fx with opaque leaves", "torch.export", "module tree"."""
        return self.meta.get("trace_path", "fx")

    @property
    def peak_phase(self) -> str:
        """The part of the step that holds the peak (simulated): forward, backward or optimizer step."""
        return self.meta.get("peak_phase", "")

    @property
    def cost_model(self) -> str:
        """What estimated `recompute_s`: "roofline" (nominal rates) or "measured" (each op timed on
        the device: planner/costs.py; a module-tree plan's are its units' forwards, timed)."""
        return self.meta.get("cost_model", "measured" if self.trace_path == "module tree" else "roofline")

    @property
    def extra_compute_pct(self) -> float:
        return 100.0 * self.recompute_s / self.forward_s if self.forward_s else 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Plan":
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
        lines = [
            f"budget {gb(self.budget_bytes)} | predicted peak {gb(self.predicted_peak_bytes)}"
            f" (unplanned {gb(self.unplanned_peak_bytes)}"
            + (f", smallest feasible {gb(self.min_feasible_bytes)}" if self.min_feasible_bytes else "")
            + ")" + (f", held by the {self.peak_phase}" if self.peak_phase else ""),
            f"recompute {self.recompute_flops / 1e9:.2f} GFLOP of {self.total_flops / 1e9:.2f} GFLOP forward;"
            f" estimated extra compute {self.extra_compute_pct:.1f}% of the forward ({self.cost_model} costs)",
            f"solver {self.solver}: {self.status}, {self.gap_text}, {self.solve_s:.2f} s",
            f"graph: {self.trace_path}" + "".join(f"; {p} not taken ({why})"
                                                  for p, why in self.meta.get("trace_attempts", ())),
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
        if "timing" in self.meta:                # runtime.measure.timing, with plan_and_wrap(time=True)
            lines.append(f"timed: {self.meta['timing']['text']}")
        return "\n".join(lines)
