"""Every random number generator a step can draw from, left as it was found.

Planning runs the user's model (fake steps, real runs of opaque modules, measured steps):
whatever it draws must not shift the user's own random stream. That is torch's CPU generator,
every accelerator's generators (CUDA and the like: `torch.random.fork_rng(devices=[])` covers
the CPU only), and Python's and numpy's global RNGs (checkpoint replays only torch's).
"""
from __future__ import annotations

import contextlib
import random
import sys

import torch


def _accelerator() -> tuple[str, list[int]] | None:
    """The accelerator's device type and its device indices, or None without one."""
    acc = getattr(torch, "accelerator", None)
    if acc is None or not acc.is_available():
        return None
    kind = acc.current_accelerator().type
    return kind, list(range(acc.device_count()))


@contextlib.contextmanager
def rng_preserved():
    """torch's CPU and accelerator generators, Python's and numpy's RNGs end as they began."""
    acc = _accelerator()
    fork = (torch.random.fork_rng(devices=acc[1], device_type=acc[0]) if acc
            else torch.random.fork_rng(devices=[]))
    with fork, host_rng_restored():
        yield


def host_rng_state() -> tuple:
    """Python's global RNG state and numpy's (None where numpy is not imported)."""
    np = sys.modules.get("numpy")
    return random.getstate(), (np.random.get_state() if np is not None else None)


def host_rng_moved(before: tuple) -> bool:
    """Python's or numpy's RNG drew since `before` (a `host_rng_state`); numpy's is compared
    only where it was imported then."""
    if random.getstate() != before[0]:
        return True
    if before[1] is None:
        return False
    now = sys.modules["numpy"].random.get_state()       # (name, keys: an array, pos, has_gauss, gauss)
    return now[0] != before[1][0] or not (now[1] == before[1][1]).all() or now[2:] != before[1][2:]


def set_host_rng_state(state: tuple) -> None:
    random.setstate(state[0])
    if state[1] is not None:
        sys.modules["numpy"].random.set_state(state[1])


@contextlib.contextmanager
def host_rng_restored(drawn: list | None = None):
    """Python's and numpy's global RNG end as they began; appends to `drawn` whether the block
    drew from them. Checkpoint replays only torch's RNG, so a module that draws from these
    cannot be recomputed."""
    before = host_rng_state()
    try:
        yield
    finally:
        if drawn is not None:
            drawn.append(host_rng_moved(before))
        set_host_rng_state(before)
