"""An opt-in timeline of one process's load work: opens, reads, checksums, copies, waits.

Where a load's time goes is not visible from its wall time: reads overlap checksums on
other threads, and a rank that finishes early waits on its peers inside the load. With
``HP_DCP_LOAD_TIMELINE`` set, the loader and the filesystem reader record each piece of
work as ``(kind, start, end, cpu, bytes, thread, detail)``: ``start`` and ``end`` on
``time.monotonic`` (one clock for every process of a machine, so ranks' timelines line
up), ``cpu`` the seconds the thread ran meanwhile (``time.thread_time``: on a busy machine
wall time includes waiting for a core, CPU time does not):

- ``open``: a data file opened (buffered or O_DIRECT);
- ``read``: one ``preadv`` loop of the reader (``detail``: ``direct``/``buffered``);
- ``index``: a data file's index read and checked;
- ``checksum``: crc32c of blocks read; ``copy``: bytes copied into a destination;
- ``wait``: the loader's thread waiting for a read it had started ahead;
- ``read_plan``: the whole of one rank's reading (everything else of a load, metadata,
  planning and the exchanges with the peers, lies outside it).

``HP_DCP_LOAD_TIMELINE=1`` keeps the events in memory for :func:`take`;
``HP_DCP_LOAD_TIMELINE=<directory>`` also writes each ``read_plan``'s events to
``<directory>/load-<pid>-<n>.json``. Off (the default), recording costs one flag test.

Usage, where work is timed::

    t0 = timeline.start()   # None when off
    ...the work...
    timeline.record("read", t0, nbytes)
"""

from __future__ import annotations

import itertools
import json
import os
import threading
import time

ENV = "HP_DCP_LOAD_TIMELINE"
MAX_EVENTS = 1 << 20  # kept in memory at most; older ones are dropped

_on = False
Event = tuple[str, float, float, float, int, str, str]  # kind, start, end, cpu, bytes, thread, detail
_events: list[Event] = []
_lock = threading.Lock()
_dumps = itertools.count()


def refresh() -> bool:
    """Read ``HP_DCP_LOAD_TIMELINE`` again (the loader calls this as a load starts)."""
    global _on
    _on = bool(os.environ.get(ENV))
    return _on


def enabled() -> bool:
    return _on


def start() -> tuple[float, float] | None:
    """The start of a piece of work (wall and thread CPU clocks); None when off."""
    return (time.monotonic(), time.thread_time()) if _on else None


def record(kind: str, t0: tuple[float, float] | None, nbytes: int = 0, detail: str = "") -> None:
    """One piece of work that began at ``t0`` (:func:`start`) and ends now."""
    if t0 is None or not _on:
        return
    event = (kind, t0[0], time.monotonic(), time.thread_time() - t0[1], nbytes, threading.current_thread().name,
             detail)
    with _lock:
        if len(_events) >= MAX_EVENTS:
            del _events[: MAX_EVENTS // 2]
        _events.append(event)


def mark() -> int:
    """A position in the event list, for :func:`dump` of what follows it."""
    with _lock:
        return len(_events)


def dump(since: int) -> str | None:
    """Write the events after ``since`` to the timeline directory, if one is set."""
    where = os.environ.get(ENV, "")
    if not _on or not os.path.isdir(where):
        return None
    with _lock:
        events = _events[since:]
    path = os.path.join(where, f"load-{os.getpid()}-{next(_dumps)}.json")
    with open(path, "w") as f:
        json.dump({"pid": os.getpid(), "events": [list(e) for e in events]}, f)
    return path


def take() -> list[Event]:
    """The events recorded so far, removed from memory."""
    with _lock:
        out = list(_events)
        _events.clear()
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summary(events: list[Event]) -> dict[str, dict[str, float]]:
    """Per kind: how many, bytes, busy seconds summed over threads, CPU seconds, and seconds
    during which at least one thread did it (``span_s``: its share of the wall time)."""
    out: dict[str, dict[str, float]] = {}
    spans: dict[str, list[tuple[float, float]]] = {}
    for kind, a, b, cpu, nbytes, _, _ in events:
        s = out.setdefault(kind, {"count": 0, "bytes": 0, "busy_s": 0.0, "cpu_s": 0.0})
        s["count"] += 1
        s["bytes"] += nbytes
        s["busy_s"] += b - a
        s["cpu_s"] += cpu
        spans.setdefault(kind, []).append((a, b))
    for kind, s in out.items():
        s["span_s"] = _union(spans[kind])
    return out
