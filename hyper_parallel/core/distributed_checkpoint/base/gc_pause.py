"""Pausing Python's cyclic garbage collector around bulk work on millions of small objects.

Not a memory policy: only :func:`paused_gc`, which planning, saving and ``.metadata``
(de)serialization wrap around loops that build or parse many acyclic records.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic GC while building or parsing millions of small objects.

    Plans and metadata of large jobs are millions of tuples and records that hold no
    cycles; the collector re-scanning them made planning grow faster than linearly.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
