"""Kernel choices a fake step makes as the device would, and the FLOPs of kernels torch's
FlopCounterMode has no formula for.

`scaled_dot_product_attention` picks its kernel by device. On a CPU or CUDA device (the inputs
4-D, one floating dtype; grouped-query heads included) it runs a flash kernel, which saves the output and one
logsumexp per row for backward; on `meta` tensors (a model built under `torch.device("meta")` to
plan a 7B step on a laptop) it falls back to the math kernel, which saves the whole attention
matrix, upcast to float32: at seq 4096 that is 2 GB per layer of a Llama-2-7B that no device
holds. Inside `device_kernels()`, attention on meta tensors runs the CPU flash kernel, whose meta
kernel saves what the flash kernels of CPU and CUDA save. Real tensors are left to torch.

FlopCounterMode counts the CUDA flash and memory-efficient kernels, not the CPU flash kernel
(real CPU tensors and the stand-in above): `FLOP_FORMULAS` gives it torch's own sdpa counts.
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _attention_on_meta(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                       enable_gqa=False):
    """scaled_dot_product_attention for meta tensors: the CPU flash kernel where it takes the inputs
    (as on a CPU, key and value may have fewer heads with `enable_gqa`), else the math kernel, as
    torch's own composite runs on meta."""
    qkv = (query, key, value)
    if (any(t.dim() != 4 for t in qkv) or len({t.dtype for t in qkv}) != 1 or query.dtype not in _FLOATS
            or (attn_mask is not None and attn_mask.dtype not in _FLOATS + (torch.bool,))):
        return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                       scale=scale, enable_gqa=enable_gqa)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:     # as torch does first: 0 where True, else -inf
        attn_mask = torch.where(attn_mask, torch.zeros((), dtype=query.dtype, device=query.device),
                                torch.full((), float("-inf"), dtype=query.dtype, device=query.device))
    return aten._scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal,
                                                            attn_mask=attn_mask, scale=scale)[0]


_active = 0     # device_kernels() entered and not left (nested uses register once)
_library: torch.library.Library | None = None


@contextlib.contextmanager
def device_kernels():
    """Inside, attention on meta tensors runs the flash kernel a CPU or CUDA device runs (module
    docstring): a kernel registered for the op at the AutogradMeta key (ahead of its composite) and
    removed on leaving. A dispatcher registration, not a TorchFunctionMode: checkpoint's
    recompute in backward runs without the caller's torch-function modes."""
    global _active, _library
    if _active == 0:
        _library = torch.library.Library("aten", "IMPL")
        _library.impl("scaled_dot_product_attention", _attention_on_meta, "AutogradMeta")
    _active += 1
    try:
        yield
    finally:
        _active -= 1
        if _active == 0:
            _library._destroy()
            _library = None


def _flash_cpu_flop(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _flash_cpu_backward_flop(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                             **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


# FlopCounterMode(custom_mapping=FLOP_FORMULAS): shapes in, FLOPs out
FLOP_FORMULAS = {aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_flop,
                 aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward_flop}
