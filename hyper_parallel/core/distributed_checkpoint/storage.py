"""Storage protocols: what a backend must do to hold checkpoints. Bytes and files only.

StorageWriter — the saver calls, in this order:

0. ``set_up(rank, is_coordinator)`` on every rank.
1. ``prepare()`` on every rank: make the destination exist (idempotent, race-safe).
2. ``write_file(name, parts)`` on every rank with data, once per data file: write the byte
   buffers ``parts`` (an iterable, consumed once, in order) as file ``name``. It may run in
   several threads at once for different files. The file need not be visible to readers
   until ``commit``.
3. ``read_committed()`` on the coordinator: the bytes of the ``.metadata`` being replaced,
   or None. (The saver uses it to know which old files become garbage after the commit.)
4. ``commit(metadata)`` on the coordinator, after every rank's writes succeeded: make
   ``.metadata`` hold these bytes atomically. Before this returns, readers see the old
   checkpoint (or none); after, the new one.
5. ``remove(names)`` on the coordinator after a commit (files of the replaced checkpoint),
   or on a rank whose save failed (its own new files). Missing files are not an error.

StorageReader — the loader calls:

0. ``set_up(rank, is_coordinator)`` on every rank.
1. ``read_metadata()`` on the coordinator; raises :class:`NotACheckpointError` when there
   is none.
2. ``file_size(name)`` and ``read_into(name, offset, buffer)`` on every rank, from any
   number of threads: fill the writable ``buffer`` with the bytes at ``offset``.
3. ``close()`` on every rank.

``bytes_read`` counts the bytes returned by ``read_into`` (benchmarks and tests use it).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Iterable

Buffer = memoryview


class StorageWriter(abc.ABC):
    """Writes one checkpoint's data files and commits its metadata."""

    def set_up(self, rank: int, is_coordinator: bool) -> None:
        self.rank = rank
        self.is_coordinator = is_coordinator

    @abc.abstractmethod
    def prepare(self) -> None: ...

    @abc.abstractmethod
    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """Write ``parts`` in order as file ``name``; return the number of bytes written."""

    @abc.abstractmethod
    def read_committed(self) -> bytes | None: ...

    @abc.abstractmethod
    def commit(self, metadata: bytes) -> None: ...

    @abc.abstractmethod
    def remove(self, names: Iterable[str]) -> None: ...


class StorageReader(abc.ABC):
    """Reads a committed checkpoint's metadata and byte ranges of its data files."""

    bytes_read: int = 0

    def set_up(self, rank: int, is_coordinator: bool) -> None:
        self.rank = rank
        self.is_coordinator = is_coordinator

    @abc.abstractmethod
    def read_metadata(self) -> bytes: ...

    @abc.abstractmethod
    def file_size(self, name: str) -> int: ...

    @abc.abstractmethod
    def read_into(self, name: str, offset: int, buffer: Buffer) -> None: ...

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release open files; the reader may be set up again afterwards."""


def checkpoint_path(path: str | os.PathLike) -> str:
    """Normalise a ``path``/``checkpoint_id`` argument to a string."""
    return os.fspath(path)
