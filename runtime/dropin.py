"""How a plan lives in the user's own model: an instance-level `forward`, as accelerate's autocast
and Hugging Face's hooks install theirs, and the `remat` attribute that holds the plans.

`install(model, state)` keeps the model the user's object: its class, attributes and methods
(`config`, `generate`, `save_pretrained`), parameters, buffers, `state_dict()` keys, tied weights,
hooks, and the signature of `model.forward` (frameworks read it: Trainer's column pruning). The
forward it installs calls `state(args, kwargs)`, which runs the planned graph in a training step
and the model's own forward otherwise. `remove(model)` puts back exactly what was there.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

ATTR = "remat"      # model.remat: the state (runtime.api.Remat)


def _original(model: torch.nn.Module, inner: Callable | None, args: tuple, kwargs: dict):
    return inner(*args, **kwargs) if inner is not None else type(model).forward(model, *args, **kwargs)


def _planned(self: torch.nn.Module, *args, **kwargs):
    """The function of the installed forward (`model.forward.__func__`: what accelerate rebinds
    when it wraps the forward in autocast). Without remat's state (removed), the model's own."""
    state = self.__dict__.get(ATTR)
    forward = self.__dict__.get("forward")
    inner = forward.inner if isinstance(forward, PlannedForward) else None
    if state is None:
        return _original(self, inner, args, kwargs)
    return state(args, kwargs)


class PlannedForward:
    """`model.forward` while a plan is installed: called like the method it replaces, with its
    signature, `__func__` and `__self__` (as a bound method has them), and pickled (torch.save,
    deepcopy) as itself, bound to the copy.

    `inner` is the instance-level forward that was there before (a framework's wrapper), or None
    (the class's): the model's own forward, run outside training steps."""

    def __init__(self, model: torch.nn.Module, inner: Callable | None):
        self.__self__, self.inner = model, inner
        self.__func__ = _planned
        own = inner if inner is not None else type(model).forward
        self.__doc__ = getattr(own, "__doc__", None)
        self.__name__ = "forward"
        self.__qualname__ = getattr(type(model).forward, "__qualname__", "forward")

    @property
    def __signature__(self) -> inspect.Signature:
        own = self.inner if self.inner is not None else type(self.__self__).forward.__get__(self.__self__)
        return inspect.signature(own)

    def __call__(self, *args, **kwargs):
        return _planned(self.__self__, *args, **kwargs)

    def original(self, *args, **kwargs):
        """The model's own forward, as it was before the plan was installed."""
        return _original(self.__self__, self.inner, args, kwargs)

    def __reduce__(self):
        return PlannedForward, (self.__self__, self.inner)

    def __repr__(self) -> str:
        return f"<remat-planned forward of {type(self.__self__).__name__}>"


def installed(model: torch.nn.Module):
    """The remat state of `model` (runtime.api.Remat), or None."""
    return model.__dict__.get(ATTR)


def install(model: torch.nn.Module, state) -> PlannedForward:
    """`model.forward` runs `state`; `model.remat` is `state`. A model planned before is re-planned
    (its state replaced, its own forward kept). Returns the installed forward."""
    own = model.__dict__.get(ATTR)
    if own is None and (ATTR in model.__dict__ or hasattr(type(model), ATTR) or ATTR in model._modules
                        or ATTR in model._parameters or ATTR in model._buffers):
        raise AttributeError(f"{type(model).__name__} has its own attribute {ATTR!r}: remat keeps its plans there")
    forward = model.__dict__.get("forward")
    if not isinstance(forward, PlannedForward):
        forward = model.__dict__["forward"] = PlannedForward(model, forward)
    model.__dict__[ATTR] = state
    return forward


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Remove remat's plan from `model`: its forward and attributes are as they were before
    `plan_and_wrap`. Returns the model. A forward a framework installed over remat's since (e.g.
    accelerate's autocast wrapper) stays, and runs the model's own forward from now on."""
    forward = model.__dict__.get("forward")
    if ATTR not in model.__dict__ and not isinstance(forward, PlannedForward):
        raise ValueError(f"{type(model).__name__} has no remat plan to remove")
    model.__dict__.pop(ATTR, None)
    if isinstance(forward, PlannedForward):
        if forward.inner is None:
            del model.__dict__["forward"]
        else:
            model.__dict__["forward"] = forward.inner
    return model
