"""The memory CUDA's math libraries keep allocated once a step ran: cuBLAS/cuBLASLt workspaces.

A CUDA step's first matmul of a dtype allocates a workspace through the caching allocator (the
forward's thread and autograd's backward thread each their own), and it stays allocated: 64 MiB
on an H200 for a bf16 step (benchmarks/results/gpu.md), outside every tensor the step
makes, yet inside `torch.cuda.max_memory_allocated`. A plan counts it as live throughout
(`costgraph.with_workspace`). It is measured once per device and set of dtypes: the workspaces
are released (torch makes them again on demand), then a forward and backward matmul of each dtype
runs, and what stays allocated beyond its tensors is the workspace. On a CPU, or with no CUDA
device to measure on, it is 0.
"""
from __future__ import annotations

import functools

import torch

from remat.planner.compat import clear_cublas_workspaces


def workspace_bytes(device: torch.device | str, dtypes) -> int:
    """Bytes of library workspace a training step of these floating dtypes on `device` holds."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    floats = tuple(sorted({d for d in dtypes if d.is_floating_point}, key=str))
    return _measured(index, floats) if floats else 0


@functools.lru_cache(maxsize=None)
def _measured(index: int, dtypes: tuple[torch.dtype, ...]) -> int:
    device = torch.device("cuda", index)
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        clear_cublas_workspaces()
        before = torch.cuda.memory_allocated(device)
        for dtype in dtypes:
            w = torch.ones(64, 64, dtype=dtype, device=device, requires_grad=True)
            (w @ w).sum().backward()     # the forward's and the backward thread's handles
            del w
        torch.cuda.synchronize()
        return max(0, torch.cuda.memory_allocated(device) - before)
