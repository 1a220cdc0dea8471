"""Measured costs: each distinct op of the profiled forward timed once on the device, with real
tensors, and what a checkpoint region, a tensor saved inside one and a SAC policy per op cost
there (torch side).

The profile (planner/profile/graph.py) records every op a node dispatches as an `OpCall`: the op and
its arguments with each tensor replaced by a `TensorSpec` (shape, strides, offset, dtype,
device, requires_grad). `measured_costs` materialises each distinct signature once on the
device (floating tensors drawn from a normal distribution, integer and bool ones zero, so that
indices are valid), times it (`time_ops`: warm-up, then the fastest of several calls spread over
the measurement, the device synchronised: a loaded machine only adds time, so the minimum is the
op's own), and sums a node's ops; the profile adds what checkpoint's hooks cost for each tensor
the node saves for backward (on CPU more than recomputing a cheap op). The overheads of a region
(`Overheads`) are what the runtime's own regions cost: an `OverheadProbe` the runtime passes in
(runtime.rewrite.overhead) times them once per device; without one, DeviceRates' constants.
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
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch
from remat.planner import cachedir
from remat.planner.compat import tree_map

from remat.planner.errors import RematError
from remat.planner.profile.rates import DeviceRates

COST_MODELS = ("auto", "measured", "roofline")
REPEATS = 7                # timed calls per op signature, after one warm-up (the fastest is kept)
CHUNK = 64                 # op signatures materialised at once (their inputs are real tensors)
OVERHEADS = "region_overheads"   # the cache's key of a probe's overheads (older versions wrote "overheads")


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
    """The JSON file of timings for this device and torch version, in remat's cache directory
    (planner/cachedir.py)."""
    root = cachedir.root()
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


@dataclass(frozen=True)
class Overheads:
    """What a checkpoint region adds on a device beyond recomputing its ops, in seconds."""
    region_s: float           # each region: its call, checkpoint's frame, the recompute's set-up
    saved_tensor_s: float     # each tensor an op inside a region saves: checkpoint's hooks
    sac_op_s: float           # each op of a region under a SAC policy: the policy's mode, twice

    @classmethod
    def of(cls, rates: DeviceRates) -> "Overheads":
        return cls(rates.region_s, rates.saved_tensor_s, rates.sac_op_s)


@dataclass(frozen=True)
class OverheadProbe:
    """What measures `Overheads` on a device type ("cpu", "cuda"): the runtime's own regions
    (runtime.rewrite.overhead.REGION_PROBE; the planner does not import the runtime, which
    passes it in). `name` says what it times: a cache measured by another probe is measured again."""
    name: str
    measure: Callable[[str], Overheads]


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


def measured_costs(calls: list[list[OpCall] | None], device: torch.device, probe: OverheadProbe | None = None,
                   rates: DeviceRates | None = None) -> MeasuredCosts:
    """Per node (a list of its op calls each; None: not to be timed), its forward seconds on
    `device`: each distinct op signature timed once, or read from the cache (`cache_path`),
    which is updated. The overheads are `probe`'s, measured once per device and cached; without
    a probe, the constants of `rates` (the device's DeviceRates by default)."""
    path = cache_path(device)
    cache = _load(path)
    ops = cache.setdefault("ops", {})
    distinct = {c.key: c for node in calls if node for c in node}
    todo = [c for k, c in distinct.items() if k not in ops]
    ops.update({c.key: t for c, t in zip(todo, time_ops(todo, device.type))})
    timed, measure = len(todo), probe is not None and cache.get(OVERHEADS, {}).get("probe") != probe.name
    if measure:
        cache[OVERHEADS] = {**asdict(probe.measure(device.type)), "probe": probe.name}
    if timed or measure:
        cache["device"] = device_name(device)
        _store(path, cache)
    node_s = tuple(None if not node or any(ops[c.key] is None for c in node) else sum(ops[c.key] for c in node)
                   for node in calls)
    if probe is None:
        overheads, how = Overheads.of(rates or DeviceRates.for_device(device)), "DeviceRates constants"
    else:
        overheads = Overheads(**{k: v for k, v in cache[OVERHEADS].items() if k != "probe"})
        how = f"measured: {probe.name}"
    meta = {"device": cache.get("device", device_name(device)), "signatures": len(distinct),
            "timed": timed, "untimed_nodes": sum(bool(node) and s is None for node, s in zip(calls, node_s)),
            "cache": str(path), "overheads": how}
    return MeasuredCosts(node_s, **asdict(overheads), meta=meta)
