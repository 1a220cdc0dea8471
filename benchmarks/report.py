"""The results file: header (command, date, hardware, versions), tables and notes, as Markdown."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import socket
from pathlib import Path

import torch

from .exact import MAX_NODES

ROCKMATE = """Rockmate is not a strategy here: it does not run with torch 2.13 on CPU (what was tried:
benchmarks/results/solver-notes.md)."""


COMPILE = """torch.compile: the unplanned model compiled (Inductor, CPU) with
`torch._functorch.config.activation_memory_budget` = x, the largest x of the grid whose measured
peak fits the budget (else the least peak); x in parentheses. Dropout runs with Inductor's
`fallback_random=True` so its masks equal eager's, and the result is checked as at least as close
to a float64 eager step as float32 eager is (twice its error, plus 1e-5). Below x = 1 the
partitioner may recompute dropout in the backward with a fresh mask, so the gradients are
silently wrong (an open PyTorch issue, pytorch/pytorch#190758); this is why torch.compile rows
of models with dropout (the GPT-2s) can read NO. It is not an artefact of `fallback_random`:
see the toy check below, compiled with Inductor's default RNG."""


REMAT_COMPILE = """remat + torch.compile: `plan_and_wrap(model, budget, compile=True)`, as a user
calls it (runtime/rewrite/compiled.py). The planner plans plain regions only (no SAC), the rewritten graph
compiles whole (each region is Dynamo's checkpoint op: no graph breaks; the notes count graphs
and breaks), and every plan it tries is compiled and its step measured at the allocator, because
Inductor's partitioner decides what else the compiled step saves; the budget correction loop runs
on those measured peaks, and a budget below every compiled plan says so, with the smallest
compiled budget measured. Inductor defaults otherwise; `fallback_random=True` and caches off, so
compile times are cold. Peak: allocator peak, as for torch.compile; planning s: capture, profile,
solve and every compile. Checked as torch.compile is; where the float32 check fails, the same plan
is compiled in float64 and compared with the float64 eager step (the notes say so and give its
error): the row reads yes only if that is within 1e-8."""


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or platform.machine()


def stem(quick: bool) -> str:
    """step-time (benchmarks/results/step-time.md, the current file: a rerun replaces it; the old
    run's headline goes to benchmarks/results/HISTORY.md by hand), with -quick for a --quick run
    (it never overwrites the full table)."""
    return "step-time" + ("-quick" if quick else "")


def header(argv: list[str]) -> str:
    return "\n".join([
        f"# Benchmark {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')} on {socket.gethostname()}", "",
        f"- command: `{' '.join(['PYTHONPATH=. python benchmarks/run.py', *argv])}`",
        f"- hardware: {_cpu()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, CPU only;"
        f" {platform.platform()}",
        f"- versions: torch {torch.__version__}, python {platform.python_version()}, pulp {_version('pulp')},"
        f" transformers {_version('transformers')}, matplotlib {_version('matplotlib')}",
        "- budgets: fraction of the way from the smallest feasible peak to the unplanned peak",
        "- baselines (every block, sqrt(n) segments, SAC every block) run through the same rewriter as ours",
        "- measured peak: CPU live-tensor tracker (runtime.peak_memory); for the compiled rows (torch.compile,"
        " remat + torch.compile), allocator peak from profiler events (see the meter check)",
        "- step time: median over rounds that time one step of each strategy of the budget in turn (torch.compile"
        " at the fraction its search chose among them) of the per-round ratio to no checkpointing, with the range"
        " of those ratios (the spread) in parentheses; the machine is shared, so the spread is part of the result;"
        " wall time, or with `--clock cpu` the calling thread's CPU time (one torch thread: every kernel runs in it)",
        "- planning s: trace + profile + solve for ours; for remat + torch.compile, that plus every compile its"
        " measurements needed; for torch.compile, the compiles (first calls) its search for that budget needs"])


def main_table(rows: list[dict]) -> str:
    out = ["| model | budget (MB) | strategy | measured peak (MB) | fits | step time vs none | recomputed GFLOP |"
           " planning s | same loss+grads |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gflop = "n/a" if r["gflop"] is None else f"{r['gflop']:.3f}"
        out.append(f"| {r['model']} | {r['budget'] / 1e6:.2f} ({r['fraction']:.0%}) | {r['strategy']} | "
                   f"{r['peak'] / 1e6:.2f} | {'yes' if r['fits'] else 'no'} | {_ratio(r)} | {gflop} | "
                   f"{r['plan_s']:.1f} | {'yes' if r['same'] else 'NO'} |")
    return "\n".join(out)


def _ratio(r: dict) -> str:
    if r.get("low", r["ratio"]) == r.get("high", r["ratio"]):
        return f"{r['ratio']:.2f}x"
    return f"{r['ratio']:.2f}x ({r['low']:.2f}-{r['high']:.2f})"


def meter_table(meters: list[dict]) -> str:
    out = ["| model (eager, unplanned) | live-tensor peak (MB) | allocator peak (MB) | difference |",
           "|---|---|---|---|"]
    for m in meters:
        out.append(f"| {m['model']} | {m['live'] / 1e6:.2f} | {m['alloc'] / 1e6:.2f} | "
                   f"{(m['alloc'] - m['live']) / m['live']:+.1%} |")
    return "\n".join(out)


def _gap(ours: float, exact: float, scale: float) -> str:
    return f"{(ours - exact) * scale:+.3f}" + (f" ({(ours - exact) / exact:+.1%})" if exact else "")


def exact_table(exacts: list[dict]) -> str:
    out = ["| model | budget (MB) | nodes | exact ILP status | solve s | exact GFLOP | ours GFLOP | gap GFLOP |"
           " exact est. ms | ours est. ms | gap est. ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in exacts:
        head = (f"| {e['model']} | {e['budget'] / 1e6:.2f} ({e['fraction']:.0%}) | {e['nodes']} | {e['status']} |"
                f" {e['solve_s']:.1f} |")
        if "exact_s" not in e:
            out.append(head + f" - | {e['ours_flops'] / 1e9:.3f} | - | - | {e['ours_s'] * 1e3:.2f} | - |")
            continue
        out.append(head + f" {e['exact_flops'] / 1e9:.3f} | {e['ours_flops'] / 1e9:.3f} | "
                   f"{_gap(e['ours_flops'], e['exact_flops'], 1e-9)} | {e['exact_s'] * 1e3:.2f} | "
                   f"{e['ours_s'] * 1e3:.2f} | {_gap(e['ours_s'], e['exact_s'], 1e3)} |")
    return "\n".join(out)


def document(argv, rows, meters, exacts, notes: list[str], plots: list[Path]) -> str:
    parts = [header(argv), "## Strategies", main_table(rows),
             "## Meter check: allocator events against the live-tensor tracker",
             "The allocator also sees kernel scratch memory that never becomes a tensor (convolutions on CPU).",
             meter_table(meters)]
    if exacts:
        parts += [f"## Optimality gap against the exact ILP optimum (graphs of at most {MAX_NODES} nodes)",
                  "Every node boundary a cut, no span limit, zero gap, no node limit, 300 s limit; recompute of"
                  " both plans simulated with planner.solve.simulate.timeline. The ILP's memory model is the simulator's"
                  " (NOTE [ ILP ]), so no plan beats the exact optimum beyond CBC's tolerance of about a byte per"
                  " MB of budget; a negative gap can only come from that.",
                  exact_table(exacts)]
    parts += ["## Notes", COMPILE, REMAT_COMPILE, "\n".join(f"- {n}" for n in notes), ROCKMATE]
    if plots:
        parts += ["## Pareto plots", "\n".join(f"![{p.stem}]({p.name})" for p in plots)]
    return "\n\n".join(p for p in parts if p) + "\n"
