"""Every CBC solve goes through `cbc()`: a result this process, or an earlier one, already has for
the same input is handed back instead of solving again. No torch here.

NOTE [ solved once ]
CBC with one thread and a node limit is a function of what it is given: the problem, the start
solution and its options. Planning solves the same problem again and again (a hierarchical solve's
segment fronts at every budget, the budget correction's rounds, a re-plan at another budget or
after a restart, each test's plan of a model another test planned): `cbc` keeps each solve's
result under the hash of exactly that input (`problem_key`) and hands it back when it comes again.
Two stores, looked up in order:
- in memory: `SOLVED`, the last MEMO_ENTRIES results of this process. A result CBC reached at its
  time limit is kept here too, so the same input gets the same plan in this process whatever the
  machine's load at the second call;
- on disk (planner/cachedir.py: `solves/` under remat's cache directory; off with REMAT_CACHE=0 or
  REMAT_SOLVE_CACHE=0): one file per result, named by the key, which also holds PuLP's version.
  Only results CBC reached before its time limit are written, so the store never keeps a plan
  that depended on the machine's load. A file that cannot be read or does not fit the problem
  (another number of variables, a bad status) is ignored and logged, and solved anew; a write
  is whole or not at all (a temporary file renamed), so processes can share the directory.
Each result is the statuses and the variables' values in `prob.variables()` order (the key holds
that order; NaN for no value): 8 bytes a variable in memory, at most ~40 MB for the largest flat
ILPs; compressed on disk (mostly zeros and ones: a few hundred bytes to a few kB).

NOTE [ CBC's threads ]
CBC given `threads 1` runs its parallel branch and bound with one worker thread, and that worker
sometimes never starts: CBC waits, using no CPU, until its time limit (its log says "Thread 0 used
0 times, waiting to start 10.0"), then stops "on time limit" with its first incumbent. On PuLP's
bundled CBC (2.10) a 23-variable segment ILP of the built-in gpt2 hung in 8 of 60 runs with
`threads 1` and in none of 60 without; a plan of gpt2 spent 20 of its 22 s in two such waits, and
the plan it got depended on which solves hung. Without the option CBC's search is serial, as
deterministic as one thread, so one thread is asked for by leaving `threads` out.

NOTE [ PuLP's deprecation warnings ]
PuLP 3.3 warns (DeprecationWarning, its 4.0 migration notices) on spellings remat used: an
`LpVariable(...)` built directly, `prob.constraints` read as a dict, and any `PULP_CBC_CMD`
made. A user's pytest shows every one, once per variable of every ILP remat builds. Where PuLP
has a spelling that does not warn, it is here for every module that builds a problem:
`variable` (`prob.add_variable` where this PuLP has it) and `constraints_of`
(`prob.constraints()` where it is a call); `problem_key` and planner/profile/modules.py use them
(planner/solve/ilp.py and planner/solve/segment.py still build `LpVariable`s themselves:
tests/test_quiet.py's xfail says so). PuLP's bundled CBC has no such spelling (its replacement,
COIN_CMD, needs a CBC installed apart), so `cbc_command` makes it with PuLP's
DeprecationWarnings ignored for that one call (`quiet`): `warnings.catch_warnings` swaps the
process's filters, not a thread's, so the block holds only PuLP's constructor.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
import warnings
import zlib
from array import array
from collections import OrderedDict
from pathlib import Path

import pulp

from remat.planner import cachedir

log = logging.getLogger("remat.cache")

MEMO_ENTRIES = 1024
SOLVED: OrderedDict[str, tuple[int, int, array]] = OrderedDict()
_memo_lock = threading.Lock()
CBC_ATTEMPTS = 4
DISK_ENTRIES = 20_000          # files kept in the disk store; beyond, the least recently used go
DISK_FORMAT = 1
COUNTS = {"solved": 0, "memo": 0, "disk": 0}   # CBC runs, and results taken from each store (benchmarks)


@contextlib.contextmanager
def quiet():
    """PuLP's own DeprecationWarnings ignored in the block, nothing else (NOTE [ PuLP's
    deprecation warnings ]): keep the block to the one PuLP call that warns."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"pulp(\.|$)")
        yield


def cbc_command(threads: int = 1, **kw) -> pulp.PULP_CBC_CMD:
    """CBC as every solve runs it (NOTE [ CBC's threads ]), made without PuLP's warning that its
    bundled CBC goes in PuLP 4.0 (NOTE [ PuLP's deprecation warnings ])."""
    with quiet():
        return pulp.PULP_CBC_CMD(msg=False, threads=threads if threads > 1 else None, **kw)


def variable(prob: pulp.LpProblem, name: str, low: float | None = None, up: float | None = None,
             cat: str = pulp.LpContinuous) -> pulp.LpVariable:
    """A variable of `prob`, spelled as this PuLP has it without a warning: `prob.add_variable`
    (PuLP >= 3.3), else `LpVariable` (NOTE [ PuLP's deprecation warnings ])."""
    add = getattr(prob, "add_variable", None)
    return add(name, low, up, cat=cat) if add is not None else pulp.LpVariable(name, low, up, cat)


def constraints_of(prob: pulp.LpProblem) -> list:
    """`prob`'s constraints in the order they were added, as (name, constraint), spelled as this
    PuLP has it without a warning: `prob.constraints()` where it is a call (PuLP >= 3.3: a list;
    a constraint added without a name has name None there), else the dict's items."""
    cons = prob.constraints
    return [(c.name, c) for c in cons()] if callable(cons) else list(cons.items())


def problem_key(prob, solver) -> str:
    """The hash of what CBC is given: objective, constraints, variables (bounds, kinds and, for a
    warm start, the start values), in the order they are written, and the solver's options."""
    warm = bool(solver.optionsDict.get("warmStart", False))
    h = hashlib.sha256(repr((type(solver).__name__, prob.sense, solver.timeLimit, solver.mip,
                             sorted(solver.optionsDict.items()), list(solver.options))).encode())

    def terms(e) -> None:                      # names, then coefficients as packed doubles (fast)
        h.update("\0".join([v.name for v in e]).encode())
        h.update(array("d", e.values()).tobytes())
    if prob.objective is not None:
        terms(prob.objective)
    for name, c in constraints_of(prob):
        h.update(f"|{name} {c.sense} {c.constant!r}|".encode())
        terms(c)
    vs = prob.variables()
    h.update("\0".join([v.name for v in vs]).encode())
    h.update(repr([(v.lowBound, v.upBound, v.cat) for v in vs]).encode())
    if warm:
        h.update(repr([v.varValue for v in vs]).encode())
    return h.hexdigest()


def _file(key: str) -> Path | None:
    folder = cachedir.solves()
    if folder is None:
        return None
    name = hashlib.sha256(f"{key} pulp {pulp.__version__} format {DISK_FORMAT}".encode()).hexdigest()
    return folder / name[:2] / f"{name}.cbc"


def _read(path: Path, n: int) -> tuple[int, int, array] | None:
    try:
        data = zlib.decompress(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, zlib.error) as e:
        log.warning("solved-ILP store: %s unreadable (%s); solving anew", path, e)
        return None
    head, _, body = data.partition(b"\n")
    try:
        status, sol_status = json.loads(head)
        values = array("d")
        values.frombytes(body)
        ok = status in pulp.LpStatus and sol_status in pulp.LpSolution and len(values) == n
    except (ValueError, TypeError) as e:
        ok, status = False, e
    if not ok:
        log.warning("solved-ILP store: %s does not fit the problem (%s); solving anew", path, status)
        return None
    try:
        os.utime(path)                 # recently used: kept when the store is pruned
    except OSError:
        pass
    return status, sol_status, values


_writes = 0


def _write(path: Path, entry: tuple[int, int, array]) -> None:
    global _writes
    status, sol_status, values = entry
    data = zlib.compress(json.dumps([status, sol_status]).encode() + b"\n" + values.tobytes())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("solved-ILP store: cannot write %s (%s)", path, e)
        return
    _writes += 1
    if _writes % 256 == 1:
        _prune(path.parent.parent)


def _prune(folder: Path) -> None:
    """The least recently used files beyond DISK_ENTRIES removed."""
    try:
        files = [(f.stat().st_mtime, f) for f in folder.glob("*/*.cbc")]
    except OSError:
        return
    for _, f in sorted(files)[:max(0, len(files) - DISK_ENTRIES)]:
        try:
            f.unlink()
        except OSError:
            pass


def _assign(prob, got: tuple[int, int, array]) -> None:
    status, sol_status, values = got
    for v, x in zip(prob.variables(), values, strict=True):
        v.varValue = None if math.isnan(x) else x
    prob.assignStatus(status, sol_status)


def cbc(prob, solver) -> None:
    """`prob.solve(solver)`, or its result if it was solved before (NOTE [ solved once ]); again if
    CBC's process failed (PulpSolverError: it exited with an error, seen on a machine loaded past
    its cores, twice in a row at a load of 7 on 2 cores), up to CBC_ATTEMPTS runs in all; the last
    failure is raised."""
    key = problem_key(prob, solver)
    with _memo_lock:
        got = SOLVED.get(key)
        if got is not None:
            SOLVED.move_to_end(key)
    path = _file(key) if got is None else None
    if path is not None:
        got = _read(path, len(prob.variables()))
    if got is not None:
        source = "memo" if path is None else "disk"
        _assign(prob, got)
    else:
        source = "solved"
        t0 = time.perf_counter()
        for attempt in range(CBC_ATTEMPTS):
            try:
                prob.solve(solver)
                break
            except pulp.PulpSolverError:
                if attempt == CBC_ATTEMPTS - 1:
                    raise
        got = (prob.status, prob.sol_status,
               array("d", [math.nan if v.varValue is None else v.varValue for v in prob.variables()]))
        limit = solver.timeLimit
        if path is not None and (limit is None or time.perf_counter() - t0 < 0.9 * limit):
            _write(path, got)
    with _memo_lock:
        COUNTS[source] += 1
        SOLVED[key] = got
        SOLVED.move_to_end(key)
        while len(SOLVED) > MEMO_ENTRIES:
            SOLVED.popitem(last=False)
