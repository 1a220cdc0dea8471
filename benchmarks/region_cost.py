"""What a checkpoint region of the runtime's rewriter costs, against what the planner predicts.

    PYTHONPATH=. python benchmarks/region_cost.py [--threads 1] [--rounds 40]

A chain of 32 Linear+Tanh blocks (64 nodes) is rewritten with no region, one region over every
node, 8 regions and 32 regions (the same nodes recomputed in each), and the steps are timed in
interleaved rounds (the fastest of each); the prediction is planner.solve.simulate.timeline's under
measured costs (planner/profile/costs.py), the region overheads measured through the runtime's own
regions (runtime.rewrite.overhead.REGION_PROBE). Every plan recomputes the same nodes, so what
grows with the number of regions is each region's own cost.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat.planner import analyze  # noqa: E402
from remat.planner.result import Region  # noqa: E402
from remat.planner.solve.simulate import timeline  # noqa: E402
from remat.runtime.measure.timing import interleaved_times  # noqa: E402
from remat.runtime.rewrite import REGION_PROBE, rewrite  # noqa: E402


def chain(blocks: int = 32, width: int = 16, batch: int = 8):
    torch.manual_seed(0)
    layers = [torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(blocks)]
    return torch.nn.Sequential(*layers), torch.randn(batch, width)


def plans(n: int) -> dict[str, tuple[Region, ...]]:
    return {"no region": (), "1 region": (Region(0, n - 1),),
            "8 regions": tuple(Region(i, i + n // 8 - 1) for i in range(0, n, n // 8)),
            "32 regions": tuple(Region(i, i + n // 32 - 1) for i in range(0, n, n // 32))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--rounds", type=int, default=40)
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model, x = chain()
    an = analyze(model, (x,), cost_model="measured", overheads=REGION_PROBE)
    cg, names = an.cost_graph, tuple(c.name for c in an.cost_graph.nodes)
    cases = plans(len(cg.nodes) - 1)
    steps = []
    for regions in cases.values():
        gm = rewrite(model, an.traced.gm, regions, names)

        def step(gm=gm):
            model.zero_grad(set_to_none=True)
            gm(**an.traced.inputs(model, (x,), {})).sum().backward()
        steps.append(step)
    times = interleaved_times(steps, "cpu", rounds=a.rounds, warmup=3)
    base = min(times[0])
    print(f"region {cg.region_s * 1e6:.1f} us, SAC op {cg.sac_op_s * 1e6:.1f} us (measured costs, {cg.meta['costs']['overheads']})")
    for (label, regions), t in zip(cases.items(), times):
        print(f"{label}: measured {(min(t) - base) * 1e3:+.2f} ms, predicted "
              f"{timeline(cg, regions).recompute_s * 1e3:+.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
