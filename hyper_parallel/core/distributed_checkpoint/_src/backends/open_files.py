"""A bounded set of open file descriptors for a reader: files opened once, closed when idle
and too many are open.

A reader opens each data file once and reads it with ``preadv``. Keeping every file open
stops working at scale: loading one tensor of a checkpoint of 65,536 ranks touches 65,536
files, past the process's descriptor limit (20,000 here: ``EMFILE``, "Too many open files").
:class:`OpenFiles` keeps at most ``limit`` descriptors; a file is held while a call uses it
(:meth:`OpenFiles.held`) and only files nobody holds are closed, least recently used first,
so a descriptor is never closed under a read (nor its number reused for another file while a
read still names it).

What it is not: how a file is opened (the reader's opener: flags, refusing links, O_DIRECT).
"""

from __future__ import annotations

import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["OpenFiles", "default_limit"]


def default_limit() -> int:
    """A quarter of the process's soft descriptor limit, between 16 and 4,096: room for the
    other readers, sockets and files of the job."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        soft = 1024
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 16
    return max(16, min(4096, soft // 4))


class OpenFiles:
    """Descriptors by ``(name, direct)``, opened on first use by ``opener(name, direct)``.

    ``opener`` returns a descriptor, or None when the file cannot be opened in that mode
    (O_DIRECT refused by the filesystem): remembered, and :meth:`held` yields None for it
    from then on.

    Example::

        files = OpenFiles(lambda name, direct: os.open(name, os.O_RDONLY))
        with files.held("data-r00000-0.safetensors") as fd:
            os.preadv(fd, [buf], 0)
    """

    def __init__(self, opener: Callable[[str, bool], int | None], limit: int | None = None):
        self._opener = opener
        self.limit = default_limit() if limit is None else max(1, limit)
        self._fds: OrderedDict[tuple[str, bool], int] = OrderedDict()
        self._users: dict[tuple[str, bool], int] = {}
        self._refused: set[tuple[str, bool]] = set()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._fds)

    @contextmanager
    def held(self, name: str, direct: bool = False) -> Iterator[int | None]:
        """The descriptor of ``name`` (opened if need be), not closed while the block runs."""
        key = (name, direct)
        with self._lock:
            if key in self._refused:
                fd = None
            else:
                fd = self._fds.get(key)
                if fd is None:
                    fd = self._opener(name, direct)  # opened under the lock: one descriptor a file
                    if fd is None:
                        self._refused.add(key)
                    else:
                        self._fds[key] = fd
                else:
                    self._fds.move_to_end(key)
                if fd is not None:
                    self._users[key] = self._users.get(key, 0) + 1  # held before any closing
                    self._close_idle()
        try:
            yield fd
        finally:
            if fd is not None:
                with self._lock:
                    left = self._users[key] - 1
                    if left:
                        self._users[key] = left
                    else:
                        del self._users[key]
                    if len(self._fds) > self.limit:
                        self._close_idle()

    def _close_idle(self) -> None:  # under the lock
        """Close the least recently used idle descriptors past the limit. The scan stops at the
        last one it needs: the oldest are almost always idle, so each call costs about one
        step (a scan of every open file at each open made a 65,536-file load quadratic:
        143 of its 197 s)."""
        excess = len(self._fds) - self.limit
        if excess <= 0:
            return
        idle = []
        for key in self._fds:  # oldest first
            if key not in self._users:
                idle.append(key)
                if len(idle) == excess:
                    break
        for key in idle:
            os.close(self._fds.pop(key))

    def close(self) -> None:
        """Close every descriptor (the reader is done; nothing may hold one)."""
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._users.clear()
            self._refused.clear()
