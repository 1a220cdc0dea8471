"""planner/workers.py: independent pieces of planning in forked workers (NOTE [ forked workers ]).
The calling process is the oracle: what a worker returns equals what the call returns here."""
from __future__ import annotations

import os
import time

import pytest
import torch

from remat.planner import workers
from remat.planner.workers import at_once, cores, started

needs_fork = pytest.mark.skipif(not workers.FORK or (os.cpu_count() or 1) < 2, reason="no fork or one core")


def _square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def _threads() -> int:
    return torch.get_num_threads()


def _fails(x: int, after: float = 0.0):
    time.sleep(after)
    raise ValueError(f"bad {x}")


def _unpicklable():
    return lambda: None


@needs_fork
def test_at_once_returns_each_calls_result_in_order_from_other_processes(monkeypatch):
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    got = at_once(_square_and_pid, [(i,) for i in range(7)])
    assert [v for v, _ in got] == [i * i for i in range(7)]
    assert os.getpid() not in {pid for _, pid in got}


def test_remat_workers_1_runs_every_call_here(monkeypatch):
    monkeypatch.setenv("REMAT_WORKERS", "1")
    assert cores() == 0
    assert {pid for _, pid in at_once(_square_and_pid, [(i,) for i in range(3)])} == {os.getpid()}
    assert started(_square_and_pid, 3).result() == (9, os.getpid())


@needs_fork
def test_a_worker_runs_one_torch_thread_and_the_caller_keeps_its_own(monkeypatch):
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    before = torch.get_num_threads()
    assert started(_threads).result() == 1
    assert torch.get_num_threads() == before


@needs_fork
def test_a_workers_exception_is_raised_here_with_its_traceback(monkeypatch):
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    with pytest.raises(ValueError, match="bad 3") as e:     # the first failing call, not the first to fail
        at_once(_fails, [(3, 0.5), (4,)])
    assert any("planning worker" in n for n in getattr(e.value, "__notes__", []))
    with pytest.raises(RuntimeError, match="pickl|Pickl|attribute"):
        started(_unpicklable).result()


@needs_fork
def test_a_cancelled_call_leaves_no_worker_and_says_so(monkeypatch):
    """Compile mode stops the check of a plan the fit has bettered (`Started.cancel`): the worker
    is gone at once, and its result, asked for, is an error, not a stale answer."""
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    t0 = time.perf_counter()
    call = started(time.sleep, 60)
    pid = call._proc.pid
    call.cancel()
    assert time.perf_counter() - t0 < 30
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="cancelled"):
        call.result()
    done = started(_square_and_pid, 4)
    assert done.result()[0] == 16
    done.cancel()                        # a call already answered keeps its answer
    assert done.result()[0] == 16


@needs_fork
def test_a_worker_runs_below_the_callers_priority(monkeypatch):
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    assert started(os.nice, 0).result() == min(19, os.nice(0) + workers.NICE)


@needs_fork
def test_a_worker_after_the_caller_ran_openmp_does_not_hang(monkeypatch):
    """The parent's OpenMP pool used, then a real op in the worker (NOTE [ forked workers ]: with
    the parent's thread count a forked child entering a parallel region hangs)."""
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(4096, 1024).exp().sum()
        running = started(lambda: float(torch.ones(4096, 1024).exp().sum()))
        assert running._recv.poll(120), "the worker hung"
        assert running.result() == pytest.approx(float(torch.ones(4096, 1024).exp().sum()))
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.compile
@needs_fork
@pytest.mark.parametrize("name", ["gpt2", "resnet"])
def test_compile_modes_check_in_workers_equals_the_check_here(name, monkeypatch):
    """A plan's check (Inductor's wrappers of both graphs: the GPT's backward started with the saved
    tensors as traced, the ResNet's with them laid out as its forward without checkpointing lays
    them out, found beside the fit: NOTE [ the layout known ]) and the unplanned step's check beside
    the caller, each equal to the same checks made one after the other in this process, to the
    byte; and a backward started with the saved tensors laid out wrong (as traced) is read again, to
    the same."""
    import torch.fx as fx

    import remat.planner.compiled.step as step
    from remat.planner.api import analyze
    from remat.planner.solve.baselines import every_block
    from remat.runtime import examples
    from remat.runtime.planning import ExactReplay, compiled_measure
    ex = examples.gpt2(n_layer=2) if name == "gpt2" else examples.resnet()
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    a = analyze(ex.model, ex.inputs, {}, ex.loss_fn)
    prediction = compiled_measure(ExactReplay(ex.model, a, ex.loss_fn), {}).compiled
    plan = every_block(a.cost_graph)
    known = []
    check = step.checked_memory
    monkeypatch.setattr(step, "checked_memory", lambda *args: known.append(args[-1] is not None) or check(*args))
    prediction.start(())
    forked = prediction.checked(()), prediction.checked(plan), prediction.step(plan, wrapper=True)
    assert known == [False, name == "resnet"]         # the unplanned check (alongside) needs no layout
    graphs = prediction._partition(plan)
    if name == "resnet":        # read at once in the layout found beside the fit, not after lowering the forward
        assert step.check_started(prediction.joint, graphs, laid_out=prediction.laying.result()).guessed is not None
    as_traced = {n.name: tuple(n.meta["val"].stride()) for n in graphs[0].graph.find_nodes(op="output")[0].args[0]
                 if isinstance(n, fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)}
    wrong = step.check_started(prediction.joint, graphs, laid_out=as_traced).result()
    prediction.checks.clear()
    prediction.steps = {k: v for k, v in prediction.steps.items() if not k[1]}
    monkeypatch.setenv("REMAT_WORKERS", "1")
    here = prediction.checked(()), prediction.checked(plan), prediction.step(plan, wrapper=True)
    assert forked[:2] == here[:2] and forked[0] > forked[1] > 0
    assert (forked[2].forward, forked[2].backward) == (here[2].forward, here[2].backward) == wrong


def test_the_heap_is_frozen_inside_and_given_back_after():
    """NOTE [ the heap frozen ]: inside, what was alive at its start is in the collector's permanent
    generation and its youngest generation collects less often; nested, the inner one neither
    freezes more nor gives it back; after, none is, and a cycle made inside is collected as before."""
    import gc
    import weakref
    from remat.planner.workers import heap_frozen

    class Node:
        pass
    assert gc.get_freeze_count() == 0
    before = gc.get_threshold()
    with heap_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        # a frozen object that dies leaves the count (another test's, under xdist): it only falls
        with heap_frozen():
            assert 0 < gc.get_freeze_count() <= frozen      # not frozen again, not given back
        assert 0 < gc.get_freeze_count() <= frozen
        assert gc.get_threshold()[0] == workers.YOUNG
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        gc.collect()
        assert gone() is None
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == before


@needs_fork
def test_a_worker_collects_no_cycles_and_the_caller_still_does(monkeypatch):
    """NOTE [ a worker collects nothing ]: the collector is off in a worker, on here."""
    import gc
    monkeypatch.delenv("REMAT_WORKERS", raising=False)
    assert started(gc.isenabled).result() is False
    assert gc.isenabled()
