"""Selective checkpointing's dispatch modes, with autocast's cached weight casts left out.

torch's SAC (`create_selective_checkpoint_contexts`) matches the recompute's ops to the
forward's by position: the k-th call of an op in the recompute gets what the k-th call in the
forward left (its cached output, or "recompute"). That holds only if both run the same ops.
Under autocast they need not: autocast casts a float32 leaf that requires grad (a parameter) to
its lower-precision dtype once per autocast context and caches the cast, so whether the
`_to_copy` is dispatched depends on the cache, which is global state. A recompute whose cache
holds the casts (backward inside the `autocast` block, as the exact replay runs it) skips them;
a region whose forward found its weight cast already (a weight used before it, in another
region or outside) casts it in the recompute. Either way every later `_to_copy` of the region
gets another one's entry: a tensor of the wrong shape (an IndexError, or torch's "not found in
storage") or, where the shapes agree, silently wrong gradients.

Here those casts are outside the position count, as torch's SAC already leaves `detach` out:
they run in the forward and again in the recompute (or come from autocast's cache), never
cached by SAC. A cast is deterministic and its source does not change within the step, so the
recompute gets the forward's values and the gradients stay bitwise the unwrapped model's.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from remat.planner.compat import CachedTorchDispatchMode, CachingTorchDispatchMode
from remat.planner.errors import UnsafePlanError

_LOWER = (torch.bfloat16, torch.float16)


def autocast_weight_cast(func, args, kwargs) -> bool:
    """A `_to_copy` autocast may cache (aten/src/ATen/autocast_mode.cpp, `cached_cast`): a float32
    leaf that requires grad and is not a view, to a lower-precision float. (Inside a dispatch mode
    autocast reads as disabled, so the cast is recognised by its arguments.)"""
    if func is not torch.ops.aten._to_copy.default or not args or not isinstance(args[0], torch.Tensor):
        return False
    src = args[0]
    return (src.dtype == torch.float32 and src.requires_grad and src.is_leaf and not src._is_view()
            and (kwargs or {}).get("dtype") in _LOWER)


class _CastsOutside:
    """Autocast's weight casts run as they come, outside the positions SAC matches."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if autocast_weight_cast(func, args, kwargs):
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _Saving(_CastsOutside, CachingTorchDispatchMode):
    pass


class _Replaying(_CastsOutside, CachedTorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as e:
            if "backward an extra time" not in str(e):
                raise
            raise UnsafePlanError(
                "a region of this plan keeps some of its outputs (selective checkpointing), and torch lets such a "
                "region be recomputed for one backward only; this step differentiates through it twice (the loss "
                "calls autograd.grad(..., create_graph=True), or backward runs with retain_graph=True). Plan with "
                "this loss as loss_fn (remat then keeps nothing in regions the loss differentiates through), or "
                "with PlanOptions(solve=SolveOptions(sac=False))") from e


def selective_contexts(policy, allow_cache_entry_mutation: bool = False):
    """(forward mode, recompute mode) of selective checkpointing under `policy`, as
    `torch.utils.checkpoint.create_selective_checkpoint_contexts` makes them, with autocast's
    weight casts outside the ops they match by position (module docstring)."""
    # torch's own pair, of this torch's making (their arguments and storage differ between versions:
    # 2.11 keeps a list per op and asks the policy in the recompute too), with the casts outside
    saving, replaying = create_selective_checkpoint_contexts(policy, allow_cache_entry_mutation)
    saving.__class__, replaying.__class__ = _Saving, _Replaying
    return saving, replaying
