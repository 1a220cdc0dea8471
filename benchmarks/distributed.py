"""FSDP2 on 2 gloo ranks (CPU): remat against torchtitan's checkpointing at equal per-rank memory.

    python benchmarks/distributed.py [--models gpt,hf-llama] [--layers 6] [--dim 256] [--seq 256]
                                     [--batch 8] [--vocab 4096] [--steps 6]
                                     [--out benchmarks/results/distributed.md]

Models: `gpt`, a GPT-style model (attention by scaled_dot_product_attention, 4x MLP, vocab 512);
`hf-llama`, a Hugging Face LlamaForCausalLM from a config (`--layers` decoder layers, hidden
`--dim`, MLP 2.75 x dim, 4 heads, vocab `--vocab`). Each block (decoder layer) sharded with
fully_shard, then the root (torchtitan's `apply_fsdp` order); AdamW steps; the loss the logits'
mean logsumexp. Strategies:
- none: no checkpointing;
- per-block: every block under checkpoint_wrapper before sharding (torchtitan's `full` AC);
- sac: every block under a selective checkpoint that saves its matmul outputs (torchtitan's
  op-level SAC keeps matmuls; here all of them);
- remat: plan_and_wrap with the per-rank budget set to per-block's measured peak (equal memory),
  and again at sac's measured peak.
Per rank: the measured peak of one step (allocator events, runtime.measure.allocator_peak, with
the sharded parameters and the optimizer's state), and the median step time over `--steps`
rounds in which every strategy takes one step in turn; the slower rank's numbers are reported. CPU times on a shared
machine are noisy: ratios in one run, not absolute speeds.
The table goes to benchmarks/results/distributed.md (the current file: a rerun replaces it; move the
old run's headline to benchmarks/results/HISTORY.md).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.measure import CLOCKS  # noqa: E402

WORLD = 2


class Block(nn.Module):
    def __init__(self, d: int, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(a)
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, d: int, layers: int, vocab: int = 512):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def loss_fn(out):
    return getattr(out, "logits", out).float().logsumexp(-1).mean()


def hf_llama(cfg: dict) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    d = cfg["dim"]
    return LlamaForCausalLM(LlamaConfig(vocab_size=cfg["vocab"], hidden_size=d, intermediate_size=d * 11 // 4,
                                        num_hidden_layers=cfg["layers"], num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=cfg["seq"]))


MODELS = {"gpt": lambda cfg: GPT(cfg["dim"], cfg["layers"]), "hf-llama": hf_llama}


def blocks(m: nn.Module) -> nn.ModuleList:
    return m.model.layers if hasattr(m, "model") else m.layers


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _sac_policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if op in _MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def build(cfg: dict, strategy: str, model: str) -> nn.Module:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    import functools
    torch.manual_seed(0)
    m = MODELS[model](cfg)
    layers = blocks(m)
    for i, block in enumerate(layers):
        if strategy == "per-block":
            block = checkpoint_wrapper(block, preserve_rng_state=False)
        elif strategy == "sac":
            block = checkpoint_wrapper(block, preserve_rng_state=False,
                                       context_fn=functools.partial(create_selective_checkpoint_contexts, _sac_policy))
        layers[i] = block
        fully_shard(block)
    return fully_shard(m)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _step_fn(model_call, opt, idx, kwargs):
    def step():
        loss_fn(model_call(idx, **kwargs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def peak_of(model: nn.Module, opt, step) -> int:
    """Peak bytes of one step after two warm-up steps (the optimizer's state exists by then)."""
    from remat.runtime.measure.peak import allocator_peak
    for _ in range(2):
        step()
    state = [_local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return allocator_peak(step, [_local(p) for p in model.parameters()] + state)


def _timed(step) -> tuple[float, float]:
    """(wall seconds between barriers, this rank's main-thread CPU seconds): on CPU the autograd
    engine runs backward in the calling thread and gloo's collectives in its own, so the CPU time
    is the rank's compute, which the other jobs of a shared machine do not stretch."""
    dist.barrier()
    wall, cpu = CLOCKS["wall"], CLOCKS["cpu"]
    t0, c0 = wall(), cpu()
    step()
    c1 = cpu()
    dist.barrier()
    return wall() - t0, c1 - c0


def rank_main(rank: int, cfg: dict, port: int, out_dir: str) -> None:
    """Each strategy's peak, then step times taken round-robin over the strategies (`steps`
    rounds), so that drift on a shared machine hits them alike."""
    from remat.planner import InfeasibleBudgetError
    from remat.runtime import plan_and_wrap
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    steps, rows = {}, {}
    for model in cfg["models"]:
        vocab = cfg["vocab"] if model == "hf-llama" else 512
        idx = torch.randint(0, vocab, (cfg["batch"], cfg["seq"]), generator=torch.Generator().manual_seed(1))
        local = idx.chunk(WORLD)[rank]
        kw = {"use_cache": False} if model == "hf-llama" else {}    # as Hugging Face trains under checkpointing
        for strategy in ("none", "per-block", "sac"):
            m = build(cfg, strategy, model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            steps[model, strategy] = _step_fn(m, opt, local, kw)
            peak = torch.tensor([peak_of(m, opt, steps[model, strategy])], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)     # the per-rank memory: the larger rank's
            rows[model, strategy] = [int(peak.item()), None, None, None]
        for ref in ("per-block", "sac"):
            m = build(cfg, "none", model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            t0 = time.perf_counter()
            name = f"remat @ {ref}"
            try:
                w = plan_and_wrap(m, rows[model, ref][0] / 1e9, example_inputs=(local,), example_kwargs=kw,
                                  loss_fn=loss_fn, optimizer=opt)
            except InfeasibleBudgetError as e:     # (on every rank) its measured peak lies below our floor: plan there
                w = plan_and_wrap(m, e.min_feasible_bytes / 1e9, example_inputs=(local,), example_kwargs=kw,
                                  loss_fn=loss_fn, optimizer=opt)
                name += " (at our floor*)"
            plan_s = time.perf_counter() - t0
            steps[model, name] = _step_fn(w, opt, local, kw)
            rows[model, name] = [peak_of(m, opt, steps[model, name]), w.remat.plan.predicted_peak_bytes,
                                 len(w.remat.plan.regions), plan_s]
    times = {k: [] for k in steps}
    order = list(steps)
    for i in range(cfg["steps"]):            # each round in another order: no strategy always first
        for k in order[i % len(order):] + order[:i % len(order)]:
            times[k].append(_timed(steps[k]))
    out = {"|".join(k): (rows[k][0], times[k], *rows[k][1:]) for k in steps}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def table(ranks: list[dict], cfg: dict, argv: list[str]) -> str:
    def slower(clock: int) -> dict:    # per strategy and round, the slower rank's time by one clock
        return {k: [max(r[k][1][i][clock] for r in ranks) for i in range(len(ranks[0][k][1]))] for k in ranks[0]}

    # a round's step time: the slower rank's (the ranks meet at barriers around every step); its
    # compute: the larger rank's CPU time
    rounds, cpu = slower(0), slower(1)
    worst = {k: (max(r[k][0] for r in ranks), statistics.median(rounds[k])) + tuple(ranks[0][k][2:]) for k in ranks[0]}
    lines = [f"# FSDP2 on {WORLD} gloo ranks: remat vs torchtitan's checkpointing ({datetime.date.today()})", "",
             f"`python benchmarks/distributed.py {' '.join(argv)}` on {platform.machine()}, {os.cpu_count()} cores "
             f"(shared), torch {torch.__version__}, 1 thread per rank. Each model: {cfg['layers']} blocks, "
             f"d={cfg['dim']}, global batch {cfg['batch']} x {cfg['seq']} tokens ({cfg['batch'] // WORLD} sequences "
             f"per rank), AdamW (GPT: vocab 512; HF Llama: vocab {cfg['vocab']}); "
             "fully_shard per block, then the root. Per rank (the slower rank): measured peak of one step "
             "(allocator events), median step time over "
             f"{cfg['steps']} rounds of one step per strategy in turn (each round in another order); "
             "vs per-block: the median and range over the rounds of the step time over per-block's in the same round; "
             "CPU: the same for the rank's main-thread CPU time (its compute: the autograd engine runs backward in "
             "that thread on CPU, gloo's collectives in their own), the larger rank's."]
    for model in cfg["models"]:
        none_s = worst[f"{model}|none"][1]

        def vs_block(k: str, times: dict) -> str:
            r = sorted(a / b for a, b in zip(times[k], times[f"{model}|per-block"]))
            return f"{statistics.median(r):.2f}x [{r[0]:.2f}-{r[-1]:.2f}]"
        lines += ["", f"## {model}", "",
                  "| strategy | per-rank peak | step time | vs no checkpointing | vs per-block | CPU ms | CPU vs per-block "
                  "| remat predicted | regions | plan s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for k, (peak, step_s, pred, regions, plan_s) in worst.items():
            if not k.startswith(model + "|"):
                continue
            extra = (f"{pred / 1e6:.2f} MB" if pred else "", str(regions) if regions is not None else "",
                     f"{plan_s:.1f}" if plan_s else "")
            lines.append(f"| {k.split('|')[1]} | {peak / 1e6:.2f} MB | {step_s * 1e3:.0f} ms | {step_s / none_s:.2f}x | "
                         f"{vs_block(k, rounds)} | {statistics.median(cpu[k]) * 1e3:.0f} | {vs_block(k, cpu)} | "
                         + " | ".join(extra) + " |")
    if any("floor*" in k for k in worst):
        lines += ["", "*: the baseline's measured peak lies below the smallest per-rank budget remat plans for "
                  "(the floor the planner names: what it cannot take out of the step, e.g. the loss's backward, "
                  "or a kept all-gather buffer it counts), so remat is planned at that floor."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,hf-llama")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "distributed.md"))
    argv = sys.argv[1:] if argv is None else argv
    a = ap.parse_args(argv)
    cfg = {k: getattr(a, k) for k in ("layers", "dim", "seq", "batch", "vocab", "steps")}
    cfg["models"] = [m for m in a.models.split(",") if m]
    unknown = [m for m in cfg["models"] if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}: {sorted(MODELS)}")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(cfg, _port(), d), nprocs=WORLD)
        ranks = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(WORLD)]
    text = table(ranks, cfg, argv)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
