"""What a failed torch.export says, muted in the thread that exports, and only there.

A failed export logs warnings on torch's loggers and prints its partial graph to `sys.stderr`
(torch/export/_trace.py); its exception, which the capture keeps, says enough. `muted()` drops
both for the calling thread alone:
- torch's log records made in this thread at WARNING or below, by a filter on the handlers of
  torch's loggers and the root logger while inside (records of other threads, remat's own log,
  and errors pass);
- writes to `sys.stderr` from this thread, through a stand-in for `sys.stderr` that forwards
  every other thread's writes to the stream it replaced. The stand-in is installed while any
  thread is inside (counted, under a lock) and the stream put back when the last one leaves,
  unless someone replaced it meanwhile (theirs is kept).
Nothing else of the process changes: `logging.disable` and `contextlib.redirect_stderr`, which
this replaces, muted every thread.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading

_MUTED = threading.local()      # .depth: how deep this thread is inside `muted`
_STDERR = {"count": 0, "stand_in": None}
_LOCK = threading.Lock()


class _ThreadStderr:
    """`sys.stderr` while some thread is muted: a muted thread's writes go nowhere, every other
    thread's to `stream`."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        if getattr(_MUTED, "depth", 0):
            return len(text)
        return self.stream.write(text)

    def flush(self) -> None:
        if not getattr(_MUTED, "depth", 0):
            self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _ThreadFilter(logging.Filter):
    """Drops torch's records at WARNING or below made in thread `ident`."""

    def __init__(self, ident: int):
        super().__init__()
        self.ident = ident

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.thread == self.ident and record.levelno <= logging.WARNING
                    and record.name.split(".")[0] == "torch")


def _torch_handlers() -> set[logging.Handler]:
    loggers = [v for k, v in list(logging.root.manager.loggerDict.items())
               if k.split(".")[0] == "torch" and isinstance(v, logging.Logger)]
    return {h for lg in loggers + [logging.root] for h in lg.handlers}


@contextlib.contextmanager
def _stderr_stand_in():
    with _LOCK:
        if _STDERR["count"] == 0:
            _STDERR["stand_in"] = sys.stderr = _ThreadStderr(sys.stderr)
        _STDERR["count"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STDERR["count"] -= 1
            if _STDERR["count"] == 0:
                if sys.stderr is _STDERR["stand_in"]:
                    sys.stderr = _STDERR["stand_in"].stream
                _STDERR["stand_in"] = None


@contextlib.contextmanager
def muted():
    """Inside, this thread's torch warnings and stderr writes are dropped (module docstring)."""
    only = _ThreadFilter(threading.get_ident())
    handlers = _torch_handlers()
    for h in handlers:
        h.addFilter(only)
    _MUTED.depth = getattr(_MUTED, "depth", 0) + 1
    try:
        with _stderr_stand_in():
            yield
    finally:
        _MUTED.depth -= 1
        for h in handlers:
            h.removeFilter(only)
