"""The capture check: the captured graph and the model take one step each, and must agree.

Capture can lose meaning in ways no detector lists (planner/capture/fidelity.py catches the known
ones). Before a graph is profiled, it and the model's own forward run one training step on a
cheap slice of the example inputs (the first sample, when every batched input shares its first
dimension and the graph reads sizes at run time; the first two where it was exported with dynamic
sizes that admit them; else the inputs as given) under the same seed:
outputs, and the gradients of a fixed random projection of them with respect to every trainable
parameter and every input that requires grad, must agree to rounding, and the same gradients
must be missing. Nothing of the model changes (buffers, RNG, `.grad`). A disagreement is
returned as a sentence naming the tensor, its norm in the model and in the graph, and the
error's; planner.api then takes the next capture path.

NOTE [ the check's tolerance ]
Rounding is relative to the sizes of the numbers a result is computed from, not to the result:
a gradient that is zero in exact arithmetic (a query projection's, when every key sees the same
value: one repeated token) comes out as noise of the size of its upstream gradients times the
machine epsilon, and a graph that orders its sums differently gets other noise: its error is as
large as its norm. So an error (the norm of graph - model, over the tensor) counts only when it
exceeds, with `tol` = TOLERANCE for the reference's dtype (LOW below float32):
- tol x the tensor's own norm in the model (a relative error), and
- tol x the tensor's share of its group's scale: the group's norm (every float output, or every
  gradient, of the model) x sqrt(the tensor's elements / the group's elements), i.e. tol x the
  group's root-mean-square element, per element of the tensor (`share`);
and is above FLOOR (nothing at all). A wrong graph (a term dropped, another dropout mask, a
sign flipped) is caught in a tensor of small norm as long as its error per element is more than
tol of the group's root-mean-square element: only in a tensor whose whole gradient is below that
(1e-4 of the group's typical element, in float32) is a wrong graph not told from rounding.
tests/test_check_tolerance.py has both: noise in a vanishing gradient, and a gradient a hundredth of
the others' per element flipped, halved or dropped out differently.
"""
from __future__ import annotations

import math

import torch
from remat.planner.compat import tree_flatten, tree_map

from remat.planner.step.rng import rng_preserved
from remat.planner.step.state import buffers_restored, state_preserved, tensor_assignments
from remat.planner.capture.trace import Traced

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}   # relative; lower precisions: LOW
LOW = 2e-2
FLOOR = 1e-12           # an error norm at most this is none (NOTE [ the check's tolerance ])


def skipped(args: tuple, kwargs: dict, model: torch.nn.Module) -> str | None:
    """Why the check cannot run (a model or inputs on meta hold no values), else None."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    tensors += list(model.parameters())[:1]
    if any(t.device.type == "meta" for t in tensors):
        return "the model or its inputs are on meta (no values)"
    return None


def _first_sample(args: tuple, kwargs: dict, n: int = 1):
    """(args, kwargs) with every batched tensor cut to its first `n` samples, or None when the
    inputs do not share a first dimension larger than `n`, or one is not strided (a sparse
    adjacency whose rows are the batch's: not a batch to cut, and no view of it can be taken)."""
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and t.dim() > 0]
    if any(t.layout != torch.strided for t in tensors):
        return None
    sizes = {t.shape[0] for t in tensors}
    if len(sizes) != 1 or next(iter(sizes)) <= n:
        return None
    cut = lambda x: x[:n].detach().clone().requires_grad_(x.requires_grad) \
        if isinstance(x, torch.Tensor) and x.dim() > 0 else x  # noqa: E731
    return tree_map(cut, (args, kwargs))


def _slice(model: torch.nn.Module, traced: Traced, args: tuple, kwargs: dict):
    """The cheap slice the check runs first: the first sample for an fx graph (sizes read at run
    time); the first two for a graph exported with dynamic sizes that admits them (export fixes
    sizes 0 and 1); None for one exported at fixed sizes."""
    if traced.in_spec is None:
        return _first_sample(args, kwargs)
    if traced.shapes is None or not traced.shapes.dynamic:
        return None
    cut = _first_sample(args, kwargs, 2)
    return cut if cut is not None and traced.shapes.admits(traced.inputs(model, *cut)) else None


def _step(run, params: list[torch.Tensor], inputs: list[torch.Tensor]):
    """Outputs and gradients of one step of `run()`: the backward of a random projection of
    every float output (the same projection for both runs: seeded by position and shape)."""
    with rng_preserved():
        torch.manual_seed(0)
        out = run()
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    diff = [t for t in leaves if t.requires_grad and t.is_floating_point()]
    gen = torch.Generator().manual_seed(1)
    loss = sum((t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in diff)
    wrt = params + inputs
    grads = torch.autograd.grad(loss, wrt, allow_unused=True) if diff and wrt else [None] * len(wrt)
    return [t.detach() for t in leaves], list(grads)


def group_scale(tensors: list[torch.Tensor | None]) -> tuple[float, int]:
    """The squared norm and the number of elements of the float tensors of `tensors` (NaN as 0)."""
    sq, n = 0.0, 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
            sq += t.detach().double().nan_to_num(0.0, 0.0, 0.0).square().sum().item()
            n += t.numel()
    return sq, n


def share(scale: tuple[float, int], numel: int) -> float:
    """A tensor of `numel` elements' share of its group's norm: the norm it would have if each
    of its elements were the group's root-mean-square element."""
    sq, n = scale
    return math.sqrt(sq * numel / n) if n else 0.0


def _norms(a: torch.Tensor, b: torch.Tensor) -> str:
    """The norms of the model's `b`, the graph's `a` and their difference, as words."""
    ref, got, err = b.norm().item(), a.norm().item(), (a - b).norm().item()
    return f"norm {ref:.3g} in the model, {got:.3g} in the graph, error {err:.3g}"


def _differs(a: torch.Tensor | None, b: torch.Tensor | None, scale: tuple[float, int]) -> str | None:
    """What differs between the graph's `a` and the model's `b`, else None; `scale`: the group's
    (`group_scale` of the model's tensors), NOTE [ the check's tolerance ]."""
    if (a is None) != (b is None):
        return "a gradient the model has is missing" if a is None else "a gradient the model has not is there"
    if a is None:
        return None
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if not a.is_floating_point():
        return None if torch.equal(a, b) else "integer values differ"
    tol = TOLERANCE.get(b.dtype, LOW)
    if not torch.equal(a.isnan(), b.isnan()):
        return "NaN where the model has none" if a.isnan().any() else "no NaN where the model has one"
    a, b = a.double().nan_to_num(0.0), b.double().nan_to_num(0.0)
    own, err = b.norm().item(), (a - b).norm().item()
    if err > tol * own and err > tol * share(scale, b.numel()) and err > FLOOR:
        return f"relative error {err / max(own, 1e-30):.2g}: {_norms(a, b)}"
    return None


def check_capture(model: torch.nn.Module, traced: Traced, args: tuple, kwargs: dict) -> str | None:
    """None when `traced` computes what `model` does on one step (see the module's docstring),
    else what differs, as a sentence."""
    sample = _slice(model, traced, args, kwargs)
    candidates = [sample, (args, kwargs)] if sample is not None else [(args, kwargs)]
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for k, (a, kw) in enumerate(candidates):
        inputs = [t for t in tree_flatten((a, kw))[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        # with the keywords the graph was captured with (use_cache=False): those are its semantics
        model_run = _Recorded(model, lambda: model(*a, **{**(traced.extra_kwargs or {}), **kw}))
        graph_run = _Recorded(model, lambda: traced.gm(**traced.inputs(model, a, kw)))
        try:
            with state_preserved(model), buffers_restored(model):
                want = _step(model_run, params, inputs)
        except Exception:       # the model cannot take the slice (BatchNorm on one value): the inputs as given
            if k + 1 < len(candidates):
                continue
            return None         # nor the inputs as given: the profile reports the model's own error
        try:
            with state_preserved(model), buffers_restored(model):
                got = _step(graph_run, params, inputs)
        except torch.OutOfMemoryError:
            return None         # no room for the check's step: nothing is known against the graph
        except Exception as e:
            if k + 1 < len(candidates):
                continue
            return f"the graph raised {type(e).__name__} where the model did not: {str(e).strip()[:200]}"
        return _assigned_differently(model_run.names, graph_run.names) or _compare(want, got, names)
    return None


class _Recorded:
    """`fn()` as the check runs it: its output, and the tensors the forward bound to module
    attributes (`self.aux_loss = ...`), compared as outputs are; `names` says which ('layers.0.aux_loss').
    The attributes are bound as before afterwards."""

    def __init__(self, model: torch.nn.Module, fn):
        self.model, self.fn, self.names = model, fn, ()

    def __call__(self):
        with tensor_assignments(self.model) as assigned:
            out = self.fn()
        keys = sorted(assigned)
        self.names = tuple(".".join(filter(None, k)) for k in keys)
        return out, [assigned[k] for k in keys]


def _assigned_differently(model: tuple[str, ...], graph: tuple[str, ...]) -> str | None:
    """What differs between the tensor attributes the model's forward assigns and the graph's run."""
    lost, extra = sorted(set(model) - set(graph)), sorted(set(graph) - set(model))
    if lost:
        return f"the graph does not assign {', '.join(lost)}, which the model's forward assigns (a tensor attribute)"
    if extra:
        return f"the graph assigns {', '.join(extra)}, which the model's forward does not"
    return None


def _compare(want, got, names: list[str]) -> str | None:
    (out_w, grads_w), (out_g, grads_g) = want, got
    if len(out_w) != len(out_g):
        return f"the graph returns {len(out_g)} tensors, the model {len(out_w)}"
    scale = group_scale(out_w)
    for i, (a, b) in enumerate(zip(out_g, out_w)):
        why = _differs(a, b, scale)
        if why:
            return f"output {i} differs ({why})"
    labels = names + [f"input {i}" for i in range(len(grads_w) - len(names))]
    scale = group_scale(grads_w)
    for name, a, b in zip(labels, grads_g, grads_w):
        why = _differs(a, b, scale)
        if why:
            return f"the gradient of {name} differs ({why})"
    return None
