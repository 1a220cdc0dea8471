"""The state of a user's model that planning must leave as it found it: modes, buffers, tensors, grads.

Planning traces and profiles a *training* step: a model handed over in eval mode (as
`from_pretrained` returns it) is planned as `model.train()` would leave it, since a captured
graph bakes the mode in (fx reads `self.training` once; torch.export bakes eval dropout and
BatchNorm). Tracing may run real code on real tensors; whatever it changes is put back, and
an attribute a forward rebinds while traced is bound to its own object again
(`attributes_restored`): a tracer never leaves a Proxy or a fake tensor in the user's model.
"""
from __future__ import annotations

import contextlib
from typing import Iterable

import torch

from remat.planner.compat import FakeTensor, FunctionalTensor, tree_leaves
from remat.planner.capture.fidelity import TENSOR_ONLY_HOOKS
from remat.planner.step.rng import rng_preserved


def mode_key(model: torch.nn.Module) -> tuple[str, ...]:
    """The modules a training step of `model` runs in eval mode (a frozen BatchNorm), by name.
    A model in eval mode trains as `model.train()` leaves it: every module in train mode, ()."""
    if not model.training:
        return ()
    return tuple(name for name, m in model.named_modules() if not m.training)


@contextlib.contextmanager
def training_modes(model: torch.nn.Module):
    """`model` in the modes of its training step (see `mode_key`) for the block; restored after."""
    if model.training:
        yield
        return
    modes = [(m, m.training) for m in model.modules()]
    model.train()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def named_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A module's parameters and buffers by qualified name (tied ones under every name)."""
    named = dict(module.named_parameters(remove_duplicate=False))
    named.update(module.named_buffers(remove_duplicate=False))
    return named


class Snapshot:
    """Copies of some tensors' values, taken when it is made; `restore` writes them back. With
    `versions`, only into the tensors written since: their version counters moved, or their
    values differ (BatchNorm's CPU kernel writes its running statistics without moving the
    counter: `native_batch_norm`'s schema does not mark them written; fuzz seed 5009)."""

    def __init__(self, tensors: Iterable[torch.Tensor], versions: bool = False):
        self.tensors = list(tensors)
        with torch.no_grad():
            self.values = [t.detach().clone() for t in self.tensors]
        self.versions = [t._version for t in self.tensors] if versions else None

    def restore(self) -> None:
        with torch.no_grad():
            for k, (t, value) in enumerate(zip(self.tensors, self.values)):
                if self.versions is None or t._version != self.versions[k] or _differ(t, value):
                    t.copy_(value)


def _differ(t: torch.Tensor, value: torch.Tensor) -> bool:
    """`t` holds other values than `value` (tensors without data, meta or fake, never differ)."""
    if t.device.type == "meta" or type(t).__name__ == "FakeTensor":
        return False
    return not torch.equal(t, value)


@contextlib.contextmanager
def buffers_restored(model: torch.nn.Module):
    """`model`'s buffers (BatchNorm statistics) hold, after the block, the values they had before it."""
    saved = Snapshot(model.buffers())
    try:
        yield
    finally:
        saved.restore()


@contextlib.contextmanager
def step_preserved(model: torch.nn.Module, inputs=()):
    """A real step inside leaves no trace: gradients (the parameters', and those of the tensors
    among `inputs`, a pytree: a loss differentiating by an input makes the input require grad, and
    backward accumulates into it), buffers and every RNG are restored."""
    leaves = [t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad]
    grads = {p: p.grad for p in [*model.parameters(), *leaves]}
    for t in leaves:        # the step accumulates from none, never into the user's gradient in place
        t.grad = None
    try:
        with buffers_restored(model), rng_preserved():
            yield
    finally:
        for p, g in grads.items():
            p.grad = g


@contextlib.contextmanager
def state_preserved(model: torch.nn.Module):
    """Buffers keep their values, and plain tensor attributes their objects (a forward pre-hook
    such as spectral_norm's sets `module.weight`) and values, whatever a trace or profile runs."""
    buffers = Snapshot(model.buffers(), versions=True)
    attrs = [(m, k, v) for m in model.modules() for k, v in vars(m).items() if isinstance(v, torch.Tensor)]
    values = Snapshot((v for _, _, v in attrs), versions=True)
    try:
        yield
    finally:
        buffers.restore()
        for m, k, v in attrs:
            m.__dict__[k] = v
        values.restore()


_NONE = object()


def _leaves(v) -> list:
    try:
        return tree_leaves(v)
    except Exception:
        return [v]


def _traced_value(v) -> bool:
    """A value only a tracer makes (an fx Proxy; export's fake and functional tensors and symbolic
    sizes), or a container holding one."""
    return any(isinstance(x, (torch.fx.Proxy, FakeTensor, FunctionalTensor, torch.SymInt, torch.SymFloat,
                              torch.SymBool)) for x in _leaves(v))


def holds_tensor(v) -> bool:
    """A tensor (real, fake or an fx Proxy standing for one), or a container holding one."""
    return any(isinstance(x, (torch.Tensor, torch.fx.Proxy)) for x in _leaves(v))


def _rebound(before: dict, table: dict) -> list[str]:
    """The keys of `table` bound, since `before` was copied from it, to another object or added."""
    return [k for k, v in table.items() if before.get(k, _NONE) is not v]


def _tables(m: torch.nn.Module) -> tuple[dict, dict, dict]:
    return m.__dict__, m._buffers, m._parameters


@contextlib.contextmanager
def attributes_restored(model: torch.nn.Module):
    """Every module's attributes are, after the block, the objects they were before it: a plain
    attribute, buffer or parameter rebound inside (`self.freqs = self.freqs.to(x.device)` while fx
    traces it leaves an fx Proxy there; torch.export, a fake tensor) is bound to its old object
    again, and one added holding a tracer's value (a Proxy, a fake tensor, a symbolic size) is
    removed. Other added values stay: fx's own tensor constants (`_tensor_constant0`, which its
    graph reads from the model), a flag a forward sets with the hooks it installs.
    Yields a list, filled on exit: (module, name) of each plain attribute the block bound to a
    tensor (or a Proxy), as a forward storing an auxiliary loss on its module does."""
    saved = [(m, t, dict(t)) for m in model.modules() for t in _tables(m)]
    assigned: list[tuple[torch.nn.Module, str]] = []
    try:
        yield assigned
    finally:
        for m, table, before in saved:
            changed = _rebound(before, table)
            if table is m.__dict__:
                assigned += [(m, k) for k in changed if holds_tensor(table[k])]
            for k in changed:
                if k in before:
                    table[k] = before[k]
                elif _traced_value(table[k]):
                    del table[k]
            for k in before.keys() - table.keys():
                table[k] = before[k]


def copy_of(new, old) -> bool:
    """`new` holds `old`'s values, moved or cast (`self.freqs_cis = self.freqs_cis.to(h.device)`,
    Meta's Llama: a constant a plain attribute does not take along with `model.cuda()`), and
    neither is part of an autograd graph: a rebinding no graph needs to keep."""
    return (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor) and not new.requires_grad
            and not old.requires_grad and new.shape == old.shape
            and torch.equal(new, old.to(device=new.device, dtype=new.dtype)))


def assign_attribute(module: torch.nn.Module, name: str, value) -> None:
    """A graph's node for `module.<name> = value` in forward (an auxiliary loss stored on a
    module): fx records the ops and drops the store, so capture puts it back as this call
    (NOTE [ tensor attributes assigned in forward ], planner/capture/trace.py). Never recomputed."""
    setattr(module, name, value)


@contextlib.contextmanager
def tensor_assignments(model: torch.nn.Module):
    """Yields a dict, filled on exit: (module name, attribute) -> the tensor (or container of
    tensors) each plain attribute was bound to inside the block (another object than before, or
    added; not a `copy_of` the old one). Those attributes are then bound as before (removed when
    added), copies too: what a forward assigned (`self.aux_loss = ...`) is in the dict, not left
    in the model."""
    saved = [(name, m, dict(m.__dict__)) for name, m in model.named_modules()]
    assigned: dict[tuple[str, str], object] = {}
    try:
        yield assigned
    finally:
        for name, m, before in saved:
            derived = reparametrized(m)
            for k in [k for k in _rebound(before, m.__dict__) if holds_tensor(m.__dict__[k]) and k not in derived]:
                if not copy_of(m.__dict__[k], before.get(k)):
                    assigned[name, k] = m.__dict__[k]
                if k in before:
                    m.__dict__[k] = before[k]
                else:
                    del m.__dict__[k]


def reparametrized(m: torch.nn.Module) -> set[str]:
    """The attributes a reparametrizing pre-hook (spectral_norm, weight_norm) binds before each
    forward: derived from parameters, which the graph computes as the hook does, and read by
    nothing outside the forward: not an assignment a graph would lose."""
    return {h.name for h in m._forward_pre_hooks.values() if isinstance(h, TENSOR_ONLY_HOOKS)}


@contextlib.contextmanager
def instance_forwards(forwards: dict):
    """Each module's `forward` is the given callable inside the block (None: the module's own, as
    it was before any instance-level forward), and afterwards exactly what it was before: an
    instance-level forward a user or framework set (accelerate's hooks, remat's own) is kept."""
    before = {m: m.__dict__.get("forward", _NONE) for m in forwards}
    for m, fn in forwards.items():
        if fn is None:
            m.__dict__.pop("forward", None)
        else:
            m.__dict__["forward"] = fn
    try:
        yield
    finally:
        for m, fn in before.items():
            if fn is _NONE:
                m.__dict__.pop("forward", None)
            else:
                m.__dict__["forward"] = fn


HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


@contextlib.contextmanager
def hooks_set(hooks: dict):
    """Each module's hooks (forward, forward pre, backward, backward pre) are the given dicts
    inside the block ({}: none), and what they were afterwards. A stand-in of an opaque module
    on fake tensors runs without them: its measurement ran them for real."""
    before = {m: {k: getattr(m, k) for k in HOOKS} for m in hooks}
    for m, d in hooks.items():
        for k in HOOKS:
            setattr(m, k, d.get(k, type(before[m][k])()))
    try:
        yield before
    finally:
        for m, d in before.items():
            for k, v in d.items():
                setattr(m, k, v)
