"""The step directories of a CheckpointManager: naming, one-listing discovery, deletion, ownership.

Storage-level helpers of :mod:`.manager` (which holds the policy and the cross-rank
protocol): what a manager directory holds (:func:`list_steps`), how a step directory is
named (:func:`step_dir_name`), how it is deleted (``.metadata`` first, see :class:`Deleter`),
and who may write the directory (the owner file). Local and shared filesystems use ``os``;
fsspec URLs (``s3://...``) use one recursive listing. The layout is in ``docs/format.md``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import queue
import shutil
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..backends.filesystem import FileSystemReader, FileSystemWriter
from ..backends.fsspec import BoundedCalls, FsspecReader, FsspecWriter, open_filesystem
from ..backends.locations import is_url, local_path, location
from ..backends.protocol import StorageReader, StorageWriter
from ..base.errors import CheckpointError, NotACheckpointError
from ..engine.commit import unreferenced_files
from ..format import metadata as md
from ..format.validation import step_dir_name, step_of  # the format's naming rule (``dirs``)
from ..format.values import decode_value, encode_value

__all__ = ["StepInfo", "files_other_steps_use", "list_steps", "step_dir_name", "references_of"]

PathLike = str | os.PathLike
OWNER_FILE = ".manager-owner.json"
USER_KEY = "checkpoint_manager"  # where a step's own facts live in Metadata.user
_READ_THREADS = 8  # parallel .metadata reads at start (object stores have latency)


# ----------------------------------------------------------------------------- storage


class Listed:
    """A file listing in the shape :func:`commit.unreferenced_files` reads."""

    def __init__(self, names: Iterable[str]):
        self.names = sorted(names)

    def list_files(self) -> list[str]:
        return self.names


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

    def read_metadata(self, name: str) -> bytes:
        return FileSystemReader(self.step_path(name)).read_metadata()

    def writer(self, name: str) -> StorageWriter:
        return FileSystemWriter(self.step_path(name))

    def reader(self, name: str) -> StorageReader:
        return FileSystemReader(self.step_path(name))

    def make_root(self) -> None:
        os.makedirs(self.path, exist_ok=True)

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
        try:
            with open(os.path.join(self.path, OWNER_FILE), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def claim_owner(self, record: bytes, refuse: Callable[[bytes | None], None]) -> None:
        """Put ``record`` in the owner file unless ``refuse(what it holds now)`` raises, as one
        step: every claim holds an exclusive lock (``flock``) on the owner file while it reads,
        decides and writes, so of managers starting at the same moment one writes and the
        others read its record."""
        with self._owner_locked(create=True) as fd:
            refuse(_read_fd(fd) or None)
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
            os.fsync(fd)

    def release_owner(self, mine: Callable[[bytes], bool]) -> None:
        """Remove the owner file if ``mine(its record)`` (under the claim's lock)."""
        with self._owner_locked(create=False) as fd:
            if fd is not None and mine(_read_fd(fd)):
                os.unlink(os.path.join(self.path, OWNER_FILE))

    @contextlib.contextmanager
    def _owner_locked(self, create: bool) -> Iterator[int | None]:
        """The owner file, open and locked exclusively (None: absent and ``create`` False). A
        file removed or replaced while we waited for its lock is not the owner file any more:
        lock the one in place then."""
        path = os.path.join(self.path, OWNER_FILE)
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
        deadline = time.monotonic() + _OWNER_LOCK_WAIT_S
        while True:
            try:
                fd = os.open(path, flags, 0o644)
            except FileNotFoundError:
                yield None
                return
            try:
                if _lock(fd, path, deadline):
                    try:
                        now = os.stat(path, follow_symlinks=False)
                    except FileNotFoundError:
                        now = None
                    here = os.fstat(fd)
                    if now is None or (now.st_dev, now.st_ino) != (here.st_dev, here.st_ino):
                        continue  # (the finally closes it, which unlocks it)
                yield fd
                return
            finally:
                os.close(fd)


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

    def read_metadata(self, name: str) -> bytes:
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

    def check_step(self, name: str) -> None:
        """Object stores have no symbolic links: nothing to refuse."""

    def remove_if_empty(self, name: str) -> None:
        """Drop the step's directory marker, if a filesystem keeps one, once no file is left."""
        with contextlib.suppress(FileNotFoundError):
            if not self._call(f"listing {name}", self.fs.find, self._key(name)):
                self._call(f"deleting {name}", self.fs.rm, self._key(name), recursive=True)

    def read_owner(self) -> bytes | None:
        try:
            return self._call(f"reading {OWNER_FILE}", self.fs.cat_file, self._key(OWNER_FILE))
        except FileNotFoundError:
            return None

    def claim_owner(self, record: bytes, refuse: Callable[[bytes | None], None]) -> None:
        """Put ``record`` as the owner object unless ``refuse(what it holds now)`` raises, with
        a conditional put, so of managers starting at the same moment one writes and the others
        fail: created only if absent (If-None-Match), replaced only if unchanged since read
        (If-Match on its ETag, S3). Stores without If-Match replace a stale record
        unconditionally: there, two jobs taking over one directory at once are not told apart."""
        key = self._key(OWNER_FILE)
        for _ in range(3):
            etag, raw = self._read_owner_tagged(key)
            refuse(raw)
            try:
                self._put_owner(key, record, etag, replace=raw is not None)
                return
            except Exception as exc:
                if not _lost_race(exc, replacing=raw is not None):
                    raise
            finally:
                self._forget_cached_listings()
            # another manager's put came first: its record is fresh, so it is alive whatever
            # its host; only a record that is gone again (that manager closed) is tried anew
            _, now = self._read_owner_tagged(key)
            if now is not None:
                refuse(now)
                raise CheckpointError(f"{self.url!r} was claimed by another CheckpointManager at the same moment "
                                      f"({_who(now)}): one job writes a directory at a time")
        raise CheckpointError(f"{self.url!r}: could not claim the directory (its owner record changed at every try)")

    def _put_owner(self, key: str, record: bytes, etag: str | None, replace: bool) -> None:
        """One put of the owner record, conditional where the store allows (see claim_owner)."""
        try:
            if not replace:
                self._call(f"creating {OWNER_FILE}", self.fs.pipe_file, key, record, mode="create")
            elif etag is not None and hasattr(self.fs, "call_s3"):
                bucket, path, _ = self.fs.split_path(key)
                self._call(f"replacing {OWNER_FILE}", self.fs.call_s3, "put_object", Bucket=bucket, Key=path,
                           Body=record, IfMatch=etag)
            else:
                self._call(f"writing {OWNER_FILE}", self.fs.pipe_file, key, record)
        except Exception as exc:
            if not _no_conditional_put(exc):
                raise
            warnings.warn(f"CheckpointManager: {self.url!r}: the store refuses conditional puts ({exc}); claiming "
                          "the directory is not atomic there: do not start two jobs on one directory at once",
                          stacklevel=5)
            self._call(f"writing {OWNER_FILE}", self.fs.pipe_file, key, record)

    def _read_owner_tagged(self, key: str) -> tuple[str | None, bytes | None]:
        """(ETag, bytes) of the owner object, or (None, None). The ETag is read first: a record
        that changes in between fails the If-Match put, never passes it with stale content."""
        self._forget_cached_listings()
        try:
            etag = self._call(f"reading {OWNER_FILE}", self.fs.info, key).get("ETag")
            return etag, self._call(f"reading {OWNER_FILE}", self.fs.cat_file, key)
        except FileNotFoundError:
            return None, None

    def release_owner(self, mine: Callable[[bytes], bool]) -> None:
        """Remove the owner object if ``mine(its record)``."""
        raw = self.read_owner()
        if raw is not None and mine(raw):
            with contextlib.suppress(FileNotFoundError):
                self._call(f"deleting {OWNER_FILE}", self.fs.rm_file, self._key(OWNER_FILE))


Directory = LocalDirectory | FsspecDirectory


def open_directory(directory: PathLike, storage_options: dict[str, Any] | None) -> Directory:
    path = os.fspath(directory)
    if is_url(path):
        return FsspecDirectory(path, dict(storage_options or {}))
    if storage_options:
        raise ValueError(f"storage_options apply to fsspec URLs (s3://...), not to the local path {path!r}")
    return LocalDirectory(local_path(path))


# ----------------------------------------------------------------------------- what a directory holds


@dataclass(frozen=True)
class StepInfo:
    """One step directory as found on storage (see :func:`list_steps`).

    ``state`` is ``"committed"`` (its ``.metadata`` parses: it loads), ``"uncommitted"`` (no
    ``.metadata``: a save in flight, or debris of a crashed save or deletion, which the next
    manager start sweeps), or ``"unreadable"`` (a ``.metadata`` that does not parse: corrupt
    or written by a newer version; never counted, never deleted; ``error`` says why).
    ``references`` are the other steps whose files this step uses (always empty until
    incremental checkpoints exist).
    """

    step: int
    path: str
    state: str
    files: int
    bytes: int
    metrics: dict[str, Any] | None = None
    references: tuple[int, ...] = ()
    error: str | None = None


def encode_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as they are stored in ``Metadata.user``: plain JSON where it can be (``nan``
    and other non-JSON values carry the type tags of :func:`values.encode_value`)."""
    return {k: encode_value(v) for k, v in metrics.items()}


def metrics_of(meta: md.Metadata) -> dict[str, Any] | None:
    own = meta.user.get(USER_KEY)
    stored = own.get("metrics") if isinstance(own, dict) else None
    if not isinstance(stored, dict):
        return None
    try:
        return {k: decode_value(v) for k, v in stored.items()}
    except ValueError:
        return None


def references_of(meta: md.Metadata) -> tuple[int, ...]:
    """The steps (other than its own) whose directories hold data ``meta`` names: an
    incremental checkpoint's unchanged chunks live in earlier steps' files."""
    return tuple(sorted(s for d in meta.referenced_dirs() if (s := step_of(d)) is not None))


def scan(root: Directory) -> tuple[list[StepInfo], dict[str, dict[str, int]], dict[int, md.Metadata]]:
    """List ``root`` once and read every step's ``.metadata``: (infos by step, the listing,
    parsed metadata of committed steps)."""
    listing = root.listing()
    with_meta = [name for name, files in listing.items() if md.METADATA_FILE in files]

    def read(name: str) -> tuple[str, md.Metadata | None, str | None]:
        try:
            return name, md.Metadata.from_json(root.read_metadata(name), where=f"{root.step_path(name)}/"
                                               f"{md.METADATA_FILE}"), None
        except NotACheckpointError:  # removed between the listing and the read: uncommitted
            return name, None, None
        except CheckpointError as exc:
            return name, None, str(exc)

    if len(with_meta) > 1:
        with ThreadPoolExecutor(min(_READ_THREADS, len(with_meta))) as pool:
            results = list(pool.map(read, with_meta))
    else:
        results = [read(n) for n in with_meta]
    parsed: dict[int, md.Metadata] = {}
    errors: dict[str, str] = {}
    for name, meta, error in results:
        if meta is not None:
            parsed[step_of(name)] = meta  # type: ignore[index]
        elif error is not None:
            errors[name] = error
    infos = []
    for name, files in listing.items():
        step = step_of(name)
        meta = parsed.get(step)  # type: ignore[arg-type]
        state = "committed" if meta is not None else ("unreadable" if name in errors else "uncommitted")
        infos.append(StepInfo(step, root.step_path(name), state, len(files), sum(files.values()),  # type: ignore[arg-type]
                              metrics_of(meta) if meta else None, references_of(meta) if meta else (),
                              errors.get(name)))
    return sorted(infos, key=lambda i: i.step), listing, parsed


def list_steps(directory: PathLike, *, storage_options: dict[str, Any] | None = None) -> list[StepInfo]:
    """Every step directory under ``directory``, committed or not, oldest first (read-only).

    Needs no process group and changes nothing (no sweep, no owner file); ``hyper-dcp ls``
    prints it.

    Example::

        committed = [s.step for s in list_steps("/ckpt/run1") if s.state == "committed"]
    """
    return scan(open_directory(directory, storage_options))[0]


def files_other_steps_use(path: PathLike) -> set[str]:
    """Files of the step directory ``path`` that committed sibling steps name: an incremental
    step reads its unchanged chunks from an earlier step's files (``../<step>/<file>``), and
    the manager keeps those files when it retires that step. Empty when ``path`` is not a
    step directory. A sibling whose ``.metadata`` does not parse might name some: that is an
    error, not a guess.
    """
    given = os.fspath(path)
    if is_url(given):
        return _files_siblings_use(given.rstrip("/"))
    # the step under the name given ("step/." and "." normalised; run/step_1 may be a symlink
    # to another volume) and under the name it resolves to (an alias of the step directory)
    names = {os.path.abspath(local_path(given)), location(given)}
    return set().union(*(_files_siblings_use(p) for p in sorted(names)))


def _files_siblings_use(path: str) -> set[str]:
    name = path.rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)
    if step_of(name) is None:
        return set()
    parent = path[: len(path) - len(name)].rstrip("/") or "."
    infos, _, parsed = scan(open_directory(parent, None))
    unreadable = [i for i in infos if i.state == "unreadable"]
    if unreadable:
        raise CheckpointError(
            f"cannot tell which files of {path!r} other steps use: {unreadable[0].error} "
            f"({len(unreadable)} step(s) unreadable)")
    return {f.name for meta in parsed.values() for f in meta.files if f.dir == name}


# ----------------------------------------------------------------------------- background deletion


class Deleter:
    """The coordinator's deletion thread: jobs run one at a time, in order; failures warn."""

    def __init__(self, root: Directory):
        self.root = root
        self._jobs: queue.Queue[tuple[str, str, tuple[str, ...]] | None] = queue.Queue()
        self._pending: dict[str, int] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []

    def submit(self, kind: str, name: str, files: Iterable[str] = (), keep: Iterable[str] = ()) -> None:
        """``kind`` "step": remove a whole step (``.metadata`` first) except the data files in
        ``keep`` (later steps name them); "files": only ``files``; "failed": what a save that
        did not commit left (see :meth:`_clean_failed`), except ``keep``."""
        with self._cond:
            self._pending[name] = self._pending.get(name, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hp-dcp-manager-delete", daemon=True)
                self._thread.start()
        self._jobs.put((kind, name, tuple(files) if kind == "files" else tuple(keep)))

    def _clean_failed(self, name: str, keep: tuple[str, ...]) -> None:
        """After a save of step directory ``name`` that did not commit: remove the files this
        library writes there that no ``.metadata`` in it names (data files, temporary metadata),
        then the directory if nothing else is left; nothing else, and nothing at all when a
        ``.metadata`` there cannot be read (what it names is unknown)."""
        present = self.root.listing().get(name)  # a step path that is a symbolic link is never listed
        if present is None:
            return
        referenced = list(keep)
        if md.METADATA_FILE in present:
            try:
                referenced += md.Metadata.from_json(self.root.read_metadata(name)).file_names()
            except NotACheckpointError:
                pass
            except CheckpointError:
                return
        self.root.remove_files(name, unreferenced_files(Listed(present), referenced))
        self.root.remove_if_empty(name)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, name, files = job
            try:
                if kind == "step":
                    self.root.uncommit(name)  # the step stops counting before any data goes
                    if files:  # data later steps still name stays; the rest goes
                        present = self.root.listing().get(name, {})
                        self.root.remove_files(name, [f for f in present if f not in files])
                    else:
                        self.root.remove_tree(name)
                elif kind == "failed":
                    self._clean_failed(name, files)
                else:
                    self.root.remove_files(name, files)
            except Exception as exc:  # the step stays: the next start finds it and tries again
                message = f"{self.root.step_path(name)}: deletion failed ({type(exc).__name__}: {exc})"
                self.failures.append(message)
                warnings.warn(f"CheckpointManager: {message}; it is retried at the next start", stacklevel=1)
            finally:
                with self._cond:
                    self._pending[name] -= 1
                    if not self._pending[name]:
                        del self._pending[name]
                    self._cond.notify_all()

    def wait_for(self, name: str | None = None, timeout: float | None = None) -> bool:
        """Wait until nothing (or nothing for step dir ``name``) is pending; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._pending if name is None else name not in self._pending, timeout)

    def stop(self) -> None:
        with self._cond:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()


# ----------------------------------------------------------------------------- ownership

OPEN_TOKENS: set[str] = set()  # owner tokens of the managers open in this process
_OWNER_LOCK_WAIT_S = 60.0  # a claim holds the lock for one read and one write


def _read_fd(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _lock(fd: int, path: str, deadline: float) -> bool:
    """Lock ``fd`` exclusively, waiting until ``deadline``; False where the filesystem has no
    locks (then the claim is a plain read and write, and a warning says so)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"{path!r} stayed locked for {_OWNER_LOCK_WAIT_S:g}s: another CheckpointManager is starting "
                    "or closing there and does not finish (a stuck filesystem?)") from None
            time.sleep(0.005)
        except OSError as exc:  # e.g. ENOLCK, EOPNOTSUPP: a filesystem mounted without locks
            warnings.warn(f"CheckpointManager: cannot lock {path!r} ({exc}); claiming the directory is not atomic "
                          "on this filesystem: do not start two jobs on one directory at once", stacklevel=4)
            return False


def _store_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception (s3fs chains the botocore error as the cause)."""
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _lost_race(exc: BaseException, replacing: bool) -> bool:
    """Whether a conditional put failed because the object changed meanwhile: it appeared, or
    (``replacing`` a record) it went or changed."""
    return (isinstance(exc, FileExistsError) or (replacing and isinstance(exc, FileNotFoundError))
            or _store_code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"))


def _no_conditional_put(exc: BaseException) -> bool:
    """Whether a put failed because the filesystem or store has no conditional puts (an fsspec
    filesystem without ``mode="create"``, an S3-compatible store answering 501)."""
    return (isinstance(exc, TypeError) and "mode" in str(exc)) or _store_code(exc) in ("NotImplemented", "501")


def parse_owner(raw: bytes | None) -> dict[str, Any] | None:
    """An owner record (None: none, or not one: it does not parse)."""
    if raw is None:
        return None
    try:
        owner = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return owner if isinstance(owner, dict) else None


def _who(raw: bytes | None) -> str:
    owner = parse_owner(raw) or {}
    return f"pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('since')}"


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` (Linux /proc), so a reused pid is not taken for the owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the manager ``owner`` names is still open (only checkable on this host)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    pid = owner["pid"]
    if pid == os.getpid():
        return owner.get("token") in OPEN_TOKENS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    started = process_start(pid)
    return started is None or owner.get("started") in (None, started)
