"""Real architectures (runtime.zoo) at 50% of their activation memory: trace path, fit, equality.

    python benchmarks/zoo.py [--models hf-gpt2,lstm-lm] [--fraction 0.5] [--out results/zoo.md]

Per model: how the graph was captured, its node count and opaque modules, the planning time, and
at `fixed + fraction * activations` (fixed = parameters, their grads, buffers, inputs): the
measured peak against the budget and the predicted extra compute. Where no plan fits that
budget, the row says so with the smallest feasible budget, and the model is planned there
instead. Each row also checks that loss, grads, buffers and the RNG state after the step equal
the unwrapped model's. tests/test_zoo.py asserts the same per row.
"""
from __future__ import annotations

import argparse
import copy
import time
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves

from planner import InfeasibleBudgetError, PlanOptions, analyze
from planner.simulate import timeline
from runtime import plan_and_wrap
from runtime.measure import peak_memory
from runtime.zoo import ZOO


@dataclass
class Row:
    name: str
    path: str
    nodes: int
    opaque: list
    plan_s: float
    unplanned: int
    budget: int           # fixed + fraction * activations
    planned_at: int       # the budget planned for: `budget`, or the smallest feasible one
    measured: int
    predicted: int
    extra_pct: float
    regions: int
    max_abs_diff: float   # outputs, loss, grads, buffers vs the unwrapped model
    rng_equal: bool
    why: str = ""         # why `budget` could not be met

    @property
    def fits(self) -> bool:
        return self.measured <= self.planned_at


def _bytes(ts) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts}.values())


def fixed_bytes(model, inputs) -> int:
    """Parameters, their grads, buffers and inputs: what no plan can drop."""
    params = [p for p in model.parameters()]
    return (_bytes(params) + _bytes([p for p in params if p.requires_grad]) + _bytes(list(model.buffers()))
            + _bytes([t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)]))


def _step(model, ex, seed=1):
    torch.manual_seed(seed)
    out = model(*ex.inputs, **(ex.kwargs or {}))
    loss = ex.loss_fn(out)
    loss.backward()
    return [t.detach() for t in tree_leaves(out) if isinstance(t, torch.Tensor)] + [loss.detach()], torch.get_rng_state()


def max_diff(a: list, b: list) -> float:
    return max((float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True)),
               default=0.0)


def run_row(name: str, fraction: float = 0.5, options: PlanOptions = PlanOptions(), **overrides) -> Row:
    ex = ZOO[name](**overrides)
    ref, model = copy.deepcopy(ex.model), ex.model
    kwargs = ex.kwargs or {}
    probe = plan_and_wrap(copy.deepcopy(model), 1e6, example_inputs=ex.inputs, example_kwargs=kwargs,
                          loss_fn=ex.loss_fn, options=options).plan
    fixed = fixed_bytes(model, (ex.inputs, kwargs))
    budget = int(fixed + fraction * (probe.unplanned_peak_bytes - fixed))
    t0 = time.perf_counter()
    why, planned_at = "", budget
    try:
        wrapped = plan_and_wrap(model, budget / 1e9, example_inputs=ex.inputs, example_kwargs=kwargs,
                                loss_fn=ex.loss_fn, options=options)
    except InfeasibleBudgetError as e:
        planned_at = e.min_feasible_bytes
        wrapped = plan_and_wrap(model, planned_at / 1e9, example_inputs=ex.inputs, example_kwargs=kwargs,
                                loss_fn=ex.loss_fn, options=options)
        why = f"the smallest feasible peak is {planned_at / 1e6:.2f} MB{_where_peak(wrapped.plan, ex)}"
    plan_s = time.perf_counter() - t0
    ref_out, ref_rng = _step(ref, ex)
    out, rng = _step(wrapped, ex)
    grads = [(p.grad, q.grad) for p, q in zip(ref.parameters(), model.parameters()) if p.grad is not None or q.grad is not None]
    if any(g is None or h is None for g, h in grads):
        raise AssertionError(f"{name}: a parameter has a grad in one model and not the other")
    diff = max(max_diff(ref_out, out), max_diff(*zip(*grads)),
               max_diff([b.float() for b in ref.buffers()], [b.float() for b in model.buffers()]))
    for p in model.parameters():
        p.grad = None
    measured = peak_memory(lambda: _step(wrapped, ex), model, ex.inputs, kwargs)
    p = wrapped.plan
    return Row(name, p.trace_path, len(p.node_names), [m for m, _ in p.opaque], plan_s, p.unplanned_peak_bytes,
               budget, planned_at, measured, p.predicted_peak_bytes, p.extra_compute_pct, len(p.regions), diff,
               torch.equal(ref_rng, rng), why)


def _where_peak(plan, ex) -> str:
    """Where the smallest feasible plan peaks: the floor no plan goes below."""
    if plan.trace_path == "module tree":
        return ", with every submodule checkpointed (module tree)"
    cg = analyze(ex.model, ex.inputs, ex.kwargs, ex.loss_fn).cost_graph
    tl = timeline(cg, plan.regions)
    phase, seq = max(((max(tl.fwd), "forward", tl.fwd), (max(tl.bwd), "backward", tl.bwd)))[1:]
    c = cg.nodes[max(range(len(seq)), key=seq.__getitem__)]
    return f", at the {phase} of {c.name}" + (f" ({c.module})" if c.module else "")


def table(rows: list[Row]) -> str:
    head = ("| model | graph | nodes | opaque modules | plan s | unplanned MB | budget MB (50% act.) | measured MB "
            "| fits | regions | est. extra compute | max abs diff vs original |\n" + "|---" * 12 + "|")
    lines = [head]
    for r in rows:
        fit = "yes" if r.measured <= r.budget else f"no: {r.why}; planned there, measured fits" if r.fits else "NO"
        lines.append(f"| {r.name} | {r.path} | {r.nodes} | {', '.join(r.opaque) or '-'} | {r.plan_s:.1f} "
                     f"| {r.unplanned / 1e6:.2f} | {r.budget / 1e6:.2f} | {r.measured / 1e6:.2f} | {fit} | {r.regions} "
                     f"| {r.extra_pct:.0f}% | {r.max_abs_diff:.0e}{'' if r.rng_equal else ', RNG differs'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--out", default=None, help="also write the table to this markdown file")
    a = ap.parse_args(argv)
    rows = []
    for name in a.models.split(","):
        try:
            rows.append(run_row(name, a.fraction))
        except ImportError as e:
            print(f"{name}: skipped ({e})")
            continue
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = f"torch {torch.__version__}, budget = fixed + {a.fraction:.0%} of activations\n\n" + table(rows)
    print("\n" + text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
