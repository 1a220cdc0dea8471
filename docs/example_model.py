"""A model factory for the CLI: `remat check docs/example_model.py:make --budget 70%`.

A factory takes no arguments and returns (model, inputs) or (model, inputs, loss_fn): inputs is
a tuple (positional arguments), a dict (keyword arguments) or one tensor; loss_fn(output) is a
scalar. Copy this file, build your own model in `make`, and point the CLI at it.
"""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def make(depth: int = 6, width: int = 256, batch: int = 512, n_classes: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(*[Block(width) for _ in range(depth)], nn.LayerNorm(width), nn.Linear(width, n_classes))
    x = torch.randn(batch, width, generator=g)
    y = torch.randint(n_classes, (batch,), generator=g)
    return model, (x,), lambda out: F.cross_entropy(out, y)
