"""Which backend serves a checkpoint location: the one URL -> storage dispatch.

An fsspec URL (:func:`~.locations.is_url`) goes to :mod:`.fsspec`, anything else to the local
filesystem backend (:mod:`.filesystem`). ``load``, ``save``, the offline tools, ``verify``,
the manager and the command line all pick their storage here.
"""

from __future__ import annotations

import os

from .filesystem import FileSystemReader, FileSystemWriter
from .fsspec import FsspecReader, FsspecWriter
from .locations import is_url, local_path
from .protocol import StorageReader, StorageWriter


def reader_for(path: str | os.PathLike) -> StorageReader:
    """The reader of a checkpoint at ``path``: an :class:`~.fsspec.FsspecReader` for an fsspec
    URL, a :class:`~.filesystem.FileSystemReader` for anything else."""
    return FsspecReader(os.fspath(path)) if is_url(path) else FileSystemReader(local_path(path))


def writer_for(path: str | os.PathLike, sync_files: bool = True, defer_sync: bool = False) -> StorageWriter:
    """The writer of a checkpoint at ``path``, as :func:`reader_for` picks readers (object stores
    have no fsync: ``sync_files`` and ``defer_sync`` apply to local files only)."""
    if is_url(path):
        return FsspecWriter(os.fspath(path))
    return FileSystemWriter(local_path(path), sync_files=sync_files, defer_sync=defer_sync)
