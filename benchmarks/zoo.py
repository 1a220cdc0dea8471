"""Real architectures (benchmarks/zoo_models.py) at 50% of their activation memory: trace path, fit, equality.

    python benchmarks/zoo.py [--models hf-gpt2,lstm-lm] [--fraction 0.5] [--out benchmarks/results/zoo.md]

Per model: how the graph was captured, its node count and opaque modules, the planning time, and
at `fixed + fraction * activations` (fixed = parameters, their grads, buffers, inputs): the
measured peak against the budget, the predicted peak (the plan's `predicted_peak_bytes`) and
its ratio to the measured one, and the predicted extra compute. Where no plan fits that
budget, the row says so with the smallest feasible budget, and the model is planned there
instead. Each row also checks that loss, grads, buffers and the RNG state after the step equal
the unwrapped model's. tests/test_zoo.py asserts the same per row.

The floor: the smallest feasible budget remat reports (the plan's `min_feasible_bytes`, or the
InfeasibleBudgetError's) beside the measured peaks of what a user could apply instead, on a
fresh copy with the same inputs and loss: every block checkpointed (planner.solve.baselines.every_block
through the same rewriter), and for Hugging Face models their own one-liner,
`model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`
(per-block checkpointing). Every measured peak is of the second real step (the first warms up).
tests/test_accuracy.py asserts predicted against measured, and the floor against these baselines.
The table goes to benchmarks/results/zoo.md (the current file: a rerun replaces it; move the old
run's headline to benchmarks/results/HISTORY.md); --out elsewhere for a run of some models.
"""
from __future__ import annotations

import argparse
import copy
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._pytree import tree_leaves

from remat.planner import InfeasibleBudgetError, PlanOptions, RematError, analyze
from remat.planner.solve.baselines import every_block
from remat.planner.result import Plan
from remat.planner.solve.simulate import timeline
from remat.runtime import plan_and_wrap
from remat.runtime.measure import peak_memory
from remat.runtime.rewrite import rewrite
from benchmarks.zoo_models import ZOO


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
    floor: int | None = None          # smallest feasible budget remat reports
    every_block: int | None = None    # measured peak with every block checkpointed (None: no blocks)
    hf_per_block: int | None = None   # measured peak with HF's gradient_checkpointing_enable() (HF only)

    @property
    def fits(self) -> bool:
        return self.measured <= self.planned_at

    @property
    def ratio(self) -> float:
        """predicted / measured: the accuracy contract is 1 <= ratio <= 1.05."""
        return self.predicted / self.measured


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


def planned_step(model, ex, seed=1) -> None:
    """The step remat plans, `loss_fn(model(...)).backward()`: the output released once the loss
    is computed (PlanOptions.keep_output is off). Peaks are measured on this one."""
    torch.manual_seed(seed)
    ex.loss_fn(model(*ex.inputs, **(ex.kwargs or {}))).backward()


def max_diff(a: list, b: list) -> float:
    return max((float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True)),
               default=0.0)


def measured_step(model, ex) -> int:
    """Peak live bytes of one real training step of `model` (called like `ex.model`), after a
    warm-up step; grads are cleared before each."""
    for p in model.parameters():
        p.grad = None
    planned_step(model, ex)
    for p in model.parameters():
        p.grad = None
    peak = peak_memory(lambda: planned_step(model, ex), model, ex.inputs, ex.kwargs or {})
    for p in model.parameters():
        p.grad = None
    return peak


def hf_per_block_peak(ex) -> int | None:
    """Measured peak of a copy of a Hugging Face model with its own per-block checkpointing on
    (`gradient_checkpointing_enable`, non-reentrant); None for other models."""
    model = copy.deepcopy(ex.model)
    if not hasattr(model, "gradient_checkpointing_enable"):
        return None
    with warnings.catch_warnings():    # transformers 5 calls it a deprecated alias of activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return measured_step(model, ex)


class _Graph(torch.nn.Module):
    """A rewritten graph called like the model (positional and keyword inputs)."""

    def __init__(self, model, gm, traced):
        super().__init__()
        self.gm, self.traced, self._model = gm, traced, (model,)

    def forward(self, *args, **kwargs):
        return self.gm(**self.traced.inputs(self._model[0], args, kwargs))


def every_block_peak(ex) -> int | None:
    """Measured peak of a copy with every block checkpointed (planner.solve.baselines.every_block, through
    the same rewriter as remat's plans); None when the model has no graph or no blocks."""
    model = copy.deepcopy(ex.model)
    try:
        a = analyze(model, ex.inputs, ex.kwargs, ex.loss_fn)
    except RematError:
        return None
    regions = every_block(a.cost_graph)
    if not regions:
        return None
    gm = rewrite(model, a.traced.gm, regions, tuple(c.name for c in a.cost_graph.nodes))
    return measured_step(_Graph(model, gm, a.traced), ex)


def _refused_floor(pristine, ex, kwargs, options) -> int | None:
    """The floor a plan that fits does not search (planner/solve/fit.py NOTE [ floor if needed ]): the one
    the refusal of a one-byte budget names."""
    try:
        plan_and_wrap(copy.deepcopy(pristine), 1e-9, example_inputs=ex.inputs, example_kwargs=kwargs,
                      loss_fn=ex.loss_fn, options=options)
        return None
    except InfeasibleBudgetError as e:
        return e.min_feasible_bytes


def run_row(name: str, fraction: float = 0.5, options: PlanOptions = PlanOptions(), baselines: bool = False,
            **overrides) -> Row:
    """One row; with `baselines`, also the every-block and Hugging Face per-block peaks."""
    ex = ZOO[name](**overrides)
    ref, model = copy.deepcopy(ex.model), ex.model
    blocks = (every_block_peak(ex), hf_per_block_peak(ex)) if baselines else (None, None)
    kwargs = ex.kwargs or {}
    probe = plan_and_wrap(copy.deepcopy(model), 1e6, example_inputs=ex.inputs, example_kwargs=kwargs,
                          loss_fn=ex.loss_fn, options=options).remat.plan
    fixed = fixed_bytes(model, (ex.inputs, kwargs))
    budget = int(fixed + fraction * (probe.unplanned_peak_bytes - fixed))
    t0 = time.perf_counter()
    why, planned_at = "", budget
    try:
        wrapped = plan_and_wrap(model, budget / 1e9, example_inputs=ex.inputs, example_kwargs=kwargs,
                                loss_fn=ex.loss_fn, options=options)
        t1 = time.perf_counter()
        floor = _refused_floor(ref, ex, kwargs, options)
        t0 += time.perf_counter() - t1       # not the plan's time
    except InfeasibleBudgetError as e:
        planned_at = floor = e.min_feasible_bytes
        wrapped = plan_and_wrap(model, planned_at / 1e9, example_inputs=ex.inputs, example_kwargs=kwargs,
                                loss_fn=ex.loss_fn, options=options)
        why = f"the smallest feasible peak is {planned_at / 1e6:.2f} MB{_where_peak(wrapped.remat.plan, ex)}"
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
    measured = peak_memory(lambda: planned_step(wrapped, ex), model, ex.inputs, kwargs)
    p = wrapped.remat.plan
    return Row(name, p.trace_path, len(p.node_names), [m for m, _ in p.opaque], plan_s, p.unplanned_peak_bytes,
               budget, planned_at, measured, p.predicted_peak_bytes, p.extra_compute_pct, len(p.regions), diff,
               torch.equal(ref_rng, rng), why, floor, *blocks)


def _where_peak(plan, ex) -> str:
    """Where the smallest feasible plan peaks: the floor no plan goes below."""
    if plan.trace_path == "module tree":
        return ", with every submodule checkpointed (module tree)"
    cg = analyze(ex.model, ex.inputs, ex.kwargs, ex.loss_fn).cost_graph
    tl = timeline(cg, plan.regions)
    phase, seq = max(((max(tl.fwd), "forward", tl.fwd), (max(tl.bwd), "backward", tl.bwd)))[1:]
    c = cg.nodes[max(range(len(seq)), key=seq.__getitem__)]
    return f", at the {phase} of {c.name}" + (f" ({c.module})" if c.module else "")


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def _floor(r: Row) -> str:
    """The floor, marked where it is above a baseline's measured peak (the floor contract)."""
    if r.floor is None:
        return "-"
    above = [k for k, v in (("every block", r.every_block), ("HF per-block", r.hf_per_block))
             if v is not None and r.floor > v]
    return _mb(r.floor) + (f" (above {' and '.join(above)})" if above else "")


def table(rows: list[Row]) -> str:
    head = ("| model | graph | nodes | opaque modules | plan s | unplanned MB | budget MB (50% act.) | measured MB "
            "| predicted MB | predicted / measured | fits | regions | est. extra compute | every block measured MB "
            "| HF per-block measured MB | remat floor MB | max abs diff vs original |\n" + "|---" * 17 + "|")
    lines = [head]
    for r in rows:
        fit = "yes" if r.measured <= r.budget else f"no: {r.why}; planned there, measured fits" if r.fits else "NO"
        lines.append(f"| {r.name} | {r.path} | {r.nodes} | {', '.join(r.opaque) or '-'} | {r.plan_s:.1f} "
                     f"| {r.unplanned / 1e6:.2f} | {r.budget / 1e6:.2f} | {r.measured / 1e6:.2f} "
                     f"| {r.predicted / 1e6:.2f} | {r.ratio:.3f} | {fit} | {r.regions} "
                     f"| {r.extra_pct:.0f}% | {_mb(r.every_block)} | {_mb(r.hf_per_block)} | {_floor(r)} "
                     f"| {r.max_abs_diff:.0e}{'' if r.rng_equal else ', RNG differs'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--fraction", type=float, default=0.5)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "zoo.md"),
                    help="also write the table to this markdown file (default benchmarks/results/zoo.md)")
    a = ap.parse_args(argv)
    rows = []
    for name in a.models.split(","):
        try:
            rows.append(run_row(name, a.fraction, baselines=True))
        except ImportError as e:
            print(f"{name}: skipped ({e})")
            continue
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    text = (f"torch {torch.__version__}, budget = fixed + {a.fraction:.0%} of activations; predicted = the plan's"
            " predicted_peak_bytes (contract: measured <= predicted <= 1.05 x measured); remat floor = the smallest"
            " feasible budget remat reports (contract: at most every baseline's measured peak)\n\n" + table(rows))
    print("\n" + text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
