"""Planning over the module tree: the last resort, for models that no tracer captures.

When neither fx nor torch.export yields a graph (data-dependent Python in the top-level
forward), the model still runs as Python, and its submodules can still be checkpointed as
whole calls. The units are the root's children, with containers (Sequential, ModuleList,
ModuleDict) opened: the blocks a person would wrap by hand. One real training step, observed
with module hooks, the live-tensor meter and saved-tensor hooks, says per unit what checkpointing
it frees (activations it makes that only it saves for backward), what it adds (inputs nobody
else keeps), what recomputing it needs at once, and how long its forward takes. A small ILP
picks the units; the runtime measures the chosen plan with a real step and tightens if needed.

Fake tensors cannot run such a model (that is why it is here), so this path costs one real
step per measurement, at the real size.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import pulp
import torch
from torch.utils._pytree import tree_flatten

from .rng import rng_preserved
from .storage import LiveBytes, unlinked

CONTAINERS = (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict)


@dataclass(frozen=True)
class Unit:
    name: str             # module qualified name
    calls: int
    freed_bytes: int      # activations made inside that only its own ops save for backward
    added_bytes: int      # its tensor inputs no op saves: checkpointing must keep them
    transient_bytes: int  # what one call's recompute holds during backward (largest call)
    time_s: float         # measured forward time of its calls: the recompute cost


@dataclass(frozen=True)
class ModuleProfile:
    units: tuple[Unit, ...]
    peak_bytes: int       # measured peak of the unplanned step
    forward_s: float

    def estimate(self, chosen) -> int:
        """Peak of the step with the `chosen` unit indices checkpointed (a model; measure to be sure)."""
        us = [self.units[i] for i in chosen]
        return (self.peak_bytes - sum(u.freed_bytes - u.added_bytes for u in us)
                + max((u.transient_bytes for u in us), default=0))


def units_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The root's children, containers opened: 'embed', 'layers.0', ..., 'head'. A Sequential
    that is an element of a ModuleList or ModuleDict is a block, kept whole."""
    out: list[tuple[str, torch.nn.Module]] = []

    def walk(prefix: str, m: torch.nn.Module):
        for name, child in m.named_children():
            q = f"{prefix}{name}"
            block = isinstance(child, torch.nn.Sequential) and isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
            if isinstance(child, CONTAINERS) and not block:
                walk(q + ".", child)
            elif any(p.requires_grad for p in child.parameters()):
                out.append((q, child))
    walk("", model)
    return out


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def profile_modules(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn) -> ModuleProfile:
    """One real step of `model`, observed per unit. Parameters' grads, buffers and the RNG state
    are left as they were."""
    units = units_of(model)
    index = {id(m): k for k, (_, m) in enumerate(units)}
    active: list[int] = []                       # the unit running now (units do not nest)
    serial: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # storage -> its number
    creator: dict[int, int] = {}                 # storage number -> unit that made it
    savers: dict[int, set] = {}                  # storage number -> units (-1: none) whose ops saved it
    sizes: dict[int, int] = {}
    inputs: list[set] = [set() for _ in units]
    t_start, times, calls, per_call = {}, [0.0] * len(units), [0] * len(units), [0] * len(units)
    call_saved: dict[int, int] = {}

    def pre(m, a, kw):
        k = index[id(m)]
        if active:
            return
        active.append(k)
        calls[k] += 1
        call_saved[k] = 0
        inputs[k].update(serial[t.untyped_storage()] for t in _tensors((a, kw)) if t.untyped_storage() in serial)
        t_start[k] = time.perf_counter()

    def post(m, a, kw, out):
        k = index[id(m)]
        if active and active[-1] == k:
            times[k] += time.perf_counter() - t_start[k]
            per_call[k] = max(per_call[k], call_saved[k])
            active.pop()

    def on_alloc(st, n):
        sid = serial[st] = len(sizes)
        sizes[sid] = n
        if active:
            creator[sid] = active[-1]

    def pack(t):
        sid = serial.get(t.untyped_storage())
        if sid is None:
            return unlinked(t)
        k = active[-1] if active else -1
        who = savers.setdefault(sid, set())
        if k >= 0 and creator.get(sid) == k and k not in who:
            call_saved[k] += sizes[sid]
        who.add(k)
        return unlinked(t)

    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    handles = [m.register_forward_pre_hook(pre, with_kwargs=True) for _, m in units]
    handles += [m.register_forward_hook(post, with_kwargs=True) for _, m in units]
    fixed = params + [b for b, _ in buffers] + _tensors((args, kwargs))
    try:
        for p in params:
            p.grad = None
        with rng_preserved(), LiveBytes(baseline=fixed, on_alloc=on_alloc) as meter, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            t0 = time.perf_counter()
            out = model(*args, **kwargs)
            forward_s = time.perf_counter() - t0
            loss = loss_fn(out) if loss_fn else sum(t.float().exp().sum() for t in _tensors(out) if t.requires_grad)
            del out                 # the step is loss_fn(model(x)).backward(): the output is released
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    result = []
    for k, (name, _) in enumerate(units):
        freed = sum(sizes.get(s, 0) for s, who in savers.items() if who == {k} and creator.get(s) == k)
        added = sum(sizes[s] for s in inputs[k] if s not in savers)
        result.append(Unit(name, calls[k], freed, added, per_call[k], times[k]))
    return ModuleProfile(tuple(u for u in result if u.calls), meter.peak_bytes, forward_s)


def solve_units(prof: ModuleProfile, budget_bytes: int, time_limit_s: float = 10.0) -> tuple[int, ...] | None:
    """The least-time set of units whose estimated peak fits `budget_bytes` (None: none does).

    min sum t_k x_k  s.t.  peak - sum (freed_k - added_k) x_k + z <= budget,  z >= transient_k x_k.
    """
    n = len(prof.units)
    prob = pulp.LpProblem("units", pulp.LpMinimize)
    x = [pulp.LpVariable(f"x{k}", cat="Binary") for k in range(n)]
    z = pulp.LpVariable("z", lowBound=0)
    prob += pulp.lpSum(u.time_s * 1e6 * x[k] for k, u in enumerate(prof.units)) + 1e-9 * z
    prob += (prof.peak_bytes - pulp.lpSum((u.freed_bytes - u.added_bytes) * x[k] for k, u in enumerate(prof.units))
             + z <= budget_bytes)
    for k, u in enumerate(prof.units):
        prob += z >= u.transient_bytes * x[k]
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, threads=1))
    if pulp.LpStatus[prob.status] != "Optimal":
        return None
    return tuple(k for k in range(n) if x[k].value() > 0.5)
