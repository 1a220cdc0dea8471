"""Pipeline parallelism composed with FSDP2 (PP x DP) on 4 gloo ranks (issue 44): the tiny GPT of
benchmarks/pipeline_run.py in 2 stages, each stage sharded with fully_shard (every block, then the
stage module) over the data-parallel dimension of a 2 x 2 DeviceMesh ("pp", "dp"); rank r runs
stage r // 2 on data-parallel rank r % 2 (its own batch: seed r % 2), under ScheduleGPipe or
Schedule1F1B, optionally planned by remat (`plan_and_wrap(stage_module, budget, schedule=...)`).

    from benchmarks.pipeline_fsdp_run import config, run_many
    plain, planned = run_many([config("1f1b"), config("1f1b", budget="85%", plan=True)])

Each step is metered twice over: `peaks`, live storages at the dispatcher (as the other pipeline
runs meter: pipeline_run._metered's StorageMeter), and `allocator`, the CPU allocator's peak
(runtime.measure.peak.allocator_peak), which also sees what gloo allocates inside its collectives
(the staging copies of all-gathers and reduce-scatters, below the dispatcher). Both count what
the rank holds before the step (its parameter shards, the stage's receive buffers, its batch).
NOTE [ what a pipeline rank holds between steps ] (benchmarks/pipeline_run.py) holds here too.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.pipeline_run import (D, MB, MULTI_STAGE, SEQ, START_METHOD, VOCAB, _schedule_class, _step_of, batch,
                                     held_stages, loss_fn, saved_rank_result, stages)

N_RANKS, N_STAGES = 4, 2          # N_STAGES pipeline ranks (each of MULTI_STAGE[schedule] stages), 2 data-parallel
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero-bubble", "zbv", "dualpipev")


def config(schedule: str = "1f1b", n_microbatches: int = 4, budget=None, plan: bool = False, steps: int = 5,
           optimizer: bool = False, checkpoint_blocks: bool = False, refuse: bool = False) -> dict:
    """One run's settings (`run_many` runs several in one spawn of the 4 ranks): `steps` metered
    twice (the StorageMeter, then the allocator), AdamW's step inside each with `optimizer`; with
    `refuse`, the error plan_and_wrap raises is the run's result (`refused`), no step run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {SCHEDULES}")
    return dict(schedule=schedule, n_microbatches=n_microbatches, budget=budget, plan=plan, steps=steps,
                optimizer=optimizer, checkpoint_blocks=checkpoint_blocks, refuse=refuse)


def _build(mesh, cfg: dict):
    """(the rank's stage modules under fully_shard, their PipelineStages, the schedule)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage
    pp = mesh["pp"].get_local_rank()
    per = MULTI_STAGE.get(cfg["schedule"], 1)
    n = N_STAGES * per
    every = stages("gpt", n, 2 // per, checkpoint_blocks=cfg["checkpoint_blocks"])
    modules, pstages = [], []
    for i in held_stages(cfg["schedule"], pp, N_STAGES):
        module = every[i]
        for block in module.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        first, last = i == 0, i == n - 1
        in_meta = (torch.empty(MB, SEQ, dtype=torch.long, device="meta") if first
                   else torch.empty(MB, SEQ, D, device="meta", requires_grad=True))
        out_meta = torch.empty(MB, SEQ, VOCAB if last else D, device="meta", requires_grad=True)
        pstages.append(PipelineStage(module, i, n, torch.device("cpu"), input_args=(in_meta,),
                                     output_args=(out_meta,), group=mesh["pp"].get_group()))
        modules.append(module)
    schedule = _schedule_class(cfg["schedule"])(pstages if per > 1 else pstages[0], cfg["n_microbatches"],
                                                loss_fn=loss_fn)
    return modules, pstages, schedule


def _plan(res: dict, modules: list, pstages: list, schedule, opt, cfg: dict, dp: int) -> None:
    """plan_and_wrap on the rank's first stage module (a rank's other stages are planned with it)."""
    from remat.planner import PlanOptions
    from remat.runtime import plan_and_wrap
    budget = cfg["budget"]
    budget = budget / 1e9 if isinstance(budget, (int, float)) else budget
    one = batch(cfg["n_microbatches"], dp)[1][:MB]          # one micro-batch's loss, as the schedule computes it
    example = batch(1, dp)[0][:MB] if pstages[0].is_first else torch.zeros(MB, SEQ, D)
    t0 = time.perf_counter()
    try:
        plan_and_wrap(modules[0], budget, example_inputs=(example,), schedule=schedule, optimizer=opt,
                      loss_fn=(lambda out: loss_fn(out, one)) if pstages[-1].is_last else None,
                      options=PlanOptions(pipeline_outputs=False))
    except Exception as e:  # noqa: BLE001 - a refusal the test names (cfg["refuse"])
        if not cfg["refuse"]:
            raise
        res["refused"] = (type(e).__name__, str(e))
        return
    plans = [m.remat.plan for m in modules]
    forward = sum(p.forward_s for p in plans)
    res.update(plan_seconds=time.perf_counter() - t0, predicted_peak_bytes=max(p.predicted_peak_bytes for p in plans),
               budget_bytes=plans[0].budget_bytes, regions=[(r.start, r.end) for p in plans for r in p.regions],
               stage_regions=[[(r.start, r.end) for r in p.regions] for p in plans],
               extra_compute=100.0 * sum(p.recompute_s for p in plans) / forward if forward else 0.0)


def _held(modules: list, pstages: list, opt, inputs: list) -> list[torch.Tensor]:
    """What the rank holds before a step: its parameter shards, its stages' receive buffers, the
    optimizer's state, its batch."""
    local = [p.to_local() for m in modules for p in m.parameters()] + [b for m in modules for b in m.buffers()]
    bufs = [a.buffer for stage in pstages for info in (stage.args_recv_info, stage.grad_recv_info)
            for r in info.values() for a in r if getattr(a, "buffer", None) is not None]
    state = [v.to_local() if hasattr(v, "to_local") else v for s in (opt.state.values() if opt else ())
             for v in s.values() if torch.is_tensor(v)]
    return local + bufs + state + inputs


def _steps(rank: int, mesh, cfg: dict) -> dict:
    from remat.runtime.measure import peak as peak_mod
    modules, pstages, schedule = _build(mesh, cfg)
    dp = mesh["dp"].get_local_rank()
    first, last = pstages[0].is_first, pstages[-1].is_last
    tokens, targets = batch(cfg["n_microbatches"], dp)
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=1e-3) if cfg["optimizer"] else None
    res = {"rank": rank, "stage": pstages[0].stage_index, "stages": [s.stage_index for s in pstages], "dp": dp,
           "schedule": cfg["schedule"], "regions": None, "predicted_peak_bytes": None, "budget_bytes": None}
    if cfg["plan"]:
        _plan(res, modules, pstages, schedule, opt, cfg, dp)
        if res.get("refused"):
            return res
    inputs = ([tokens] if first else []) + ([targets] if last else [])
    losses: list = []

    step = _step_of(schedule, opt, first, last, tokens, targets, False, losses)
    res.update(peaks=[], allocator=[], seconds=[])
    for meter in ("peaks", "allocator"):
        for _ in range(cfg["steps"]):
            for m in modules:
                m.zero_grad(set_to_none=True)
            live = _held(modules, pstages, opt, inputs)
            t0 = time.perf_counter()
            if meter == "peaks":
                m = peak_mod.StorageMeter(baseline=live)
                del live
                with m, peak_mod.resizes_seen(m):
                    step()
                res["peaks"].append(m.peak_bytes)
            else:
                res["allocator"].append(peak_mod.allocator_peak(step, *live))
                del live
            res["seconds"].append(time.perf_counter() - t0)
    many = len(modules) > 1
    res["grads"] = {(f"stage{st.stage_index}." if many else "") + k: p.grad.to_local().detach().clone()
                    for st, m in zip(pstages, modules) for k, p in m.named_parameters() if p.grad is not None}
    res["losses"] = [float(x) for x in losses[-cfg["n_microbatches"]:]]
    return res


def _rank(rank: int, cfgs: list[dict], store_path: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, N_RANKS), rank=rank, world_size=N_RANKS)
    def run():
        mesh = init_device_mesh("cpu", (N_STAGES, N_RANKS // N_STAGES), mesh_dim_names=("pp", "dp"))
        return [_steps(rank, mesh, cfg) for cfg in cfgs]
    saved_rank_result(rank, out_dir, run)


def run_many(cfgs: list[dict]) -> list[list[dict]]:
    """Each of `cfgs` run in turn by one spawn of the 4 ranks: per config, one dict per rank
    (`rank`, `stage`, `dp`, `peaks` and `allocator` per step, `seconds`, `grads` (this rank's
    gradient shards after the last step), `losses` (the last stage's, of the last step), and when
    planned `predicted_peak_bytes`, `budget_bytes`, `regions`, `extra_compute`, `plan_seconds`)."""
    with tempfile.TemporaryDirectory(prefix="remat-pp-fsdp-") as tmp:
        try:
            mp.start_processes(_rank, args=(cfgs, os.path.join(tmp, "store"), tmp), nprocs=N_RANKS, join=True,
                               start_method=START_METHOD)
        except Exception as e:
            saved = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)
                     for r in range(N_RANKS) if os.path.exists(os.path.join(tmp, f"rank{r}.pt"))]
            raise RuntimeError("PP x FSDP2 ranks failed:\n" + "\n".join(
                r["error"] for r in saved if isinstance(r, dict))) from e
        ranks = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(N_RANKS)]
    return [[ranks[r][i] for r in range(N_RANKS)] for i in range(len(cfgs))]


def steady(values: list[int]) -> int:
    """A step's live-storage peak as it repeats: the (low) median of the steps after the first
    (which allocates the receive buffers). Single steps read high: gloo's worker thread can keep a
    collective's buffer past the node that waited for it."""
    rest = sorted(values[1:] or values)
    return rest[(len(rest) - 1) // 2]


def least(values: list[int]) -> int:
    """The allocator's peak of a run's steps (all after the receive buffers exist): the least
    reading. The profiler's meter reads some steps one collective buffer high, several in a row
    at times (a free gloo's worker makes unseen: NOTE [ unseen frees ] in runtime/measure/peak.py)."""
    return min(values)
