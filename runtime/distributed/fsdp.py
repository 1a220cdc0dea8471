"""FSDP2 and DDP as remat sees them: which engine wraps a model, what a rank holds (each
fully_shard unit's sizes: every private FSDP2 attribute remat reads is read here, checked on
torch 2.13.0), and a plain unsharded copy of the model to profile."""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from remat.planner.distributed import Sharding, Unit


log = logging.getLogger("remat.runtime")
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
          "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def engine(model: torch.nn.Module) -> str | None:
    """"fsdp" for a model sharded with fully_shard (root included), "ddp" for a DDP wrapper, else
    None. A model with fully_shard units but an unsharded root is refused (TypeError)."""
    if isinstance(model, DistributedDataParallel):
        return "ddp"
    if isinstance(model, FSDPModule):
        return "fsdp"
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise TypeError(f"{type(model).__name__} has fully_shard units but its root is not sharded: call "
                        "fully_shard(model) after its blocks (torchtitan's order), then plan_and_wrap")
    return None


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# ---- FSDP2: what a rank holds, and a plain copy to profile ----------------------------------

def _original_class(m: torch.nn.Module) -> type:
    """The class fully_shard swapped out (it makes `FSDP<cls>(FSDPModule, cls)`)."""
    cls = type(m)
    return cls.__bases__[1] if isinstance(m, FSDPModule) and cls.__bases__[0] is FSDPModule else cls


def _groups(unit: FSDPModule) -> list:
    """FSDP2's parameter groups of one unit (its private state: sizes, dtypes, resharding)."""
    return list(unit._get_fsdp_state()._fsdp_param_groups)


def _compute_dtype(group, p: torch.Tensor) -> torch.dtype:
    return group.mp_policy.param_dtype or p.dtype


def unit_sizes(name: str, unit: FSDPModule, world: int) -> Unit:
    """What one rank holds of `unit`: unsharded and sharded parameter bytes, and gradients."""
    full = shard = grad = grad_shard = 0
    reshard = name != ""
    for g in _groups(unit):
        reshard = reshard and g.post_forward_mesh_info is not None
        for fp in g.fsdp_params:
            p = fp.sharded_param
            numel = fp._orig_size.numel()
            local = fp.padded_sharded_param_size.numel()
            cdt = _compute_dtype(g, p).itemsize
            rdt = (g.mp_policy.reduce_dtype or _compute_dtype(g, p)).itemsize
            full += numel * cdt
            shard += local * p.dtype.itemsize
            if p.requires_grad:
                grad += numel * cdt
                grad_shard += local * rdt
    return Unit(name, full, shard, grad, grad_shard, reshard)


def dp_group(model: FSDPModule):
    """The process group `model`'s units shard over (their mesh's shard dimension), else None."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in _groups(m):
                return g.mesh_info.shard_process_group
    return None


def fsdp_sharding(model: FSDPModule, world: int | None = None) -> Sharding:
    world = world or _world()
    units = tuple(unit_sizes(n, m, world) for n, m in model.named_modules() if isinstance(m, FSDPModule))
    nested = [u.name for u in units if u.name and any(v.name and u.name.startswith(v.name + ".") for v in units)]
    if nested:
        raise TypeError(f"fully_shard units inside other units ({nested[:3]}): remat plans one level of units "
                        "below the root (torchtitan's per-block wrapping)")
    # gloo's all-gather and reduce-scatter stage through a temporary the size of their full
    # buffer (the all-gather's output, the reduce-scatter's input), measured on torch 2.13.0
    staged = dist.is_initialized() and dist.get_backend() == "gloo"
    return Sharding("fsdp", world, units, staged=staged)


def _empty(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of `shape` that holds no memory (its storage freed): fake tensors made from it
    have its shape, dtype and device."""
    t = torch.empty(shape, dtype=dtype, device=device)
    t.untyped_storage().resize_(0)
    return t


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The module tree as it computes in forward, for planning: the original classes, no hooks,
    each fully_shard parameter as an unsharded, storage-less tensor in the dtype forward computes
    in; buffers and unsharded parameters are the model's own objects. Tied parameters stay tied."""
    dtypes = {}
    for m in model.modules():
        if isinstance(m, FSDPModule):
            for g in _groups(m):
                for fp in g.fsdp_params:
                    dtypes[id(fp.sharded_param)] = (fp._orig_size, _compute_dtype(g, fp.sharded_param))
    made: dict[int, torch.nn.Module | torch.nn.Parameter] = {}

    def param(p):
        if id(p) not in made:
            if id(p) in dtypes:
                shape, dt = dtypes[id(p)]
                made[id(p)] = torch.nn.Parameter(_empty(shape, dt, p.to_local().device), requires_grad=p.requires_grad)
            else:
                made[id(p)] = p
        return made[id(p)]

    def clone(m):
        if id(m) in made:
            return made[id(m)]
        cls = _original_class(m)
        c = cls.__new__(cls)
        c.__dict__.update(m.__dict__)
        for k in _HOOKS:
            if k in c.__dict__:
                c.__dict__[k] = type(m.__dict__[k])()
        c._parameters = {k: None if p is None else param(p) for k, p in m._parameters.items()}
        c._buffers = dict(m._buffers)
        made[id(m)] = c
        c._modules = {k: None if s is None else clone(s) for k, s in m._modules.items()}
        return c
    return clone(model)
