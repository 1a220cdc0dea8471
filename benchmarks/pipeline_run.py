"""Pipeline-parallel steps on gloo ranks (issue 44): a tiny GPT (or a tiny Hugging Face Llama) split by
blocks into stages, each rank running its stage under torch.distributed.pipelining's ScheduleGPipe
or Schedule1F1B (or two stages under ScheduleInterleaved1F1B), optionally planned by remat per
rank, and metered step by step.

    from benchmarks.pipeline_run import config, run, run_many
    ranks = run("1f1b", n_stages=2, n_microbatches=4, budget="60%", plan=True)
    plain, planned = run_many([config("interleaved"), config("interleaved", budget="80%", plan=True)])

`run` spawns one process per rank (torch.multiprocessing, gloo over a FileStore in a temporary
directory) and returns one dict per rank (see `run`); `run_many` runs several configurations in
one spawn, in turn. Each step is metered whole with
`remat.runtime.measure.peak_memory`'s meter (`_metered`: holding no reference to what it counts, as
a V-shaped schedule's middle rank drops receive buffers mid-step), counting as live from its start what the rank holds before it
(`live_before`: parameters, the stage's receive buffers and what else persists between steps).

NOTE [ what a pipeline rank holds between steps ]
PipelineStage allocates its receive buffers in the first step (`_prepare_forward_infra`: one
activation buffer per micro-batch per input on every stage but the first;
`_prepare_backward_infra`: one gradient buffer per micro-batch per output on every stage but the
last) and keeps them: step 1 allocates them inside the step, later steps find them live. Gradients
a backward left on the activation buffers (`buffer.grad`, the stage's input gradients it sent back)
are live until the next step's `clear_runtime_states` drops them at its start (as are the last
stage's `output_chunks` with `return_outputs`): reported in `live_before` (kinds TRANSIENT) but not
counted in the step's peak, since they are freed before the step allocates. The harness sets
the parameters' gradients to None before each step (outside the meter), so a step begins without
them; with `optimizer=True` AdamW's step runs inside the metered step and its state (made in step
1) is live before later steps. The last stage's outputs are not kept (`return_outputs=False`,
`run`'s default): with `return_outputs=True` every micro-batch's logits are kept to the step's end
(`output_chunks`, merged by torch.cat into a new tensor the step returns).
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from benchmarks.distributed import Block  # the GPT block the FSDP2 benchmark runs too
from remat.runtime.distributed.pipeline_job import DecoderStage, split_layers
import torch.nn.functional as F

VOCAB, D, HEADS, SEQ, MB = 128, 64, 4, 32, 2      # MB: rows per micro-batch
SEED = 0


# ---------------------------------------------------------------- the plain GPT

class Checkpointed(nn.Module):
    """`inner` under torch.utils.checkpoint (non-reentrant): the per-block reference."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


class GPTStage(nn.Module):
    """Blocks [lo, hi) of the GPT; the first stage also embeds (tokens and positions), the last
    also normalizes and projects to the vocabulary."""

    def __init__(self, blocks, emb=None, pos=None, ln=None, head=None):
        super().__init__()
        self.emb, self.pos = emb, pos
        self.blocks = nn.ModuleList(blocks)
        self.ln, self.head = ln, head

    def forward(self, x):
        if self.emb is not None:
            x = self.emb(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln(x))
        return x


def gpt_stages(n_stages: int, layers_per_stage: int = 2, seed: int = SEED) -> list[nn.Module]:
    """The GPT (n_stages * layers_per_stage blocks), made whole from `seed` and split into stages."""
    torch.manual_seed(seed)
    emb, pos = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
    blocks = [Block(D, HEADS) for _ in range(n_stages * layers_per_stage)]
    ln, head = nn.LayerNorm(D), nn.Linear(D, VOCAB)
    out = []
    for s, idx in enumerate(split_layers(len(blocks), n_stages)):
        first, last = s == 0, s == n_stages - 1
        out.append(GPTStage([blocks[i] for i in idx], emb if first else None, pos if first else None,
                            ln if last else None, head if last else None))
    return out


# ---------------------------------------------------------------- a tiny Hugging Face Llama

def llama_model(n_layers: int, seed: int = SEED):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=4 * D, num_hidden_layers=n_layers,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=SEQ,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).train()


def llama_stages(n_stages: int, layers_per_stage: int = 2, seed: int = SEED) -> list[nn.Module]:
    model = llama_model(n_stages * layers_per_stage, seed)
    return [DecoderStage(model, idx, s == 0, s == n_stages - 1)
            for s, idx in enumerate(split_layers(n_stages * layers_per_stage, n_stages))]


def stages(model: str, n_stages: int, layers_per_stage: int = 2, seed: int = SEED,
           checkpoint_blocks: bool = False) -> list[nn.Module]:
    """The stage modules of `model` ("gpt" or "llama"); with `checkpoint_blocks`, each block or
    decoder layer under torch.utils.checkpoint."""
    out = (gpt_stages if model == "gpt" else llama_stages)(n_stages, layers_per_stage, seed)
    if checkpoint_blocks:
        for st in out:
            layers = st.blocks if model == "gpt" else st.layers
            for i in range(len(layers)):
                layers[i] = Checkpointed(layers[i])
    return out


def batch(n_microbatches: int, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch (tokens, next-token targets): n_microbatches * MB rows of SEQ tokens."""
    g = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, VOCAB, (n_microbatches * MB, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------- what a rank holds

def _nbytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        key = (st.data_ptr(), st.nbytes())
        if key not in seen and st.nbytes():
            seen.add(key)
            total += st.nbytes()
    return total


def _walk(x, out: list, depth: int = 0, seen=None) -> list:
    """Every tensor `x` holds (containers, _RecvInfo-like objects), to a small depth."""
    seen = set() if seen is None else seen
    if depth > 6 or id(x) in seen:
        return out
    seen.add(id(x))
    if isinstance(x, torch.Tensor):
        out.append(x)
        if x.grad is not None:
            out.append(x.grad)
    elif isinstance(x, dict):
        for v in x.values():
            _walk(v, out, depth + 1, seen)
    elif isinstance(x, (list, tuple, set)):
        for v in x:
            _walk(v, out, depth + 1, seen)
    elif hasattr(x, "__dict__") and not isinstance(x, (nn.Module, type)) and type(x).__module__.startswith("torch.distributed.pipelining"):
        for v in vars(x).values():
            _walk(v, out, depth + 1, seen)
    return out


# freed by the next step's clear_runtime_states, at its start: not passed to the meter as live (its
# arguments are held for the whole step: they would be kept alive)
TRANSIENT = ("recv_act_buffer_grads", "other")


def held(stages: list, schedule, modules: list[nn.Module], opt, inputs) -> tuple[dict[str, int], list[torch.Tensor]]:
    """What the rank holds now, by kind (bytes), and the tensors that persist through a step
    (each storage once; not those of TRANSIENT kinds); `stages` and `modules`: the rank's (one, or
    an interleaved schedule's several)."""
    params = [t for m in modules for t in list(m.parameters()) + list(m.buffers())]
    grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
    act = [a.buffer for st in stages for r in st.args_recv_info.values() for a in r
           if getattr(a, "buffer", None) is not None]
    act_grads = [b.grad for b in act if b.grad is not None]
    grad_bufs = [a.buffer for st in stages for r in st.grad_recv_info.values() for a in r
                 if getattr(a, "buffer", None) is not None]
    opt_state = _walk(opt.state, []) if opt is not None else []
    kinds = {"params": params, "param_grads": grads, "recv_act_buffers": act, "recv_act_buffer_grads": act_grads,
             "recv_grad_buffers": grad_bufs, "optimizer_state": opt_state, "inputs": list(inputs)}
    known = {id(t.untyped_storage()) for ts in kinds.values() for t in ts}
    skip = {"submod", "args_recv_info", "grad_recv_info", "group"}
    rest = [t for st in stages for k, v in vars(st).items() if k not in skip for t in _walk(v, [])]
    rest += [t for k, v in vars(schedule).items() if k not in ("_stage", "_stages") for t in _walk(v, [])]
    kinds["other"] = [t for t in rest if id(t.untyped_storage()) not in known]
    out, seen = {}, set()
    tensors = []
    # a V's middle rank: a buffer's gradient is also the previous stage's gradient buffer, which
    # persists: a storage goes to the first kind that persists, TRANSIENT ones last
    for k, ts in sorted(kinds.items(), key=lambda kv: kv[0] in TRANSIENT):
        fresh = []
        for t in ts:
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                fresh.append(t)
        out[k] = _nbytes(fresh)
        if k not in TRANSIENT:
            tensors += fresh
    out = {k: out[k] for k in kinds}
    out["total"] = sum(out.values())
    return out, tensors


def _baseline(modules: list[nn.Module], live: list[torch.Tensor]) -> list[torch.Tensor]:
    """What the rank holds before a step: `modules`' parameters and buffers, and `live` (emptied
    here, so that the caller holds none of it through the step: a V-shaped schedule's middle rank
    drops its receive buffers during the step, NOTE [ a V's handover ] in
    runtime/distributed/pipeline.py, and a reference held would keep them)."""
    out = [t for m in modules for t in list(m.parameters()) + list(m.buffers())] + live
    live.clear()
    return out


def _metered(step, modules: list[nn.Module], live: list[torch.Tensor]) -> int:
    """`peak_memory`'s meter of `step`, what the rank holds before it (`_baseline`) counted from its
    start, as the meter tracks it: weakly."""
    from remat.runtime.measure import peak as peak_mod
    meter = peak_mod.StorageMeter(baseline=_baseline(modules, live))
    with meter, peak_mod.resizes_seen(meter):
        step()
    return meter.peak_bytes


def _allocator_metered(step, modules: list[nn.Module], live: list[torch.Tensor]) -> int:
    """The CPU allocator's peak of `step` (runtime.measure.peak.allocator_peak), which also sees
    what is made below the dispatcher (gloo's staging copies), plus what the rank holds before it
    (`_baseline`, summed here, not held through the step)."""
    from remat.runtime.measure.peak import allocator_peak
    resident = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in _baseline(modules, live)}.values())
    return resident + allocator_peak(step)


def _step_of(schedule, opt, first: bool, last: bool, tokens, targets, keep: bool, losses: list):
    """One `schedule.step` of the rank (its first stage given the tokens, its last the targets and
    `losses`), then the optimizer's step if any."""
    args = (tokens,) if first else ()
    kwargs = dict(target=targets, losses=losses) if last else {}

    def step():
        schedule.step(*args, return_outputs=keep, **kwargs)
        if opt is not None:
            opt.step()
    return step


# ---------------------------------------------------------------- one rank

SCHEDULES = ("gpipe", "1f1b", "interleaved")
MULTI_STAGE = {"interleaved": 2, "zero-bubble": 2, "zbv": 2, "dualpipev": 2}     # stages a rank holds
V_SHAPED = ("zbv", "dualpipev")      # rank r of R holds stages r and 2R - 1 - r (the others: r and r + R)
MORE = ("zero-bubble",) + V_SHAPED   # schedules `config` takes beyond SCHEDULES


def held_stages(schedule: str, rank: int, n_ranks: int) -> list[int]:
    """The stage indices rank `rank` of `n_ranks` holds under `schedule`, ascending."""
    if schedule in V_SHAPED:
        return [rank, 2 * n_ranks - 1 - rank]
    return list(range(rank, n_ranks * MULTI_STAGE.get(schedule, 1), n_ranks))
START_METHOD = os.environ.get("REMAT_PIPELINE_START", "fork")   # fork: no re-import per rank (seconds a run)


def _schedule_class(name: str):
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)
    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B,
            "zero-bubble": ScheduleInterleavedZeroBubble, "zbv": ScheduleZBVZeroBubble,
            "dualpipev": ScheduleDualPipeV}[name]


def _rank(rank: int, cfgs: list[dict], store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    world = cfgs[0]["n_stages"]
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    saved_rank_result(rank, out_dir, lambda: [_rank_steps(rank, cfg) for cfg in cfgs])


def saved_rank_result(rank: int, out_dir: str, run) -> None:
    """`run()`'s result saved as this rank's file (its traceback instead, when it raises); the
    process group destroyed after."""
    try:
        result = run()
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        raise
    else:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _build(rank: int, cfg: dict) -> tuple[list[nn.Module], list, object, list[torch.Tensor]]:
    """The rank's stage modules, their PipelineStages, the schedule and one micro-batch's inputs of
    each stage (a later stage's: zeros of the activations it receives)."""
    from torch.distributed.pipelining import PipelineStage
    per = MULTI_STAGE.get(cfg["schedule"], 1)
    n_ranks, n = cfg["n_stages"], cfg["n_stages"] * per
    every = stages(cfg["model"], n, cfg["layers_per_stage"] // per, cfg["seed"], cfg["checkpoint_blocks"])
    tokens, _ = batch(1, cfg["seed"])
    modules, pstages, examples = [], [], []
    for i in held_stages(cfg["schedule"], rank, n_ranks):
        first, last = i == 0, i == n - 1
        example_in = tokens[:MB] if first else torch.zeros(MB, SEQ, D)
        # static metadata (no inference step): inputs and outputs that need grad, on the meta device
        in_meta = example_in.to("meta") if first else torch.empty(MB, SEQ, D, device="meta", requires_grad=True)
        out_meta = torch.empty(MB, SEQ, VOCAB if last else D, device="meta", requires_grad=True)
        pstages.append(PipelineStage(every[i], i, n, torch.device("cpu"), input_args=(in_meta,), output_args=(out_meta,)))
        modules.append(every[i])
        examples.append(example_in)
    cls = _schedule_class(cfg["schedule"])
    schedule = cls(pstages if per > 1 else pstages[0], cfg["n_microbatches"], loss_fn=loss_fn)
    return modules, pstages, schedule, examples


def _plan(res: dict, modules: list, pstages: list, schedule, examples: list, opt, cfg: dict) -> None:
    """plan_and_wrap on the rank's first stage module (an interleaved rank's others are planned with
    it); the plans' numbers into `res`. With `refuse`, the PipelineScheduleError it raises instead."""
    from remat.planner import PlanOptions
    from remat.runtime import plan_and_wrap
    budget = cfg["budget"]
    budget = budget / 1e9 if isinstance(budget, (int, float)) else budget
    one = batch(cfg["n_microbatches"], cfg["seed"])[1][:MB]     # one micro-batch's loss, as the schedule computes it
    last = pstages[-1].is_last
    t0 = time.perf_counter()
    try:
        plan_and_wrap(modules[0], budget, example_inputs=(examples[0].clone(),), schedule=schedule,
                      loss_fn=(lambda out: loss_fn(out, one)) if last else None, optimizer=opt,
                      options=PlanOptions(pipeline_outputs=cfg["return_outputs"]))
    except Exception as e:  # noqa: BLE001 - a refusal the test names (cfg["refuse"])
        if not cfg["refuse"]:
            raise
        res["refused"] = (type(e).__name__, str(e))
        return
    res["plan_seconds"] = time.perf_counter() - t0
    plans = [m.remat.plan for m in modules]
    res["predicted_peak_bytes"] = max(p.predicted_peak_bytes for p in plans)
    res["budget_bytes"] = plans[0].budget_bytes
    res["regions"] = [(r.start, r.end) for p in plans for r in p.regions]
    res["stage_regions"] = [[(r.start, r.end) for r in p.regions] for p in plans]
    res["plan_time"] = [p.facts.plan_time for p in plans]
    forward = sum(p.forward_s for p in plans)
    res["extra_compute"] = 100.0 * sum(p.recompute_s for p in plans) / forward if forward else 0.0


def _rank_steps(rank: int, cfg: dict) -> dict:
    modules, pstages, schedule, examples = _build(rank, cfg)
    first, last = pstages[0].is_first, pstages[-1].is_last
    tokens, targets = batch(cfg["n_microbatches"], cfg["seed"])
    res = {"rank": rank, "schedule": cfg["schedule"], "predicted_peak_bytes": None, "regions": None,
           "budget_bytes": None, "plan_seconds": None, "refused": None}
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-3) if cfg["optimizer"] else None
    if cfg["plan"]:
        _plan(res, modules, pstages, schedule, examples, opt, cfg)
        if res["refused"]:
            return res
    inputs = [tokens] if first else []
    inputs += [targets] if last else []
    res.update(peaks=[], live_before=[], seconds=[], losses=[], trace=[])
    keep = cfg["return_outputs"]
    for _ in range(cfg["steps"]):
        for m in modules:
            m.zero_grad(set_to_none=True)
        live, live_tensors = held(pstages, schedule, modules, opt, inputs)
        losses: list = []
        step = _step_of(schedule, opt, first, last, tokens, targets, keep, losses)
        t0 = time.perf_counter()
        with _traced(pstages, res["trace"]) if cfg["trace"] else _nothing():
            peak = _metered(step, modules, live_tensors)
        res["seconds"].append(time.perf_counter() - t0)
        res["peaks"].append(peak)
        res["live_before"].append(live)
        res["losses"].append(torch.stack([l.detach() for l in losses]).mean().item() if losses else None)
    if cfg.get("allocator"):        # one more step, metered by the CPU allocator
        for m in modules:
            m.zero_grad(set_to_none=True)
        res["allocator"] = _allocator_metered(_step_of(schedule, opt, first, last, tokens, targets, keep, []),
                                              modules, held(pstages, schedule, modules, opt, inputs)[1])
    res["live_after"] = held(pstages, schedule, modules, opt, inputs)[0]
    # named as in the plain split (a Checkpointed block's `.inner` dropped), by stage on a rank of several
    many = len(modules) > 1
    res["grads"] = {(f"stage{st.stage_index}." if many else "") + k.replace(".inner.", "."): p.grad.detach().clone()
                    for st, m in zip(pstages, modules) for k, p in m.named_parameters() if p.grad is not None}
    res["loss"] = res["losses"][-1]
    res["param_bytes"] = _nbytes(params)
    return res


@contextlib.contextmanager
def _nothing():
    yield


@contextlib.contextmanager
def _traced(pstages: list, out: list):
    """Inside, the meter records its live bytes after every op into a new list appended to `out`,
    and each stage's forward_one_chunk / backward_one_chunk mark where each micro-batch's begins
    and ends."""
    from remat.runtime.measure import peak as peak_mod
    events: list = []
    out.append(events)
    base = peak_mod.StorageMeter

    class Tracing(base):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            r = super().__torch_dispatch__(func, types, args, kwargs)
            events.append((str(func.overloadpacket.__name__), self.live_bytes))
            return r

    def marked(kind: str, run):
        def chunk(i, *a, **k):
            events.append((kind, i))
            try:
                return run(i, *a, **k)
            finally:
                events.append((f"end {kind}", i))
        return chunk

    peak_mod.StorageMeter = Tracing
    for st in pstages:
        st.forward_one_chunk, st.backward_one_chunk = marked("F", st.forward_one_chunk), marked("B", st.backward_one_chunk)
    try:
        yield
    finally:
        peak_mod.StorageMeter = base
        for st in pstages:
            del st.forward_one_chunk, st.backward_one_chunk


def config(schedule: str = "gpipe", n_stages: int = 2, n_microbatches: int = 4, budget=None, plan: bool = False,
           steps: int = 2, model: str = "gpt", optimizer: bool = False, checkpoint_blocks: bool = False,
           layers_per_stage: int = 2, seed: int = SEED, return_outputs: bool = False, trace: bool = False,
           refuse: bool = False, allocator: bool = False) -> dict:
    """One run's settings, as `run` takes them (its keyword arguments); `run_many` runs several
    in one spawn of the ranks. `allocator`: one more step, metered by the CPU allocator
    (`allocator`: its peak, runtime.measure.peak.allocator_peak)."""
    if schedule not in SCHEDULES + MORE and not refuse:
        raise ValueError(f"schedule {schedule!r}: one of {SCHEDULES + MORE}")
    return dict(schedule=schedule, n_stages=n_stages, n_microbatches=n_microbatches, budget=budget, plan=plan or refuse,
                steps=steps, model=model, optimizer=optimizer, checkpoint_blocks=checkpoint_blocks,
                layers_per_stage=layers_per_stage, seed=seed, return_outputs=return_outputs, trace=trace,
                refuse=refuse, allocator=allocator)


def run(schedule: str = "gpipe", n_stages: int = 2, n_microbatches: int = 4, budget=None, plan: bool = False,
        steps: int = 2, model: str = "gpt", optimizer: bool = False, checkpoint_blocks: bool = False,
        layers_per_stage: int = 2, seed: int = SEED, return_outputs: bool = False,
        trace: bool = False) -> list[dict]:
    """Run `steps` pipeline steps of `model` ("gpt" or "llama", `layers_per_stage` blocks a rank)
    on `n_stages` gloo ranks under `schedule` ("gpipe", "1f1b", or "interleaved": each rank holds
    2 stages of `layers_per_stage` / 2 blocks, stages r and r + n_stages, under
    ScheduleInterleaved1F1B; "zero-bubble": the same stages under ScheduleInterleavedZeroBubble;
    "zbv", "dualpipev": stages r and 2 * n_stages - 1 - r under ScheduleZBVZeroBubble, ScheduleDualPipeV) with `n_microbatches` micro-batches of MB rows (the same global batch
    each step). With `plan`, each rank plans its stage module with `plan_and_wrap(module, budget,
    example_inputs=(one micro-batch,), schedule=schedule)` (an interleaved rank: its first stage's
    module, which plans both) (`budget`: bytes, or a string such as "60%"); `checkpoint_blocks`
    puts each block under torch.utils.checkpoint instead (the per-block reference).

    Returns per rank: `peaks` (bytes, per step: step 1 allocates the receive buffers, later ones
    are the steady state), `live_before` (per step, bytes by kind held at its start, all counted
    in its peak: NOTE [ what a pipeline rank holds between steps ]), `live_after`, `losses` (per
    step, the mean of the micro-batches' losses on the last rank, else None) and `loss` (the last
    step's), `grads` (name -> the parameter gradients after the last step; "stage<i>." before
    each name on a rank of several stages), `seconds` (per metered step), `param_bytes`, and when
    planned `predicted_peak_bytes`, `budget_bytes`, `regions` ((start, end) per region, every
    stage's), `stage_regions` (per stage), `extra_compute` (% of the rank's forward), `plan_seconds`
    and `plan_time` (per stage, the plan's own breakdown; None for a rank of several stages). With `trace`, `trace` lists per step the meter's live bytes after each op:
    ("F", i) / ("B", i) / ("end F", i) / ("end B", i) marks around each micro-batch's forward and
    backward, then (op name, live bytes) entries. `return_outputs` is passed to `schedule.step`:
    with it the last stage keeps every micro-batch's output (its `output_chunks`) until the step
    merges them, and from then until the next step begins."""
    return run_many([config(schedule, n_stages, n_microbatches, budget, plan, steps, model, optimizer,
                            checkpoint_blocks, layers_per_stage, seed, return_outputs, trace)])[0]


def run_many(cfgs: list[dict]) -> list[list[dict]]:
    """Each of `cfgs` (`config`, one number of ranks) run in turn by one spawn of the ranks: per
    config, `run`'s list of rank dicts. A config with `refuse` plans a schedule remat refuses: its
    ranks' dicts carry `refused` (the error's type name and message) and no steps."""
    n_ranks = cfgs[0]["n_stages"]
    if any(c["n_stages"] != n_ranks for c in cfgs):
        raise ValueError("one spawn runs one number of ranks")
    with tempfile.TemporaryDirectory(prefix="remat-pipeline-") as tmp:
        store_path = os.path.join(tmp, "store")
        try:
            mp.start_processes(_rank, args=(cfgs, store_path, tmp), nprocs=n_ranks, join=True, start_method=START_METHOD)
        except Exception as e:
            saved = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                     for r in range(n_ranks) if os.path.exists(os.path.join(tmp, f"rank{r}.pt"))]
            errors = [r["error"] for r in saved if isinstance(r, dict)]
            raise RuntimeError("pipeline ranks failed:\n" + "\n".join(errors)) from e
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(n_ranks)]
    return [[ranks[r][i] for r in range(n_ranks)] for i in range(len(cfgs))]


def _table(ranks: list[dict], label: str) -> str:
    lines = []
    for r in ranks:
        live = ", ".join(f"{k} {v}" for k, v in r["live_before"][-1].items() if v)
        pred = f" predicted {r['predicted_peak_bytes']} regions {len(r['regions'])}" if r["regions"] is not None else ""
        lines.append(f"{label} rank {r['rank']}: peaks {r['peaks']}{pred} loss {r['loss']} "
                     f"s/step {[round(s, 3) for s in r['seconds']]}\n    live before step 1: {r['live_before'][0]}"
                     f"\n    live before step {len(r['peaks'])}: {live}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schedule", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--optimizer", action="store_true")
    ap.add_argument("--budget", default=None)
    a = ap.parse_args()
    for s in a.schedule:
        kw = dict(n_stages=a.stages, n_microbatches=a.microbatches, steps=a.steps, model=a.model, optimizer=a.optimizer)
        print(_table(run(s, **kw), f"{s} unplanned"))
        print(_table(run(s, checkpoint_blocks=True, **kw), f"{s} per-block"))
        if a.budget is not None:
            b = int(a.budget) if a.budget.isdigit() else a.budget
            print(_table(run(s, budget=b, plan=True, **kw), f"{s} planned {a.budget}"))
