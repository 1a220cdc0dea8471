"""What a region of this rewriter costs on a device beyond recomputing its ops, measured through
the rewriter itself: the `Overheads` of the planner's measured cost model (planner/profile/costs.py).

A chain of cheap ops (tanh on 64 numbers: each saves its output, so a region's recompute runs)
is traced and rewritten (`rewrite`) as the planner's plans are, and its training steps are timed
in interleaved rounds, the fastest of each kept (a loaded machine only adds time):
- a region's fixed cost: 16 regions of 2 ops against one region of the same 32 ops (the same
  ops recomputed, the same tensors saved), per extra region;
- a tensor saved inside a region (checkpoint's hooks pack it in the forward and the recompute
  and unpack it in backward): what one region over the chain adds beyond the plain step and a
  forward (its recompute), its slope between chains of 8 and 32 ops;
- a SAC policy's cost per op (its dispatch mode runs in the forward and the recompute): the
  same region keeping its first node against the plain one, its slope between 8 and 32 ops.
`REGION_PROBE` hands this to the planner (`analyze(..., overheads=REGION_PROBE)`), which caches
the result per device with its op timings.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from remat.planner.profile.costs import OverheadProbe, Overheads, time_call
from remat.planner.profile.graph import compute_nodes
from remat.planner.result import Region

from .graph import rewrite, view_replay

ROUNDS = 30            # interleaved rounds (the fastest of each step is kept)
SHORT, LONG = 8, 32    # ops in the two chains
SPLIT = 16             # regions the long chain is cut into for the fixed cost


class _Chain(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        for _ in range(self.n):
            x = torch.tanh(x)
        return x


def _step(n: int, regions: tuple[Region, ...], x: torch.Tensor):
    model = _Chain(n)
    gm = fx.symbolic_trace(model)
    names = tuple(node.name for node in compute_nodes(gm)) + ("loss",)
    out = rewrite(model, gm, regions, names)

    def step():
        with view_replay():
            out(x).sum().backward()
    return step


def _forward(n: int, x: torch.Tensor):
    model = _Chain(n)
    return lambda: model(x)


def measure_overheads(device: str) -> Overheads:
    """The fixed cost of one region, of a tensor saved inside one, and of a SAC policy per op, in
    seconds on `device` (module docstring)."""
    x = torch.randn(64, device=device, requires_grad=True)
    pair = LONG // SPLIT
    steps = {}
    for n in (SHORT, LONG):
        steps |= {(n, "plain"): _step(n, (), x), (n, "region"): _step(n, (Region(0, n - 1),), x),
                  (n, "sac"): _step(n, (Region(0, n - 1, (0,)),), x), (n, "forward"): _forward(n, x)}
    steps[LONG, "split"] = _step(LONG, tuple(Region(i, i + pair - 1) for i in range(0, LONG, pair)), x)
    for fn in steps.values():
        fn()
    best = {k: float("inf") for k in steps}
    for _ in range(ROUNDS):
        for k, fn in steps.items():
            best[k] = min(best[k], time_call(fn, device))
    t = best
    added = {n: t[n, "region"] - t[n, "plain"] - t[n, "forward"] for n in (SHORT, LONG)}
    sac = {n: t[n, "sac"] - t[n, "region"] for n in (SHORT, LONG)}
    return Overheads(region_s=max(0.0, (t[LONG, "split"] - t[LONG, "region"]) / (SPLIT - 1)),
                     saved_tensor_s=max(0.0, (added[LONG] - added[SHORT]) / (LONG - SHORT)),
                     sac_op_s=max(0.0, (sac[LONG] - sac[SHORT]) / (LONG - SHORT)))


REGION_PROBE = OverheadProbe("runtime.rewrite regions (tanh chains, v1)", measure_overheads)
