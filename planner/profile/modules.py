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

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass

import pulp
import torch

from remat.planner.solve.cbc import cbc, cbc_command, variable
from remat.planner.errors import SolverError
from remat.planner.step.state import step_preserved
from remat.planner.step.fake import run_step, tensors, training_loss
from remat.planner.step.storage import LiveBytes, unlinked

log = logging.getLogger("remat.planner")

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


def _blocks(m: torch.nn.Module) -> bool:
    """A container of repeated blocks: two or more children of one class, each with children of
    its own (Hugging Face's `layers`, a ResNet stage), not a Sequential of layers."""
    kids = list(m.children())
    return (isinstance(m, CONTAINERS) and len(kids) >= 2 and len({type(k) for k in kids}) == 1
            and all(next(k.children(), None) is not None for k in kids))


def units_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The blocks a person would checkpoint by hand, with the modules between them: the root's
    children, containers opened, and any child that holds a container of repeated blocks at any
    depth opened too (a Hugging Face encoder-decoder: 'model.shared', 'model.encoder.layers.0',
    ..., 'lm_head'). A Sequential that is an element of a ModuleList or ModuleDict is a block,
    kept whole."""
    out: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()        # a module under two names (tied embeddings) is one unit

    def walk(prefix: str, m: torch.nn.Module):
        for name, child in m.named_children():
            q = f"{prefix}{name}"
            if id(child) in seen:
                continue
            seen.add(id(child))
            block = isinstance(child, torch.nn.Sequential) and isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
            holds_blocks = not isinstance(m, CONTAINERS) and any(_blocks(c) for c in child.modules())
            if (isinstance(child, CONTAINERS) and not block) or holds_blocks:
                walk(q + ".", child)
            elif any(p.requires_grad for p in child.parameters()):
                out.append((q, child))
    walk("", model)
    return out


def block_units(model: torch.nn.Module, names: list[str]) -> tuple[int, ...]:
    """Of `names` (units), the ones that are elements of a container of repeated blocks: what
    per-block checkpointing (Hugging Face's gradient_checkpointing_enable()) checkpoints."""
    parents = {n.rpartition(".")[0] for n in names}
    repeated = {p for p in parents if _blocks(model.get_submodule(p))}
    return tuple(i for i, n in enumerate(names) if n.rpartition(".")[0] in repeated)


class _Observer:
    """Module hooks, a live-bytes `on_alloc` and a saved-tensor `pack` hook that, over one step,
    record per unit the storages it makes, its inputs, who saves what, its calls and time."""

    def __init__(self, units: list[tuple[str, torch.nn.Module]]):
        self.units = units
        self.index = {id(m): k for k, (_, m) in enumerate(units)}
        self.active: list[int] = []                  # the unit running now (units do not nest)
        self.serial: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # storage -> its number
        self.creator: dict[int, int] = {}            # storage number -> unit that made it
        self.savers: dict[int, set] = {}             # storage number -> units (-1: none) whose ops saved it
        self.sizes: dict[int, int] = {}
        self.inputs: list[set] = [set() for _ in units]
        self.t_start: dict[int, float] = {}
        self.times, self.calls, self.per_call = [0.0] * len(units), [0] * len(units), [0] * len(units)
        self.call_saved: dict[int, int] = {}

    def pre(self, m, a, kw):
        k = self.index[id(m)]
        if self.active:
            return
        self.active.append(k)
        self.calls[k] += 1
        self.call_saved[k] = 0
        self.inputs[k].update(self.serial[t.untyped_storage()] for t in tensors((a, kw))
                              if t.untyped_storage() in self.serial)
        self.t_start[k] = time.perf_counter()

    def post(self, m, a, kw, out):
        k = self.index[id(m)]
        if self.active and self.active[-1] == k:
            self.times[k] += time.perf_counter() - self.t_start[k]
            self.per_call[k] = max(self.per_call[k], self.call_saved[k])
            self.active.pop()

    def on_alloc(self, st, n):
        sid = self.serial[st] = len(self.sizes)
        self.sizes[sid] = n
        if self.active:
            self.creator[sid] = self.active[-1]

    def pack(self, t):
        sid = self.serial.get(t.untyped_storage())
        if sid is None:
            return unlinked(t)
        k = self.active[-1] if self.active else -1
        who = self.savers.setdefault(sid, set())
        if k >= 0 and self.creator.get(sid) == k and k not in who:
            self.call_saved[k] += self.sizes[sid]
        who.add(k)
        return unlinked(t)

    @contextlib.contextmanager
    def hooked(self):
        """The module hooks on every unit, for the block."""
        handles = [m.register_forward_pre_hook(self.pre, with_kwargs=True) for _, m in self.units]
        handles += [m.register_forward_hook(self.post, with_kwargs=True) for _, m in self.units]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def result(self) -> tuple[Unit, ...]:
        """Every unit, with what checkpointing each frees and adds; one that did not run in this
        step (a block layer drop skipped) is kept: it runs in others."""
        out, sizes, creator = [], self.sizes, self.creator
        for k, (name, _) in enumerate(self.units):
            freed = sum(sizes.get(s, 0) for s, who in self.savers.items() if who == {k} and creator.get(s) == k)
            added = sum(sizes[s] for s in self.inputs[k] if s not in self.savers)
            out.append(Unit(name, self.calls[k], freed, added, self.per_call[k], self.times[k]))
        return tuple(out)


def profile_modules(model: torch.nn.Module, args: tuple, kwargs: dict, loss_fn) -> ModuleProfile:
    """One real step of `model`, observed per unit. Parameters' grads, buffers and the RNG state
    are left as they were."""
    obs = _Observer(units_of(model))
    fixed = list(model.parameters()) + list(model.buffers()) + tensors((args, kwargs))
    forward_s = []

    def forward():
        t0 = time.perf_counter()
        out = model(*args, **kwargs)
        forward_s.append(time.perf_counter() - t0)
        return out
    with step_preserved(model, (args, kwargs)), obs.hooked():
        for p in model.parameters():
            p.grad = None
        with LiveBytes(baseline=fixed, on_alloc=obs.on_alloc) as meter, \
                torch.autograd.graph.saved_tensors_hooks(obs.pack, lambda t: t):
            run_step(forward, lambda out: training_loss(out, loss_fn))
    return ModuleProfile(obs.result(), meter.peak_bytes, forward_s[0])


_US = 1e6       # seconds -> microseconds
_TIE = 1e-9     # weight of the transient working set in the objective: a tie-break only


def solve_units(prof: ModuleProfile, budget_bytes: int, time_limit_s: float = 10.0,
                excluded: frozenset[int] = frozenset()) -> tuple[int, ...] | None:
    """The least-time set of units whose estimated peak fits `budget_bytes`, none of `excluded`;
    None when none does, or when CBC found no set in its time (logged): the caller falls back to
    its measured floor.

    min sum t_k x_k  s.t.  peak - sum (freed_k - added_k) x_k + z <= budget,  z >= transient_k x_k.
    """
    n = len(prof.units)
    prob = pulp.LpProblem("units", pulp.LpMinimize)
    x = [variable(prob, f"x{k}", cat=pulp.LpBinary) for k in range(n)]
    z = variable(prob, "z", low=0)
    # the objective in microseconds (CBC's tolerances suit that size); z only breaks ties
    prob += pulp.lpSum(u.time_s * _US * x[k] for k, u in enumerate(prof.units)) + _TIE * z
    prob += (prof.peak_bytes - pulp.lpSum((u.freed_bytes - u.added_bytes) * x[k] for k, u in enumerate(prof.units))
             + z <= budget_bytes)
    for k, u in enumerate(prof.units):
        prob += z >= u.transient_bytes * x[k]
    for k in excluded:
        prob += x[k] == 0
    cbc(prob, cbc_command(timeLimit=time_limit_s))
    return chosen_units(prob, x)


def chosen_units(prob: pulp.LpProblem, x: list) -> tuple[int, ...] | None:
    """The units a solved `prob` picks (`x`: their binaries); None when it is infeasible or CBC
    stopped without a solution (a time limit). A unit in no term of the problem (it did not run:
    nothing to free, nothing to cost) is not picked. SolverError: a solution without a value for
    a variable CBC was given."""
    status = pulp.LpStatus.get(prob.status, str(prob.status))
    if prob.status == pulp.LpStatusInfeasible:
        return None
    if prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        log.warning("module-tree ILP: CBC stopped without a solution (status %s, solution %s): no set of "
                    "units from the solver", status, pulp.LpSolution.get(prob.sol_status, prob.sol_status))
        return None
    given = {v.name for v in prob.variables()}
    values = [v.value() for v in x]
    lost = [v.name for v, got in zip(x, values) if got is None and v.name in given]
    if lost:
        raise SolverError(status, f"CBC's solution has no value for {', '.join(lost)}")
    return tuple(k for k, got in enumerate(values) if got is not None and got > 0.5)
