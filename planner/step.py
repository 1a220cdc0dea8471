"""The rules of the training step remat plans: `loss_fn(model(*inputs)).backward()`.

One definition of each, for the profile, the module-tree profile, the exact replay and the
runtime's real steps: the loss (`training_loss`); forward, loss and backward in that order, the
output released once the loss is computed (`run_step`); and the fake step's setup, the model on
fake copies of its tensors under a FakeTensorMode (`fake_step`, profile and replay).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.nn.utils.stateless import _reparametrize_module
from .compat import FakeTensorMode, compute_required_storage_length, tree_flatten, tree_map

from .kernels import device_kernels
from .rng import rng_preserved
from .state import named_tensors
from .storage import fake_copy


def tensors(tree) -> list[torch.Tensor]:
    """The tensors among the leaves of a pytree, in order."""
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


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
             backward: Callable[[torch.Tensor], object] = _backward, keep_output: bool = False):
    """`backward(loss(forward()))`, the output released once the loss is computed (what the loss
    saves stays) unless `keep_output`: the caller holds it through backward, and gets it back.
    Returns (what `backward` returned, the output or None)."""
    out = forward()
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


@dataclass(frozen=True)
class FakeState:
    """What a fake step runs on, made by `fake_step`."""
    real: dict[str, torch.Tensor]      # the graph's real parameters, buffers and constants by name
    state: dict[str, torch.Tensor]     # their fake copies, under the same names
    inputs: object                     # the fake inputs, structured as the real ones
    fixed: list[torch.Tensor]          # the fake state and input tensors: live the whole step
    made_from: list[torch.Tensor]      # the real tensor each of `fixed` was made from


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
    on meta tensors runs the kernel a device runs (planner/kernels.py). Every RNG ends as it began."""
    real = graph_state(gm)      # tensor constants too: a graph may write one in place
    modes = (_MetaCopies(), contextlib.nullcontext()) if meta else (None, FakeTensorMode(allow_non_fake_inputs=True))
    with rng_preserved(), modes[1] as fake, device_kernels():
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
        step = FakeState(real, state, fake_in, list(state.values()) + tensors(fake_in) + existing,
                         list(real.values()) + tensors(inputs))
        with _reparametrize_module(gm, state):
            yield step
