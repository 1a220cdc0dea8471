"""The solver's pure work with Python's cyclic garbage collector paused (pure: no torch).

NOTE [ solving without the cyclic GC ]
The solver's DPs and searches make millions of short-lived tuples, lists and frozensets (the
front and lower DPs' entries and states, the chain's, the local search's plans), none of them in a
reference cycle: reference counting frees each as soon as it is dropped. In a process that also
holds the model, its fx graphs and torch's own modules, every few hundred of those allocations
start a collection, and the older generations, full of objects that outlive the plan, are
scanned again and again: in a planning process hf-moe's block front took 0.38 s and its lower DP
0.45-0.71 s a call, 0.07 and 0.15-0.21 s with the collector paused; the hierarchical solve of a
plan 3.0 -> 1.35 s (benchmarks/plan_time.py's hf-moe row at u = 0.5), gpt2's 1.16 -> 0.98 s.
`paused` runs a solver entry point with the collector off and turns it back on after, if it was
on (nested calls leave it to the outermost): cyclic garbage made meanwhile is collected then. It
wraps only code without torch: a replay's storages are freed when autograd drops them, and a
cycle among them must be collected when it would be in training, not later.
The collector is the process's, not a thread's: it is paused only while the planning thread is
the process's only Python thread. With others running (a data loader's, a trainer's), planning
leaves it on and takes longer rather than hold back their garbage.
"""
from __future__ import annotations

import functools
import gc
import threading


def paused(fn):
    """`fn` run with the cyclic garbage collector off (NOTE [ solving without the cyclic GC ])."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if not gc.isenabled() or threading.active_count() > 1:
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()
    return run
