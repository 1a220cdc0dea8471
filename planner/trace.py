"""Capture a model as a torch.fx GraphModule, making untraceable submodules opaque leaves.

`symbolic_trace` stops at the first thing it cannot follow (data-dependent control flow,
unsupported Python). We retrace with the innermost module that was being traced at that moment
turned into a leaf node, and repeat: every model whose top-level forward is traceable is thus
plannable, at worst at the granularity of its failing submodules. Each opaque module is recorded
with the tracer's own error.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.fx as fx

from .errors import TraceError


@dataclass(frozen=True)
class Traced:
    gm: fx.GraphModule
    input_names: tuple[str, ...]            # forward parameters that are graph inputs (by name)
    opaque: tuple[tuple[str, str], ...]     # (module qualified name, tracer error) per opaque leaf


class _LeafTracer(fx.Tracer):
    """fx.Tracer that treats `extra_leaves` as leaves and remembers the module stack."""

    def __init__(self, extra_leaves: frozenset[str]):
        super().__init__()
        self.extra_leaves = extra_leaves
        self.stack: list[str] = []
        self.failed_in: str | None = None

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return qualname in self.extra_leaves or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        qualname = self.path_of_module(m)
        if self.is_leaf_module(m, qualname):
            return super().call_module(m, forward, args, kwargs)
        self.stack.append(qualname)
        try:
            out = super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:
                self.failed_in = qualname
            raise
        self.stack.pop()
        return out


def bind_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """Map example inputs onto `model.forward`'s parameter names (positional then keyword)."""
    sig = inspect.signature(model.forward)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"example inputs do not match {type(model).__name__}.forward{sig}: {e}") from e
    return dict(bound.arguments)


def trace(model: torch.nn.Module, args: tuple, kwargs: dict, max_opaque: int = 64) -> Traced:
    """Trace `model` called as `model(*args, **kwargs)`.

    Parameters of `forward` that are not given are fixed to their defaults (fx concrete_args).
    >>> t = trace(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU()), (torch.ones(1, 2),), {})
    >>> [n.op for n in t.gm.graph.nodes]
    ['placeholder', 'call_module', 'call_module', 'output']
    """
    bound = bind_inputs(model, args, kwargs)
    sig = inspect.signature(model.forward)
    concrete = {
        name: p.default for name, p in sig.parameters.items()
        if name not in bound and p.default is not inspect.Parameter.empty
    }
    opaque: dict[str, str] = {}
    while True:
        tracer = _LeafTracer(frozenset(opaque))
        try:
            graph = tracer.trace(model, concrete_args=concrete or None)
            break
        except Exception as e:  # fx raises many types; we classify by where, not by message
            where = tracer.failed_in
            if not where or where in opaque or len(opaque) >= max_opaque:
                raise TraceError(where or f"{type(model).__name__}.forward", f"{type(e).__name__}: {e}") from e
            opaque[where] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
    gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
    names = tuple(n.target for n in gm.graph.nodes if n.op == "placeholder" and n.target in bound)
    return Traced(gm, names, tuple(sorted(opaque.items())))


def placeholder_values(gm: fx.GraphModule, named: dict) -> list:
    """Positional arguments for `gm` from named inputs; parameters not given take their defaults."""
    out = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            out.append(named[n.target] if n.target in named else (n.args[0] if n.args else None))
    return out
