"""The process events an async save must survive: fork and exit.

Every live checkpointer is registered here (:func:`track`, held weakly). In a forked child,
each forgets its parent's threads, saves, locks and groups (``_forget_parent()``). At exit,
an ``atexit`` hook (and a ``multiprocessing`` finalizer, for worker processes, which skip
atexit) lets each wait up to its ``exit_timeout_s`` for saves in flight (``_drain_at_exit()``).
A save that does not finish by then is abandoned; it never commits half-written, because
``.metadata`` is written only after every rank's data is written, so the directory holds
either the new checkpoint, the previous one, or none.

This module knows checkpointers only by those two methods; it makes none itself.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from typing import Any

__all__ = ["track", "install_exit_hooks", "process_lock"]

_CHECKPOINTERS: weakref.WeakSet[Any] = weakref.WeakSet()
_HOOKS_PID: int | None = None
_HOOKS_LOCK = threading.Lock()


def track(checkpointer: Any) -> None:
    """Register ``checkpointer`` (held weakly) for the fork and exit hooks."""
    _CHECKPOINTERS.add(checkpointer)


def process_lock() -> threading.Lock:
    """This process's lock for process-wide state (a fresh one in a forked child)."""
    return _HOOKS_LOCK


def _after_fork_in_child() -> None:
    global _HOOKS_LOCK
    _HOOKS_LOCK = threading.Lock()
    for checkpointer in list(_CHECKPOINTERS):
        checkpointer._forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _exit_hook() -> None:
    for checkpointer in list(_CHECKPOINTERS):
        checkpointer._drain_at_exit()


def install_exit_hooks() -> None:
    """Register the exit wait once per process (atexit, plus multiprocessing's own exit path,
    which worker processes take instead of atexit)."""
    global _HOOKS_PID
    with _HOOKS_LOCK:
        if _HOOKS_PID == os.getpid():
            return
        _HOOKS_PID = os.getpid()
        atexit.register(_exit_hook)
        try:
            from multiprocessing import util

            util.Finalize(None, _exit_hook, exitpriority=100)
        except Exception:  # multiprocessing unavailable: atexit alone covers plain scripts
            pass
