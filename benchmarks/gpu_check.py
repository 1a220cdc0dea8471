"""The promise on a real accelerator: a ~1B-parameter decoder (bf16, AdamW) planned and trained at
three budgets, predicted peak against `torch.cuda.max_memory_allocated`, step time against
checkpointing every block. One prepared run of a few minutes for a session that has a GPU:

    python benchmarks/gpu_check.py                                            # on a CUDA device: benchmarks/results/gpu.md
    python benchmarks/gpu_check.py --device cpu --tiny                        # the same code, small, on CPU

Per budget (fractions of the way from the smallest feasible to the unplanned whole-step peak, and
with --over-block every block's own measured peak times 1 + m: the same memory as its baseline):
plan with `plan_and_wrap(model, budget, optimizer=opt)`, train `--steps` whole steps (forward,
backward, optimizer.step(), zero_grad), and record the allocator's peak of the last one and the
median step time; before them, the unwrapped model and the same model with every block
checkpointed (torch's non-reentrant checkpoint on each decoder layer) as the baselines. Timings
never decide anything here: they are printed and saved. On a CUDA device the file is
benchmarks/results/gpu.md unless --out says otherwise (the current file: a rerun replaces it; move
the old run's headline to benchmarks/results/HISTORY.md); --tiny or a CPU device writes no file
unless --out names one.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remat.planner import InfeasibleBudgetError, PlanOptions  # noqa: E402
from remat.runtime import plan_and_wrap  # noqa: E402
from remat.runtime.examples import gpt2  # noqa: E402


def _model(tiny: bool, device: torch.device):
    """A GPT-2-style decoder: ~1.2B parameters (24 layers, d=2048, seq 2048, batch 4) or tiny."""
    cfg = dict(n_layer=2, d_model=128, n_head=4, seq_len=64, batch=2, vocab=512) if tiny else \
        dict(n_layer=24, d_model=2048, n_head=16, seq_len=2048, batch=4, vocab=50257)
    ex = gpt2(**cfg, dropout=0.0)
    model = ex.model.to(device=device, dtype=torch.bfloat16)
    return ex._replace(model=model, inputs=tuple(x.to(device) for x in ex.inputs)), cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train(model, ex, opt, steps: int, device: torch.device) -> tuple[int | None, float]:
    """(allocator peak of the last whole step on CUDA, else None; median step seconds)."""
    times, peak = [], None
    for k in range(steps):
        _sync(device)
        if device.type == "cuda" and k == steps - 1:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        ex.loss_fn(model(*ex.inputs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        times.append(time.perf_counter() - t0)
        if device.type == "cuda" and k == steps - 1:
            peak = torch.cuda.max_memory_allocated(device)
    return peak, statistics.median(times[1:] or times)


@contextlib.contextmanager
def every_block(model):
    """Inside, every decoder block checkpointed (what `gradient_checkpointing_enable()` does);
    the blocks' own forwards again after."""
    for block in model.h:
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)
    try:
        yield model
    finally:
        for block in model.h:
            del block.forward


def library_workspace(device: torch.device) -> int:
    """Bytes the allocator holds after one small bf16 matmul's forward and backward beyond its
    tensors (cuBLAS/cuBLASLt workspaces, kept for the process): what a step's allocator peak
    holds that no tensor of the step does. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    a = torch.randn(64, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    (a @ a).sum().backward()
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - before - 2 * a.numel() * a.element_size()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a small model (to check the script on CPU)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--out", type=Path, help="default on CUDA without --tiny: benchmarks/results/gpu.md")
    ap.add_argument("--fractions", nargs="*", type=float, default=[0.2, 0.5, 0.8],
                    help="budgets as fractions of the way from the smallest feasible to the unplanned peak")
    ap.add_argument("--over-block", nargs="*", type=float, default=[],
                    help="budgets at every-block checkpointing's measured peak times (1 + each) (CUDA)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if a.out is None and device.type == "cuda" and not a.tiny:
        a.out = Path(__file__).resolve().parent / "results" / "gpu.md"
    workspace = library_workspace(device)             # first, in a process that has run nothing yet
    ex, cfg = _model(a.tiny, device)
    params = sum(p.numel() for p in ex.model.parameters())
    opt = torch.optim.AdamW(ex.model.parameters(), lr=1e-4)
    _train(ex.model, ex, opt, 1, device)                  # the optimizer's state exists from here on
    base_peak, base_s = _train(ex.model, ex, opt, a.steps, device)      # before the model is wrapped
    with every_block(ex.model):
        block_peak, block_s = _train(ex.model, ex, opt, a.steps, device)
    options = PlanOptions()
    free = plan_and_wrap(ex.model, 10**6, example_inputs=ex.inputs, loss_fn=ex.loss_fn, optimizer=opt,
                         options=options).remat.plan
    try:
        plan_and_wrap(ex.model, 1e-6, example_inputs=ex.inputs, loss_fn=ex.loss_fn, optimizer=opt, options=options)
    except InfeasibleBudgetError as e:
        floor = e.min_feasible_bytes
    rows = []
    budgets = [(f"{f:.0%}", int(floor + f * (free.unplanned_peak_bytes - floor))) for f in a.fractions]
    budgets += [(f"every block +{m:.0%}", int(block_peak * (1 + m))) for m in a.over_block if block_peak]
    for name, budget in budgets:
        t0 = time.perf_counter()
        try:
            w = plan_and_wrap(ex.model, budget / 1e9, example_inputs=ex.inputs, loss_fn=ex.loss_fn, optimizer=opt,
                              options=options)
        except InfeasibleBudgetError as e:
            print(f"row {name}: {budget} B is below the smallest feasible {e.min_feasible_bytes} B", flush=True)
            continue
        plan_s = time.perf_counter() - t0
        peak, step_s = _train(w, ex, opt, a.steps, device)
        rows.append((name, budget, w.remat.plan.predicted_peak_bytes, peak, step_s, len(w.remat.plan.regions), plan_s,
                     w.remat.plan.peak_phase))
        print("row", rows[-1], flush=True)               # a run cut short still shows what it measured
    lines = [f"# GPU check: {cfg} ({params / 1e9:.2f}B parameters, bf16, AdamW) on "
             f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else device.type}, torch {torch.__version__}",
             "", f"unplanned whole step: predicted {free.unplanned_peak_bytes} B, measured {base_peak} B, {base_s:.3f} s; "
             f"every block checkpointed: "
             f"measured {block_peak} B, {block_s:.3f} s; smallest feasible (remat) {floor} B; library workspaces "
             f"after one bf16 matmul: {workspace} B", "",
             "| budget | bytes | predicted | measured (allocator) | pred/meas | step s | vs every block | regions | plan s | peak in |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, budget, pred, meas, step_s, regions, plan_s, phase in rows:
        ratio = f"{pred / meas:.3f}" if meas else "-"
        lines.append(f"| {name} | {budget} | {pred} | {meas if meas is not None else '-'} | {ratio} | {step_s:.3f} | "
                     f"{step_s / block_s:.2f}x | {regions} | {plan_s:.1f} | {phase} |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
