"""What a captured graph would lose of a forward's meaning, caught while the graph is captured.

A graph holds tensor ops, and nothing else the forward does. fx and torch.export both record
a custom `torch.autograd.Function`'s forward ops and lose its backward (a straight-through
estimator's gradient becomes zero); fx runs `torch.no_grad()` / `set_grad_enabled` /
`inference_mode` once, at trace time, so the graph backpropagates through a stop-gradient
branch (torch.export keeps them: its `wrap_with_set_grad_enabled`); saved-tensor hooks (the
user's own `torch.utils.checkpoint`, offloading) and `torch.func` transforms run at trace time
only; a module hook's Python side effects (a list of features a loss reads) happen once.

`watching(tracer)` makes each of these raise `Unfaithful` while it is used on traced values;
planner.capture.trace then takes the module it happened in as an opaque leaf (run as itself, measured
for real) or the next capture path, and says which and why. A grad-mode change is kept instead:
each node traced under it runs under it (`in_grad_mode`). Hooks are found before tracing
(`hooked_modules`): a hooked submodule is a leaf of the graph, so its hooks run when it runs,
and it is never recomputed, so they run once a step.
"""
from __future__ import annotations

import contextlib
import importlib
import threading

import torch
import torch.fx as fx
from remat.planner.compat import functorch_active, is_custom_op_class, tree_flatten

_spectral_norm = importlib.import_module("torch.nn.utils.spectral_norm")   # the modules: torch.nn.utils
_weight_norm = importlib.import_module("torch.nn.utils.weight_norm")       # exports functions by their names


class Unfaithful(RuntimeError):
    """A construct a graph would not keep was used on traced values."""

    def __init__(self, construct: str, detail: str, recomputable: bool = True):
        self.construct = construct
        self.recomputable = recomputable   # False: the module holds its own checkpoint; not checkpointed again
        super().__init__(f"{construct}: {detail}")


def _proxies(args, kwargs) -> bool:
    return any(isinstance(x, fx.Proxy) for x in tree_flatten((args, kwargs))[0])


# NOTE [ watched in this thread only ]
# torch offers no hook on a custom autograd.Function's apply or on entering saved-tensor hooks,
# so `watching` puts watchers on both classes, once for all threads that watch (counted, under a
# lock; the originals back when the last one leaves). A watcher acts only in a thread that is
# inside `watching` (a thread-local mode); in every other thread it calls the original at once:
# a model training in another thread while this one captures runs its Functions as ever
# (tests/test_threads.py).
_WATCH = threading.local()      # .proxies_only: None outside `watching`, else its argument
_INSTALLED = {"count": 0, "apply": None, "enter": None}
_LOCK = threading.Lock()


def _watched_apply(cls, *args, **kwargs):
    proxies_only = getattr(_WATCH, "proxies_only", None)
    # a torch.library custom op's autograd (its Function is generated there) is kept: the graph
    # records the op itself, whose registered backward runs when the graph runs
    if proxies_only is not None and not is_custom_op_class(cls) and (not proxies_only or _proxies(args, kwargs)):
        own = cls is torch.utils.checkpoint.CheckpointFunction    # the user's reentrant checkpoint
        raise Unfaithful(f"custom autograd.Function {cls.__qualname__}",
                         "a graph records its forward's ops and loses its backward", recomputable=not own)
    return _INSTALLED["apply"].__func__(cls, *args, **kwargs)


def _watched_enter(self):
    if getattr(_WATCH, "proxies_only", None) is not None:
        raise Unfaithful(f"saved-tensor hooks ({type(self).__qualname__})",
                         "the forward pushes saved-tensor hooks (its own torch.utils.checkpoint, offloading), "
                         "which a graph runs only while it is captured", recomputable=False)
    return _INSTALLED["enter"](self)


def watchers_installed() -> bool:
    """Some thread is inside `watching` (the watchers are on torch's classes)."""
    return _INSTALLED["count"] > 0


@contextlib.contextmanager
def _watchers():
    """The watchers on Function.apply and saved_tensors_hooks.__enter__ while any thread watches."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    with _LOCK:
        if _INSTALLED["count"] == 0:
            _INSTALLED.update(apply=torch.autograd.Function.__dict__["apply"], enter=hooks.__enter__)
            torch.autograd.Function.apply = classmethod(_watched_apply)
            hooks.__enter__ = _watched_enter
        _INSTALLED["count"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _INSTALLED["count"] -= 1
            if _INSTALLED["count"] == 0:
                torch.autograd.Function.apply, hooks.__enter__ = _INSTALLED["apply"], _INSTALLED["enter"]


@contextlib.contextmanager
def watching(proxies_only: bool):
    """Inside, in this thread, a custom autograd.Function applied (to fx proxies, with
    `proxies_only`: fx runs Functions on constants at trace time, harmlessly) or saved-tensor
    hooks entered raise Unfaithful: a graph would keep the Function's forward without its
    backward, and run the hooks (the user's torch.utils.checkpoint among them) only while it is
    captured. Other threads are not watched (NOTE [ watched in this thread only ])."""
    before = getattr(_WATCH, "proxies_only", None)
    with _watchers():
        _WATCH.proxies_only = proxies_only
        try:
            yield
        finally:
            _WATCH.proxies_only = before


class Modes:
    """The grad mode, inference mode and torch.func level a trace starts in. `check` says in which
    grad mode a traced op runs when it differs (the graph then runs that node in it: `in_grad_mode`),
    and raises Unfaithful for inference mode or a torch.func transform, which a graph cannot keep."""

    def __init__(self):
        self.start = self._now()

    @staticmethod
    def _now() -> tuple:
        return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                functorch_active())

    def check(self) -> bool | None:
        now = self._now()
        if now == self.start:
            return None
        grad, inference, func = now
        if func != self.start[2]:
            raise Unfaithful("a torch.func transform", "a graph records the transformed ops, not the transform")
        if inference != self.start[1]:
            raise Unfaithful("an inference_mode block", "fx runs it once, at trace time; its graph keeps none")
        return grad


_IN_MODE: dict = {}


def in_grad_mode(enabled: bool, target, kind: str):
    """The callable a graph node runs instead of `target` (a function; a method name, kind
    "call_method"; or "module", the module passed first) so that it runs with grad mode `enabled`,
    as it did in the forward traced (`with torch.no_grad():`, an EMA update, a stop-gradient
    branch). One per (mode, target), named after both, so that a graph prints and names its nodes."""
    key = (enabled, target, kind)
    if key not in _IN_MODE:
        mode = torch.enable_grad if enabled else torch.no_grad
        if kind == "call_module":
            def fn(module, *args, **kwargs):
                with mode():
                    return module(*args, **kwargs)
        elif kind == "call_method":
            def fn(obj, *args, **kwargs):
                with mode():
                    return getattr(obj, target)(*args, **kwargs)
        else:
            def fn(*args, **kwargs):
                with mode():
                    return target(*args, **kwargs)
        what = "module" if kind == "call_module" else target if isinstance(target, str) else \
            getattr(target, "__name__", type(target).__name__)
        fn.__name__ = fn.__qualname__ = f"{'with_grad' if enabled else 'no_grad'}_{what}".replace(".", "_")
        _IN_MODE[key] = fn
    return _IN_MODE[key]


# torch's own hooks that only compute tensors from the module's parameters and buffers (the old
# spectral_norm's power iteration, weight_norm): graphs keep them, and a recompute replays them
# exactly (the buffers they write are rewound, runtime.rewrite)
TENSOR_ONLY_HOOKS = (_spectral_norm.SpectralNorm, _weight_norm.WeightNorm)


# NOTE [ output-capturing hooks ]
# Hugging Face models (transformers 5: `capture_outputs`) install forward hooks on their layers the
# first time a forward asks for recorded outputs (Mixtral's router logits, for its auxiliary
# loss; `output_hidden_states`, `output_attentions`): each appends its module's output to a
# collector that the decorated forward of the model that installed them (it carries
# `_output_capturing_hooks_installed`) creates and reads back into its outputs within the same
# call. When that model is inside the capture, the hook's whole effect is in the outputs the graph
# records, so the hooked layers need not be leaves. Without this, a Mixtral that had run once (the
# capture check's real step installs them) could not be captured again: a shorter padded batch
# or a plan-cache hit raised TraceError (tests/test_capture.py::
# test_hugging_faces_output_capturing_hooks_keep_the_graph).
_OUTPUT_CAPTURING = "transformers.utils.output_capturing"


def _records_outputs(hook, name: str, recorders: list[str]) -> bool:
    """A forward hook of Hugging Face's output capturing, installed by a model inside the capture."""
    return (getattr(hook, "__module__", None) == _OUTPUT_CAPTURING
            and getattr(hook, "__name__", "") == "output_capturing_hook"
            and any(r == "" or name == r or name.startswith(r + ".") for r in recorders))


def _counts(hook, kind: str, name: str, recorders: list[str]) -> bool:
    """Whether `hook` (of `kind`, on submodule `name`) makes its module a leaf."""
    return not isinstance(hook, TENSOR_ONLY_HOOKS) and not (kind == "forward" and _records_outputs(hook, name, recorders))


def hooked_modules(model: torch.nn.Module) -> dict[str, str]:
    """Submodules (not the root: its hooks run around the planned forward) with forward or
    backward hooks, by qualified name -> why they are leaves: a traced hook runs once, at trace
    time, and keeps only its tensor ops. Modules nested in a hooked one are left out. Hooks that
    only compute tensors (TENSOR_ONLY_HOOKS) and Hugging Face's output capturing (NOTE [
    output-capturing hooks ]) do not count."""
    recorders = [n for n, m in model.named_modules() if getattr(m, "_output_capturing_hooks_installed", False)]
    out: dict[str, str] = {}
    for name, m in model.named_modules():
        if not name or any(name.startswith(o + ".") for o in out):
            continue
        kinds = [k for k, d in (("forward", m._forward_hooks), ("forward pre", m._forward_pre_hooks),
                                ("backward", m._backward_hooks), ("backward pre", m._backward_pre_hooks))
                 if any(_counts(h, k, name, recorders) for h in d.values())]
        if kinds:
            out[name] = f"has {' and '.join(kinds)} hooks, which a graph would run only while it is captured"
    return out
