"""How the solver scales: large models planned on the meta device (no memory allocated).

    python benchmarks/scale.py                              # GPT-2-small shape and Llama-2-7B shape, 50%
    python benchmarks/scale.py --models gpt2-small --fractions 0.3 0.5 0.7
    python benchmarks/scale.py --flat                       # also today's flat path, for comparison
    python benchmarks/scale.py --out 2026-12-01-scale.md    # Markdown table in benchmarks/results/

Each model is built under `torch.device("meta")` (parameters and inputs are meta tensors), traced
and profiled by `planner.analyze`, and planned by `planner.solve_plan` at a fraction of its
activation memory: budget = fixed bytes + fraction x (unplanned peak - fixed bytes), where the
fixed bytes are `CostGraph.fixed_bytes` (parameters, buffers, inputs) and the unplanned peak is the
simulator's prediction (planner.fit.unplanned_peak_bytes). Models:
- gpt2-small: runtime.examples.gpt2(n_layer=12, d_model=768, n_head=12, seq_len=1024, batch=8,
  vocab=50257), fp32;
- llama-7b: Hugging Face LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=11008,
  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, vocab_size=32000)), fp32,
  sdpa attention, seq 4096, batch 1, labels = input ids (needs transformers).
Columns: graph nodes, analyze and solve seconds (wall clock, this machine; the solve's CPU
seconds, CBC's included, beside it: the machine may be shared), the unplanned and
planned peaks (predicted), recomputed FLOPs as a share of the forward's, the estimated extra
compute (recompute seconds over forward seconds, roofline estimate), and the solver's status.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner import PlanOptions, analyze, solve_plan  # noqa: E402
from planner.fit import unplanned_peak_bytes  # noqa: E402


def gpt2_small():
    from runtime.examples import gpt2

    with torch.device("meta"):
        ex = gpt2(n_layer=12, d_model=768, n_head=12, seq_len=1024, batch=8, vocab=50257)
    return ex.model, ex.inputs, {}, ex.loss_fn


def llama_7b():
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                   max_position_embeddings=4096, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).train()
        ids = torch.randint(0, cfg.vocab_size, (1, 4096))
    return model, (), dict(input_ids=ids, labels=ids), lambda out: out.loss


MODELS = {"gpt2-small": gpt2_small, "llama-7b": llama_7b}


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the CBC solver runs as one)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def run(name: str, fractions, flat: bool, options: PlanOptions) -> list[dict]:
    model, args, kwargs, loss_fn = MODELS[name]()
    a = analyze(model, args, kwargs, loss_fn)
    cg = a.cost_graph
    unplanned = unplanned_peak_bytes(cg, options)
    rows = []
    paths = [("hierarchical", False)] + ([("flat", True)] if flat else [])
    for frac in fractions:
        budget = int(cg.fixed_bytes + frac * (unplanned - cg.fixed_bytes))
        for path, force_flat in paths:
            import planner.fit as fit
            dispatch = fit.hierarchy.for_graph
            if force_flat:                     # today's path: the flat candidates and ILP
                fit.hierarchy.for_graph = lambda *_: None
            try:
                t0, c0 = time.perf_counter(), _cpu()
                p = solve_plan(cg, budget, options)
                solve_s, cpu_s = time.perf_counter() - t0, _cpu() - c0
            finally:
                fit.hierarchy.for_graph = dispatch
            rows.append(dict(model=name, path=path, nodes=len(cg.nodes), analyze_s=a.analyze_s, solve_s=solve_s, cpu_s=cpu_s,
                             fraction=frac, budget=budget, unplanned=unplanned, planned=p.predicted_peak_bytes,
                             min_feasible=p.min_feasible_bytes,
                             recompute_pct=100.0 * p.recompute_flops / max(p.total_flops, 1),
                             extra_pct=p.extra_compute_pct, status=f"{p.solver}: {p.status}"))
            r = rows[-1]
            print(f"{name:11s} {path:12s} {frac:.0%}  nodes {r['nodes']}  analyze {r['analyze_s']:.1f} s  "
                  f"solve {solve_s:.1f} s ({cpu_s:.1f} s CPU)  unplanned {gb(unplanned)}  budget {gb(budget)}  planned {gb(r['planned'])}  "
                  f"recompute {r['recompute_pct']:.1f}% of fwd FLOPs  extra {r['extra_pct']:.1f}%  [{r['status']}]",
                  flush=True)
    return rows


def markdown(rows: list[dict], argv: list[str]) -> str:
    head = ("| model | solver path | nodes | analyze s | solve s (CPU s) | budget (act.) | unplanned peak | planned peak "
            "| smallest feasible | recompute (% fwd FLOPs) | extra compute (est.) | solver status |")
    lines = [f"# Solver scaling: large models on the meta device ({time.strftime('%Y-%m-%d')})", "",
             f"`python benchmarks/scale.py {' '.join(argv)}` on {platform.machine()} with "
             f"{torch.get_num_threads()} torch threads, torch {torch.__version__}. Wall-clock seconds on a shared "
             "machine; the peaks are the planner's predictions (simulator, plus its 1% margin).", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mf = gb(r["min_feasible"]) if r["min_feasible"] else "-"
        lines.append(f"| {r['model']} | {r['path']} | {r['nodes']} | {r['analyze_s']:.1f} | {r['solve_s']:.1f} ({r['cpu_s']:.1f}) "
                     f"| {gb(r['budget'])} ({r['fraction']:.0%}) | {gb(r['unplanned'])} | {gb(r['planned'])} | {mf} "
                     f"| {r['recompute_pct']:.1f}% | {r['extra_pct']:.1f}% | {r['status']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5], help="of the activation memory")
    ap.add_argument("--flat", action="store_true", help="also plan with the flat path (before the hierarchy)")
    ap.add_argument("--out", help="Markdown file (a bare name goes to benchmarks/results/)")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        rows += run(name, args.fractions, args.flat, PlanOptions())
    if args.out:
        out = pathlib.Path(args.out)
        if out.parent == pathlib.Path("."):
            out = ROOT / "benchmarks" / "results" / out
        out.write_text(markdown(rows, argv))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
