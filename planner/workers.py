"""Independent pieces of planning run at once, in forked worker processes (NOTE [ forked workers ]).

`started(fn, *args)` runs one call in a worker and returns a handle whose `result()` waits for it;
`at_once(fn, calls)` runs several. Where the platform does not fork, the machine has one core,
or `REMAT_WORKERS=1`, both run the calls in this process, one after another.
"""
from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import os
import traceback

import torch

# NOTE [ forked workers ]
# Some of a plan's work is a pure function of data this process already holds: a pipeline job's
# stage profiles and stage solves (runtime/distributed/pipeline_job.py), compile mode's check of a
# plan (Inductor's wrapper for the forward and the backward graph, planner/compiled/wrapper.py) and
# the check of the step without checkpointing, which the fit need not wait for. A worker is
# forked: what it needs reaches it by the fork, not by pickling, and it sends back plain data.
# - The plans are the same as one process makes: each call is deterministic and sees only its own
#   inputs (the machine's core count decides only how many run at once).
# - A worker first sets one torch thread: a forked child that enters an OpenMP parallel region
#   the parent used hangs (seen here: a matmul in the parent, one in the child, no answer in
#   50 s); with one thread it runs none. What depends on the parent's thread count (a kernel's
#   measured workspace) is found in the parent, before the fork.
# - Only for work on CPU, meta and fake tensors: a forked child cannot use CUDA.
# - An exception in a worker is raised again here, with the worker's traceback in its notes.
# - A worker runs NICE steps below this process: where this process goes on beside its workers
#   (compile mode's fit, beside the checks it started), it keeps a core and the workers share the
#   rest; where it waits, they have them all (GPT-2 of 6 layers, compile mode at 36.7 MB on 2
#   cores: 15.0-15.4 s to plan with the workers at this process's priority, 13.8-14.3 s niced).

FORK = "fork" in multiprocessing.get_all_start_methods()
NICE = 5
YOUNG = 50_000      # the collector's youngest generation while the heap is frozen (NOTE [ the heap frozen ])


# NOTE [ the heap frozen ]
# Compile mode's planning (the capture, the fit's partitions, the checks) makes millions of
# Python objects (fx nodes, Inductor's IR), and each of Python's cyclic collections of its oldest
# generation scans the whole heap again: the model, torch's modules, the traced graph, all of it
# alive until the plan is made. `heap_frozen` moves what is alive when planning starts to the
# collector's permanent generation (`gc.freeze`) for its length: collections then scan only what
# planning made, and a forked worker does not write the collector's marks into the pages it
# shares with this process (copies of them). The GPT-2 of 6 layers, compile mode at its halfway
# budget on 2 cores, three runs each: the joint graph's capture 4.6 / 6.1 / 5.5 s -> 4.3 / 4.7 /
# 4.4 s, the whole plan 12.9 / 16.8 / 15.4 s -> 13.4 / 14.5 / 12.9 s. After, `gc.unfreeze` returns
# it to the collector: garbage among it (a cycle that died meanwhile) is collected then.
# Inside, the youngest generation is collected every YOUNG allocations, not every 700: planning's
# objects mostly live until the plan is made, and each young collection moved them on to be
# scanned again (that GPT-2: 678 young, 61 middle and 5 oldest collections, 0.53 s, became 9 and
# 1, 0.23-0.32 s; a GC callback timing each).
#
# NOTE [ a worker collects nothing ]
# A worker's collector is off (`gc.disable`): a worker makes one call and exits, and what its call
# leaves in cycles dies with it. A compile check's worker spent 0.28-0.44 s of its 3-5 s in 299
# collections; its peak resident memory with the collector off was 372 MB against 357 MB on.
@contextlib.contextmanager
def heap_frozen():
    """Inside, the objects alive at its start are exempt from cyclic collection (NOTE [ the heap
    frozen ]); nested, the outermost unfreezes."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def cores() -> int:
    """The cores this process may run on (0: the calls run here, one after another)."""
    if not FORK or os.environ.get("REMAT_WORKERS") == "1":
        return 0
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return n if n > 1 else 0


def forks_for(devices: set[str]) -> bool:
    """Whether work on tensors (fake ones included) of these device types runs in forked workers
    here: on CPU only (a forked child cannot use CUDA), with two cores or more."""
    return cores() > 1 and devices <= {"cpu"}


def _child(send, fn, args) -> None:
    torch.set_num_threads(1)
    os.nice(NICE)
    gc.disable()                              # NOTE [ a worker collects nothing ]
    try:
        out = (True, fn(*args))
    except BaseException as e:                # noqa: BLE001  (raised again in the parent)
        out = (False, (e, traceback.format_exc()))
    try:
        send.send(out)
    except Exception as e:                    # an unpicklable result or exception
        send.send((False, (RuntimeError(f"{type(e).__name__}: {e}"), traceback.format_exc())))
    send.close()


class Started:
    """One call, running in a forked worker (or already done here: `REMAT_WORKERS=1`, no fork)."""

    def __init__(self, fn, *args, here: bool = False):
        self._done = None
        if here or not cores():
            self._done = (True, fn(*args))
            return
        ctx = multiprocessing.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
        self._proc.start()
        send.close()

    def __del__(self):               # a call no one waited for (the caller raised): no worker left behind
        self.cancel()

    def cancel(self) -> None:
        """The call stopped, its worker killed, if it is still running (its answer no longer wanted)."""
        if self._done is None and getattr(self, "_proc", None) is not None:
            self._proc.kill()
            self._proc.join()
            self._recv.close()
            self._done = (False, (RuntimeError("cancelled"), ""))

    def wait(self) -> "Started":
        """Wait for the worker's answer without raising what it raised (`result()` raises it)."""
        if self._done is None:
            try:
                self._done = self._recv.recv()
            except EOFError:
                self._proc.join()
                self._done = (False, (RuntimeError(f"a planning worker died (exit code {self._proc.exitcode})"), ""))
            self._recv.close()
            self._proc.join()
        return self

    def result(self):
        ok, value = self.wait()._done
        if ok:
            return value
        e, where = value
        if where:
            e.add_note(f"in a planning worker (remat.planner.workers):\n{where}")
        raise e


def started(fn, *args, here: bool = False) -> Started:
    """`fn(*args)` running in a forked worker; `.result()` waits for it. `here`: run it now, in
    this process (work a fork cannot take: on CUDA)."""
    return Started(fn, *args, here=here)


def at_once(fn, calls: list[tuple]) -> list:
    """`[fn(*args) for args in calls]`, `cores()` of them running at a time (the next one starts
    as soon as any finishes). Where calls fail, the first failing call in order raises, as in
    one process (whichever worker happens to finish first)."""
    n = cores()
    if n < 2 or len(calls) < 2:
        return [fn(*args) for args in calls]
    out: dict[int, Started] = {}
    running: dict[int, Started] = {}
    for i, args in enumerate(calls):
        running[i] = started(fn, *args)
        while len(running) >= n or (i == len(calls) - 1 and running):
            ready = multiprocessing.connection.wait([r._recv for r in running.values()])
            for j in [j for j, r in running.items() if r._recv in ready]:
                out[j] = running.pop(j).wait()
    return [out[i].result() for i in range(len(calls))]
