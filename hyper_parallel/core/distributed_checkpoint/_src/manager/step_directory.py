"""A CheckpointManager's directory on storage: its step directories, read, written and removed.

A manager directory holds one step directory per saved step (named by
:func:`~..format.metadata.step_dir_name`) and the owner file. :class:`LocalDirectory`
(local and shared filesystems, through ``os``; never through a symbolic link) and
:class:`FsspecDirectory` (fsspec URLs such as ``s3://...``: one recursive listing, whole-object
puts, every call bounded) give the manager the same operations: list the step directories,
read a step's ``.metadata`` (:meth:`~LocalDirectory.step_metadata`), open storage writers and
readers for a step, remove a step (``.metadata`` first), its files or its tree, and read,
claim and release the owner record (the claim itself is in :mod:`.ownership`).
:func:`open_directory` picks one for a path or URL. The layout is in ``docs/format.md``.

It is not what the steps are (:mod:`.step_listing`), nor when they go (:mod:`.retention`,
:mod:`.step_deletion`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from ..backends.filesystem import FileSystemReader, FileSystemWriter
from ..backends.fsspec import BoundedCalls, FsspecReader, FsspecWriter, open_filesystem
from ..backends.locations import is_url, local_path
from ..backends.protocol import StorageReader, StorageWriter
from ..base.errors import CheckpointError, NotACheckpointError
from ..engine.commit import Listed  # a listing in the shape the debris check reads
from ..format import metadata as md
from ..format.validation import step_of  # the format's naming rule (``dirs``)
from .ownership import (
    claim_fsspec,
    claim_local,
    read_fsspec_owner,
    read_local_owner,
    release_fsspec,
    release_local,
)

__all__ = ["Directory", "FsspecDirectory", "Listed", "LocalDirectory", "PathLike", "open_directory"]

PathLike = str | os.PathLike


# ----------------------------------------------------------------------------- storage


class LocalDirectory:
    """The manager's directory on a local or shared POSIX filesystem."""

    def __init__(self, path: str):
        self.url = self.path = path

    def step_path(self, name: str) -> str:
        return os.path.join(self.path, name)

    def listing(self) -> dict[str, dict[str, int]]:
        """``{step dir name: {file name: size}}`` for every step-named directory."""
        try:
            entries = list(os.scandir(self.path))
        except FileNotFoundError:
            return {}
        out: dict[str, dict[str, int]] = {}
        for entry in entries:
            if step_of(entry.name) is None or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                out[entry.name] = {f.name: f.stat(follow_symlinks=False).st_size
                                   for f in os.scandir(entry.path) if f.is_file(follow_symlinks=False)}
            except FileNotFoundError:  # removed while we looked (`ls` during a deletion)
                continue
        return out

    def step_metadata(self, name: str) -> bytes:
        """The bytes of step directory ``name``'s ``.metadata`` (NotACheckpointError: none)."""
        return FileSystemReader(self.step_path(name)).read_metadata_bytes()

    def writer(self, name: str) -> StorageWriter:
        return FileSystemWriter(self.step_path(name))

    def reader(self, name: str) -> StorageReader:
        return FileSystemReader(self.step_path(name))

    def make_root(self) -> None:
        os.makedirs(self.path, exist_ok=True)

    def linked_steps(self) -> list[str]:
        """Step-named entries that are symbolic links: :meth:`listing` never walks them, so
        what their ``.metadata`` names is unknown to the manager."""
        try:
            return sorted(e.name for e in os.scandir(self.path) if step_of(e.name) is not None and e.is_symlink())
        except FileNotFoundError:
            return []

    def check_step(self, name: str) -> None:
        """Raise if the step's path is a symbolic link: the manager never writes through one."""
        step = self.step_path(name)
        if os.path.islink(step):
            raise CheckpointError(
                f"{step!r} is a symbolic link (to {os.readlink(step)!r}); the manager never saves, deletes or "
                "overwrites through one, so the data it points at stays safe. Remove the link, or save that "
                "step elsewhere")

    @contextlib.contextmanager
    def _step_dir(self, name: str) -> Iterator[int | None]:
        """The step directory opened without following a symbolic link (None: it is missing), so a
        deletion acts on the directory listed, never on where a link (swapped in meanwhile) points."""
        try:
            fd = os.open(self.step_path(name), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            yield None
            return
        except OSError:
            self.check_step(name)  # ELOOP: a link, said so
            raise
        try:
            yield fd
        finally:
            os.close(fd)

    def uncommit(self, name: str) -> None:
        """Remove the step's ``.metadata`` durably: from now on the step does not count."""
        with self._step_dir(name) as fd:
            if fd is None:
                return
            try:
                os.unlink(md.METADATA_FILE, dir_fd=fd)
            except FileNotFoundError:
                return
            with contextlib.suppress(OSError):  # so the unlink reaches the disk before the data goes
                os.fsync(fd)

    def remove_tree(self, name: str) -> None:
        """Remove an uncommitted step directory and everything in it (missing is fine)."""
        with self._step_dir(name) as fd:
            if fd is None:
                return
            for entry in list(os.scandir(fd)):
                with contextlib.suppress(FileNotFoundError):
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.name, dir_fd=fd)
                    else:
                        os.unlink(entry.name, dir_fd=fd)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(self.step_path(name))  # a link swapped in meanwhile: ENOTDIR, nothing removed

    def remove_files(self, name: str, files: Iterable[str]) -> None:
        with self._step_dir(name) as fd:
            if fd is None:
                return
            for f in files:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f, dir_fd=fd)

    def remove_if_empty(self, name: str) -> None:
        """Remove the step directory if nothing is left in it (a failed save's, once cleaned)."""
        with contextlib.suppress(OSError):  # ENOTEMPTY: someone else's files stay; ENOTDIR: a link
            os.rmdir(self.step_path(name))

    def read_owner(self) -> bytes | None:
        return read_local_owner(self.path)

    def claim_owner(self, record: bytes, refuse: Callable[[bytes | None], None]) -> None:
        """Put ``record`` in the owner file unless ``refuse(what it holds now)`` raises, atomically
        (see :func:`.ownership.claim_local`)."""
        claim_local(self.path, record, refuse)

    def release_owner(self, mine: Callable[[bytes], bool]) -> None:
        """Remove the owner file if ``mine(its record)`` (under the claim's lock)."""
        release_local(self.path, mine)


class FsspecDirectory:
    """The manager's directory under an fsspec URL (object stores: one listing, whole-object PUTs)."""

    def __init__(self, url: str, options: dict[str, Any]):
        self.url, self.options = url.rstrip("/"), options
        self.fs, self.root = open_filesystem(url, options)
        self._call = BoundedCalls(self.url)

    def bound_calls(self, seconds: float) -> None:
        """Fail a call to the store with no answer within ``seconds`` (the manager's timeout)."""
        self._call.bound(seconds)

    def step_path(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _key(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _forget_cached_listings(self) -> None:
        """Drop the filesystem's cached listings under the root. Other processes (the other
        ranks, the previous job) write here, and s3fs answers ``size``/``info`` (which
        ``cat_file`` and the core's readers call) from cached listings when it has them."""
        cache = getattr(self.fs, "dircache", None)
        with contextlib.suppress(Exception):
            if cache is not None:
                for key in [k for k in list(cache) if k == self.root or k.startswith(self.root + "/")]:
                    cache.pop(key, None)
            self.fs.invalidate_cache(self.root)

    def listing(self) -> dict[str, dict[str, int]]:
        self._forget_cached_listings()
        try:
            found = self._call("listing the step directories", self.fs.find, self.root, detail=True)
        except FileNotFoundError:
            return {}
        finally:
            self._forget_cached_listings()  # find() fills the cache with every step directory
        out: dict[str, dict[str, int]] = {}
        prefix = self.root + "/"
        for path, info in found.items():
            rel = path[len(prefix):] if path.startswith(prefix) else None
            parts = rel.split("/") if rel else []
            if len(parts) != 2 or step_of(parts[0]) is None or info.get("type") == "directory":
                continue
            out.setdefault(parts[0], {})[parts[1]] = int(info.get("size") or 0)
        return out

    def step_metadata(self, name: str) -> bytes:
        """The bytes of step directory ``name``'s ``.metadata`` (NotACheckpointError: none)."""
        try:
            return self._call(f"reading {name}/{md.METADATA_FILE}", self.fs.cat_file, self._key(name, md.METADATA_FILE))
        except FileNotFoundError:
            raise NotACheckpointError(f"{self.step_path(name)!r} has no {md.METADATA_FILE}") from None

    def writer(self, name: str) -> StorageWriter:
        return FsspecWriter(self.step_path(name), **self.options)

    def reader(self, name: str) -> StorageReader:
        return FsspecReader(self.step_path(name), **self.options)

    def make_root(self) -> None:
        self._call("creating the directory", self.fs.makedirs, self.root, exist_ok=True)

    def uncommit(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(f"deleting {name}/{md.METADATA_FILE}", self.fs.rm_file, self._key(name, md.METADATA_FILE))

    def remove_tree(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(f"deleting {name}", self.fs.rm, self._key(name), recursive=True)

    def remove_files(self, name: str, files: Iterable[str]) -> None:
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                self._call(f"deleting {name}/{f}", self.fs.rm_file, self._key(name, f))

    def linked_steps(self) -> list[str]:
        """Object stores have no symbolic links."""
        return []

    def check_step(self, name: str) -> None:
        """Object stores have no symbolic links: nothing to refuse."""

    def remove_if_empty(self, name: str) -> None:
        """Drop the step's directory marker, if a filesystem keeps one, once no file is left."""
        with contextlib.suppress(FileNotFoundError):
            if not self._call(f"listing {name}", self.fs.find, self._key(name)):
                self._call(f"deleting {name}", self.fs.rm, self._key(name), recursive=True)

    def read_owner(self) -> bytes | None:
        return read_fsspec_owner(self)

    def claim_owner(self, record: bytes, refuse: Callable[[bytes | None], None]) -> None:
        """Put ``record`` as the owner object unless ``refuse(what it holds now)`` raises, with a
        conditional put (see :func:`.ownership.claim_fsspec`)."""
        claim_fsspec(self, record, refuse)

    def release_owner(self, mine: Callable[[bytes], bool]) -> None:
        """Remove the owner object if ``mine(its record)``."""
        release_fsspec(self, mine)


Directory = LocalDirectory | FsspecDirectory


def open_directory(directory: PathLike, storage_options: dict[str, Any] | None) -> Directory:
    """The manager directory of a local path or an fsspec URL (``storage_options``: URLs only)."""
    path = os.fspath(directory)
    if is_url(path):
        return FsspecDirectory(path, dict(storage_options or {}))
    if storage_options:
        raise ValueError(f"storage_options apply to fsspec URLs (s3://...), not to the local path {path!r}")
    return LocalDirectory(local_path(path))


