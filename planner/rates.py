"""How fast a device recomputes: the rates behind NodeCost.cost_s (pure data, no torch)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceRates:
    """Nominal device speed for the recompute-time estimate: a roofline of FLOPs and bytes moved,
    plus a fixed cost per dispatched op (eager PyTorch launches each op from Python)."""
    flops_per_s: float
    bytes_per_s: float
    op_s: float
    region_s: float = 2e-4      # one checkpoint region: its call, frame and recompute set-up
    sac_op_s: float = 3e-5      # each op of a SAC region: the policy mode runs, forward and recompute

    @classmethod
    def for_device(cls, device) -> "DeviceRates":
        """Nominal rates for a device (a torch.device or its type name: "cuda", "cpu", "meta")."""
        if getattr(device, "type", device) == "cuda":
            return cls(flops_per_s=2e14, bytes_per_s=3e12, op_s=1e-5)
        return cls(flops_per_s=1.5e11, bytes_per_s=4e10, op_s=1e-5)   # fitted on 2 x86 cores
