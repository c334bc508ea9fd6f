"""Local and shared-filesystem storage: large sequential writes, ``preadv`` reads, atomic commit.

Commit protocol: ``.metadata`` is written to a unique temporary name, fsynced, renamed over
``.metadata`` (atomic on POSIX filesystems), and the directory is fsynced. Data files of a
save carry the save's id in their names, so a new save never overwrites the files of the
checkpoint it replaces; those are removed only after the new ``.metadata`` is in place.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
import warnings
from collections.abc import Iterable

from .errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from .metadata import METADATA_FILE
from .storage import Buffer, StorageReader, StorageWriter, checkpoint_path


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FileSystemWriter(StorageWriter):
    """Writes a checkpoint into a directory on a local or shared (POSIX) filesystem.

    Args:
        path: the checkpoint directory (created if missing).
        sync_files: fsync data files, metadata and directory before the commit returns, so a
            committed checkpoint survives a power loss. On by default.
    """

    def __init__(self, path: str | os.PathLike, sync_files: bool = True):
        self.path = checkpoint_path(path)
        self.sync_files = sync_files

    def prepare(self) -> None:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path!r} exists and is not a directory; a checkpoint is a directory")
        os.makedirs(self.path, exist_ok=True)

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        full = os.path.join(self.path, name)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        total = 0
        try:
            for part in parts:
                view = memoryview(part).cast("B")
                while view.nbytes:
                    n = os.write(fd, view)
                    total += n
                    view = view[n:]
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        return total

    def read_committed(self, name: str = METADATA_FILE) -> bytes | None:
        try:
            with open(os.path.join(self.path, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def commit(self, metadata: bytes, name: str = METADATA_FILE) -> None:
        tmp = os.path.join(self.path, f"{METADATA_FILE}.tmp-{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(metadata)
                f.flush()
                if self.sync_files:
                    os.fsync(f.fileno())
            os.replace(tmp, os.path.join(self.path, name))
        except BaseException:
            try:
                self.remove([os.path.basename(tmp)])
            except OSError:
                pass  # a stray temporary file is harmless: readers only open .metadata
            raise
        # Committed: from here on problems are warnings (see StorageWriter.commit).
        if self.sync_files:
            try:
                _fsync_dir(self.path)
            except OSError as exc:
                warnings.warn(f"{self.path!r}: the checkpoint is committed, but syncing its directory failed "
                              f"({exc}); the commit may not survive a power loss", stacklevel=2)

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass


class FileSystemReader(StorageReader):
    """Reads a checkpoint directory; data files are opened once and read with ``preadv``.

    Symbolic links are refused (``O_NOFOLLOW``), so a checkpoint cannot point a reader at
    files outside its directory.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = checkpoint_path(path)
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def read_metadata(self) -> bytes:
        meta = os.path.join(self.path, METADATA_FILE)
        if not os.path.isdir(self.path):
            raise NotACheckpointError(f"{self.path!r} is not a checkpoint: no such directory")
        try:
            fd = os.open(meta, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotACheckpointError(
                f"{self.path!r} is not a checkpoint: it has no {METADATA_FILE} (an interrupted "
                "or failed save leaves none; an older checkpoint there would still have one)"
            ) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptCheckpointError(f"{meta!r} is a symbolic link; refused") from None
            raise
        with os.fdopen(fd, "rb") as f:
            return f.read()

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is not None:
            return fd
        with self._lock:
            if name not in self._fds:
                full = os.path.join(self.path, name)
                try:
                    self._fds[name] = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"data file {full!r} is missing; the checkpoint is incomplete"
                    ) from None
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise CorruptCheckpointError(
                            f"data file {full!r} is a symbolic link; refused"
                        ) from None
                    raise
            return self._fds[name]

    def file_size(self, name: str) -> int:
        return os.fstat(self._fd(name)).st_size

    def read_into(self, name: str, offset: int, buffer: Buffer) -> None:
        fd = self._fd(name)
        view = memoryview(buffer).cast("B")
        want = view.nbytes
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise CorruptCheckpointError(
                    f"data file {os.path.join(self.path, name)!r} ends early: wanted {want} bytes "
                    f"at offset {offset - (want - view.nbytes)}"
                )
            view = view[n:]
            offset += n
        with self._lock:
            self.bytes_read += want

    def list_files(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.path) if e.is_file(follow_symlinks=False))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
