"""The optimizer's part of a training step, measured by running its step on fake tensors.

No per-optimizer formula: a copy of the user's optimizer (same class, same param groups and
hyperparameters) steps twice on fake copies of the parameters, with fake gradients, under the
dispatcher-level meter. The first step creates the state (AdamW: two tensors per parameter,
plus its step counters); what it leaves is the state, live through every later step. The second
step's peak above parameters, gradients and state is its temporaries (foreach implementations
copy whole lists of tensors). `foreach=None` (torch's default) is resolved as torch resolves it
on the device the step trains on: foreach on CUDA, the per-tensor loop elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from remat.planner.compat import FakeTensorMode

from remat.planner.step.rng import rng_preserved
from remat.planner.step.storage import LiveBytes


@dataclass(frozen=True)
class OptimizerMemory:
    state_bytes: int        # the optimizer's state after its first step: live the whole step
    step_bytes: int         # the peak of optimizer.step() above parameters, gradients and state
    name: str               # the optimizer's class and implementation, for the report


def _groups(optimizer: torch.optim.Optimizer, fakes: dict[int, torch.Tensor], device: str) -> list[dict]:
    out = []
    for g in optimizer.param_groups:
        group = {k: v for k, v in g.items() if k != "params"}
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = device == "cuda"          # torch's default on that device
        out.append({**group, "params": [fakes[id(p)] for p in g["params"]]})
    return out


def optimizer_memory(optimizer: torch.optim.Optimizer, device: str | None = None) -> OptimizerMemory:
    """The state and step temporaries of `optimizer`'s step, for a step on `device` (default:
    the parameters' device). Leaves the optimizer, its parameters and every RNG as they were."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ValueError("the optimizer has no parameters")
    device = device or params[0].device.type
    with rng_preserved(), FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fakes = {id(p): mode.from_tensor(p) for p in params}
        for p in fakes.values():
            p.grad = torch.zeros_like(p)
        groups = _groups(optimizer, fakes, device)
        copy = type(optimizer)(groups)
        with LiveBytes(baseline=[t for p in fakes.values() for t in (p, p.grad)]) as meter:
            before = meter.live_bytes
            copy.step()
            state = meter.live_bytes - before
            meter.reset_peak()
            copy.step()
            step = meter.peak_bytes - meter.live_bytes
    foreach = {g.get("foreach") for g in groups}
    impl = "fused" if any(g.get("fused") for g in groups) else ("foreach" if True in foreach else "per-tensor")
    return OptimizerMemory(state, step, f"{type(optimizer).__name__} ({impl})")
