"""Async saves in flight in this process, by the place they save to.

A synchronous ``save`` or a ``load`` of a place an async save is still writing waits for it
first: committed later, the async save would replace the newer checkpoint with older state
(both reporting success), or remove the files a load is reading. The background threads'
own saves do not wait for that reason (they are what is waited for), but an async save waits
for the async saves to its place that started before it, from any checkpointer: one
checkpointer writes its saves in order, two (say ``async_save`` and a manager's) did not. The
wait is bounded by the checkpointer's ``wait_timeout_s``: a stuck storage becomes an error,
not a hang.
"""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any

from ..backends.locations import location
from ..base.errors import CheckpointError

_LOCK = threading.Lock()
_PENDING: dict[int, tuple[str, threading.Event, float, int]] = {}  # id -> (place, finished, wait, order)
_ORDER = itertools.count()
_BACKGROUND = threading.local()


def place_of(path: Any, storage: Any) -> str | None:
    """Where a save or load goes, comparable between calls: the path given, else the storage
    writer's or reader's ``url``/``path`` (None when it says neither)."""
    where = path if path is not None else getattr(storage, "url", None) or getattr(storage, "path", None)
    return location(where) if isinstance(where, (str, os.PathLike)) else None


def started(key: int, place: str | None, finished: threading.Event, wait_timeout_s: float) -> None:
    """An async save to ``place`` is in flight until ``finished`` is set (or :func:`ended`)."""
    if place is not None:
        with _LOCK:
            _PENDING[key] = (place, finished, wait_timeout_s, next(_ORDER))


def ended(key: int) -> None:
    with _LOCK:
        _PENDING.pop(key, None)


def forget_all() -> None:
    """In a forked child: the parent's saves are not this process's."""
    with _LOCK:
        _PENDING.clear()


def mark_background() -> None:
    """This thread runs async saves: its own calls never wait for saves in flight."""
    _BACKGROUND.active = True


def wait_for_saves_to(place: str | None) -> None:
    """Wait until no async save of this process to ``place`` is in flight (see the module
    docstring). Its failure stays its own (raised by its ``result()`` or the next
    ``async_save``)."""
    if place is None or getattr(_BACKGROUND, "active", False):
        return
    with _LOCK:
        waits = [(finished, limit) for where, finished, limit, _ in _PENDING.values() if where == place]
    _wait(place, waits)


def wait_for_earlier_saves(key: int) -> None:
    """In the background thread about to write async save ``key``: wait until the async saves
    to its place that started before it (in any checkpointer of this process) have ended."""
    with _LOCK:
        mine = _PENDING.get(key)
        if mine is None:
            return
        waits = [(finished, limit) for other, (where, finished, limit, order) in _PENDING.items()
                 if other != key and where == mine[0] and order < mine[3]]
    _wait(mine[0], waits)


def _wait(place: str, waits: list[tuple[threading.Event, float]]) -> None:
    for finished, limit in waits:
        if not finished.wait(limit):
            raise CheckpointError(
                f"an async save to {place!r} is still running after {limit}s, so this call did not start "
                "(it would race that save's commit); its storage may be stuck") from TimeoutError(limit)
