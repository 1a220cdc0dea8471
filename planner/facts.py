"""What the planner learned about the step, typed: the one reader of the `meta` dict a CostGraph
and a Plan carry (pure, no torch).

The dict stays the serialized form (Plan JSON, the plan cache); every reader goes through
`StepFacts.of(meta)` (`Plan.facts`), so each key is spelled here only, with its default: a key a
graph or plan does not carry reads as the default, never as "all" in one place and "none" in
another.

Examples:
    >>> f = StepFacts.of({"optimizer_state_bytes": 8, "workspace_bytes": 4, "extra": 1})
    >>> f.held_throughout_bytes, f.accumulation_steps, f.mutated_buffers is None
    (12, 1, True)
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Mapping


@dataclass(frozen=True)
class StepFacts:
    """The step as the capture, the profile and the runtime recorded it (`Plan.meta`, `CostGraph.meta`)."""
    trace_path: str = "fx"
    """How the graph was captured: "fx", "fx with opaque leaves", "torch.export", "module tree"."""
    trace_attempts: tuple[tuple[str, str], ...] = ()
    """Capture paths not taken, with why: (path, reason)."""
    device: str = "cpu"
    """The device type the step was profiled on."""
    loss: str | None = None
    """What the loss is: "given" (the user's loss_fn), "stand-in" (room for one output-sized tensor), ..."""
    keep_output: bool = False
    """The step keeps its output past the backward."""
    mutated_buffers: frozenset[str] | None = None
    """Buffers the step writes (a recompute rewinds them); None: not recorded, every buffer."""
    deterministic_ops: frozenset[str] = frozenset()
    """Custom ops ("namespace::name") the user declared free of randomness."""
    measured_peak_bytes: int | None = None
    """The profile's metered peak of the step without checkpointing; None: not metered."""
    optimizer: str | None = None
    """The optimizer whose step ends the training step (its class name), if any."""
    optimizer_state_bytes: int = 0
    """The optimizer's state, live throughout the step."""
    optimizer_step_bytes: int | None = None
    """The optimizer step's temporaries, after backward; None: no optimizer."""
    workspace_bytes: int = 0
    """The math libraries' workspaces, live throughout the step (planner/step/workspace.py)."""
    accumulation_steps: int = 1
    """Gradient accumulation: > 1 plans a micro-step with every gradient live from its start."""
    inputs: Mapping[str, dict] = field(default_factory=dict)
    """The named inputs' signature (shape, dtype) the graph was captured at."""
    extra_kwargs: Mapping[str, object] = field(default_factory=dict)
    """Keyword arguments a module-tree plan's step is called with besides the user's (use_cache=False)."""
    units: tuple[str, ...] | None = None
    """A data-parallel plan's unit of each node (runtime/distributed/)."""
    distributed: Mapping[str, object] | None = None
    """The data-parallel sharding a per-rank graph is for (planner/distributed.py)."""
    peak_phase: str = ""
    """The part of the step that holds the simulated peak: forward, backward or optimizer step."""
    cost_model: str | None = None
    """What estimated the recompute: "roofline" or "measured"; None: not recorded."""
    timing: Mapping[str, object] | None = None
    """The measured timing (runtime.measure.timing.StepTiming.to_dict) with plan_and_wrap(time=True)."""
    plan_time: Mapping[str, float] | None = None
    """Seconds spent making the plan, by stage (capture, profile, solve, replay)."""
    cached: bool = False
    """The plan was taken from the plan cache (runtime/plan_cache.py)."""

    @classmethod
    def of(cls, meta: "Mapping | StepFacts | None") -> "StepFacts":
        """The facts a meta dict records (keys it does not carry: their defaults; others ignored)."""
        if isinstance(meta, StepFacts):
            return meta
        meta = meta or {}
        got = {f.name: meta[f.name] for f in fields(cls) if meta.get(f.name) is not None}
        for name in ("mutated_buffers", "deterministic_ops"):
            if name in got:
                got[name] = frozenset(got[name])
        for name in ("trace_attempts", "units"):
            if name in got:
                got[name] = tuple(tuple(x) if isinstance(x, list) else x for x in got[name])
        return cls(**got)

    @staticmethod
    def noted(meta: Mapping, **facts) -> dict:
        """`meta` with `facts` recorded (by their field names: a misspelt one is a TypeError)."""
        unknown = set(facts) - {f.name for f in fields(StepFacts)}
        if unknown:
            raise TypeError(f"not a step fact: {', '.join(sorted(unknown))}")
        return {**meta, **facts}

    @property
    def held_throughout_bytes(self) -> int:
        """Bytes live through the whole step that a replay of forward and backward does not make:
        the optimizer's state, the math libraries' workspaces."""
        return self.optimizer_state_bytes + self.workspace_bytes

    @property
    def accumulates(self) -> bool:
        """The step is a micro-step of gradient accumulation (every gradient live from its start)."""
        return self.accumulation_steps > 1
