"""Two gloo ranks on CPU train a small model wrapped by remat under FSDP2 or DDP; one process
trains the plain model on the global batch as the oracle. Run by tests/test_distributed.py:

    python tests/distributed_worker.py CONFIG[,CONFIG...] PORT OUT.json

Every CONFIG runs in turn in one pair of ranks (one process group: a launch costs more than a
configuration's steps), each on a fresh model and optimizer. CONFIG: "fsdp" (fully_shard per
block then root, AdamW), "fsdp-keep" (reshard_after_forward=False, no optimizer), "ddp" (AdamW),
"fsdp-bf16" (MixedPrecisionPolicy with bf16 parameters, against FSDP2 without remat),
"infeasible" (FSDP2 and a budget no plan fits), "gpt" (issue 23's held-out GPT: vocab 2048,
cross-entropy, FSDP2 with default resharding, no optimizer, the budget halfway between the
measured peaks of FSDP2 with and without per-block checkpointing), "llama", "gpt2" or "gpt2-ddp"
(a tiny Hugging Face causal LM under FSDP2, its decoder layers sharded, or DDP; AdamW;
HF_RUNS). Writes, per CONFIG, per rank: the plan's budget, prediction and regions, the measured
peak of the third step (of every step for the Hugging Face models; allocator events; DDP adds
its reducer's buckets, allocated before the step), whether units were resharded after forward,
the seconds the configuration took; and the largest gradient and parameter differences from the
oracle. OUT.json maps each CONFIG to {"ranks": [...], "diff": {...}}, or to {"error": the
traceback} for a configuration that raised on a rank (the job stops there: the later
configurations are missing); the exit status is 0 when every one ran.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from remat.runtime import plan_and_wrap                         # noqa: E402
from remat.runtime.distributed import region_count              # noqa: E402
from remat.runtime.measure.peak import allocator_peak           # noqa: E402

WORLD, BATCH, SEQ = 2, 8, 256
STEPS = 3                # two warm-up steps, the third measured
BUDGET = "80%"


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, d: int = 64, layers: int = 4, vocab: int = 96):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(out):
    return out.float().pow(2).mean()


class GPTBlock(nn.Module):
    """Pre-norm attention (scaled_dot_product_attention, causal) and a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.fc, self.out = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, 2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Issue 23's held-out model: its logits (vocab 2048) and their cross-entropy hold the peak."""

    def __init__(self, vocab: int = 2048, d: int = 128, layers: int = 4, heads: int = 4, seq: int = 128):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.layers = nn.ModuleList(GPTBlock(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln(x))


GPT_BATCH, GPT_SEQ = 4, 128          # per rank


def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: token ids and next-token targets."""
    g = torch.Generator().manual_seed(2)
    return tuple(torch.randint(0, 2048, (GPT_BATCH * WORLD, GPT_SEQ), generator=g) for _ in range(2))


def gpt_loss(targets: torch.Tensor):
    return lambda out: nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten())


def batch() -> torch.Tensor:
    return torch.randint(0, 96, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def hf_llama() -> nn.Module:
    """A tiny Hugging Face LlamaForCausalLM from a config (2 decoder layers: two units and the
    root, a unit's output handed to the next; d=128, vocab 4096: its logits and their
    cross-entropy hold the floor). 2 layers, not 4: each capture of a layer costs seconds, and
    the Llama is captured twice per rank (at 60%, then at the floor)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=HF_VOCAB["llama"], hidden_size=128, intermediate_size=256,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=256))


def hf_gpt2() -> nn.Module:
    """A tiny Hugging Face GPT2LMHeadModel from a config (2 blocks, d=128, vocab 512, no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=HF_VOCAB["gpt2"], n_embd=128, n_layer=2, n_head=4, n_positions=128,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


HF = {"llama": hf_llama, "gpt2": hf_gpt2}
HF_VOCAB = {"llama": 4096, "gpt2": 512}
# config -> (model, engine, budget): the Llama at 60% of its unplanned per-rank peak, or at the
# floor the planner names when that does not fit
HF_RUNS = {"llama": ("llama", "fsdp", "60%"), "gpt2": ("gpt2", "fsdp", "85%"), "gpt2-ddp": ("gpt2", "ddp", "85%")}


def hf_layers(m: nn.Module) -> nn.ModuleList:
    """The decoder layers of a Hugging Face causal LM (Llama's model.layers, GPT-2's transformer.h)."""
    return m.model.layers if hasattr(m, "model") else m.transformer.h


def hf_batch(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return tuple(torch.randint(0, HF_VOCAB[name], (GPT_BATCH * WORLD, 64), generator=g) for _ in range(2))


def hf_loss(targets: torch.Tensor):
    return lambda out: nn.functional.cross_entropy(out.logits.flatten(0, 1), targets.flatten())


def model(config: str = "") -> nn.Module:
    torch.manual_seed(0)
    return {"gpt": GPT, **HF}.get(config, Tiny)()


def factory():
    """For the CLI (`tests/distributed_worker.py:factory`): the model and one rank's batch."""
    return model(), (batch().chunk(WORLD)[0],), loss_fn


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard(m: nn.Module, config: str, checkpointed: bool = False) -> nn.Module:
    """`m` under `config`'s engine; `checkpointed`: each block under checkpoint_wrapper first
    (torchtitan's per-block activation checkpointing)."""
    if checkpointed:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, layer in enumerate(m.layers):
            m.layers[i] = checkpoint_wrapper(layer)
    if config == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(m)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = {"mp_policy": mixed} if config == "fsdp-bf16" else {}
    for layer in (hf_layers(m) if config in HF else m.layers):
        fully_shard(layer, reshard_after_forward=config != "fsdp-keep", **kw)
    return fully_shard(m, **kw)


def _write(out_dir: str, config: str, rank: int, result: dict) -> None:
    with open(os.path.join(out_dir, f"{config}-rank{rank}.json"), "w") as f:
        json.dump(result, f)


def rank_main(rank: int, configs: list[str], port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    for config in configs:
        t0 = time.perf_counter()
        try:
            result = {**run_config(rank, config, out_dir), "seconds": round(time.perf_counter() - t0, 1)}
        except BaseException:
            _write(out_dir, config, rank, {"error": traceback.format_exc()})
            raise                       # mp.spawn ends the other rank: none waits in a collective
        _write(out_dir, config, rank, result)
        dist.barrier()
    dist.destroy_process_group()


def run_config(rank: int, config: str, out_dir: str) -> dict:
    if config == "gpt":
        return _held_out(rank, out_dir)
    if config in HF_RUNS:
        return _hugging_face(rank, out_dir, config)
    m = shard(model(), config)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2) if config != "fsdp-keep" else None
    local = batch().chunk(WORLD)[rank]
    if config == "infeasible":
        return _infeasible(m, local)
    if config == "fsdp-bf16":
        return _mixed(m, local)
    w = plan_and_wrap(m, BUDGET, example_inputs=(local,), loss_fn=loss_fn, optimizer=opt)
    resharded = []

    def step():
        out = w(local)
        inner = m.module if config == "ddp" else m
        resharded.append(all(hasattr(p, "to_local") for layer in inner.layers for p in layer.parameters()))
        loss_fn(out).backward()
        if opt is not None:
            opt.step()

    for _ in range(2):       # the optimizer's state exists, DDP has rebuilt its buckets (2nd step)
        step()
        if opt is not None:
            opt.zero_grad(set_to_none=True)
    state = [_local(v) for s in (opt.state.values() if opt else ()) for v in s.values() if torch.is_tensor(v)]
    peak = allocator_peak(step, [_local(p) for p in m.parameters()] + state, local)
    if config == "ddp":
        peak += sum(b.buffer().nbytes for b in m.reducer._get_zeros_like_grad_buckets())
    grads = {n.removeprefix("module."): _full(p.grad) for n, p in m.named_parameters()}
    params = {n.removeprefix("module."): _full(p.detach()) for n, p in m.named_parameters()}
    if rank == 0:
        torch.save((grads, params), os.path.join(out_dir, f"{config}-rank0.pt"))
    return {"budget": w.remat.plan.budget_bytes, "predicted": w.remat.plan.predicted_peak_bytes, "measured": peak,
            "regions": len(w.remat.plan.regions), "unplanned": w.remat.plan.unplanned_peak_bytes,
            "resharded_after_forward": all(resharded[1:])}


def _peak_of_third_step(m: nn.Module, step, inputs: tuple) -> int:
    """The allocator's peak of `step()` after two, the gradients cleared before each, with the
    sharded parameters and `inputs` held."""
    for _ in range(STEPS - 1):
        step()
        for p in m.parameters():
            p.grad = None
    return allocator_peak(step, [_local(p) for p in m.parameters()], *inputs)


def _held_out(rank: int, out_dir: str) -> dict:
    """Issue 23's held-out GPT under FSDP2 (default resharding), no optimizer: the per-rank
    budget halfway between the measured peaks of FSDP2 alone and FSDP2 with per-block
    checkpointing; the third step's gradients, against one process on the global batch."""
    idx, targets = (t.chunk(WORLD)[rank] for t in gpt_batch())
    loss = gpt_loss(targets)
    peaks = []
    for checkpointed in (False, True):
        m = shard(model("gpt"), "fsdp", checkpointed)
        peaks.append(_peak_of_third_step(m, lambda: loss(m(idx)).backward(), (idx, targets)))
    m = shard(model("gpt"), "fsdp")
    w = plan_and_wrap(m, sum(peaks) / 2 / 1e9, example_inputs=(idx,), loss_fn=loss)
    peak = _peak_of_third_step(m, lambda: loss(w(idx)).backward(), (idx, targets))
    grads = {n: _full(p.grad) for n, p in m.named_parameters()}          # collectives: on every rank
    params = {n: _full(p.detach()) for n, p in m.named_parameters()}
    if rank == 0:
        torch.save((grads, params), os.path.join(out_dir, "gpt-rank0.pt"))
    return {"budget": w.remat.plan.budget_bytes, "predicted": w.remat.plan.predicted_peak_bytes, "measured": peak,
            "regions": len(w.remat.plan.regions), "unplanned": w.remat.plan.unplanned_peak_bytes,
            "baselines": dict(zip(("fsdp", "fsdp+per-block"), peaks))}


def _hugging_face(rank: int, out_dir: str, config: str) -> dict:
    """A tiny Hugging Face causal LM under FSDP2 (each decoder layer, then the root) or DDP
    (HF_RUNS[config]), AdamW: planned at its budget, or at the floor the planner names when that
    does not fit; three steps, each one's peak measured; the last gradients and the parameters
    after it, against one process on the global batch."""
    from remat.planner.errors import InfeasibleBudgetError
    name, engine, budget = HF_RUNS[config]
    idx, targets = (t.chunk(WORLD)[rank] for t in hf_batch(name))
    loss = hf_loss(targets)
    m = shard(model(name), "ddp" if engine == "ddp" else name)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    floor = None
    try:
        w = plan_and_wrap(m, budget, example_inputs=(idx,), loss_fn=loss, optimizer=opt)
    except InfeasibleBudgetError as e:                     # raised on every rank
        floor = e.min_feasible_bytes
        w = plan_and_wrap(m, floor / 1e9, example_inputs=(idx,), loss_fn=loss, optimizer=opt)
    peaks = []
    for k in range(STEPS):
        if k:
            opt.zero_grad(set_to_none=True)
        state = [_local(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        # DDP rebuilds its buckets in its second step's forward: it frees the first ones (made
        # before the step: their free has no size in the allocator's events) and allocates new
        # ones, which the events count
        rebuilt = getattr(m, "_has_rebuilt_buckets", False)
        held = [_local(p) for p in m.parameters()] + state
        peak = allocator_peak(lambda: (loss(w(idx)).backward(), opt.step()), held, idx, targets)
        if engine == "ddp" and (rebuilt or not m._has_rebuilt_buckets):     # buckets made before the step
            peak += sum(b.buffer().nbytes for b in m.reducer._get_zeros_like_grad_buckets())
        peaks.append(peak)
    grads = {n.removeprefix("module."): _full(p.grad) for n, p in m.named_parameters()}   # collectives
    params = {n.removeprefix("module."): _full(p.detach()) for n, p in m.named_parameters()}
    if rank == 0:
        torch.save((grads, params), os.path.join(out_dir, f"{config}-rank0.pt"))
    inner = m.module if engine == "ddp" else m
    plan = w.remat.plan
    return {"budget": plan.budget_bytes, "predicted": plan.predicted_peak_bytes, "measured": max(peaks),
            "peaks": peaks, "regions": len(plan.regions), "unplanned": plan.unplanned_peak_bytes, "floor": floor,
            "rewritten_layers": sum(region_count(layer) > 0 for layer in hf_layers(inner)),
            "root_regions": region_count(inner)}


def _infeasible(m, local) -> dict:
    """A budget no plan fits: every rank raises (rank 0's error, broadcast), none waits."""
    from remat.planner.errors import InfeasibleBudgetError
    try:
        plan_and_wrap(m, "1MB", example_inputs=(local,), loss_fn=loss_fn)
        return {"raised": None}
    except InfeasibleBudgetError as e:
        return {"raised": type(e).__name__, "min_feasible": e.min_feasible_bytes, "unit": e.unit}


def _mixed(m, local) -> dict:
    """bf16 parameters under FSDP2's MixedPrecisionPolicy: the oracle is FSDP2 without remat (one
    process in fp32 computes otherwise); three steps, the third measured."""
    w = plan_and_wrap(m, BUDGET, example_inputs=(local,), loss_fn=loss_fn)
    ref = shard(model(), "fsdp-bf16")
    peak = 0
    for k in range(STEPS):
        for p in list(m.parameters()) + list(ref.parameters()):
            p.grad = None
        loss_fn(ref(local)).backward()
        if k < STEPS - 1:
            loss_fn(w(local)).backward()
        else:
            peak = allocator_peak(lambda: loss_fn(w(local)).backward(), [_local(p) for p in m.parameters()], local)
    diff = max((_full(p.grad) - _full(q.grad)).abs().max().item() for p, q in zip(m.parameters(), ref.parameters()))
    return {"budget": w.remat.plan.budget_bytes, "predicted": w.remat.plan.predicted_peak_bytes, "measured": peak,
            "regions": len(w.remat.plan.regions), "grad_diff_vs_fsdp": diff}


def oracle(config: str):
    """One process, the plain model, the global batch: the steps the ranks take."""
    if config == "gpt":                                   # one step, the mean of the ranks' losses
        m = model("gpt")
        for part, targets in zip(*(t.chunk(WORLD) for t in gpt_batch())):
            (gpt_loss(targets)(m(part)) / WORLD).backward()
        return {n: p.grad for n, p in m.named_parameters()}, {n: p.detach() for n, p in m.named_parameters()}
    name = HF_RUNS[config][0] if config in HF_RUNS else ""
    m = model(name)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2) if config != "fsdp-keep" else None
    for k in range(STEPS):
        if opt is not None:
            opt.zero_grad(set_to_none=True)
        parts = zip(*(t.chunk(WORLD) for t in hf_batch(name))) if name else ((p, None) for p in batch().chunk(WORLD))
        for part, targets in parts:                       # the mean over ranks of the local losses
            ((hf_loss(targets) if name else loss_fn)(m(part)) / WORLD).backward()
        if opt is not None:
            opt.step()
    return {n: p.grad for n, p in m.named_parameters()}, {n: p.detach() for n, p in m.named_parameters()}


def _collect(config: str, out_dir: str) -> dict | None:
    """The configuration's result: its ranks' (and the oracle's differences), an error, or None (not run)."""
    paths = [os.path.join(out_dir, f"{config}-rank{r}.json") for r in range(WORLD)]
    ranks = [json.load(open(p)) for p in paths if os.path.exists(p)]
    errors = [r["error"] for r in ranks if "error" in r]
    if errors:
        return {"error": "\n".join(errors)}
    if len(ranks) < WORLD:
        return None
    if config in ("infeasible", "fsdp-bf16"):
        return {"ranks": ranks}
    grads, params = torch.load(os.path.join(out_dir, f"{config}-rank0.pt"))
    want_g, want_p = oracle(config)
    diff = {"grad": max((grads[n] - g).abs().max().item() for n, g in want_g.items()),
            "param": max((params[n] - p).abs().max().item() for n, p in want_p.items()),
            "grad_scale": max(g.abs().max().item() for g in want_g.values())}
    return {"ranks": ranks, "diff": diff}


def main(configs: list[str], port: int, out: str) -> int:
    out_dir = os.path.dirname(os.path.abspath(out))
    status = 0
    try:
        mp.spawn(rank_main, args=(configs, port, out_dir), nprocs=WORLD)
    except Exception:                   # a rank raised: what ran is still reported
        traceback.print_exc()
        status = 1
    results = {c: r for c in configs if (r := _collect(c, out_dir)) is not None}
    with open(out, "w") as f:
        json.dump(results, f)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]))
