"""Measured costs: each distinct op of the profiled forward timed once on the device, with real
tensors, and what a checkpoint region, a tensor saved inside one and a SAC policy per op cost
there (torch side).

The profile (planner/profile.py) records every op a node dispatches as an `OpCall`: the op and
its arguments with each tensor replaced by a `TensorSpec` (shape, strides, offset, dtype,
device, requires_grad). `measured_costs` materialises each distinct signature once on the
device (floating tensors drawn from a normal distribution, integer and bool ones zero, so that
indices are valid), times it (`time_ops`: warm-up, then the fastest of several calls spread over
the measurement, the device synchronised: a loaded machine only adds time, so the minimum is the
op's own), and sums a node's ops; the profile adds what checkpoint's hooks cost for each tensor
the node saves for backward (`measure_overheads`: on CPU more than recomputing a cheap op).
Timings are cached in a JSON file per device and torch version (`cache_path`), so the next plan
on the same machine times nothing and plans the same.
An op that cannot be timed on made-up values (it raises) leaves its node on the roofline.
torch's own operator-level estimator (torch.distributed._tools.RuntimeEstimator, its
"operator-level-benchmark" mode) times ops the same way.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch.utils._pytree import tree_map
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .errors import RematError

COST_MODELS = ("auto", "measured", "roofline")
REPEATS = 7                # timed calls per op signature, after one warm-up (the fastest is kept)
CHUNK = 64                 # op signatures materialised at once (their inputs are real tensors)
OVERHEAD_ROUNDS = 30       # interleaved rounds of the region and SAC overhead measurement
_CHAIN = 16                # ops in the (shorter) toy region the overheads are measured on


class CostModelError(RematError):
    """A measured cost model was asked for where there is nothing real to time on."""


@dataclass(frozen=True)
class TensorSpec:
    """What an op's tensor argument looks like: enough to make a real one like it."""
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: str
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorSpec":
        return cls(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.device.type, t.requires_grad)

    def real(self, grad: bool) -> torch.Tensor:
        """A real tensor of this layout (a strided view of a buffer large enough for it)."""
        numel = self.offset + 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride) if n > 0)
        base = torch.empty(numel if all(self.shape) else 0, dtype=self.dtype, device=self.device)
        if base.is_floating_point() or base.is_complex():
            base.normal_()
        else:
            base.zero_()
        t = base.as_strided(self.shape, self.stride, self.offset) if all(self.shape) else base.view(self.shape)
        return t.requires_grad_() if grad and self.requires_grad and t.is_floating_point() else t


@dataclass(frozen=True)
class OpCall:
    """One op a node dispatched, its tensors as specs (`key` names the signature)."""
    func: object          # the torch OpOverload
    args: tuple
    kwargs: dict

    @classmethod
    def of(cls, func, args, kwargs) -> "OpCall":
        spec = partial(tree_map, lambda x: TensorSpec.of(x) if isinstance(x, torch.Tensor) else x)
        return cls(func, spec(tuple(args)), spec(dict(kwargs or {})))

    @property
    def key(self) -> str:
        return f"{self.func}{self.args!r}{sorted(self.kwargs.items())!r}"


def cost_model_for(requested: str, device: torch.device) -> str:
    """"measured" or "roofline" for a plan on `device` (the example inputs' and parameters').

    "auto" measures on a CUDA device that is present, and takes the roofline elsewhere: CPU
    timings swing with the machine's load, so CPU plans stay reproducible unless asked to
    measure; meta/fake models have nothing to time."""
    if requested not in COST_MODELS:
        raise ValueError(f"cost_model must be one of {', '.join(COST_MODELS)}; got {requested!r}")
    present = device.type == "cpu" or (device.type == "cuda" and torch.cuda.is_available())
    if requested == "measured" and not present:
        raise CostModelError(f"cost_model='measured' times ops on the device, and the model is on {device.type}: "
                             "plan with the model and inputs on the device, or with cost_model='roofline'")
    if requested == "auto":
        return "measured" if device.type == "cuda" and present else "roofline"
    return requested


def device_name(device: torch.device) -> str:
    """The device timings are valid for: the GPU's name, or the CPU and its thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.machine()} {platform.processor() or ''} x{torch.get_num_threads()}".replace("  ", " ")


def cache_path(device: torch.device) -> Path:
    """The JSON file of timings for this device and torch version: under $REMAT_CACHE_DIR, else
    ~/.cache/remat."""
    root = Path(os.environ.get("REMAT_CACHE_DIR") or Path.home() / ".cache" / "remat")
    name = "".join(c if c.isalnum() else "-" for c in f"{device_name(device)}-torch{torch.__version__}")
    return root / f"costs-{name}.json"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device: str) -> float:
    """Seconds of one call of `fn()`, the device synchronised before and after."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _runnable(call: OpCall, device: str):
    """The op as a no-argument function on real tensors, run as the recompute runs it (grad
    enabled, inputs requiring grad as in the step), warmed up; None when it cannot run on
    made-up values (an in-place op on a leaf that requires grad is retried without grad)."""
    for grad in (True, False):
        real = partial(tree_map, lambda x: x.real(grad) if isinstance(x, TensorSpec) else x)
        args, kwargs = real(call.args), real(call.kwargs)

        def fn(args=args, kwargs=kwargs, grad=grad):
            with torch.enable_grad() if grad else torch.no_grad():
                call.func(*args, **kwargs)
        try:
            fn()
        except (RuntimeError, ValueError, TypeError, IndexError):
            continue
        return fn
    return None


def time_ops(calls: list[OpCall], device: str, rounds: int = REPEATS, chunk: int = CHUNK) -> list[float | None]:
    """Seconds of one call of each op: the fastest of `rounds` timed calls, taken round-robin over
    a chunk of ops at a time, so that each op is timed at moments spread over the measurement (a
    loaded machine adds time, in bursts: an op's fastest call is its own time). None: the op could
    not run on made-up values."""
    out: list[float | None] = []
    for k in range(0, len(calls), chunk):
        fns = [_runnable(c, device) for c in calls[k:k + chunk]]
        best = [float("inf")] * len(fns)
        for _ in range(rounds):
            for j, fn in enumerate(fns):
                if fn is not None:
                    best[j] = min(best[j], time_call(fn, device))
        out += [b if fn is not None else None for b, fn in zip(best, fns)]
    return out


def _toy_region(n: int, w: torch.Tensor | None):
    """A chain of `n` cheap ops; each saves two tensors for backward when `w` is given (x * w)."""
    def f(x):
        for _ in range(n):
            x = x * (w if w is not None else 1.0001)
        return x
    return f


def _recompute_everything(ctx, func, *args, **kwargs):
    return CheckpointPolicy.PREFER_RECOMPUTE


def _toy_step(kind: str, f, x: torch.Tensor) -> None:
    if kind == "plain":
        y = f(x)
    elif kind == "region":
        y = checkpoint(f, x, use_reentrant=False)
    else:
        y = checkpoint(f, x, use_reentrant=False,
                       context_fn=partial(create_selective_checkpoint_contexts, _recompute_everything))
    y.sum().backward()


def _toy_times(f, x: torch.Tensor, device: str, kinds=("plain", "region", "sac")) -> dict[str, float]:
    """Fastest seconds of each kind of step of the toy `f` and of its forward, interleaved."""
    fns = {k: partial(_toy_step, k, f, x) for k in kinds} | {"forward": partial(f, x)}
    best = {k: float("inf") for k in fns}
    for _ in range(OVERHEAD_ROUNDS):
        for k, fn in fns.items():
            best[k] = min(best[k], time_call(fn, device))
    return best


def measure_overheads(device: str) -> tuple[float, float, float]:
    """(region_s, saved_tensor_s, sac_op_s) on `device`, from toy chains of cheap ops stepped
    plain, as one checkpoint region and as one region under a SAC policy, interleaved (fastest
    of each). A region costs what it adds beyond the plain step and its recompute (the chain's
    forward): a fixed part, from a chain of `_CHAIN` ops that save nothing, and a part per
    tensor its ops save for backward (checkpoint's hooks pack it in the forward and the
    recompute and unpack it in backward), the slope between chains of `_CHAIN` and 4 * `_CHAIN`
    ops that save two tensors each; a SAC policy adds a cost per op (its dispatch mode runs in
    the forward and the recompute), from the chain that saves nothing."""
    x = torch.randn(64, device=device, requires_grad=True)
    w = torch.randn(64, device=device, requires_grad=True)
    added = []
    for n in (_CHAIN, 4 * _CHAIN):
        t = _toy_times(_toy_region(n, w), x, device, ("plain", "region"))
        added.append(t["region"] - t["plain"] - t["forward"])
    saved_tensor_s = max(0.0, (added[1] - added[0]) / (2 * 3 * _CHAIN))
    t = _toy_times(_toy_region(_CHAIN, None), x, device)
    region_s = max(0.0, t["region"] - t["plain"] - t["forward"])
    return region_s, saved_tensor_s, max(0.0, (t["sac"] - t["region"]) / _CHAIN)


@dataclass(frozen=True)
class MeasuredCosts:
    """What `measured_costs` found: per node its seconds (None: an op could not be timed, the
    roofline stays), the overheads, and where they came from."""
    node_s: tuple[float | None, ...]
    region_s: float
    saved_tensor_s: float       # checkpoint's hooks, per tensor saved for backward inside a region
    sac_op_s: float
    meta: dict


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _store(path: Path, cache: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
    tmp.replace(path)


def measured_costs(calls: list[list[OpCall] | None], device: torch.device) -> MeasuredCosts:
    """Per node (a list of its op calls each; None: not to be timed), its forward seconds on
    `device`: each distinct op signature timed once, or read from the cache (`cache_path`),
    which is updated."""
    path = cache_path(device)
    cache = _load(path)
    ops = cache.setdefault("ops", {})
    distinct = {c.key: c for node in calls if node for c in node}
    todo = [c for k, c in distinct.items() if k not in ops]
    ops.update({c.key: t for c, t in zip(todo, time_ops(todo, device.type))})
    timed, measure = len(todo), "overheads" not in cache
    if measure:
        cache["overheads"] = dict(zip(("region_s", "saved_tensor_s", "sac_op_s"), measure_overheads(device.type)))
    if timed or measure:
        cache["device"] = device_name(device)
        _store(path, cache)
    node_s = tuple(None if not node or any(ops[c.key] is None for c in node) else sum(ops[c.key] for c in node)
                   for node in calls)
    meta = {"device": cache["device"], "signatures": len(distinct),
            "timed": timed, "untimed_nodes": sum(bool(node) and s is None for node, s in zip(calls, node_s)),
            "cache": str(path)}
    return MeasuredCosts(node_s, **cache["overheads"], meta=meta)
