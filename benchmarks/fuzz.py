"""Differential fuzzer: random small models, planned and wrapped, trained against the unwrapped model.

`make_case(seed)` builds a random model (a DAG of torch.nn layers: Linear, Conv1d/Conv2d,
BatchNorm, LayerNorm, Dropout, Embedding, attention as F.scaled_dot_product_attention or as
softmax(QK^T)V, activations; residuals, branch-and-merge, in-place ops (on views too), views,
buffers updated in forward, forward pre-hooks that update buffers, frozen and tied parameters,
tuple and dict outputs, keyword inputs; and what a graph capture can lose: custom autograd
Functions with backwards of their own, no_grad / set_grad_enabled / enable_grad blocks and
stop-gradient branches, forward, pre and backward hooks on composite blocks (one with a Python
side effect), the user's own torch.utils.checkpoint, reentrant or not), its example inputs, a mode (wrapped in train mode, or wrapped in eval
mode and then .train()-ed), a loss (the default, or a closure over a real target tensor), a
budget fraction and bf16 autocast or not (around planning and each step's forward and loss, and
its backward or not), and whether it is first asked for half its smallest feasible budget (then
planned at the floor the InfeasibleBudgetError names). Everything is drawn from the seed alone.

Drawn last, from a stream of their own (a seed without them is the model it was), the constructs
of issue 42 (EXTRA, each with its probability EXTRA_P): a loss that reads the model's weights
(the model returns hidden states, the loss applies `model.head.weight` itself: F.linear and a
reduction, the head tied to the embedding or untied, in one piece or chunked under the user's own
torch.utils.checkpoint, reentrant or not, as fused linear-cross-entropy losses do; 0.12); blocks
that store an auxiliary loss on themselves in forward (`self.aux_loss = ...`: a router's
load-balancing loss or z-loss), which the loss adds from the model's modules (0.12); a gradient
penalty by the float input (`autograd.grad(out.sum(), x, create_graph=True)`, the loss closing
over the input; dropped where the unwrapped model cannot take a double backward; 0.10); blocks
rebinding a plain tensor attribute in forward (`self.freqs = self.freqs.to(x.device)`, as Meta's
Llama does), then a Python branch on a size or not (0.12); and a GCN on a sparse COO adjacency, a
case of its own (0.04). Each model's loss reads its own modules and inputs (`Case.loss`).

`check_case(case)` plans the budget (between the smallest feasible and the unplanned peak),
wraps a deep copy with `runtime.plan_and_wrap`, and runs two training steps (SGD between them)
on it and on the unwrapped oracle with the same torch seed and autocast: loss, outputs, gradients,
parameters, buffers and the CPU RNG state must be bitwise equal; planning must not change the
user's model or the RNG; the measured peak of the first wrapped step must be within the budget
and the plan's prediction in [measured, 1.05 x measured] (with backward after the autocast block,
in [measured, budget]: the plan is for backward inside it, which holds autocast's weight casts);
the input's gradient and each module's stored aux loss must match too, and after planning no
FakeTensor or fx Proxy may be left in a parameter's .grad, a buffer or a module attribute, each
rebound attribute must be the very tensor it held before, and no example input may hold a .grad.
A sparse case passes when planning raises exactly remat.InputLayoutError naming the adjacency
and leaves the model (it still trains as its copy does) and the RNG as they were. It returns failures as
"kind: detail" strings (an empty list is a pass).

    python benchmarks/fuzz.py --n 1000 [--start 0] [--out benchmarks/results/DATE-fuzz.md]
    python benchmarks/fuzz.py --seed 123 -v          # one case: the model and every number
    python benchmarks/fuzz.py --n 200 --autocast step  # every case under bf16 autocast
    python benchmarks/fuzz.py --n 200 --below-floor    # every case asked below its floor first
    python benchmarks/fuzz.py --n 200 --extra aux_loss,rebind   # every case with these EXTRA constructs
    python benchmarks/fuzz.py --n 200 --start S --log /tmp/S.jsonl   # one JSON line per case
    python benchmarks/fuzz.py --combine /tmp/*.jsonl --out benchmarks/results/fuzz.md   # batches, one file
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import json
import math
import os
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from remat.planner import InfeasibleBudgetError, PlanOptions, SolveOptions, analyze, solve_plan  # noqa: E402
from remat.planner.errors import TraceError  # noqa: E402
from remat.runtime import plan_and_wrap  # noqa: E402
from remat.runtime.measure import peak_memory  # noqa: E402
from remat.runtime.measure import training_loss  # noqa: E402

# Node limits (not time) bound the solver, so a case plans the same on every run and machine;
# the time limit is only a safety net.
FAST = PlanOptions(solve=SolveOptions(time_limit_s=5.0, max_nodes=100, rel_gap=0.05, improve_evals=1000))
# PlanOptions(keep_output=True): the step holds the output through backward (newer planners; older
# ones always assumed so)
_KEEP_OUTPUT_OPTION = "keep_output" in {f.name for f in dataclasses.fields(PlanOptions)}


def options(case) -> PlanOptions:
    if _KEEP_OUTPUT_OPTION and case.hold_output:
        return dataclasses.replace(FAST, keep_output=True)
    return FAST
ACTS = ("gelu", "relu", "silu", "tanh")


def _act(name: str, x):
    return {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh}[name](x)


def _act_module(name: str) -> nn.Module:
    return {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}[name]()


# ---------------------------------------------------------------------------------------------
# Blocks. Each maps the hidden state to one of the same shape:
#   seq (B, T, D), img (B, C, H, W), flat (B, D).
# ---------------------------------------------------------------------------------------------

class Mlp(nn.Module):
    def __init__(self, r, fam, d):
        super().__init__()
        h = d * r.choice((1, 2, 4))
        conv = fam == "img"
        self.up = nn.Conv2d(d, h, 1) if conv else nn.Linear(d, h)
        self.down = nn.Conv2d(h, d, 1) if conv else nn.Linear(h, d)
        self.act = r.choice(ACTS)
        self.act_as_module = r.random() < 0.5
        if self.act_as_module:
            self.act_mod = _act_module(self.act)
        self.p = r.choice((0.0, 0.1, 0.3))
        self.functional_dropout = r.random() < 0.5      # F.dropout(..., self.training) vs nn.Dropout
        if self.p and not self.functional_dropout:
            self.drop = nn.Dropout(self.p)
        self.residual = r.random() < 0.6

    def forward(self, x):
        h = self.up(x)
        h = self.act_mod(h) if self.act_as_module else _act(self.act, h)
        if self.p:
            h = F.dropout(h, self.p, self.training) if self.functional_dropout else self.drop(h)
        h = self.down(h)
        return x + h if self.residual else h


class Norm(nn.Module):
    def __init__(self, r, fam, d):
        super().__init__()
        self.fam = fam
        self.kind = "bn" if fam == "img" else r.choice(("ln", "bn"))
        if self.kind == "ln":
            self.norm = nn.LayerNorm(d, elementwise_affine=r.random() < 0.8)
        else:
            self.norm = (nn.BatchNorm2d if fam == "img" else nn.BatchNorm1d)(d, momentum=0.1 if r.random() < 0.9 else None)

    def forward(self, x):
        if self.kind == "bn" and self.fam == "seq":
            return self.norm(x.transpose(1, 2)).transpose(1, 2)
        return self.norm(x)


class Conv(nn.Module):
    def __init__(self, r, fam, d):
        super().__init__()
        self.fam = fam
        k = r.choice((1, 3))
        self.conv = (nn.Conv2d if fam == "img" else nn.Conv1d)(d, d, k, padding=k // 2, bias=r.random() < 0.7)
        self.act = r.choice(ACTS)
        self.residual = r.random() < 0.5

    def forward(self, x):
        if self.fam == "seq":
            h = self.conv(x.transpose(1, 2).contiguous()).transpose(1, 2)
        else:
            h = self.conv(x)
        h = _act(self.act, h)
        return x + h if self.residual else h


class SdpaAttention(nn.Module):
    def __init__(self, r, fam, d):
        super().__init__()
        self.heads = r.choice([h for h in (1, 2, 4) if d % h == 0])
        self.qkv = nn.Linear(d, 3 * d, bias=r.random() < 0.7)
        self.proj = nn.Linear(d, d)
        self.p = r.choice((0.0, 0.0, 0.1, 0.3))
        self.causal = r.random() < 0.4
        self.gate_p_by_training = r.random() < 0.7      # dropout_p=self.p if self.training else 0.0

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        p = (self.p if self.training else 0.0) if self.gate_p_by_training else self.p
        h = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return x + self.proj(h.transpose(1, 2).reshape(b, t, d))


class ManualAttention(nn.Module):
    def __init__(self, r, fam, d):
        super().__init__()
        self.heads = r.choice([h for h in (1, 2, 4) if d % h == 0])
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.drop = nn.Dropout(r.choice((0.1, 0.2))) if r.random() < 0.6 else None
        self.causal = r.random() < 0.4

    def forward(self, x):
        b, t, d = x.shape
        hd = d // self.heads
        q = self.q(x).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, hd).transpose(1, 2)
        s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(hd))
        if self.causal:
            s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        a = s.softmax(dim=-1)
        if self.drop is not None:
            a = self.drop(a)
        return x + self.o((a @ v).transpose(1, 2).reshape(b, t, d))


class Branch(nn.Module):
    """Split into two branches, merge by concat (+ projection) or add."""

    def __init__(self, r, fam, d):
        super().__init__()
        conv = fam == "img"
        mk = (lambda i, o: nn.Conv2d(i, o, 3, padding=1)) if conv else (lambda i, o: nn.Linear(i, o))
        self.a1, self.b1 = mk(d, d), mk(d, d)
        self.b2 = mk(d, d) if r.random() < 0.5 else None
        self.acts = (r.choice(ACTS), r.choice(ACTS))
        self.cat = r.random() < 0.5
        self.dim = 1 if conv else -1
        if self.cat:
            self.merge = nn.Conv2d(2 * d, d, 1) if conv else nn.Linear(2 * d, d)

    def forward(self, x):
        a = _act(self.acts[0], self.a1(x))
        b = _act(self.acts[1], self.b1(x))
        if self.b2 is not None:
            b = self.b2(b)
        return self.merge(torch.cat([a, b], dim=self.dim)) if self.cat else a + b


class InPlace(nn.Module):
    """In-place ops on a fresh intermediate: relu_, add_, mul_."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.lin = nn.Conv2d(d, d, 1) if fam == "img" else nn.Linear(d, d)
        # ops that do not save their output first; at most one that does (relu_, sigmoid_), last:
        # anything in place after it would break its backward in eager PyTorch too
        self.ops = r.sample(("add_", "mul_"), r.randint(0, 2)) + r.sample(("relu_", "sigmoid_"), r.randint(0, 1))
        if not self.ops:
            self.ops = [r.choice(("relu_", "add_", "mul_", "sigmoid_"))]
        self.residual = r.random() < 0.5

    def forward(self, x):
        h = self.lin(x)
        for op in self.ops:
            if op == "relu_":
                h.relu_()
            elif op == "add_":
                h.add_(0.5)
            elif op == "mul_":
                h.mul_(0.75)
            else:
                h.sigmoid_()
        if self.residual:
            h = h + x
        return h


class Views(nn.Module):
    """Views, reshapes and transposes that end in the same shape (a permutation of features)."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.fam = fam
        self.lin = nn.Conv2d(d, d, 1) if fam == "img" else nn.Linear(d, d)
        self.variant = r.randint(0, 1)

    def forward(self, x):
        h = self.lin(x)
        if self.fam == "seq":
            b, t, d = h.shape
            h = h.view(b, t, 2, d // 2).transpose(2, 3).reshape(b, t, d) if self.variant else \
                h.transpose(0, 1).contiguous().transpose(0, 1)
        elif self.fam == "img":
            b, c, hh, ww = h.shape
            h = h.flatten(2).transpose(1, 2).reshape(b, hh, ww, c).permute(0, 3, 1, 2) if self.variant else \
                h.view(b, 2, c // 2, hh, ww).transpose(1, 2).reshape(b, c, hh, ww)
        else:
            b, d = h.shape
            h = h.view(b, 2, d // 2).transpose(1, 2).reshape(b, d) if self.variant else h.unsqueeze(1).squeeze(1)
        return x + h


class Ema(nn.Module):
    """A buffer read and updated in forward: an EMA of the batch mean and a call counter."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.fam = fam
        shape = (d, 1, 1) if fam == "img" else (d,)
        self.register_buffer("ema", torch.zeros(shape))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.only_in_training = r.random() < 0.5          # `if self.training:` around the update
        self.read_before_update = r.random() < 0.5
        self.lin = nn.Conv2d(d, d, 1) if fam == "img" else nn.Linear(d, d)

    def _update(self, x):
        dims = (0, 2, 3) if self.fam == "img" else tuple(range(x.dim() - 1))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(x.detach().mean(dim=dims).reshape(self.ema.shape), alpha=0.1)
            self.count.add_(1)

    def forward(self, x):
        h = self.lin(x)
        if self.read_before_update:
            out = h - self.ema
        if self.only_in_training:
            if self.training:
                self._update(h)
        else:
            self._update(h)
        if not self.read_before_update:
            out = h - self.ema
        return out


def _count_calls(mod, args):
    with torch.no_grad():
        mod.calls.add_(1)


class Hooked(nn.Module):
    """Forward pre-hooks that update buffers: spectral_norm's power iteration, a call counter."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.variant = r.choice(("spectral_norm", "counter"))
        lin = nn.Conv2d(d, d, 1) if fam == "img" else nn.Linear(d, d)
        if self.variant == "spectral_norm":
            lin = nn.utils.spectral_norm(lin)
        else:
            lin.register_buffer("calls", torch.zeros(()))
            lin.register_forward_pre_hook(_count_calls)
        self.lin = lin
        self.act = r.choice(ACTS)

    def forward(self, x):
        return x + _act(self.act, self.lin(x))


class Tied(nn.Module):
    """Two layers sharing one weight Parameter."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d, bias=r.random() < 0.5)
        self.b.weight = self.a.weight
        self.act = r.choice(ACTS)

    def forward(self, x):
        return x + self.b(_act(self.act, self.a(x)))


class ShapeBranch(nn.Module):
    """Control flow on a shape: fx cannot follow it (this module becomes opaque), torch.export can."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.lin = nn.Conv2d(d, d, 1) if fam == "img" else nn.Linear(d, d)
        self.act = r.choice(ACTS)

    def forward(self, x):
        h = self.lin(x)
        if h.shape[0] % 2 == 0:
            h = _act(self.act, h)
        else:
            h = -h
        return x + h


class _STE(torch.autograd.Function):
    """Straight-through estimator (quantization-aware training): round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class _ScaleGrad(torch.autograd.Function):
    """Identity forward, scaled gradient backward (gradient reversal, as in domain adaptation)."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


class _Swish(torch.autograd.Function):
    """A hand-written backward from a saved input (a fused activation)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s * (1 + x * (1 - s)))


def _lin(fam, d):
    return nn.Conv2d(d, d, 1) if fam == "img" else nn.Linear(d, d)


class CustomFn(nn.Module):
    """A custom autograd.Function with a backward of its own between two layers."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.variant = r.choice(("ste", "scale_grad", "swish"))
        self.a, self.b = _lin(fam, d), _lin(fam, d)

    def forward(self, x):
        h = self.a(x)
        h = _STE.apply(h) if self.variant == "ste" else _ScaleGrad.apply(h, -0.5) \
            if self.variant == "scale_grad" else _Swish.apply(h)
        return x + self.b(h)


class StopGrad(nn.Module):
    """A stop-gradient branch (SimSiam/BYOL targets, EMA teachers): a shared layer run again in a
    grad-mode block (or detached), its result part of the output."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.variant = r.choice(("no_grad", "set_grad_enabled", "detach", "enable_grad_inside"))
        self.lin, self.act = _lin(fam, d), r.choice(ACTS)

    def forward(self, x):
        h = _act(self.act, self.lin(x))
        if self.variant == "no_grad":
            with torch.no_grad():
                t = _act(self.act, self.lin(x * 0.5))
        elif self.variant == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                t = self.lin(x).tanh()
        elif self.variant == "detach":
            t = self.lin(x * 0.5).detach()
        else:               # no_grad around, enable_grad inside: the inner part does get gradients
            with torch.no_grad():
                s = self.lin(x)
                with torch.enable_grad():
                    t = s * self.lin(x).sigmoid()
        return x + h - 0.5 * t


class HookedBlock(nn.Module):
    """Hooks on a composite submodule: a forward hook that rescales its output, a forward pre-hook
    that rescales its input, a full backward hook that scales its input's gradient, or a forward
    hook that records a statistic in a Python list (a side effect)."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.variant = r.choice(("forward", "pre", "backward", "record"))
        self.inner = nn.Sequential(_lin(fam, d), _act_module(r.choice(ACTS)), _lin(fam, d))
        self.seen: list[float] = []
        if self.variant == "forward":
            self.inner.register_forward_hook(_halve_output)
        elif self.variant == "pre":
            self.inner.register_forward_pre_hook(_double_input)
        elif self.variant == "backward":
            self.inner.register_full_backward_hook(_halve_grad)
        else:
            self.inner.register_forward_hook(self._record)

    def _record(self, module, args, out):
        self.seen.append(float(out.detach().abs().mean()))

    def forward(self, x):
        return x + self.inner(x)


def _halve_output(module, args, out):
    return out * 0.5


def _double_input(module, args):
    return (args[0] * 2,)


def _halve_grad(module, grad_in, grad_out):
    return tuple(None if g is None else g * 0.5 for g in grad_in)


class InPlaceView(nn.Module):
    """In-place ops on views of an intermediate (autograd rebases the base's history): a slice
    scaled, a transposed view shifted, a narrowed view through relu_."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.variant = r.choice(("slice", "transpose", "narrow_relu"))
        self.lin = _lin(fam, d)

    def forward(self, x):
        h = self.lin(x)
        if self.variant == "slice":
            h[:, : h.shape[1] // 2].mul_(0.5)
        elif self.variant == "transpose":
            h.transpose(0, 1).add_(1.0)
        else:
            h.narrow(-1, 0, h.shape[-1] // 2).relu_()
        return x + h


class UserCheckpoint(nn.Module):
    """The user's own torch.utils.checkpoint around the block's inner function."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.reentrant = r.random() < 0.3
        self.a = nn.Conv2d(d, 2 * d, 1) if fam == "img" else nn.Linear(d, 2 * d)
        self.b = nn.Conv2d(2 * d, d, 1) if fam == "img" else nn.Linear(2 * d, d)
        self.act = r.choice(ACTS)

    def inner(self, x):
        return self.b(_act(self.act, self.a(x)))

    def forward(self, x):
        return x + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.reentrant)


class AuxLoss(nn.Module):
    """A block that stores an auxiliary loss on itself in forward (a mixture-of-experts router's
    load-balancing loss, or a router z-loss): `self.aux_loss = <scalar from activations>`; the
    case's loss adds `sum(m.aux_loss ...)` read from the model's modules."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.fam, self.variant = fam, r.choice(("balance", "z_loss"))
        self.n_experts = r.choice((2, 3, 4))
        self.gate = nn.Linear(d, self.n_experts)
        self.experts = nn.ModuleList(_lin(fam, d) for _ in range(self.n_experts))
        self.aux_loss = None

    def forward(self, x):
        feats = x.mean(dim=(2, 3)) if self.fam == "img" else x        # img: one routing per image
        logits = self.gate(feats)
        p = logits.softmax(-1)
        if self.variant == "balance":
            self.aux_loss = self.n_experts * (p.reshape(-1, self.n_experts).mean(0) ** 2).sum()
        else:
            self.aux_loss = logits.logsumexp(-1).square().mean()
        if self.fam == "img":
            p = p[:, :, None, None, None]                             # (B, E, 1, 1, 1) against (B, C, H, W)
            return x + sum(p[:, i] * e(x) for i, e in enumerate(self.experts))
        return x + sum(p[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class Rebind(nn.Module):
    """A plain tensor attribute (not a buffer) rebound to a copy of itself in forward, as Meta's
    Llama does with freqs_cis (`self.freqs = self.freqs.to(x.device)`), then read; with `branch`,
    a Python branch on a size follows (fx cannot follow it: torch.export is used)."""

    def __init__(self, r, fam, d):
        super().__init__()
        self.fam, self.branch = fam, r.random() < 0.5
        self.variant = "branch" if self.branch else "plain"
        self.lin, self.act = _lin(fam, d), r.choice(ACTS)
        self.freqs = torch.randn({"seq": (16, d), "img": (d, 1, 1), "flat": (d,)}[fam])

    def _f(self, x):
        return self.freqs[: x.shape[1]] if self.fam == "seq" else self.freqs

    def forward(self, x):
        h = self.lin(x)
        self.freqs = self.freqs.to(x.device)
        if self.branch:
            if x.shape[1] > 1:
                h = h + self._f(x)
            else:
                h = h - self._f(x)
        else:
            h = h * self._f(x).sigmoid()
        return x + _act(self.act, h)


class FuzzGCN(nn.Module):
    """Graph convolutions over a sparse COO adjacency (nodes are the batch): remat refuses the
    sparse input by name (InputLayoutError) before it captures anything."""

    def __init__(self, r, din, d, n_out):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(din if i == 0 else d, d) for i in range(r.randint(1, 3)))
        self.norm = nn.LayerNorm(d) if r.random() < 0.5 else None
        self.drop = nn.Dropout(0.1) if r.random() < 0.5 else None
        self.head = nn.Linear(d, n_out)
        self.act = r.choice(ACTS)

    def forward(self, x, adj):
        h = x
        for lin in self.layers:
            h = _act(self.act, torch.sparse.mm(adj, lin(h)))
            if self.drop is not None:
                h = self.drop(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h)


BLOCKS = {"mlp": Mlp, "norm": Norm, "conv": Conv, "sdpa": SdpaAttention, "attn": ManualAttention,
          "branch": Branch, "inplace": InPlace, "views": Views, "ema": Ema, "hooked": Hooked,
          "tied": Tied, "shape_branch": ShapeBranch, "custom_fn": CustomFn, "stop_grad": StopGrad,
          "hooked_block": HookedBlock, "user_ckpt": UserCheckpoint, "inplace_view": InPlaceView,
          "aux_loss": AuxLoss, "rebind": Rebind}
# what a capture can lose, and in-place ops on views (issue 21)
CAPTURE = ("custom_fn", "stop_grad", "hooked_block", "user_ckpt", "inplace_view")
FAMILY_BLOCKS = {
    "seq": ("mlp", "norm", "conv", "sdpa", "attn", "branch", "inplace", "views", "ema", "hooked", "tied",
            "shape_branch"),
    "img": ("mlp", "norm", "conv", "branch", "inplace", "views", "ema", "hooked", "shape_branch"),
    "flat": ("mlp", "norm", "branch", "inplace", "views", "ema", "hooked", "tied", "shape_branch"),
}
# features that are rarer (each a known source of trouble, sampled at most a couple of times)
RARE = {"ema", "hooked", "shape_branch", "tied"}
# The CAPTURE blocks are drawn after everything else, from a stream of their own, so that a seed
# without them is the model it was before they existed (tests/test_fuzz.py's known failures)
CAPTURE_P = 0.5


class FuzzNet(nn.Module):
    head_in_loss = False        # the forward stops before the head; the loss applies model.head.weight

    def __init__(self, r: random.Random, fam: str, d: int, din: int, vocab: int | None, n_out: int,
                 blocks: list[str], output: str, use_mask: bool, use_temperature: bool, mask_at: int,
                 tie_head: bool):
        super().__init__()
        self.fam, self.output = fam, output
        self.use_mask, self.use_temperature, self.mask_at = use_mask, use_temperature, mask_at
        if vocab is not None:
            self.stem = nn.Embedding(vocab, d)
        elif fam == "img":
            self.stem = nn.Conv2d(din, d, 3, padding=1)
        else:
            self.stem = nn.Linear(din, d)
        self.blocks = nn.ModuleList(BLOCKS[k](r, fam, d) for k in blocks)
        self.final_norm = nn.LayerNorm(d) if fam != "img" and r.random() < 0.6 else None
        self.head = nn.Linear(d, n_out, bias=not tie_head)
        if tie_head:
            self.head.weight = self.stem.weight     # GPT-style: head tied to the embedding

    def forward(self, x, *, mask=None, temperature=1.0):
        h = self.stem(x)
        for i, blk in enumerate(self.blocks):
            if self.use_mask and i == self.mask_at and mask is not None:
                h = h * mask
            h = blk(h)
        if self.final_norm is not None:
            h = self.final_norm(h)
        pooled = h.mean(dim=(2, 3)) if self.fam == "img" else h
        if self.head_in_loss:
            out = pooled                            # hidden states: the loss applies the head
        else:
            out = self.head(pooled)
            if self.use_temperature:
                out = out / temperature
        if self.output == "tuple":
            return out, h
        if self.output == "dict":
            return {"out": out, "hidden": h}
        return out


@dataclass
class Case:
    seed: int
    model: nn.Module                  # a fresh model, in the mode it is wrapped in
    args: tuple
    kwargs: dict
    target: torch.Tensor | None       # what loss_fn closes over (None: the default loss)
    loss_fn: Callable | None
    mode: str                         # "train" or "eval->train" (wrapped in eval, then .train()-ed)
    u: float                          # budget = min_feasible + u * (unplanned - min_feasible)
    features: list[str] = field(default_factory=list)
    hold_output: bool = True          # the step keeps the output alive through backward
    autocast: str | None = None       # bf16 autocast around planning and each step's forward and
                                      # loss, and its backward too ("step") or not ("forward")
    below_floor: bool = False         # asked for half the smallest feasible budget first
    # the loss of one model on one step's inputs, where it reads the model (its head's weight, its
    # modules' aux losses) or the inputs (a gradient by them); None: `loss_fn` for every model
    loss_of: Callable[[nn.Module, tuple, dict], Callable] | None = None
    extra: list[str] = field(default_factory=list)    # the EXTRA constructs this case has
    expect: str | None = None         # the typed error planning must raise (a sparse input's)

    def summary(self) -> str:
        return " ".join(self.features)

    def loss(self, model: nn.Module, args: tuple, kwargs: dict) -> Callable | None:
        """The loss_fn of one model's step on `args`, `kwargs` (each model's loss reads its own modules)."""
        return self.loss_fn if self.loss_of is None else self.loss_of(model, args, kwargs)


def _main(out):
    if isinstance(out, dict):
        return out["out"], out["hidden"]
    if isinstance(out, tuple):
        return out
    return out, None


def _loss_mse(y, aux):
    def loss_fn(out):
        main, hidden = _main(out)
        loss = F.mse_loss(main, y)
        if aux and hidden is not None:
            loss = loss + 0.01 * hidden.pow(2).mean()
        return loss
    return loss_fn


def _loss_ce(y, aux):
    def loss_fn(out):
        main, hidden = _main(out)
        loss = F.cross_entropy(main.reshape(-1, main.shape[-1]), y.reshape(-1))
        if aux and hidden is not None:
            loss = loss + 0.01 * hidden.pow(2).mean()
        return loss
    return loss_fn


def _make_loss_of(base: Callable | None, target: torch.Tensor | None, ce: bool, hidden_aux: bool,
                  weight: dict | None, aux_modules: bool, penalty: float | None) -> Callable:
    """`loss_of(model, args, kwargs)` for the EXTRA constructs: `base` the case's own loss (None:
    the default), or with `weight` ({"chunks": n, "checkpoint": "none" | "reentrant" |
    "non-reentrant"}) a loss that applies `model.head` itself (F.linear, then cross-entropy or MSE
    against `target`, chunk by chunk under the user's torch.utils.checkpoint when asked, as fused
    linear-cross-entropy losses do); plus the aux losses the model's AuxLoss modules stored, and a
    gradient penalty `penalty * |d out.sum() / d x|^2` by the first input (create_graph=True)."""

    def loss_of(model, args, kwargs):
        x = args[0]

        def head_loss(h, t, reduction="mean"):
            logits = F.linear(h, model.head.weight, model.head.bias)   # read at each call, as the user's code does
            if ce:
                return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1), reduction=reduction)
            return F.mse_loss(logits, t, reduction=reduction)

        def loss_fn(out):
            main, hidden = _main(out)
            if weight is None:
                loss = training_loss(out, base)
            elif weight["chunks"] == 1:
                loss = head_loss(main, target)
            else:
                parts = [head_loss(h, t, "sum") if weight["checkpoint"] == "none" else
                         torch.utils.checkpoint.checkpoint(head_loss, h, t, "sum",
                                                           use_reentrant=weight["checkpoint"] == "reentrant")
                         for h, t in zip(main.chunk(weight["chunks"]), target.chunk(weight["chunks"]))]
                loss = sum(parts) / target.numel()       # the mean over tokens (CE) or elements (MSE)
            if weight is not None and hidden_aux and hidden is not None:
                loss = loss + 0.01 * hidden.pow(2).mean()
            if aux_modules:
                loss = loss + 0.1 * sum(m.aux_loss for m in model.modules() if isinstance(m, AuxLoss))
            if penalty is not None:
                g, = torch.autograd.grad(main.sum(), x, create_graph=True)
                loss = loss + penalty * g.float().square().mean()
            return loss
        return loss_fn
    return loss_of


AUTOCAST = ("step", "forward")
DRAWN = "drawn"
# The constructs of issue 42 (item 7), drawn after everything else from a stream of their own
# (a seed without them is the model it was), each with its probability: a loss that applies the
# model's head weight itself; blocks that store an aux loss the loss reads from the modules; a
# gradient penalty by the (float) input; a block rebinding a plain tensor attribute in forward;
# a GCN on a sparse COO adjacency (a case of its own: InputLayoutError expected).
EXTRA_P = {"weight_loss": 0.12, "aux_loss": 0.12, "input_grad_loss": 0.10, "rebind": 0.12, "sparse": 0.04}
EXTRA = tuple(EXTRA_P)


def make_case(seed: int, autocast: str | None = DRAWN, below_floor: bool | None = None,
              capture: bool | None = None, extra: bool | str | tuple | None = None) -> Case:
    """A random small model, inputs, mode, loss, budget fraction, autocast and whether to ask below
    the floor first: a function of `seed` alone (`autocast`: None or one of AUTOCAST, and
    `below_floor`, when given, instead of the drawn ones; `capture`: True or False to insert
    CAPTURE blocks or not, instead of the drawn choice; `extra`: False for none of the EXTRA
    constructs, or the names of those to add (a string, comma-separated, or a tuple), instead of
    the drawn ones)."""
    r = random.Random(seed)
    fam = r.choice(("seq", "seq", "img", "flat"))
    d = r.choice((8, 16, 32, 64)) if fam != "img" else r.choice((4, 8, 16))
    b = r.randint(2, 16) if fam != "flat" else r.randint(16, 64)   # flat: activations comparable to weights
    n_blocks = r.randint(3, 8)
    pool = FAMILY_BLOCKS[fam]
    blocks, rare_used = [], collections.Counter()
    while len(blocks) < n_blocks:
        k = r.choice(pool)
        if k in RARE and (rare_used[k] >= 2 or r.random() < 0.5):
            continue
        rare_used[k] += k in RARE
        blocks.append(k)
    tokens = fam == "seq" and r.random() < 0.4
    vocab = r.choice((16, 32, 64)) if tokens else None
    din = r.choice((3, 4, 8)) if fam == "img" else r.choice((4, 8, 16, 32))
    n_out = vocab if tokens and r.random() < 0.7 else r.choice((2, 4, 8, 16))
    tie_head = tokens and n_out == vocab and r.random() < 0.5
    output = r.choice(("tensor", "tensor", "tuple", "dict"))
    use_mask = r.random() < 0.3
    use_temperature = r.random() < 0.15
    mode = r.choice(("train", "train", "eval->train"))
    frozen_p = r.choice((0.0, 0.0, 0.2))
    input_grad = not tokens and r.random() < 0.15
    loss_kind = r.choice(("default", "closure", "closure"))
    aux = r.random() < 0.5
    u = r.random()

    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FuzzNet(r, fam, d, din, vocab, n_out, blocks, output, use_mask, use_temperature,
                        r.randrange(n_blocks), tie_head)
    frozen = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.LayerNorm)) and name != "head" and \
                r.random() < frozen_p:
            for p in m.parameters(recurse=False):
                p.requires_grad_(False)
            frozen.append(name)

    t = r.randint(4, 16)
    hw = r.randint(4, 8)
    if tokens:
        x = torch.randint(0, vocab, (b, t), generator=gen)
    elif fam == "seq":
        x = torch.randn(b, t, din, generator=gen)
    elif fam == "img":
        x = torch.randn(b, din, hw, hw, generator=gen)
    else:
        x = torch.randn(b, din, generator=gen)
    if input_grad:
        x.requires_grad_(True)
    kwargs = {}
    if use_mask:
        mshape = {"seq": (b, t, 1), "img": (b, 1, hw, hw), "flat": (b, 1)}[fam]
        kwargs["mask"] = (torch.rand(mshape, generator=gen) > 0.2).float()
    if use_temperature:
        kwargs["temperature"] = r.choice((0.5, 2.0))

    out_shape = {"seq": (b, t, n_out), "img": (b, n_out), "flat": (b, n_out)}[fam]
    target = loss_fn = None
    if loss_kind == "closure":
        if n_out == vocab and tokens and r.random() < 0.7:
            target = torch.randint(0, n_out, out_shape[:-1], generator=gen)
            loss_fn = _loss_ce(target, aux)
        else:
            target = torch.randn(out_shape, generator=gen)
            loss_fn = _loss_mse(target, aux)
    if mode == "eval->train":
        model.eval()

    features = [f"fam={fam}", f"d={d}", f"b={b}", f"blocks={','.join(blocks)}", f"out={output}",
                f"mode={mode}", f"loss={loss_kind}{'+aux' if aux and loss_kind == 'closure' else ''}", f"u={u:.2f}"]
    if tokens:
        features.append(f"tokens(vocab={vocab})")
    if tie_head:
        features.append("tied-head")
    if use_mask:
        features.append("kw:mask")
    if use_temperature:
        features.append("kw:temperature")
    if frozen:
        features.append(f"frozen={','.join(frozen)}")
    if input_grad:
        features.append("input-grad")
    # drawn last, so that every earlier draw (the model, inputs, budget) is what it was before this
    # feature existed: `out = model(x); loss_fn(out).backward()` or `loss_fn(model(x)).backward()`
    hold_output = r.random() < 0.5
    if not _KEEP_OUTPUT_OPTION:
        hold_output = True              # planners before the keep_output option assume it is held
    features.append("holds-output" if hold_output else "releases-output")
    drawn = r.choice((None, None) + AUTOCAST)       # drawn last too, for the same reason
    autocast = drawn if autocast == DRAWN else autocast
    if autocast is not None:
        features.append(f"autocast-bf16({autocast})")
    drawn = r.random() < 0.25
    below_floor = drawn if below_floor is None else below_floor
    if below_floor:
        features.append("below-floor")
    if capture is not False:
        features += _add_capture_blocks(seed, model, fam, d, blocks, force=capture is True)
    case = Case(seed, model, (x,), kwargs, target, loss_fn, mode, u, features, hold_output, autocast, below_floor)
    if extra is not False:
        case = _add_extra(case, extra, fam=fam, d=d, b=b, din=din, blocks=blocks, tokens=tokens, vocab=vocab,
                          n_out=n_out, tie_head=tie_head, out_shape=out_shape, aux=aux)
    return case


def _add_extra(case: Case, force, *, fam, d, b, din, blocks, tokens, vocab, n_out, tie_head, out_shape,
               aux) -> Case:
    """The EXTRA constructs, each with its EXTRA_P (or those `force` names), drawn and initialised
    from streams of their own; `case` changed in place (or a sparse case instead), returned."""
    seed = case.seed
    r = random.Random(f"extra-{seed}")
    draws = {k: r.random() < p for k, p in EXTRA_P.items()}
    if force is not None:
        names = set(force.split(",")) if isinstance(force, str) else set(force)
        assert names <= set(EXTRA), names
        draws = {k: k in names for k in EXTRA}
    gen = torch.Generator().manual_seed(10**7 + seed)
    if draws["sparse"]:
        return _sparse_case(case, r, gen, din, d, n_out)
    model, added = case.model, []
    for name, block, stream in (("rebind", Rebind, 2), ("aux_loss", AuxLoss, 3)):   # in this order: the draws
        if not draws[name]:
            continue
        for j in range(r.randint(1, 2)):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(stream * 10**6 + 97 * seed + j)
                blk = block(r, fam, d).train(model.training)
            at = r.randint(0, len(model.blocks))
            model.blocks.insert(at, blk)
            blocks.insert(at, name)
            added.append(f"{name}@{at}:{blk.variant}")
    weight = None
    ce = case.loss_fn is not None and case.target is not None and not case.target.is_floating_point()
    if draws["weight_loss"]:
        tie = tie_head
        if tokens and n_out == vocab and not tie_head and r.random() < 0.5:
            model.head.weight = model.stem.weight       # tied for this loss: the embedding read by model and loss
            tie = True
        weight = {"chunks": r.choice((1, 2, 2)), "checkpoint": r.choice(("none", "non-reentrant", "reentrant"))}
        if weight["chunks"] == 1:
            weight["checkpoint"] = "none"
        model.head_in_loss = True
        if case.target is None:                         # the default loss: a target of its own
            ce = tokens and n_out == vocab and r.random() < 0.7
            case.target = torch.randint(0, n_out, out_shape[:-1], generator=gen) if ce else \
                torch.randn(out_shape, generator=gen)
        added.append(f"weight_loss:{'tied' if tie else 'untied'},chunks={weight['chunks']},{weight['checkpoint']}")
    penalty = None
    if draws["input_grad_loss"] and not tokens:
        penalty = r.choice((0.1, 1.0))
        case.args[0].requires_grad_(True)
        if "input-grad" not in case.features:
            case.features.append("input-grad")
        added.append(f"input_grad_loss:{penalty}")
    if not added:
        return case
    case.extra = sorted({a.split("@")[0].split(":")[0] for a in added})
    case.loss_of = _make_loss_of(case.loss_fn, case.target, ce, aux, weight, draws["aux_loss"], penalty)
    if penalty is not None:
        err = _probe(case)
        if err:          # the unwrapped model cannot take a double backward (a reentrant checkpoint, an op)
            penalty = None
            case.extra.remove("input_grad_loss")
            added = [a for a in added if not a.startswith("input_grad_loss")] + [f"no-input_grad_loss({err})"]
            case.loss_of = _make_loss_of(case.loss_fn, case.target, ce, aux, weight, draws["aux_loss"], None) \
                if case.extra else None
    case.features.append("extra=" + ";".join(added))
    return case


def _probe(case: Case) -> str | None:
    """Why a step of the unwrapped model under the case's loss fails (an exception's name), or None."""
    model = copy.deepcopy(case.model).train()
    args, kwargs = _clone_inputs((case.args, case.kwargs))
    try:
        with torch.random.fork_rng(devices=[]), _autocast(case):
            training_loss(model(*args, **kwargs), case.loss(model, args, kwargs)).backward()
    except Exception as e:          # noqa: BLE001 (the case is drawn without it)
        return type(e).__name__
    return None


def _sparse_case(case: Case, r: random.Random, gen: torch.Generator, din: int, d: int, n_out: int) -> Case:
    """A graph convolution over a sparse COO adjacency instead of the drawn model: planning must
    raise InputLayoutError naming the adjacency, and leave the model and the RNG as they were."""
    n = r.randint(8, 64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4 * 10**6 + case.seed)
        model = FuzzGCN(r, din, d, n_out)
    edges = r.randint(n, 4 * n)
    idx = torch.randint(0, n, (2, edges), generator=gen)
    adj = torch.sparse_coo_tensor(idx, torch.rand(edges, generator=gen), (n, n), check_invariants=True)
    coalesced = r.random() < 0.7
    if coalesced:
        adj = adj.coalesce()
    x = torch.randn(n, din, generator=gen)
    as_kwarg = r.random() < 0.5
    args, kwargs = ((x,), {"adj": adj}) if as_kwarg else ((x, adj), {})
    target = torch.randn(n, n_out, generator=gen)
    if case.mode == "eval->train":
        model.eval()
    features = [f"sparse-gcn(n={n},edges={edges},layers={len(model.layers)})", f"mode={case.mode}",
                f"adj={'kwarg' if as_kwarg else 'positional'},{'coalesced' if coalesced else 'uncoalesced'}"]
    return Case(case.seed, model, args, kwargs, target, _loss_mse(target, False), case.mode, case.u, features,
                case.hold_output, None, False, extra=["sparse"], expect="InputLayoutError")


def _add_capture_blocks(seed: int, model: "FuzzNet", fam: str, d: int, blocks: list[str], force: bool) -> list[str]:
    """With probability CAPTURE_P (always with `force`), one or two CAPTURE blocks inserted at random
    places, drawn and initialised from streams of their own; returns the features to add."""
    r = random.Random(f"capture-{seed}")
    if not force and r.random() >= CAPTURE_P:
        return []
    added = []
    for j in range(r.randint(1, 2)):
        name = r.choice(CAPTURE)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(10**6 + 97 * seed + j)
            blk = BLOCKS[name](r, fam, d).train(model.training)
        at = r.randint(0, len(model.blocks))
        model.blocks.insert(at, blk)
        blocks.insert(at, name)
        added.append(f"{name}@{at}:{getattr(blk, 'variant', 'reentrant' if getattr(blk, 'reentrant', False) else 'non-reentrant')}")
    return ["capture=" + ",".join(added)]


def _autocast(case: Case):
    """The case's autocast, around planning and each step's forward and loss (and backward in "step")."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.autocast else contextlib.nullcontext()


# ---------------------------------------------------------------------------------------------
# The checker
# ---------------------------------------------------------------------------------------------

def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values (NaN equal to NaN), same shape and dtype."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    d = (a.double() - b.double()).abs()
    d = d[~d.isnan()]
    return f"max|diff|={d.max().item() if d.numel() else float('nan'):.3g}"


def _clone_inputs(x):
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) else t, x)


def _input_tensors(case: Case, args, kwargs) -> list[torch.Tensor]:
    ts = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return ts + ([case.target] if case.target is not None else [])


def _state(model: nn.Module) -> dict:
    s = {f"param {n}": p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    s.update({f"buffer {n}": b.detach().clone() for n, b in model.named_buffers(remove_duplicate=False)})
    s.update({f"requires_grad {n}": torch.tensor(p.requires_grad) for n, p in model.named_parameters()})
    s.update({f"grad-is-none {n}": torch.tensor(p.grad is None) for n, p in model.named_parameters()})
    return s


def budgets(case: Case) -> tuple[int, int, int]:
    """(unplanned, smallest feasible, budget) in bytes, on copies in wrap-time mode: the unplanned
    peak the simulator predicts, and the smallest feasible budget plan_and_wrap names when asked
    for one byte (NOTE [ one floor ] in planner/solve/fit.py: a replayed peak, met when typed back)."""
    opts = options(case)
    kw = {"keep_output": True} if _KEEP_OUTPUT_OPTION and case.hold_output else {}
    m = copy.deepcopy(case.model)
    try:
        a = analyze(m, case.args, case.kwargs, case.loss(m, case.args, case.kwargs), **kw)
        unplanned = solve_plan(a.cost_graph, 10**15, opts).predicted_peak_bytes
    except TraceError:      # no graph (aux losses stored on modules, exported): plan_and_wrap plans the module tree
        m = copy.deepcopy(case.model)
        unplanned = plan_and_wrap(m, 10**6, example_inputs=case.args, example_kwargs=case.kwargs,
                                  loss_fn=case.loss(m, case.args, case.kwargs), options=opts).remat.plan.predicted_peak_bytes
    try:
        m = copy.deepcopy(case.model)
        p = plan_and_wrap(m, 1e-9, example_inputs=case.args, example_kwargs=case.kwargs,
                          loss_fn=case.loss(m, case.args, case.kwargs), options=opts).remat.plan
        min_feasible = p.predicted_peak_bytes
    except InfeasibleBudgetError as e:
        min_feasible = e.min_feasible_bytes
    unplanned = max(unplanned, min_feasible)
    return unplanned, min_feasible, int(min_feasible + case.u * (unplanned - min_feasible))


def check_case(case: Case, verbose: bool = False, info: dict | None = None) -> list[str]:
    """Failures of `case` as 'kind: detail' strings; [] when everything matches. `info` collects numbers."""
    info = {} if info is None else info
    try:
        return _check(case, verbose, info)
    except Exception as e:  # any exception is a failure, recorded with the tail of its traceback
        tail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-3:]).strip().replace("\n", " | ")
        return [f"exception/{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
                f" [{info.get('stage', '?')}] :: {tail[-600:]}"]


def _tracer_values(model: nn.Module) -> list[str]:
    """Where a tracer's value (a FakeTensor, an fx Proxy) is left in what the user holds: a
    parameter's grad, a buffer, any attribute of a module (its parameter and buffer dicts too)."""
    bad_type = (FakeTensor, torch.fx.Proxy)
    found = [f"{n}.grad" for n, p in model.named_parameters() if isinstance(p.grad, bad_type)]
    for name, mod in model.named_modules():
        for k, v in vars(mod).items():
            values = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]
            found += [f"{name or 'model'}.{k}" for x in values if isinstance(x, bad_type)]
    return found


def _rebound(model: nn.Module) -> dict:
    """The tensor each Rebind block's plain attribute holds, by module name."""
    return {n: m.freqs for n, m in model.named_modules() if isinstance(m, Rebind)}


def _check_expected_error(case: Case, log) -> list[str]:
    """A case planning must refuse with `case.expect` (a sparse input): exactly that error, naming
    the input, and the model, its outputs and the RNG as they were."""
    fails = []
    model, oracle = copy.deepcopy(case.model), copy.deepcopy(case.model)
    before, rng_before = _state(model), torch.get_rng_state()
    budget = random.Random(f"expect-{case.seed}").choice(("50%", 1.0, 1e-9))
    try:
        plan_and_wrap(model, budget, example_inputs=case.args, example_kwargs=case.kwargs,
                      loss_fn=case.loss(model, case.args, case.kwargs), options=options(case))
        fails.append(f"expected-error/none: plan_and_wrap planned a model it should refuse with {case.expect}")
    except Exception as e:  # noqa: BLE001
        log(f"raised {type(e).__name__}: {e}")
        if type(e).__name__ != case.expect:
            tail = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-2:]).strip().replace("\n", " | ")
            fails.append(f"expected-error/other: {type(e).__name__} instead of {case.expect}: "
                         f"{str(e).strip()[:200]} :: {tail[-400:]}")
        elif "adj" not in getattr(e, "name", ""):
            fails.append(f"expected-error/unnamed: {case.expect} names {getattr(e, 'name', None)!r}, not the adjacency")
    if not torch.equal(rng_before, torch.get_rng_state()):
        fails.append("planning/rng: plan_and_wrap advanced the global torch RNG")
    after = _state(model)
    changed = [k for k in before if not _same(before[k], after[k])]
    if changed:
        fails.append(f"planning/changed-model: {', '.join(changed[:4])}")
    if hasattr(model, "remat"):
        fails.append("planning/changed-model: the refused model has a .remat")
    if _tracer_values(model):
        fails.append(f"planning/tracer-left: {', '.join(_tracer_values(model)[:4])}")
    model.train(), oracle.train()
    res = []
    for m in (oracle, model):                  # the model as it was: unwrapped, it trains as before
        torch.manual_seed(case.seed)
        loss = case.loss_fn(m(*case.args, **case.kwargs))
        loss.backward()
        res.append((loss.detach(), [p.grad for p in m.parameters()]))
    if not _same(res[0][0], res[1][0]) or not all(_same(a, b) for a, b in zip(res[0][1], res[1][1])):
        fails.append("mismatch/after-refusal: the refused model trains differently from its copy")
    return fails


def _check(case: Case, verbose: bool, info: dict) -> list[str]:
    fails: list[str] = []
    log = print if verbose else (lambda *a, **k: None)
    if case.expect:
        info["stage"] = "expected error"
        return _check_expected_error(case, log)
    oracle = copy.deepcopy(case.model)              # taken before anything touches the model
    model = copy.deepcopy(case.model)               # the user's model, to be wrapped
    info["stage"] = "budget"
    t0 = time.perf_counter()
    with _autocast(case):
        unplanned, min_feasible, budget = budgets(case)
    info["t_budget"] = time.perf_counter() - t0
    info.update(unplanned=unplanned, min_feasible=min_feasible, budget=budget)
    log(f"unplanned {unplanned} B, smallest feasible {min_feasible} B, budget {budget} B (u={case.u:.3f})")
    if case.below_floor:
        info["stage"] = "below the floor"
        try:        # every known plan is replayed for the floor; the one it names must then be met
            m = copy.deepcopy(model)
            with _autocast(case):
                plan_and_wrap(m, min_feasible / 2e9, example_inputs=case.args,
                              example_kwargs=case.kwargs, loss_fn=case.loss(m, case.args, case.kwargs),
                              options=options(case))
            budget = min_feasible // 2
        except InfeasibleBudgetError as e:
            budget = e.min_feasible_bytes
        info["budget"] = budget
        log(f"below the floor: planned at {budget} B")

    info["stage"] = "plan_and_wrap"
    xs = [t for t in tree_flatten((case.args, case.kwargs))[0] if isinstance(t, torch.Tensor)]
    for t in xs:
        t.grad = None                             # what the budget's planning left: only plan_and_wrap's counts
    before = _state(model)
    rebound = _rebound(model)
    rng_before = torch.get_rng_state()
    try:
        with _autocast(case):
            wrapped = plan_and_wrap(model, budget / 1e9, example_inputs=case.args, example_kwargs=case.kwargs,
                                    loss_fn=case.loss(model, case.args, case.kwargs), options=options(case))
    except InfeasibleBudgetError as e:
        info["t_plan"] = time.perf_counter() - t0 - info["t_budget"]
        if case.below_floor:
            return [f"floor/not-met: plan_and_wrap raised at the smallest feasible budget it had named, {budget} B "
                    f"(it says {e.min_feasible_bytes} B now)"]
        return [f"infeasible: plan_and_wrap raised at budget {budget} B >= smallest feasible {min_feasible} B "
                f"(it says {e.min_feasible_bytes} B)"]
    if not torch.equal(rng_before, torch.get_rng_state()):
        fails.append("planning/rng: plan_and_wrap advanced the global torch RNG")
    after = _state(model)
    changed = [k for k in before if not _same(before[k], after[k])]
    if changed:
        fails.append(f"planning/changed-model: plan_and_wrap changed {', '.join(changed[:4])}"
                     f"{' ...' if len(changed) > 4 else ''}")
    left = _tracer_values(model)
    if left:
        fails.append(f"planning/tracer-left: a FakeTensor or Proxy in {', '.join(left[:4])}")
    moved = [n for n, t in _rebound(model).items() if t is not rebound.get(n)]
    if moved:
        fails.append(f"planning/rebound-attribute: {', '.join(moved[:3])}.freqs is not the tensor it held before planning")
    if any(t.grad is not None for t in xs):
        fails.append("planning/input-grad-set: planning left a .grad on an example input")
    info["t_plan"] = time.perf_counter() - t0 - info["t_budget"]
    plan = wrapped.remat.plan
    info.update(predicted=plan.predicted_peak_bytes, regions=len(plan.regions),
                path=plan.meta.get("trace_path"), solver=plan.solver)
    log(plan.summary() if hasattr(plan, "summary") else plan)
    if plan.predicted_peak_bytes > budget:
        fails.append(f"memory/predicted-over-budget: predicted {plan.predicted_peak_bytes} B > budget {budget} B")

    if case.mode == "eval->train":
        wrapped.train()
    oracle.train()
    opt_ref = torch.optim.SGD([p for p in oracle.parameters() if p.requires_grad], lr=0.05)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ref_names = dict(oracle.named_parameters())

    for step in (1, 2):
        info["stage"] = f"step {step}"
        opt_ref.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        args_ref, kwargs_ref = _clone_inputs((case.args, case.kwargs))
        args_w, kwargs_w = _clone_inputs((case.args, case.kwargs)) if step == 2 else (case.args, case.kwargs)
        for x in tree_flatten((case.args, case.kwargs))[0]:
            if isinstance(x, torch.Tensor):
                x.grad = None
        seed = 1000 + 17 * case.seed + step
        res_ref, res = {}, {}

        hold = case.hold_output or step == 2      # outputs are compared where the step holds them

        def run(m, a, kw, into):
            loss_fn = case.loss(m, a, kw)            # reads its own model's modules and inputs
            torch.manual_seed(seed)
            with _autocast(case):
                out = m(*a, **kw) if hold else None
                loss = training_loss(out if hold else m(*a, **kw), loss_fn)
                if case.autocast == "step":
                    loss.backward()
            if case.autocast != "step":
                loss.backward()
            into["out"] = None if out is None else tree_map(
                lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
            into["loss"] = loss.detach()

        m_ref = peak_memory(lambda: run(oracle, args_ref, kwargs_ref, res_ref), oracle,
                            *_input_tensors(case, args_ref, kwargs_ref))
        rng_ref = torch.get_rng_state()
        measured = peak_memory(lambda: run(wrapped, args_w, kwargs_w, res), model,
                               *_input_tensors(case, args_w, kwargs_w))
        rng = torch.get_rng_state()
        if step == 1:
            info.update(measured=measured, measured_unplanned=m_ref)
            log(f"step 1: measured {measured} B (unwrapped model: {m_ref} B), predicted "
                f"{plan.predicted_peak_bytes} B, budget {budget} B")
            if measured > budget:
                fails.append(f"memory/over-budget: measured {measured} B > budget {budget} B "
                             f"(predicted {plan.predicted_peak_bytes} B, {len(plan.regions)} regions)")
            if plan.predicted_peak_bytes < measured:
                fails.append(f"memory/under-predicted: predicted {plan.predicted_peak_bytes} B < measured {measured} B")
            elif plan.predicted_peak_bytes > 1.05 * measured and case.autocast != "forward":
                fails.append(f"memory/over-predicted: predicted {plan.predicted_peak_bytes} B > 1.05 x measured "
                             f"{measured} B ({plan.predicted_peak_bytes / measured:.3f}x)")
        if not _same(res["loss"], res_ref["loss"]):
            fails.append(f"mismatch/loss: step {step}: {res['loss'].item()} vs {res_ref['loss'].item()}")
        leaves = lambda o: [] if o is None else tree_flatten(o)[0]   # noqa: E731  (None: the step released it)
        outs, outs_ref = leaves(res["out"]), leaves(res_ref["out"])
        bad = [i for i, (a, b) in enumerate(zip(outs, outs_ref)) if not _same(a, b)]
        if bad or len(outs) != len(outs_ref):
            fails.append(f"mismatch/output: step {step}: leaf {bad[:1]} {_diff(outs[bad[0]], outs_ref[bad[0]]) if bad else 'count'}")
        bad = []
        for n, p in model.named_parameters():
            g, g_ref = p.grad, ref_names[n].grad
            if (g is None) != (g_ref is None) or (g is not None and not _same(g, g_ref)):
                bad.append((n, "None vs set" if (g is None) != (g_ref is None) else _diff(g, g_ref)))
        if bad:
            fails.append(f"mismatch/grad: step {step}: {len(bad)} grads differ, e.g. {bad[0][0]} {bad[0][1]}")
        for a, b in zip(tree_flatten(args_w)[0], tree_flatten(args_ref)[0]):
            if isinstance(a, torch.Tensor) and a.requires_grad and not (
                    (a.grad is None and b.grad is None) or (a.grad is not None and b.grad is not None
                                                            and _same(a.grad, b.grad))):
                fails.append(f"mismatch/input-grad: step {step}")
        aux, aux_ref = ([m.aux_loss for m in mm.modules() if isinstance(m, AuxLoss)] for mm in (model, oracle))
        if not all(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same(a.detach(), b.detach())
                   for a, b in zip(aux, aux_ref)):
            fails.append(f"mismatch/aux-loss: step {step}: a module's stored aux_loss differs")
        if _tracer_values(model):
            fails.append(f"step/tracer-left: step {step}: {', '.join(_tracer_values(model)[:4])}")
        ref_bufs = dict(oracle.named_buffers())
        bad = [(n, _diff(bf, ref_bufs[n])) for n, bf in model.named_buffers() if not _same(bf, ref_bufs[n])]
        if bad:
            fails.append(f"mismatch/buffer: step {step}: {', '.join(f'{n} {d}' for n, d in bad[:3])}")
        if not torch.equal(rng, rng_ref):
            fails.append(f"mismatch/rng: step {step}: CPU RNG state after the step differs")
        opt_ref.step()
        opt.step()
        bad = [n for n, p in model.named_parameters() if not _same(p.detach(), ref_names[n].detach())]
        if bad:
            fails.append(f"mismatch/param: after step {step}: {', '.join(bad[:3])}")
        if fails and any(f.startswith("mismatch") for f in fails):
            break                                 # step 2 after a mismatch only repeats it
    info["stage"] = "done"
    info["t_steps"] = time.perf_counter() - t0 - info["t_budget"] - info["t_plan"]
    return fails


def kind_of(failure: str) -> str:
    return failure.split(": ", 1)[0]


def run_seed(seed: int, verbose: bool = False, autocast: str | None = DRAWN,
             below_floor: bool | None = None, extra=None) -> tuple[Case | None, list[str], dict, float]:
    t0 = time.perf_counter()
    info: dict = {}
    try:
        case = make_case(seed, autocast, below_floor, extra=extra)
    except Exception as e:
        return None, [f"exception/make_case-{type(e).__name__}: {e}"], info, time.perf_counter() - t0
    if verbose:
        print(f"seed {seed}: {case.summary()}")
        print(case.model)
        print("inputs:", [(tuple(t.shape), t.dtype) for t in tree_flatten((case.args, case.kwargs))[0]
                          if isinstance(t, torch.Tensor)], "kwargs:", list(case.kwargs))
    fails = check_case(case, verbose, info)
    return case, fails, info, time.perf_counter() - t0


def _commit() -> str:
    """The git commit the planner and runtime were imported from, '+ changes' if the tree differs."""
    import subprocess
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "planner", "runtime"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        return head + (" + uncommitted changes in planner/ or runtime/" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def combine(logs: list[str], out: str | None) -> int:
    """One results file from several --log files: cases, seed ranges, per-construct counts,
    failures with their seeds, the commands and commits."""
    rows = [json.loads(line) for path in logs for line in open(path) if line.strip()]
    by_seed = {r["seed"]: r for r in rows}           # a seed run twice: its last run
    rows = [by_seed[s] for s in sorted(by_seed)]
    failed = [r for r in rows if r["failures"]]
    seeds = sorted(by_seed)
    ranges, start = [], seeds[0] if seeds else None
    for a, b in zip(seeds, seeds[1:] + [None]):
        if b != a + 1:
            ranges.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    secs = sorted(r["seconds"] for r in rows)
    commands = sorted({"python benchmarks/fuzz.py " + " ".join(a for a in r["argv"]) for r in rows})
    commits = sorted({r["commit"] for r in rows})
    lines = ["# Differential fuzz run", "",
             f"{len(rows)} cases (seeds {', '.join(ranges)}; {sum(bool(r['regions']) for r in rows)} planned with "
             f"checkpoint regions), passed {len(rows) - len(failed)}, failed {len(failed)}; "
             f"{sum(secs):.0f} s in all, {sum(secs) / max(len(rows), 1):.2f} s per case "
             f"(median {secs[len(secs) // 2] if secs else 0:.2f} s), 1 thread, torch {torch.__version__}.", "",
             "Code at " + "; ".join(commits) + ".", "", "Commands (REMAT_CACHE=0):", ""]
    lines += [f"    {c}" for c in commands]
    lines += ["", "## The constructs of issue 42 (item 7)", "",
              "| construct | probability | cases | failed |", "|---|---|---|---|"]
    for k in EXTRA:
        n = [r for r in rows if k in r["extra"]]
        lines.append(f"| {k} | {EXTRA_P[k]} | {len(n)} | {sum(bool(r['failures']) for r in n)} |")
    kinds = collections.defaultdict(list)
    for r in failed:
        for k in sorted({kind_of(f) for f in r["failures"]}):
            kinds[k].append(r["seed"])
    if not failed:
        lines += ["", "No case failed: every check held on every case."]
    else:
        lines += ["", "| failure kind | cases | seeds |", "|---|---|---|"]
        lines += [f"| {k} | {len(s)} | {', '.join(map(str, s[:40]))}{' ...' if len(s) > 40 else ''} |"
                  for k, s in sorted(kinds.items(), key=lambda kv: -len(kv[1]))]
        lines += ["", "## Failing seeds", ""]
    for r in failed:
        lines.append(f"- **{r['seed']}** `{r['summary']}`")
        lines += [f"  - {f[:500]}" for f in r["failures"]]
    text = "\n".join(lines) + "\n"
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as fh:
            fh.write(text)
    print(text)
    return 1 if failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100, help="number of seeds")
    ap.add_argument("--start", type=int, default=0, help="first seed")
    ap.add_argument("--seed", type=int, help="run this one seed (with -v: print the model and numbers)")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--out", help="write a results markdown file here")
    ap.add_argument("--autocast", choices=AUTOCAST + ("off",),
                    help="every case with this autocast instead of the drawn one (see Case.autocast)")
    ap.add_argument("--below-floor", action="store_true", help="every case asked below its floor first")
    ap.add_argument("--extra", help="every case with these EXTRA constructs (comma-separated; 'none': without "
                                    "any) instead of the drawn ones")
    ap.add_argument("--log", help="append one JSON line per case here (seed, features, failures, seconds)")
    ap.add_argument("--combine", nargs="+", metavar="LOG", help="write --out from these --log files (no cases run)")
    args = ap.parse_args(argv)
    if args.combine:
        return combine(args.combine, args.out)
    extra = None if args.extra is None else False if args.extra == "none" else args.extra
    torch.set_num_threads(1)              # deterministic kernels, and fair on a shared machine
    import warnings
    warnings.filterwarnings("ignore")
    seeds = [args.seed] if args.seed is not None else list(range(args.start, args.start + args.n))
    t_start = time.perf_counter()
    failed: dict[int, tuple[str, list[str]]] = {}
    by_kind: collections.Counter = collections.Counter()
    seeds_by_kind: dict[str, list[int]] = collections.defaultdict(list)
    times, done, with_regions = [], 0, 0
    extra_seen: collections.Counter = collections.Counter()
    extra_failed: collections.Counter = collections.Counter()
    commit = _commit()
    try:
        for seed in seeds:
            autocast = DRAWN if args.autocast is None else None if args.autocast == "off" else args.autocast
            case, fails, info, dt = run_seed(seed, args.verbose, autocast, True if args.below_floor else None, extra)
            times.append(dt)
            for k in (case.extra if case else []):
                extra_seen[k] += 1
                extra_failed[k] += bool(fails)
            if args.log:
                with open(args.log, "a") as fh:
                    fh.write(json.dumps({"seed": seed, "summary": case.summary() if case else "?",
                                         "extra": case.extra if case else [], "failures": fails,
                                         "regions": info.get("regions"), "seconds": round(dt, 2),
                                         "argv": argv if argv is not None else sys.argv[1:],
                                         "commit": commit}) + "\n")
            done += 1
            with_regions += bool(info.get("regions"))
            summary = case.summary() if case else "?"
            if fails:
                failed[seed] = (summary, fails)
                for k in sorted({kind_of(f) for f in fails}):
                    by_kind[k] += 1
                    seeds_by_kind[k].append(seed)
                for f in fails:
                    print(f"FAIL seed {seed} [{summary}] {f}", flush=True)
            elif args.verbose or args.seed is not None:
                print(f"pass seed {seed} [{summary}] {dt:.1f}s", flush=True)
            if args.verbose:
                print("info:", info)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
    total = time.perf_counter() - t_start
    tally = (f"cases {done} ({with_regions} planned with checkpoint regions), passed {done - len(failed)}, "
             f"failed {len(failed)}; "
             f"{total:.0f} s, {total / max(done, 1):.2f} s per case (median {sorted(times)[len(times) // 2] if times else 0:.2f} s)")
    print(tally)
    for k, n in by_kind.most_common():
        print(f"  {k}: {n} cases (smallest seed {min(seeds_by_kind[k])})")
    print("  EXTRA constructs: " + ", ".join(f"{k} {extra_seen[k]} cases ({extra_failed[k]} failed)" for k in EXTRA))
    if args.out:
        cmd = "python benchmarks/fuzz.py " + " ".join(argv if argv is not None else sys.argv[1:])
        lines = ["# Differential fuzz run", "", f"`{cmd}` (torch {torch.__version__}, "
                 f"{time.strftime('%Y-%m-%d %H:%M')}, 1 thread, code at {_commit()})", "", tally, "",
                 "| failure kind | cases | seeds |", "|---|---|---|"]
        for k, n in by_kind.most_common():
            s = seeds_by_kind[k]
            lines.append(f"| {k} | {n} | {', '.join(map(str, s[:40]))}{' ...' if len(s) > 40 else ''} |")
        lines += ["", "## Failing seeds", ""]
        for seed, (summary, fails) in failed.items():
            lines.append(f"- **{seed}** `{summary}`")
            for f in fails:
                lines.append(f"  - {f[:500]}")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
