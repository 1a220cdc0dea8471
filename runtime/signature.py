"""What a plan depends on in a call: its input signature (`call_key`), and how calls of one kind
relate by size (`covers`, `grown`). A plan is made per signature (runtime.book)."""
from __future__ import annotations

from typing import NamedTuple

import torch
from remat.planner.compat import keystr, tree_flatten, tree_map_with_path
from remat.planner.step.state import mode_key


def call_key(args: tuple, kwargs: dict, model: torch.nn.Module | None = None) -> tuple:
    """What a plan depends on: tensor shapes, dtypes, devices and requires_grad; other values (by
    value: `_value_key`); the autocast state (it changes activation dtypes, hence sizes); the
    modes the training step runs its modules in (a graph bakes them in)."""
    leaves, spec = tree_flatten((args, kwargs))
    key = [str(spec), _autocast_state(), mode_key(model) if model is not None else (),
           _parameter_key(model) if model is not None else ()]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            key.append(_TensorKey(tuple(x.shape), x.dtype, x.device.type, x.requires_grad))
        else:
            key.append(_value_key(x))
    return tuple(key)


class _TensorKey(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str
    requires_grad: bool


def covers(big: tuple, small: tuple) -> bool:
    """`big` and `small` (`call_key`s) differ only in tensor sizes, each of `small`'s at most
    `big`'s (NOTE [ covered shapes ] in runtime.book)."""
    if len(big) != len(small):
        return False
    for b, s in zip(big, small):
        if isinstance(b, _TensorKey) and isinstance(s, _TensorKey):
            if b._replace(shape=()) != s._replace(shape=()) or len(b.shape) != len(s.shape) \
                    or any(j > i for i, j in zip(b.shape, s.shape)):
                return False
        elif b != s:
            return False
    return True


def _parameter_key(model: torch.nn.Module) -> tuple:
    """The parameters' dtypes and devices (`model.half()`, `.to(device)` change what a step holds)."""
    return tuple(sorted({(str(p.dtype), p.device.type) for p in model.parameters()}))


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, type(Ellipsis))


def _value_key(x, depth: int = 0):
    """A non-tensor input by value: equal values share a plan, whatever their identity or repr.
    Plain values stand for themselves; containers by their items; an object with its own
    equality and hash by itself; any other object by its type and attributes (its default repr
    carries its address, which would re-plan on every call)."""
    if isinstance(x, _PLAIN) or depth > 4:
        return (type(x).__name__, x) if isinstance(x, _PLAIN) else (type(x).__qualname__, id(x))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_value_key(v, depth + 1) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((repr(k), _value_key(v, depth + 1)) for k, v in x.items()))
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype, x.device.type, x.requires_grad)
    cls = type(x)
    if cls.__eq__ is not object.__eq__ and cls.__hash__ is not None:
        try:
            hash(x)
            return (cls.__qualname__, x)
        except TypeError:
            pass
    attrs = getattr(x, "__dict__", None)
    if attrs is None:
        return (cls.__qualname__, repr(x))
    return (cls.__module__, cls.__qualname__, tuple(sorted((k, _value_key(v, depth + 1)) for k, v in attrs.items())))


def _autocast_state() -> tuple:
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def grown(args: tuple, kwargs: dict, largest: dict[str, tuple]) -> tuple:
    """(args, kwargs) with each tensor grown to the largest sizes its input (by keyword path) had
    in a planned call, repeating its last slice along each grown dimension (a padded batch stays
    one: masks keep their values' kind); (None, None) when none grows."""
    grew = False

    def grow(path, x):
        nonlocal grew
        big = largest.get(keystr(path)) if isinstance(x, torch.Tensor) else None
        if big is None or len(big) != x.dim() or any(b < n for b, n in zip(big, x.shape)):
            return x
        for d, (b, n) in enumerate(zip(big, x.shape)):
            if b > n and n > 0:
                grew = True
                x = x.index_select(d, torch.arange(b, device=x.device).clamp_(max=n - 1))
        return x
    out = tree_map_with_path(grow, (args, kwargs))
    return out if grew else (None, None)
