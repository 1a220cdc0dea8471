"""How fast a device recomputes: the rates behind NodeCost.cost_s (pure data, no torch)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceRates:
    """Nominal device speed for the recompute-time estimate: a roofline of FLOPs and bytes moved,
    plus a fixed cost per dispatched op (eager PyTorch launches each op from Python), and what a
    checkpoint region of the runtime adds beyond its ops (planner/profile/costs.py: `Overheads`)."""
    flops_per_s: float
    bytes_per_s: float
    op_s: float
    region_s: float = 2e-4      # one checkpoint region: its call, frame and recompute set-up
    sac_op_s: float = 3e-5      # each op of a SAC region: the policy mode runs, forward and recompute
    saved_tensor_s: float = 1e-5    # each tensor saved inside a region: checkpoint's hooks (measured costs only)

    @classmethod
    def for_device(cls, device) -> "DeviceRates":
        """Nominal rates for a device (a torch.device or its type name: "cuda", "cpu", "meta").
        CPU: the roofline fitted on 2 x86 cores, the overheads as runtime.rewrite.overhead
        measures the runtime's regions on them with one torch thread (120 us a region, 18 us a
        SAC op, 10 us a saved tensor, under a load of 3); CUDA: nominal, not measured."""
        if getattr(device, "type", device) == "cuda":
            return cls(flops_per_s=2e14, bytes_per_s=3e12, op_s=1e-5)
        return cls(flops_per_s=1.5e11, bytes_per_s=4e10, op_s=1e-5, region_s=1.2e-4, sac_op_s=1.8e-5)
