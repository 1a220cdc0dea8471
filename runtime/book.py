"""A run's plans by input signature (runtime.signature.call_key): which plan a call trains on,
and what a new call can take from the calls planned before it.

NOTE [ covered shapes ]: every tensor of a step grows with its inputs' dimensions, so a plan that
fits a larger call of the same kind (every input dimension at least as large: the longest padded
batch) fits a smaller one; `larger` finds such plans (runtime.planning applies them).
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch
from remat.planner.compat import keystr, tree_flatten_with_path
from remat.planner.result import Plan
from remat.planner.capture.trace import Traced, Unflatten

from .signature import covers, grown


class Entry(NamedTuple):
    """One plan of a run, and what trains on it."""
    plan: Plan
    gm: torch.nn.Module | None
    """The rewritten graph to run (compiled, in compile mode); None: a module-tree plan."""
    traced: Traced | None
    """The capture the graph was rewritten from; None: a module-tree plan."""


class PlanBook:
    """Plans by input signature, the latest call's (`current`), the largest sizes each input
    (by keyword path) had in a planned call, and how many plans a solve made (`Remat.solves`)."""

    def __init__(self, solves: int = 0):
        self.entries: dict[tuple, Entry] = {}
        self.last: tuple | None = None
        self.largest: dict[str, tuple] = {}
        self.solves = solves
        """Plans made by a solve (not kept from other inputs or taken from the plan cache)."""

    def __contains__(self, key: tuple) -> bool:
        return key in self.entries

    def add(self, key: tuple, entry: Entry) -> Entry:
        self.entries[key] = entry
        return entry

    def use(self, key: tuple) -> Plan:
        """The plan for `key`, now the current one."""
        self.last = key
        return self.entries[key].plan

    @property
    def current(self) -> Entry:
        """The latest training call's entry; RuntimeError before the first."""
        if self.last is None:
            raise RuntimeError("no plan yet: the model plans at its first training call")
        return self.entries[self.last]

    def retimed(self, plan: Plan) -> None:
        """The current entry with `plan` (the same regions, more facts: its timing)."""
        self.entries[self.last] = self.current._replace(plan=plan)

    def plans(self) -> dict[tuple, Plan]:
        return {k: e.plan for k, e in self.entries.items()}

    def forget(self) -> None:
        """No plans (another loss): the largest sizes stay, the calls they came from are the run's."""
        self.entries, self.last = {}, None

    def larger(self, key: tuple) -> Iterator[Entry]:
        """The entries of calls of `key`'s kind at sizes at least its own (NOTE [ covered shapes ])."""
        return (e for big, e in list(self.entries.items()) if covers(big, key))

    def on_path(self, path: str) -> Iterator[Entry]:
        """The entries whose graph was captured by `path` (planner.solve.fit.reuse_plan may keep them)."""
        return (e for e in list(self.entries.values()) if e.traced is not None and e.traced.path == path)

    def note_sizes(self, args: tuple, kwargs: dict) -> None:
        """A planned call's tensor sizes join the largest, input by input."""
        for path, x in tree_flatten_with_path((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                name = keystr(path)
                old = self.largest.get(name)
                self.largest[name] = tuple(x.shape) if old is None or len(old) != x.dim() else \
                    tuple(max(a, b) for a, b in zip(old, x.shape))

    def grown(self, args: tuple, kwargs: dict) -> tuple:
        """(args, kwargs) grown to the largest sizes planned (runtime.signature.grown), or (None, None)."""
        return grown(args, kwargs, self.largest)

    def tree_specs(self) -> list:
        """The pytree specs of the plans' exported graphs (inputs, and outputs as `Unflatten` holds them)."""
        out = []
        for e in self.entries.values():
            traced = e.traced
            out += [traced.in_spec] if traced is not None and traced.in_spec is not None else []
            for g in (e.gm, traced and traced.gm):
                out += [m.spec for m in (g.modules() if g is not None else ()) if isinstance(m, Unflatten)]
        return out
