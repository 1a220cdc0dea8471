"""Planning a job of any size from one process: a fake process group, the model sharded per
block on it, and one rank's analysis (the CLI's --world-size N --fsdp/--ddp)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from remat.planner import PlanOptions
from remat.planner.compat import fake_store
from remat.planner.api import analyze_for
from remat.planner.distributed import Sharding, per_rank

from ..rewrite import REGION_PROBE
from .plan import plan_step

# ---- planning a job of any size from one process ---------------------------------------------

def fake_world(world_size: int) -> None:
    """A process group of `world_size` ranks in this process whose collectives do nothing (torch's
    `fake` backend): fully_shard shards as it would on that job, so one process plans it."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise RuntimeError(f"a process group of {dist.get_world_size()} ranks is already initialized; "
                               f"cannot plan for {world_size}")
        return
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=world_size)


def blocks_of(model: torch.nn.Module) -> list[str]:
    """The repeated blocks torchtitan shards one by one: the children of the ModuleList of
    same-typed modules that holds the most parameters (a transformer's layers)."""
    best, most = [], 0
    for name, m in model.named_modules():
        kids = list(m.children())
        if isinstance(m, torch.nn.ModuleList) and len(kids) > 1 and len({type(k) for k in kids}) == 1:
            size = sum(p.numel() for p in m.parameters())
            if size > most:
                best, most = [f"{name}.{k}" if name else str(k) for k in range(len(kids))], size
    return best


def shard_per_block(model: torch.nn.Module, world_size: int) -> torch.nn.Module:
    """`model` sharded as torchtitan does (each block, then the root) over a fake group of
    `world_size` ranks, for planning (`python -m remat report ... --world-size N --fsdp`)."""
    from torch.distributed.fsdp import fully_shard
    blocks = blocks_of(model)
    if not blocks:
        raise TypeError(f"{type(model).__name__} has no ModuleList of repeated blocks to shard one by one")
    fake_world(world_size)
    for name in blocks:
        fully_shard(model.get_submodule(name))
    return fully_shard(model)


def per_rank_analysis(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn, options: PlanOptions,
                      optimizer_of: Callable, engine_name: str, world_size: int):
    """The Analysis of one rank of a `world_size`-rank job of `model` (unsharded, unwrapped) under
    `engine_name` ("fsdp": sharded per block here, on a fake group; "ddp"), its cost graph per rank.
    `optimizer_of(model)` makes the optimizer (or None) over the model as it will train."""
    from dataclasses import replace
    if engine_name == "ddp":
        a = analyze_for(model, args, kwargs, loss_fn, options, optimizer_of(model), REGION_PROBE)
        buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return replace(a, cost_graph=per_rank(a.cost_graph, Sharding("ddp", world_size, bucket_bytes=buckets)))
    model = shard_per_block(model, world_size)
    cg, _, a = plan_step(model, args, kwargs, loss_fn, options, optimizer_of(model), world_size)
    return replace(a, cost_graph=cg)
