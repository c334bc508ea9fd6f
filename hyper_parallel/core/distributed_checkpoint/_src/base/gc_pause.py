"""Pausing Python's cyclic garbage collector around bulk work on millions of small objects.

Not a memory policy: only :func:`paused_gc`, which planning, saving and ``.metadata``
(de)serialization wrap around loops that build or parse many acyclic records.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # paused_gc blocks running now, in any thread
_was_enabled = False  # the collector's state when the first of them began


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic GC while building or parsing millions of small objects.

    Plans and metadata of large jobs are millions of tuples and records that hold no
    cycles; the collector re-scanning them made planning grow faster than linearly.
    The pause is one for the whole process (the collector is): nested and concurrent
    blocks (an async save's thread beside a load in the caller's) share it, and the
    collector comes back, if it was on, when the last of them ends.
    """
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
