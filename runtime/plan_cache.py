"""A persistent plan cache: the same script run again takes its plan from disk, with no profile
and no solve.

An entry is a plan (`Plan.to_json`) under the hash of everything the plan depends on
(`key_parts`): the code of the model (each module class's source file and forward, its hooks),
its parameters' and buffers' names, shapes, dtypes and devices, the inputs' signature, autocast
and the modules' modes, the budget as given, the loss function's code, the optimizer's
configuration, the options, and the remat and torch versions. An entry also records the hash of
the graph the plan was made on; a hit is used only when the graph captured now has that hash
(the plan's node names and inputs are checked as `runtime.apply` checks a plan made elsewhere).
A corrupt, stale or mismatching entry is ignored and logged, never trusted, and replaced by the
plan made anew.

Where: `REMAT_CACHE_DIR`, else `$XDG_CACHE_HOME/remat`, else `~/.cache/remat`. Off:
`REMAT_CACHE=0` (or `PlanOptions(cache=False)`).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import marshal
import os
import sys
import tempfile
from dataclasses import asdict, is_dataclass
from importlib import metadata
from pathlib import Path

import torch

from remat.planner import cachedir
from remat.planner.result import Plan

log = logging.getLogger("remat.cache")

# the entry layout; an entry of another format is stale (2: plans made before the fake step read one
# fake per real tensor, issue 42; 3: before regions' host RNG states were counted)
FORMAT = 3


def enabled(options) -> bool:
    return getattr(options, "cache", True) and cachedir.on()


def directory() -> Path:
    return cachedir.root()


@functools.lru_cache(maxsize=None)
def _file_hash(path: str, mtime_ns: int) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _source_hash(obj) -> str:
    """The hash of the file `obj` (a class or function) is defined in; its code's, without one."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    path = getattr(module, "__file__", None)
    if path and os.path.exists(path):
        return _file_hash(path, os.stat(path).st_mtime_ns)
    return _code_hash(getattr(obj, "forward", obj))


def _code_hash(fn) -> str:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return hashlib.sha256(marshal.dumps(code)).hexdigest()[:16] if code is not None else repr(type(fn))


def _model_part(model: torch.nn.Module) -> list:
    out = []
    for name, m in model.named_modules():
        cls = type(m)
        hooks = tuple(len(getattr(m, k)) for k in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                    "_backward_pre_hooks"))
        own_forward = m.__dict__.get("forward")
        out.append([name, f"{cls.__module__}.{cls.__qualname__}", _source_hash(cls), _code_hash(cls.forward),
                    _code_hash(own_forward) if own_forward is not None and m is not model else "", hooks, m.training])
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out.append([name, list(t.shape), str(t.dtype), t.device.type, t.requires_grad])
    return out


def _callable_part(fn) -> list:
    """A loss function by its code (and what its closure holds: tensors by shape and dtype)."""
    if fn is None:
        return ["none"]
    if isinstance(fn, torch.nn.Module):
        return ["module", repr(fn), _source_hash(type(fn))]
    cells = []
    for c in getattr(fn, "__closure__", None) or ():
        try:
            v = c.cell_contents
        except ValueError:
            continue
        cells.append([list(v.shape), str(v.dtype)] if isinstance(v, torch.Tensor) else
                     repr(v) if isinstance(v, (int, float, str, bool, type(None))) else type(v).__qualname__)
    return [getattr(fn, "__qualname__", type(fn).__qualname__), _code_hash(fn), _source_hash(fn), cells]


def _optimizer_part(opt) -> list:
    if opt is None:
        return ["none"]
    groups = [{k: repr(v) for k, v in sorted(g.items()) if k != "params"} | {"params": len(g["params"])}
              for g in opt.param_groups]
    return [type(opt).__qualname__, groups, len(opt.state)]


def _plain(x):
    """Options as JSON: dataclasses by field, sets sorted."""
    if is_dataclass(x):
        return {k: _plain(v) for k, v in asdict(x).items()}
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return sorted(repr(v) for v in x)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x if isinstance(x, (int, float, str, bool, type(None))) else repr(x)


def _version() -> str:
    try:
        return metadata.version("remat")
    except metadata.PackageNotFoundError:
        return "unknown"


def key_parts(model, signature, budget, loss_fn, options, optimizer) -> dict:
    """Everything a plan depends on, as JSON (`signature`: runtime.signature.call_key of the call)."""
    return {"format": FORMAT, "remat": _version(), "torch": torch.__version__,
            "model": _model_part(model), "call": repr(signature), "budget": [budget.kind, budget.value],
            "loss": _callable_part(loss_fn), "optimizer": _optimizer_part(optimizer), "options": _plain(options)}


def graph_hash(gm: torch.nn.Module | None) -> str:
    """The hash of a captured graph's code (the module tree's plans have none)."""
    return hashlib.sha256(gm.code.encode()).hexdigest()[:32] if gm is not None else "module tree"


class PlanCache:
    def __init__(self, root: Path | None = None):
        self.root = root or directory()

    def _path(self, parts: dict) -> Path:
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()
        return self.root / f"{digest[:40]}.json"

    def load(self, parts: dict) -> tuple[Plan, str] | None:
        """(plan, graph hash) stored for `parts`, or None: absent, unreadable, or for other parts."""
        path = self._path(parts)
        if not path.exists():
            return None
        try:
            entry = json.loads(path.read_text())
            if entry.get("format") != FORMAT or entry.get("key") != json.loads(json.dumps(parts, default=repr)):
                raise ValueError("its key is not this call's (another version or a hash collision)")
            return Plan.from_json(entry["plan"]), entry["graph"]
        except Exception as e:       # noqa: BLE001 - a bad entry of any kind is ignored, never trusted
            log.warning("plan cache: entry %s ignored (%s: %s); planning anew", path, type(e).__name__, e)
            return None

    def store(self, parts: dict, plan: Plan, graph: str) -> None:
        path = self._path(parts)
        entry = {"format": FORMAT, "key": parts, "graph": graph, "plan": plan.to_json()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f, default=repr)
            os.replace(tmp, path)          # whole or not at all: a reader never sees half an entry
        except OSError as e:
            log.warning("plan cache: could not write %s (%s); the plan is not cached", path, e)
