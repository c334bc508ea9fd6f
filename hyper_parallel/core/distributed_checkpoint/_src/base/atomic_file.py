"""Atomic file replacement on a local filesystem: write a temporary file, sync it, rename it.

A reader of ``final`` sees the old file or the new one, never a part of either:

1. the bytes go to a temporary file in the same directory (``<final>.tmp-<hex>`` unless the
   caller names one: a sweeper recognises debris by that name);
2. the temporary file is synced (``sync=True``), so the rename can never reveal unwritten data;
3. ``os.replace`` puts it in place (atomic on POSIX filesystems): the point of no return;
4. the directory is synced (``sync_dir``, by default as ``sync``), so the rename survives a
   power loss.

Any failure before step 3 removes the temporary file and re-raises. This is the one
implementation of the idea: the checkpoint's ``.metadata`` commit, the manager's owner file,
layout and strategy files, the local tier's shard files and every exporter use it.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any

TMP_MARK = ".tmp-"  # "<final name>.tmp-<hex digits>": a file being written, never a committed one


def temporary_name(final: str | os.PathLike) -> str:
    """A fresh temporary name beside ``final`` (``<final>.tmp-<8 hex digits>``)."""
    return f"{os.fspath(final)}{TMP_MARK}{uuid.uuid4().hex[:8]}"


def sync_directory(path: str | os.PathLike) -> None:
    """Make the renames and deletions made in directory ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(final: str | os.PathLike, mode: str = "wb", *, sync: bool = True, sync_dir: bool | None = None,
                tmp: str | None = None) -> Iterator[IO[Any]]:
    """Open a temporary file for writing; on a clean exit it replaces ``final``.

    Args:
        final: the file to create or replace.
        mode: ``"wb"``, ``"w"`` (text), or ``"r+b"`` to overwrite an existing ``tmp`` in place
            (the local tier reuses a retired file's pages).
        sync: fsync the file before the rename.
        sync_dir: fsync the directory after the rename (default: ``sync``).
        tmp: the temporary file's path (default :func:`temporary_name`), in ``final``'s directory.

    Raises whatever the writes, the sync or the rename raise, after removing the temporary file.

    Example::

        with atomic_file(path) as f:
            f.write(header)
            f.write(body)
    """
    final = os.fspath(final)
    tmp = tmp if tmp is not None else temporary_name(final)
    try:
        with open(tmp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync if sync_dir is None else sync_dir:
        sync_directory(os.path.dirname(os.path.abspath(final)))


def write_atomically(final: str | os.PathLike, data: bytes | str, *, sync: bool = True,
                     sync_dir: bool | None = None) -> None:
    """Replace ``final`` by ``data`` (bytes, or text written as UTF-8) with :func:`atomic_file`."""
    with atomic_file(final, "w" if isinstance(data, str) else "wb", sync=sync, sync_dir=sync_dir) as f:
        f.write(data)
