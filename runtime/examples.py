"""Built-in example models for the planner.

Each factory returns an :class:`Example` (model, positional inputs, loss_fn) with
random weights built from a small config. All models are plain PyTorch, in train
mode, and traceable with ``torch.fx.symbolic_trace``. The same arguments always
give the same weights, inputs and targets; the global RNG state is left untouched.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Example(NamedTuple):
    model: nn.Module
    inputs: tuple  # positional example inputs
    loss_fn: Callable  # loss_fn(model_output) -> scalar tensor (closes over targets)
    kwargs: dict | None = None  # keyword example inputs (Hugging Face style), if any


@contextmanager
def seeded(seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def cross_entropy(targets: torch.Tensor) -> Callable:
    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.to(logits.device).reshape(-1))

    return loss_fn


# --------------------------------------------------------------------------- gpt2
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq_len: int, dropout: float):
        super().__init__()
        self.n_head, self.d_model = n_head, d_model
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.attn_dropout = nn.Dropout(dropout)
        self.resid_dropout = nn.Dropout(dropout)
        mask = torch.ones(seq_len, seq_len, dtype=torch.bool).triu(diagonal=1)
        self.register_buffer("mask", mask, persistent=False)  # True = masked out

    def forward(self, x):  # buffers are sliced with narrow(): fx cannot slice with a traced size
        B, T = x.size(0), x.size(1)
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask.narrow(0, 0, T).narrow(1, 0, T), float("-inf")).softmax(dim=-1)
        y = self.attn_dropout(att) @ v
        y = y.transpose(1, 2).contiguous().view(B, T, self.d_model)
        return self.resid_dropout(self.c_proj(y))


class GPT2Block(nn.Module):
    def __init__(self, d_model: int, n_head: int, seq_len: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, seq_len, dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(OrderedDict(
            c_fc=nn.Linear(d_model, 4 * d_model),
            gelu=nn.GELU(approximate="tanh"),
            c_proj=nn.Linear(4 * d_model, d_model),
            dropout=nn.Dropout(dropout),
        ))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, n_layer: int, d_model: int, n_head: int, seq_len: int, vocab: int, dropout: float):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(GPT2Block(d_model, n_head, seq_len, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("pos", torch.arange(seq_len), persistent=False)
        for m in self.modules():  # GPT-2 initialisation
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        self.lm_head.weight = self.wte.weight  # weight tying

    def forward(self, idx):
        x = self.drop(self.wte(idx) + self.wpe(self.pos.narrow(0, 0, idx.size(1))))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def gpt2(*, n_layer=4, d_model=128, n_head=4, seq_len=128, batch=4, vocab=1024, dropout=0.1, seed=0) -> Example:
    """GPT-2 style pre-LN decoder with tied lm_head; input token ids (batch, seq_len), output logits."""
    with seeded(seed):
        model = GPT2(n_layer, d_model, n_head, seq_len, vocab, dropout).train()
        idx = torch.randint(vocab, (batch, seq_len))
        targets = torch.randint(vocab, (batch, seq_len))
    return Example(model, (idx,), cross_entropy(targets))


# ---------------------------------------------------------------------------- mlp
def mlp(*, depth=8, width=512, batch=1024, in_features=256, n_classes=10, seed=0) -> Example:
    """Chain of ``depth`` Linear -> LayerNorm -> GELU blocks plus a classifier head."""
    with seeded(seed):
        blocks = nn.Sequential(*(
            nn.Sequential(nn.Linear(in_features if i == 0 else width, width), nn.LayerNorm(width), nn.GELU())
            for i in range(depth)
        ))
        model = nn.Sequential(OrderedDict(blocks=blocks, head=nn.Linear(width, n_classes))).train()
        x = torch.randn(batch, in_features)
        targets = torch.randint(n_classes, (batch,))
    return Example(model, (x,), cross_entropy(targets))


# ------------------------------------------------------------------------- resnet
def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(c_out)
    )


class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = _conv_bn(c_in, c_out, 3, stride)
        self.conv2 = _conv_bn(c_out, c_out, 3)
        changed = stride != 1 or c_in != c_out
        self.shortcut = _conv_bn(c_in, c_out, 1, stride) if changed else nn.Identity()

    def forward(self, x):
        out = self.conv2(F.relu(self.conv1(x)))
        return F.relu(out + self.shortcut(x))


def resnet(*, blocks=(2, 2, 2), width=32, image=32, batch=8, n_classes=10, seed=0) -> Example:
    """ResNet-style CNN of BasicBlock stages (channels double, stride 2 after the first stage)."""
    with seeded(seed):
        layers, c = OrderedDict(stem=_conv_bn(3, width, 3), relu=nn.ReLU()), width
        for i, n in enumerate(blocks):
            c_out = width * 2**i
            stage = [BasicBlock(c if j == 0 else c_out, c_out, 2 if i > 0 and j == 0 else 1) for j in range(n)]
            layers[f"stage{i + 1}"], c = nn.Sequential(*stage), c_out
        layers.update(pool=nn.AdaptiveAvgPool2d(1), flatten=nn.Flatten(), fc=nn.Linear(c, n_classes))
        model = nn.Sequential(layers).train()
        x = torch.randn(batch, 3, image, image)
        targets = torch.randint(n_classes, (batch,))
    return Example(model, (x,), cross_entropy(targets))


# --------------------------------------------------------------------------- unet
def _double_conv(c_in: int, c_out: int) -> nn.Sequential:
    return nn.Sequential(_conv_bn(c_in, c_out, 3), nn.ReLU(), _conv_bn(c_out, c_out, 3), nn.ReLU())


class UNet(nn.Module):
    def __init__(self, depth: int, width: int):
        super().__init__()
        chans = [width * 2**i for i in range(depth)]
        self.down = nn.ModuleList(_double_conv(c_in, c) for c_in, c in zip([3] + chans[:-1], chans))
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _double_conv(chans[-1], 2 * chans[-1])
        self.up = nn.ModuleList(nn.ConvTranspose2d(2 * c, c, 2, stride=2) for c in reversed(chans))
        self.dec = nn.ModuleList(_double_conv(2 * c, c) for c in reversed(chans))
        self.out = nn.Conv2d(width, 1, 1)

    def forward(self, x):
        skips = []
        for down in self.down:
            x = down(x)
            skips.append(x)
            x = self.pool(x)
        x = self.bottleneck(x)
        for up, dec, skip in zip(self.up, self.dec, reversed(skips)):
            x = dec(torch.cat([up(x), skip], dim=1))
        return self.out(x)


def unet(*, depth=3, width=16, image=64, batch=4, seed=0) -> Example:
    """U-Net with ``depth`` encoder levels, ConvTranspose2d upsampling and concatenated skips."""
    with seeded(seed):
        model = UNet(depth, width).train()
        x = torch.randn(batch, 3, image, image)
        target = torch.randn(batch, 1, image, image)
    return Example(model, (x,), lambda out: F.mse_loss(out, target.to(out.device)))


EXAMPLES: dict[str, Callable[..., Example]] = {"gpt2": gpt2, "mlp": mlp, "resnet": resnet, "unet": unet}
