"""How the solver scales: large models planned on the meta device (no memory allocated).

    python benchmarks/scale.py                              # GPT-2-small and Llama-2-7B shapes, 50%
    python benchmarks/scale.py --models all --fractions 0.3 0.5 0.7
    python benchmarks/scale.py --flat                       # also the flat path, for comparison
    python benchmarks/scale.py --models all --flat gpt2-small llama-7b   # the flat path for two of them
    python benchmarks/scale.py --models all --out /tmp/scale.md   # elsewhere than benchmarks/results/scale.md

Each model is built under `torch.device("meta")` (parameters and inputs are meta tensors), traced
and profiled by `planner.analyze` (with AdamW over its parameters for the Hugging Face shapes:
foreach=False, whose step's temporaries are per tensor as the fused step's; a foreach step holds
one more copy of every parameter at once, which puts the peak in the optimizer step), for the
target device's rates (`--target-device`, default cuda), and planned by `planner.solve_plan` at a
fraction of its activation memory: budget = held + fraction x (unplanned peak - held), where held
is what no plan can drop (CostGraph.fixed_bytes: parameters, buffers, inputs, optimizer state;
plus a gradient for every parameter) and the unplanned peak is the simulator's prediction
(planner.solve.fit.unplanned_peak_bytes). Models (MODELS):
- gpt2-small / gpt2-medium: runtime.examples.gpt2 (12 x 768 / 24 x 1024, seq 1024, batch 8,
  vocab 50257), fp32, no optimizer;
- llama-7b / llama-13b (Llama-2 shapes), llama-70b (Llama-3 shape: 80 layers, d 8192, GQA 64/8
  heads, vocab 128256), mixtral-8x7b (8 experts, top 2): Hugging Face configs, bf16, sdpa, seq 4096,
  batch 1 (the 70B and Mixtral: batch 8; at batch 1 their activations are a few % of the step,
  and 50% of them lies below its floor), labels = input ids (needs transformers).
Columns: graph nodes, analyze and solve seconds (wall clock, this machine; the solve's CPU
seconds, CBC's included, beside it: the machine may be shared), the unplanned and planned peaks
(predicted), recomputed FLOPs as a share of the forward's (and checkpointing every block's), the
estimated extra compute (recompute seconds over forward seconds, roofline estimate), and the
solver's status. Every solve is cold: remat's caches are off (REMAT_CACHE=0, unless set), so that
no CBC result stored by an earlier run is read back (planner/solve/cbc.py NOTE [ solved once ]).
The table goes to benchmarks/results/scale.md (the current file, from `--models all`: a rerun
replaces it; move the old run's headline to benchmarks/results/HISTORY.md); --out elsewhere for
a partial run.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import torch

os.environ.setdefault("REMAT_CACHE", "0")      # cold solves: no stored CBC result read back
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from remat.planner import InfeasibleBudgetError, PlanOptions, analyze, solve_plan  # noqa: E402
from remat.planner.solve.baselines import every_block  # noqa: E402
from remat.planner.solve.fit import unplanned_peak_bytes  # noqa: E402
from remat.planner.solve.simulate import timeline  # noqa: E402


def _gpt2(n_layer: int, d_model: int, n_head: int):
    def build():
        from remat.runtime.examples import gpt2

        with torch.device("meta"):
            ex = gpt2(n_layer=n_layer, d_model=d_model, n_head=n_head, seq_len=1024, batch=8, vocab=50257)
        return ex.model, ex.inputs, {}, ex.loss_fn
    return build


def _hf(config: str, seq: int = 4096, batch: int = 1, **cfg):
    """A Hugging Face causal LM of the given config on meta, bf16, labels = input ids."""
    def build():
        import transformers

        transformers.logging.set_verbosity_error()
        c = getattr(transformers, config)(max_position_embeddings=seq, use_cache=False,
                                          attn_implementation="sdpa", **cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(c).to(torch.bfloat16).train()
            ids = torch.randint(0, c.vocab_size, (batch, seq))
        return model, (), dict(input_ids=ids, labels=ids), lambda out: out.loss
    return build


# name -> (builder, AdamW over the parameters?)
MODELS = {
    "gpt2-small": (_gpt2(12, 768, 12), False),
    "gpt2-medium": (_gpt2(24, 1024, 16), False),
    "llama-7b": (_hf("LlamaConfig", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32000), True),
    "llama-13b": (_hf("LlamaConfig", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                      num_attention_heads=40, num_key_value_heads=40, vocab_size=32000), True),
    "llama-70b": (_hf("LlamaConfig", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                      rope_theta=500000.0, batch=8), True),
    "mixtral-8x7b": (_hf("MixtralConfig", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                         num_experts_per_tok=2, vocab_size=32000, batch=8), True),
}


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the CBC solver runs as one)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def run(name: str, fractions, flat: bool, options: PlanOptions) -> list[dict]:
    build, adamw = MODELS[name]
    model, args, kwargs, loss_fn = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False) if adamw else None
    t0 = time.perf_counter()
    a = analyze(model, args, kwargs, loss_fn, optimizer=opt, target_device=options.target_device)
    analyze_s = time.perf_counter() - t0
    cg = a.cost_graph
    block = every_block(cg)
    per_block = 100.0 * timeline(cg, block).recompute_flops / max(sum(c.flops for c in cg.nodes), 1) if block else float("nan")
    unplanned = unplanned_peak_bytes(cg, options)
    held = cg.fixed_bytes + cg.param_bytes     # parameters, their gradients, optimizer state, inputs
    rows = []
    paths = [("hierarchical", False)] + ([("flat", True)] if flat else [])
    for frac in fractions:
        budget = int(held + frac * (unplanned - held))
        for path, force_flat in paths:
            import remat.planner.solve.fit as fit
            dispatch = fit.hierarchy.for_graph
            if force_flat:                     # today's path: the flat candidates and ILP
                fit.hierarchy.for_graph = lambda *_: None
            at = budget
            try:
                t0, c0 = time.perf_counter(), _cpu()
                try:
                    p = solve_plan(cg, at, options)
                except InfeasibleBudgetError as e:      # the fraction lies below the floor: plan there
                    at = e.min_feasible_bytes
                    p = solve_plan(cg, at, options)
                solve_s, cpu_s = time.perf_counter() - t0, _cpu() - c0
            finally:
                fit.hierarchy.for_graph = dispatch
            rows.append(dict(model=name, path=path, nodes=len(cg.nodes), analyze_s=analyze_s, solve_s=solve_s, cpu_s=cpu_s,
                             fraction=frac, budget=at, at_floor=at != budget, unplanned=unplanned, planned=p.predicted_peak_bytes,
                             min_feasible=p.min_feasible_bytes,
                             recompute_pct=100.0 * p.recompute_flops / max(p.total_flops, 1),
                             extra_pct=p.extra_compute_pct, per_block_pct=per_block, optimizer=bool(opt), status=f"{p.solver}: {p.status}"))
            r = rows[-1]
            print(f"{name:11s} {path:12s} {frac:.0%}  nodes {r['nodes']}  analyze {r['analyze_s']:.1f} s  "
                  f"solve {solve_s:.1f} s ({cpu_s:.1f} s CPU)  unplanned {gb(unplanned)}  budget {gb(at)}{' (the floor*)' if at != budget else ''}  planned {gb(r['planned'])}  "
                  f"recompute {r['recompute_pct']:.1f}% of fwd FLOPs (every block {r['per_block_pct']:.0f}%)  extra {r['extra_pct']:.1f}%  [{r['status']}]",
                  flush=True)
    return rows


def markdown(rows: list[dict], argv: list[str]) -> str:
    head = ("| model | solver path | nodes | analyze s | solve s (CPU s) | budget (act.) | unplanned peak | planned peak "
            "| smallest feasible | recompute (% fwd FLOPs) | every block recomputes | extra compute (est.) | solver status |")
    lines = [f"# Solver scaling: large models on the meta device ({time.strftime('%Y-%m-%d')})", "",
             f"`python benchmarks/scale.py {' '.join(argv)}` on {platform.machine()} with "
             f"{torch.get_num_threads()} torch threads, torch {torch.__version__}. Wall-clock seconds on a shared "
             "machine; the peaks are the planner's predictions (simulator, plus its 1% margin).", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        mf = gb(r["min_feasible"]) if r["min_feasible"] else "-"
        lines.append(f"| {r['model']} | {r['path']} | {r['nodes']} | {r['analyze_s']:.1f} | {r['solve_s']:.1f} ({r['cpu_s']:.1f}) "
                     f"| {gb(r['budget'])} ({'floor*' if r['at_floor'] else format(r['fraction'], '.0%')}) | {gb(r['unplanned'])} | {gb(r['planned'])} | {mf} "
                     f"| {r['recompute_pct']:.1f}% | {r['per_block_pct']:.1f}% | {r['extra_pct']:.1f}% | {r['status']} |")
    return "\n".join(lines) + "\n"


def appended(text: str, rows: list[dict], argv: list[str]) -> str:
    """`text` (a file `markdown` wrote) with `rows` after its table's last row and the command in its header."""
    lines, new = text.split("\n"), markdown(rows, argv).split("\n")
    last = max(i for i, line in enumerate(lines) if line.startswith("| "))
    cmd = new[2].split(" on ")[0]
    lines[2] = lines[2].replace("` on ", f"`, then {cmd} on ", 1)
    return "\n".join(lines[:last + 1] + [line for line in new if line.startswith("| ")][1:] + lines[last + 1:])


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["gpt2-small", "llama-7b"],
                    choices=list(MODELS) + ["all"])
    ap.add_argument("--fractions", nargs="+", type=float, default=[0.5], help="of the activation memory")
    ap.add_argument("--flat", nargs="*", metavar="MODEL", help="also plan with the flat path (before the "
                    "hierarchy): these models, or with no name every model run")
    ap.add_argument("--target-device", default="cuda", help="the rates and optimizer step planned for")
    ap.add_argument("--out", default="scale.md",
                    help="Markdown file (a bare name goes to benchmarks/results/; default scale.md)")
    ap.add_argument("--append", action="store_true", help="add the rows to --out's table (and the command to its header)")
    args = ap.parse_args(argv)
    rows = []
    for name in list(MODELS) if "all" in args.models else args.models:
        flat = args.flat is not None and (not args.flat or name in args.flat)
        rows += run(name, args.fractions, flat, PlanOptions(target_device=args.target_device))
    if args.out:
        out = pathlib.Path(args.out)
        if not out.suffix:
            out = out.with_suffix(".md")
        if out.parent == pathlib.Path("."):
            out = ROOT / "benchmarks" / "results" / out
        out.write_text(appended(out.read_text(), rows, argv) if args.append and out.exists() else markdown(rows, argv))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
