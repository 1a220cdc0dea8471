"""The rules of the training step remat plans: `loss_fn(model(*inputs)).backward()`.

One definition of each, for the profile, the module-tree profile, the exact replay and the
runtime's real steps: the loss (`training_loss`); forward, loss and backward in that order, the
output released once the loss is computed (`run_step`); and the fake step's setup, the model on
fake copies of its tensors under a FakeTensorMode (`fake_step`, profile and replay), the loss and
backward seeing the same copies wherever they read the model's tensors from (`FakeState.reads`).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from remat.planner.compat import (FakeTensorMode, reparametrize_module, compute_required_storage_length, current_fake_mode, disable_current_modes,
                     tree_flatten, tree_map)

from remat.planner.step.kernels import device_kernels
from remat.planner.step.rng import rng_preserved
from remat.planner.step.state import attributes_restored, named_tensors
from remat.planner.step.storage import fake_copy


def tensors(tree) -> list[torch.Tensor]:
    """The tensors among the leaves of a pytree, in order."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def describe(tree) -> str:
    """The tensors of a pytree as words: '(4, 128) int64, (4, 128) float32' (at most 200 characters)."""
    return ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors(tree))[:200]


def model_loss(out) -> torch.Tensor | None:
    """The loss a model computed itself (a Hugging Face model given `labels`: `out.loss`, as
    Trainer reads it): a scalar that requires grad, or None."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    ok = isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.requires_grad
    return loss if ok else None


def training_loss(out, loss_fn=None) -> torch.Tensor:
    """`loss_fn(out)`; without one, the model's own loss (`model_loss`: `out.loss`), else a
    stand-in loss that keeps one tensor of each output's size for backward (exp saves its result,
    as cross-entropy keeps its log-softmax), so that a plan leaves room for a loss."""
    if loss_fn is not None:
        return loss_fn(out)
    own = model_loss(out)
    if own is not None:
        return own
    return sum(t.float().exp().sum() for t in tensors(out) if t.requires_grad)


def _backward(loss: torch.Tensor) -> None:
    loss.backward()


def run_step(forward: Callable[[], object], loss: Callable[[object], torch.Tensor],
             backward: Callable[[torch.Tensor], object] = _backward, keep_output: bool = False,
             reads: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
    """`backward(loss(forward()))`, the output released once the loss is computed (what the loss
    saves stays) unless `keep_output`: the caller holds it through backward, and gets it back.
    The loss and backward run inside `reads()` (a fake step's `FakeState.reads`).
    Returns (what `backward` returned, the output or None)."""
    out = forward()
    with reads():
        value = loss(out)
        if not keep_output:
            out = None
        result = backward(value)
        del value
    return result, out


def graph_state(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """Parameters, buffers and tensor constants by qualified name (tied ones under every name)."""
    named = named_tensors(gm)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target not in named:
            value = functools.reduce(getattr, n.target.split("."), gm)
            if isinstance(value, torch.Tensor):
                named[n.target] = value
    return named


# NOTE [ one fake per real tensor ]
# The fake step swaps fake copies of the graph's tensors into the graph's modules; the loss reads
# the model's tensors from wherever the user holds them (`model.lm_head.weight` in a fused
# linear-cross-entropy, a tied weight, a head only the loss applies), and those are the real ones.
# Run on a real trainable tensor under FakeTensorMode, autograd wrote a fake gradient into the
# user's `.grad` (it stayed there: a later fake step read it as a tensor of its own, the optimizer
# stepped on it), and a tied weight got two gradients. `_SameFakes` (a TorchFunctionMode: above
# autograd) swaps, at every torch function the loss and backward call, each real tensor of the
# step for the fake copy the graph uses, and a trainable real tensor the graph does not hold (a
# head only the loss applies) for a fake copy of its own, made at its first read (`FakeState.late`):
# its meters count it from then on as a tensor that existed before the step. A real run inside the
# fake step (an opaque module measured for real: no FakeTensorMode current) is left alone.
# Python code autograd runs in backward (a `Function.backward`, a hook) runs without the
# TorchFunctionMode: the recompute of the user's own reentrant checkpoint reads the real tensors.
# A gradient autograd accumulates into one of them moves to its fake copy (`_Redirects`: a
# post-accumulate-grad hook), and every real tensor has its own `.grad` back when the step ends.
class _SameFakes(TorchFunctionMode):
    """Swaps the real tensors of a fake step for their fake copies (NOTE [ one fake per real tensor ])."""

    def __init__(self, step: "FakeState"):
        super().__init__()
        self.step = step

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.step.meta or current_fake_mode() is not None:
            args, kwargs = tree_map(self.step.fake_of, (args, kwargs or {}))
        return func(*args, **(kwargs or {}))


class _Redirects:
    """Gradients autograd accumulates into real tensors during a fake step, moved to their fake
    copies; each real tensor's `.grad` and hooks as they were once `close` is called."""

    def __init__(self):
        self.undo: list[Callable[[], None]] = []

    def add(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        if not (real.requires_grad and real.is_leaf) or type(real).__name__ == "FakeTensor":
            return
        before, hooks = real.grad, real._post_accumulate_grad_hooks

        def moved(t: torch.Tensor) -> None:
            g, t.grad = t.grad, before
            if g is None or g is before:        # accumulated in place into a gradient of the user's: left as it was
                return
            if fake.grad is None:
                fake.grad = g
            else:
                fake.grad.add_(g)
        handle = real.register_post_accumulate_grad_hook(moved)

        def undo() -> None:
            handle.remove()
            if hooks is None:
                real._post_accumulate_grad_hooks = None
            if real.grad is not before:
                real.grad = before
        self.undo.append(undo)

    def close(self) -> None:
        while self.undo:
            self.undo.pop()()


@dataclass(frozen=True)
class FakeState:
    """What a fake step runs on, made by `fake_step`."""
    real: dict[str, torch.Tensor]      # the graph's real parameters, buffers and constants by name
    state: dict[str, torch.Tensor]     # their fake copies, under the same names
    inputs: object                     # the fake inputs, structured as the real ones
    fixed: list[torch.Tensor]          # the fake state and input tensors: live the whole step
    made_from: list[torch.Tensor]      # the real tensor each of `fixed` was made from
    copy: Callable[[torch.Tensor], torch.Tensor]    # a fake copy of a real tensor
    copies: dict[int, torch.Tensor]    # id of each real tensor of `made_from` -> its fake copy
    late: dict[int, tuple[torch.Tensor, torch.Tensor]]  # id -> (real, fake copy): trainable tensors only the loss reads
    redirects: _Redirects              # gradients autograd gives the real tensors, moved to the copies
    grads: bool = False                # every trainable parameter has a gradient from the start
    meta: bool = False                 # meta copies, no FakeTensorMode (NOTE [ meta step ])

    def fake_of(self, x):
        """The fake copy the step computes on for `x`, a real tensor of the step or a trainable
        real tensor only the loss reads (made now, NOTE [ one fake per real tensor ]); else `x`."""
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in self.copies:
            return self.copies[id(x)]
        if id(x) in self.late:
            return self.late[id(x)][1]
        if not (x.requires_grad and x.is_leaf) or type(x).__name__ == "FakeTensor" or \
                (self.meta and x.device.type != "meta"):
            return x
        fake = self.copy(x)
        if self.grads:          # out of the meters' sight: read by backward, it counts as live from the start
            with disable_current_modes():
                fake.grad = torch.zeros_like(fake)
        self.late[id(x)] = (x, fake)
        self.redirects.add(x, fake)
        # read now, through the dispatch modes: a meter counts it once, its real storage and its
        # fake one (the fake twin) as one, however backward reads it later
        torch.ops.aten.alias.default(fake if self.meta else x)
        return fake

    def reads(self) -> contextlib.AbstractContextManager:
        """Around the loss and backward: whatever they read of the step, they read as the graph
        does (NOTE [ one fake per real tensor ])."""
        return _SameFakes(self)


# NOTE [ meta step ]
# A replay whose every tensor is on the meta device (a model built there: `remat report --hf-config`,
# a 70B planned on a laptop) needs no FakeTensorMode: meta tensors carry no data already, and their
# kernels are the ones a FakeTensorMode would run for them. Without it the replay runs twice as fast
# (a Llama-2-7B replay 1.8-2.3 -> 0.9-1.3 s: FakeTensorMode's dispatch and cache keys), on
# meta copies that keep the real tensors' storage sharing (`_MetaCopies`: views of one storage stay
# views of one), to the same peak (tests/test_capture.py: zoo models on meta, every known plan).
# What a FakeTensorMode alone can do, it still does: an op with a data-dependent shape or value
# raises on meta tensors, and the replay runs again under FakeTensorMode (`meta_first`).
# The profile stays on FakeTensorMode: a FakeTensor's device is asked through the dispatcher
# (`prim.device`, 84 of the 122 ops the mlp's profile meters; a meta tensor answers without one),
# and the roofline's per-op overheads count those asks: on meta copies every node's cost would move.
def on_meta(gm: fx.GraphModule, inputs) -> bool:
    """Every tensor of the step (the graph's state and the inputs) is on the meta device."""
    ts = list(graph_state(gm).values()) + tensors(inputs)
    return bool(ts) and all(t.device.type == "meta" for t in ts)


def meta_first(gm: fx.GraphModule, inputs, run: Callable[[bool], object]):
    """`run(meta)`: with meta True first where the step is all on meta (NOTE [ meta step ]), again
    with meta False (under FakeTensorMode) if that raises; else once with meta False."""
    if on_meta(gm, inputs):
        try:
            return run(True)
        except Exception:          # noqa: BLE001 - the fake step says what it is, or runs
            pass
    return run(False)


class _MetaCopies:
    """`from_tensor(t)`: a meta tensor like `t` on a storage of its own, one per storage of the
    originals (views of one storage stay views of one). The copy of a meta step (NOTE [ meta step ])."""

    def __init__(self):
        self.storages: dict[torch.UntypedStorage, torch.UntypedStorage] = {}   # an original's -> its copy
        self.made: dict[int, torch.Tensor] = {}

    def from_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if id(t) not in self.made:
            real = t.untyped_storage()
            if real not in self.storages:
                # a freed storage (FSDP2's gathered parameters between uses) as large as when it computes
                need = compute_required_storage_length(t.shape, t.stride(), t.storage_offset()) * t.element_size()
                self.storages[real] = torch.UntypedStorage(max(real.nbytes(), need), device="meta")
            copy = torch.empty(0, dtype=t.dtype, device="meta").set_(self.storages[real], t.storage_offset(), t.shape,
                                                                     t.stride())
            self.made[id(t)] = copy.requires_grad_(t.requires_grad)
        return self.made[id(t)]


@contextlib.contextmanager
def fake_step(gm: fx.GraphModule, inputs, grads: bool = False, meta: bool = False):
    """Inside, `gm` holds fake copies of its parameters, buffers and constants (`graph_state`),
    under a FakeTensorMode that also takes real tensors (a loss target); yields a FakeState with
    the fake inputs. `grads`: every trainable parameter starts with a gradient (a micro-step of
    gradient accumulation after the first), live the whole step. `meta`: the step is all on meta
    (`on_meta`), and runs on meta copies without a FakeTensorMode (NOTE [ meta step ]). Attention
    on meta tensors runs the kernel a device runs (planner/step/kernels.py). Every RNG ends as it began.
    The loss and backward run inside `FakeState.reads()` (`run_step`'s `reads`): nothing fake is
    left in the user's tensors (NOTE [ one fake per real tensor ])."""
    real = graph_state(gm)      # tensor constants too: a graph may write one in place
    modes = (_MetaCopies(), contextlib.nullcontext()) if meta else (None, FakeTensorMode(allow_non_fake_inputs=True))
    # attributes the graph stores (an aux loss: state.assign_attribute) hold fake values until the end
    with rng_preserved(), modes[1] as fake, device_kernels(), attributes_restored(gm):
        fake = modes[0] or fake
        # a tensor under two names (tied weights) is one fake copy: from_tensor memoizes, but a
        # freed storage's copy (fake_copy) is made anew at each call
        copies: dict[int, torch.Tensor] = {}
        for v in real.values():
            if id(v) not in copies:
                copies[id(v)] = fake.from_tensor(v) if meta else fake_copy(fake, v)
        state = {k: copies[id(v)] for k, v in real.items()}
        fake_in = tree_map(lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x, inputs)
        existing = []
        if grads:
            for v in {id(v): v for v in state.values() if v.requires_grad and v.is_leaf}.values():
                v.grad = torch.zeros_like(v)
                existing.append(v.grad)
        copy = fake.from_tensor if meta else functools.partial(fake_copy, fake)
        made_from = list(real.values()) + tensors(inputs)
        fixed = list(state.values()) + tensors(fake_in)
        step = FakeState(real, state, fake_in, fixed + existing, made_from, copy,
                         {id(r): f for r, f in zip(made_from, fixed)}, {}, _Redirects(), grads, meta)
        for r, f in zip(made_from, fixed):
            step.redirects.add(r, f)
        try:
            with reparametrize_module(gm, state):
                yield step
        finally:
            step.redirects.close()
