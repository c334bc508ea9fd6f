"""The step directories of a CheckpointManager: naming, one-listing discovery, deletion, ownership.

Storage-level helpers of :mod:`.manager` (which holds the policy and the cross-rank
protocol): what a manager directory holds (:func:`list_steps`), how a step directory is
named (:func:`step_dir_name`), how it is deleted (``.metadata`` first, see :class:`Deleter`),
and who may write the directory (the owner file). Local and shared filesystems use ``os``;
fsspec URLs (``s3://...``) use one recursive listing. The layout is in ``docs/format.md``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import socket
import threading
import uuid
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from . import metadata as md
from .errors import CheckpointError, NotACheckpointError
from .filesystem_storage import FileSystemReader, FileSystemWriter
from .metadata import step_dir_name, step_of  # the format's naming rule (``dirs``)
from .storage import StorageReader, StorageWriter, is_url, location

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

    def uncommit(self, name: str) -> None:
        """Remove the step's ``.metadata`` durably: from now on the step does not count."""
        step = self.step_path(name)
        try:
            os.unlink(os.path.join(step, md.METADATA_FILE))
        except FileNotFoundError:
            return
        with contextlib.suppress(OSError):  # so the unlink reaches the disk before the data goes
            fd = os.open(step, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def remove_tree(self, name: str) -> None:
        """Remove an uncommitted step directory and everything in it (missing is fine)."""
        step = self.step_path(name)
        try:
            entries = list(os.scandir(step))
        except FileNotFoundError:
            return
        for entry in entries:
            with contextlib.suppress(FileNotFoundError):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(step)

    def remove_files(self, name: str, files: Iterable[str]) -> None:
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.step_path(name), f))

    def read_owner(self) -> bytes | None:
        try:
            with open(os.path.join(self.path, OWNER_FILE), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def write_owner(self, data: bytes) -> None:
        tmp = os.path.join(self.path, f"{OWNER_FILE}.tmp-{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, os.path.join(self.path, OWNER_FILE))

    def remove_owner(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, OWNER_FILE))


class FsspecDirectory:
    """The manager's directory under an fsspec URL (object stores: one listing, whole-object PUTs)."""

    def __init__(self, url: str, options: dict[str, Any]):
        try:
            import fsspec
        except ImportError:  # pragma: no cover - exercised only without the extra installed
            raise ImportError("object storage needs fsspec: pip install 'hyper-parallel[s3]'") from None
        from .fsspec_storage import BoundedCalls

        self.url, self.options = url.rstrip("/"), options
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root = root.rstrip("/")
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
        from .fsspec_storage import FsspecWriter

        return FsspecWriter(self.step_path(name), **self.options)

    def reader(self, name: str) -> StorageReader:
        from .fsspec_storage import FsspecReader

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

    def read_owner(self) -> bytes | None:
        try:
            return self._call(f"reading {OWNER_FILE}", self.fs.cat_file, self._key(OWNER_FILE))
        except FileNotFoundError:
            return None

    def write_owner(self, data: bytes) -> None:
        self._call(f"writing {OWNER_FILE}", self.fs.pipe_file, self._key(OWNER_FILE), data)

    def remove_owner(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(f"deleting {OWNER_FILE}", self.fs.rm_file, self._key(OWNER_FILE))


Directory = LocalDirectory | FsspecDirectory


def open_directory(directory: PathLike, storage_options: dict[str, Any] | None) -> Directory:
    path = os.fspath(directory)
    if is_url(path):
        return FsspecDirectory(path, dict(storage_options or {}))
    if storage_options:
        raise ValueError(f"storage_options apply to fsspec URLs (s3://...), not to the local path {path!r}")
    return LocalDirectory(path.removeprefix("file://"))


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
    and other non-JSON values carry the type tags of :func:`metadata.encode_value`)."""
    return {k: md.encode_value(v) for k, v in metrics.items()}


def metrics_of(meta: md.Metadata) -> dict[str, Any] | None:
    own = meta.user.get(USER_KEY)
    stored = own.get("metrics") if isinstance(own, dict) else None
    if not isinstance(stored, dict):
        return None
    try:
        return {k: md.decode_value(v) for k, v in stored.items()}
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
    names = {os.path.abspath(given.removeprefix("file://")), location(given)}
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
        ``keep`` (later steps name them); "files": only ``files``."""
        with self._cond:
            self._pending[name] = self._pending.get(name, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hp-dcp-manager-delete", daemon=True)
                self._thread.start()
        self._jobs.put((kind, name, tuple(files) if kind == "files" else tuple(keep)))

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
