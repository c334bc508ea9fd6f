"""CheckpointManager: step directories, retention and resume for a training loop.

A training job keeps its checkpoints in one directory (a local or shared path, or an fsspec
URL such as ``s3://bucket/run``), one *step directory* per saved step::

    directory/
      .manager-owner.json      which job writes here now (host, pid); see "One writer" below
      step_00000100/           an ordinary checkpoint: .metadata + data files
      step_00000200/
      ...

Step directories are named ``step_`` + the step number zero-padded to 8 digits (longer
numbers keep all their digits); other names in the directory are ignored and never touched.

**Committed steps.** A step counts only once its ``.metadata`` is in place and parses (the
commit protocol of :mod:`.commit` puts it there last, atomically). Discovery lists the
directory once (one recursive listing on object stores) and reads each step's
``.metadata``; no "latest" pointer exists, so none can run ahead of a commit. Every rank
sees the same steps: the coordinator (rank 0 of the group) lists and decides, and its result
reaches every rank through a status-checked exchange, so an error on the coordinator (a
listing that fails) fails every rank instead of hanging them.

**Retention** (after each commit, never before): keep the newest ``keep_latest`` committed
steps, every step divisible by ``keep_every_steps``, and the ``keep_best`` best steps by the
metric ``best_metric`` (metrics are stored in each step's ``.metadata``, so "best" survives
restarts); the union is kept, and always the newest committed step and the step being saved.
With no rule set, every step is kept. Only the coordinator deletes, in a background thread:
first the step's ``.metadata`` (the step stops counting), then its data files, then the
directory. A crash in between leaves a step directory without ``.metadata``: uncommitted,
never loaded, swept at the next start.

**Sweep at start.** The coordinator removes (in the background) every step directory that
has no ``.metadata`` (a crashed save, a failed save, a deletion cut short) and, inside
committed steps, the data files their ``.metadata`` does not name (debris of an interrupted
save). A step whose ``.metadata`` exists but does not parse (corrupt, or written by a newer
version) is neither counted nor deleted: a warning names it.

**One writer.** The manager assumes it is the only writer of its directory while it is
open: that is what makes the sweep safe (nothing else can be in flight). The coordinator
records itself in ``.manager-owner.json``; a manager refuses to start while that file names
a live process on this host (another job, or another open manager in this process), takes
over otherwise (the previous job is gone), and raises at its next save if another manager
has taken over meanwhile. A writer on another host cannot be checked for liveness: do not
point two running jobs at one directory.

**Async saves** (``async_save=True``): at most one save is in flight. ``save`` of the next
step first waits for the previous one and settles it (every rank learns whether it
committed; retention runs; a failure is raised as :class:`AsyncSaveError` on every rank).
The same happens in ``wait()``, ``load()`` and ``close()``. Calls that the interval policy
skips touch nothing and never block, so errors surface at the next call that saves.

Incremental checkpoints (``incremental=True``) arrive with format version 2; the places they
plug into are marked ``PLUG (incremental)``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import re
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from . import metadata as md
from .api import load as _load
from .api import save as _save
from .async_staging import AsyncCheckpointer, AsyncSaveError, AsyncSaveResponse
from .commit import unreferenced_files
from .coordination import Coordinator
from .errors import CheckpointError, CommitError, NotACheckpointError
from .filesystem_storage import FileSystemReader, FileSystemWriter
from .storage import StorageReader, StorageWriter

__all__ = ["CheckpointManager", "StepInfo", "SaveTiming", "list_steps", "step_dir_name", "plan_retention"]

PathLike = str | os.PathLike
OWNER_FILE = ".manager-owner.json"
USER_KEY = "checkpoint_manager"  # where a step's own facts live in Metadata.user
_STEP_NAME = re.compile(r"^step_(\d{8,})$")
_READ_THREADS = 8  # parallel .metadata reads at start (object stores have latency)


def step_dir_name(step: int) -> str:
    """The directory name of ``step``: ``step_`` + the number zero-padded to 8 digits."""
    return f"step_{step:08d}"


def _step_of(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a (canonical) step name."""
    m = _STEP_NAME.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if name == step_dir_name(step) else None


# ----------------------------------------------------------------------------- storage


class _Listed:
    """A file listing in the shape :func:`commit.unreferenced_files` reads."""

    def __init__(self, names: Iterable[str]):
        self.names = sorted(names)

    def list_files(self) -> list[str]:
        return self.names


class _LocalRoot:
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
            if _step_of(entry.name) is None or not entry.is_dir(follow_symlinks=False):
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


class _FsspecRoot:
    """The manager's directory under an fsspec URL (object stores: one listing, whole-object PUTs)."""

    def __init__(self, url: str, options: dict[str, Any]):
        try:
            import fsspec
        except ImportError:  # pragma: no cover - exercised only without the extra installed
            raise ImportError("object storage needs fsspec: pip install 'hyper-parallel[s3]'") from None
        self.url, self.options = url.rstrip("/"), options
        self.fs, root = fsspec.core.url_to_fs(url, **options)
        self.root = root.rstrip("/")

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
            found = self.fs.find(self.root, detail=True)
        except FileNotFoundError:
            return {}
        finally:
            self._forget_cached_listings()  # find() fills the cache with every step directory
        out: dict[str, dict[str, int]] = {}
        prefix = self.root + "/"
        for path, info in found.items():
            rel = path[len(prefix):] if path.startswith(prefix) else None
            parts = rel.split("/") if rel else []
            if len(parts) != 2 or _step_of(parts[0]) is None or info.get("type") == "directory":
                continue
            out.setdefault(parts[0], {})[parts[1]] = int(info.get("size") or 0)
        return out

    def read_metadata(self, name: str) -> bytes:
        try:
            return self.fs.cat_file(self._key(name, md.METADATA_FILE))
        except FileNotFoundError:
            raise NotACheckpointError(f"{self.step_path(name)!r} has no {md.METADATA_FILE}") from None

    def writer(self, name: str) -> StorageWriter:
        from .fsspec_storage import FsspecWriter

        return FsspecWriter(self.step_path(name), **self.options)

    def reader(self, name: str) -> StorageReader:
        from .fsspec_storage import FsspecReader

        return FsspecReader(self.step_path(name), **self.options)

    def make_root(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)

    def uncommit(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(name, md.METADATA_FILE))

    def remove_tree(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._key(name), recursive=True)

    def remove_files(self, name: str, files: Iterable[str]) -> None:
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(self._key(name, f))

    def read_owner(self) -> bytes | None:
        try:
            return self.fs.cat_file(self._key(OWNER_FILE))
        except FileNotFoundError:
            return None

    def write_owner(self, data: bytes) -> None:
        self.fs.pipe_file(self._key(OWNER_FILE), data)

    def remove_owner(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._key(OWNER_FILE))


_Root = _LocalRoot | _FsspecRoot


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _open_root(directory: PathLike, storage_options: dict[str, Any] | None) -> _Root:
    path = os.fspath(directory)
    if _is_url(path):
        return _FsspecRoot(path, dict(storage_options or {}))
    if storage_options:
        raise ValueError(f"storage_options apply to fsspec URLs (s3://...), not to the local path {path!r}")
    return _LocalRoot(path.removeprefix("file://"))


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


def _encode_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """Metrics as they are stored in ``Metadata.user``: plain JSON where it can be (``nan``
    and other non-JSON values carry the type tags of :func:`metadata.encode_value`)."""
    return {k: md.encode_value(v) for k, v in metrics.items()}


def _metrics_of(meta: md.Metadata) -> dict[str, Any] | None:
    own = meta.user.get(USER_KEY)
    stored = own.get("metrics") if isinstance(own, dict) else None
    if not isinstance(stored, dict):
        return None
    try:
        return {k: md.decode_value(v) for k, v in stored.items()}
    except ValueError:
        return None


def references_of(meta: md.Metadata) -> tuple[int, ...]:
    """The steps (other than its own) whose directories hold data ``meta`` names.

    PLUG (incremental): with format version 2 a chunk may live in an earlier step's file;
    this returns those steps, and retention keeps them as long as a kept step names them.
    Version 1 checkpoints reference nothing outside their own directory.
    """
    return ()


def _scan(root: _Root) -> tuple[list[StepInfo], dict[str, dict[str, int]], dict[int, md.Metadata]]:
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
            parsed[_step_of(name)] = meta  # type: ignore[index]
        elif error is not None:
            errors[name] = error
    infos = []
    for name, files in listing.items():
        step = _step_of(name)
        meta = parsed.get(step)  # type: ignore[arg-type]
        state = "committed" if meta is not None else ("unreadable" if name in errors else "uncommitted")
        infos.append(StepInfo(step, root.step_path(name), state, len(files), sum(files.values()),  # type: ignore[arg-type]
                              _metrics_of(meta) if meta else None, references_of(meta) if meta else (),
                              errors.get(name)))
    return sorted(infos, key=lambda i: i.step), listing, parsed


def list_steps(directory: PathLike, *, storage_options: dict[str, Any] | None = None) -> list[StepInfo]:
    """Every step directory under ``directory``, committed or not, oldest first (read-only).

    Needs no process group and changes nothing (no sweep, no owner file); ``hyper-dcp ls``
    prints it.

    Example::

        committed = [s.step for s in list_steps("/ckpt/run1") if s.state == "committed"]
    """
    return _scan(_open_root(directory, storage_options))[0]


# ----------------------------------------------------------------------------- retention


def plan_retention(
    steps: dict[int, dict[str, Any] | None],
    *,
    keep_latest: int | None = None,
    keep_every_steps: int | None = None,
    keep_best: int | None = None,
    best_metric: str | None = None,
    best_mode: str = "min",
    protect: Iterable[int] = (),
    references: Callable[[int], Iterable[int]] = lambda step: (),
) -> list[int]:
    """The committed steps to delete: those no rule keeps (pure; the manager's policy).

    Kept: the newest ``keep_latest``; every step divisible by ``keep_every_steps``; the
    ``keep_best`` best by ``steps[step][best_metric]`` (``best_mode`` "min" or "max"; steps
    without a finite number for it do not compete; ties go to the newer step); the newest
    step; ``protect``; and, transitively, every step a kept step ``references``. With no rule
    set, nothing is deleted.
    """
    if not steps or (keep_latest is None and keep_every_steps is None and keep_best is None):
        return []
    order = sorted(steps)
    keep = {order[-1], *protect}
    if keep_latest is not None:
        keep.update(order[-keep_latest:] if keep_latest > 0 else [])
    if keep_every_steps is not None:
        keep.update(s for s in order if s % keep_every_steps == 0)
    if keep_best is not None and best_metric is not None:
        keep.update(_best(steps, best_metric, best_mode)[:keep_best])
    todo = list(keep)
    while todo:  # PLUG (incremental): a kept step keeps every step whose files it names
        for ref in references(todo.pop()):
            if ref in steps and ref not in keep:
                keep.add(ref)
                todo.append(ref)
    return [s for s in order if s not in keep]


def _metric_value(metrics: dict[str, Any] | None, name: str) -> float | None:
    value = metrics.get(name) if isinstance(metrics, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _best(steps: dict[int, dict[str, Any] | None], metric: str, mode: str) -> list[int]:
    """Steps with a finite ``metric``, best first (ties: the newer step first)."""
    scored = [(v, s) for s, m in steps.items() if (v := _metric_value(m, metric)) is not None]
    sign = 1.0 if mode == "min" else -1.0
    return [s for _, s in sorted(scored, key=lambda vs: (sign * vs[0], -vs[1]))]


# ----------------------------------------------------------------------------- background deletion


class _Deleter:
    """The coordinator's deletion thread: jobs run one at a time, in order; failures warn."""

    def __init__(self, root: _Root):
        self.root = root
        self._jobs: queue.Queue[tuple[str, str, tuple[str, ...]] | None] = queue.Queue()
        self._pending: dict[str, int] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []

    def submit(self, kind: str, name: str, files: Iterable[str] = ()) -> None:
        """``kind`` "step": remove a whole step (``.metadata`` first); "files": only ``files``."""
        with self._cond:
            self._pending[name] = self._pending.get(name, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hp-dcp-manager-delete", daemon=True)
                self._thread.start()
        self._jobs.put((kind, name, tuple(files)))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, name, files = job
            try:
                if kind == "step":
                    self.root.uncommit(name)  # the step stops counting before any data goes
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

_OPEN_TOKENS: set[str] = set()  # owner tokens of the managers open in this process


def _process_start(pid: int) -> str | None:
    """The start time of ``pid`` (Linux /proc), so a reused pid is not taken for the owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the manager ``owner`` names is still open (only checkable on this host)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    pid = owner["pid"]
    if pid == os.getpid():
        return owner.get("token") in _OPEN_TOKENS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    started = _process_start(pid)
    return started is None or owner.get("started") in (None, started)


# ----------------------------------------------------------------------------- the manager


@dataclass(frozen=True)
class SaveTiming:
    """What one save cost this process: ``blocking_s`` the ``save`` call (for async, until the
    snapshot was taken), ``total_s`` until committed (None while in flight or if it failed)."""

    step: int
    blocking_s: float
    total_s: float | None


@dataclass
class _Pending:
    """A save whose outcome every rank has not yet learned (async: in flight)."""

    step: int
    response: AsyncSaveResponse | None = None
    meta: md.Metadata | None = None  # sync saves, on the coordinator
    blocking_s: float = 0.0


class CheckpointManager:
    """Saves a training job's checkpoints into step directories, keeps some, resumes from the newest.

    Every rank of the group constructs it and calls ``save``/``load``/``wait``/``close`` alike
    (same arguments, same order); ``latest_step``/``all_steps``/``best_step``/``metrics`` are
    local and may be called anywhere.

    Args:
        directory: where the step directories go: a local/shared path or an fsspec URL.
        save_interval_steps: ``save(step, ...)`` saves only when ``step`` is a multiple of it
            (or ``force=True``).
        keep_latest: keep the newest N committed steps.
        keep_every_steps: keep every step divisible by it (milestones).
        keep_best: keep the N best steps by ``best_metric`` (needs ``best_metric``).
        best_metric: the key in ``save(..., metrics=)`` that ranks steps; ``best_mode``
            ``"min"`` (a loss) or ``"max"`` (an accuracy).
        async_save: return from ``save`` once a snapshot is taken; a background thread writes
            and commits (one save in flight; see the module docstring).
        incremental: not available yet (needs format version 2); raises NotImplementedError.
        process_group: the ranks that save together (default: the whole world).
        timeout: bound on every cross-rank exchange, seconds or timedelta (default 30 min).
        storage_options: options of the fsspec filesystem for a URL ``directory`` (e.g.
            ``{"client_kwargs": {"endpoint_url": ...}}``).

    The retention rules keep the union of what each rule keeps, plus always the newest
    committed step; with none set, every step is kept. Retention runs after each commit.

    Raises:
        CheckpointError: another open manager (a live process on this host) owns ``directory``.
        RankFailedError: listing the directory failed on the coordinator (on every rank).

    Example::

        with CheckpointManager("/ckpt/run1", save_interval_steps=100, keep_latest=3,
                               keep_best=1, best_metric="loss", async_save=True) as mgr:
            start = mgr.load(state) or 0          # resume from the newest committed step
            for step in range(start + 1, steps + 1):
                loss = train_step()
                mgr.save(step, state, metrics={"loss": loss})
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        save_interval_steps: int = 1,
        keep_latest: int | None = None,
        keep_every_steps: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool = False,
        incremental: bool = False,
        process_group: Any = None,
        timeout: timedelta | float | None = None,
        storage_options: dict[str, Any] | None = None,
    ):
        if incremental:
            raise NotImplementedError("incremental checkpoints arrive with format v2")
        _check_count("save_interval_steps", save_interval_steps)
        for name, value in (("keep_latest", keep_latest), ("keep_every_steps", keep_every_steps),
                            ("keep_best", keep_best)):
            if value is not None:
                _check_count(name, value)
        if best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {best_mode!r}")
        if keep_best is not None and not best_metric:
            raise ValueError("keep_best needs best_metric: the key of save(..., metrics=) that ranks steps")
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        self.directory = os.fspath(directory)
        self.save_interval_steps = save_interval_steps
        self.keep_latest, self.keep_every_steps, self.keep_best = keep_latest, keep_every_steps, keep_best
        self.best_metric, self.best_mode = best_metric, best_mode
        self.async_save = async_save
        self.incremental = incremental
        self.process_group = process_group
        self.timeout = timeout
        self._root = self._root_for(directory, storage_options)
        self._steps: dict[int, dict[str, Any] | None] = {}  # committed step -> metrics, same on every rank
        self._pending: _Pending | None = None
        self._timings: deque[SaveTiming] = deque(maxlen=100)
        self._closed = False
        self._token = uuid.uuid4().hex
        self._async: AsyncCheckpointer | None = AsyncCheckpointer(max_in_flight=1) if async_save else None
        self._coord = Coordinator(process_group, False, 0, timeout)
        self._deleter = _Deleter(self._root) if self._coord.is_coordinator else None
        try:
            self._start()
        except BaseException:
            self._release()  # a failed start must not keep the directory claimed
            raise

    # ------------------------------------------------------------------ queries (local)

    def latest_step(self) -> int | None:
        """The newest committed step, or None. Local: as of this rank's last manager call."""
        return max(self._steps) if self._steps else None

    def all_steps(self) -> list[int]:
        """Every committed step the manager keeps, oldest first (not the one in flight)."""
        return sorted(self._steps)

    def best_step(self) -> int | None:
        """The best committed step by ``best_metric`` (None without a metric or a scored step)."""
        if not self.best_metric:
            return None
        ranked = _best(self._steps, self.best_metric, self.best_mode)
        return ranked[0] if ranked else None

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with committed ``step`` (the coordinator's), or None."""
        m = self._steps.get(step)
        return dict(m) if m is not None else None

    def step_path(self, step: int) -> str:
        """Where ``step`` is (or would be) saved."""
        return self._root.step_path(step_dir_name(step))

    @property
    def save_timings(self) -> list[SaveTiming]:
        """This process's last 100 saves: time the call blocked, time until committed."""
        return list(self._timings)

    # ------------------------------------------------------------------ save / load

    def save(self, step: int, state_dict: dict[str, Any], *, metrics: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Save ``state_dict`` as ``step`` if the policy says so; return whether it saved.

        Skipped (False, nothing touched, no collective): ``step`` is not a multiple of
        ``save_interval_steps`` and ``force`` is False. Otherwise every rank first settles the
        previous async save (waits for it; raises its failure), then agrees on ``step``; a
        ``step`` equal to the newest committed one is skipped (False). With ``async_save`` the
        call returns once the snapshot is taken.

        Args:
            step: the training step (an int >= 0, larger than every committed step).
            state_dict: what :func:`save` accepts (e.g. ``{"app": TrainState(...)}``).
            metrics: ``{name: value}`` stored with the step (the coordinator's values); values
                are JSON-representable, or 0-d tensors / numpy scalars (stored as numbers).
                ``best_metric`` ranks steps by one of them.
            force: save even off the interval (e.g. the last step of training).

        Raises:
            ValueError: ``step`` is older than the newest committed step, or ranks disagree.
            AsyncSaveError: the previous async save failed (nothing new is started).
            RankFailedError / CommitError / LostContactError: a synchronous save failed (as
                :func:`save`).
        """
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if metrics is not None:
            metrics = _plain_metrics(metrics)
        if not force and step % self.save_interval_steps:
            return False
        self._settle()
        self._agree("save", step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                return False
            raise ValueError(
                f"step {step} is older than the newest committed step {latest} in {self.directory!r}: steps "
                "only go forward (a resume would pick the newer one). Resume from it, or move the newer "
                "step directories away to restart an older timeline")
        name = step_dir_name(step)
        user = {USER_KEY: {"step": step, "metrics": None if metrics is None else _encode_metrics(metrics)}}
        writer = self._storage_writer(name)
        started = time.perf_counter()
        if self._async is not None:
            response = self._async.save(state_dict, storage_writer=writer, process_group=self.process_group,
                                        timeout=self.timeout, user_metadata=user)
            self._pending = _Pending(step, response=response, blocking_s=response.blocking_s)
            return True
        try:
            meta = _save(state_dict, storage_writer=writer, process_group=self.process_group,
                         timeout=self.timeout, user_metadata=user)
        except Exception as exc:
            # Not committed unless a CommitError says it may be: the coordinator (alone deleting)
            # clears the step's debris; a CommitError step is left for the next start to judge.
            if self._deleter is not None and not isinstance(exc, CommitError):
                self._deleter.submit("step", name)
            self._timings.append(SaveTiming(step, time.perf_counter() - started, None))
            raise
        elapsed = time.perf_counter() - started
        self._pending = _Pending(step, meta=meta, blocking_s=elapsed)
        self._settle()
        return True

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> int | None:
        """Load committed ``step`` (default: the newest) into ``state_dict`` in place.

        Settles an async save in flight first. Returns the step loaded, or None (and leaves
        ``state_dict`` untouched) when ``step`` is None and nothing is committed yet.

        Raises:
            NotACheckpointError: ``step`` is not a committed step of this directory.
            ValueError: ranks asked for different steps.
            Errors of :func:`load` (mismatched keys, corrupt data) on every rank.
        """
        self._check_open()
        self._settle()
        chosen = self.latest_step() if step is None else step
        self._agree("load", chosen)
        if chosen is None:
            return None
        if chosen not in self._steps:
            raise NotACheckpointError(
                f"step {chosen} is not a committed checkpoint in {self.directory!r}; committed steps: "
                f"{self.all_steps() or 'none'}")
        _load(state_dict, storage_reader=self._storage_reader(step_dir_name(chosen)),
              process_group=self.process_group, timeout=self.timeout)
        return chosen

    def wait(self) -> None:
        """Wait until the save in flight is committed (and retention has run); raise its error.

        On the coordinator, also waits for background deletions to finish.

        Raises:
            AsyncSaveError: the save in flight failed (on every rank).
        """
        self._check_open()
        self._settle()
        if self._deleter is not None:
            self._deleter.wait_for()

    def close(self) -> None:
        """Settle the save in flight, finish deletions, release the owner file and threads.

        Idempotent. Raises the in-flight save's error, after releasing everything.
        """
        if self._closed:
            return
        try:
            self._settle()
        finally:
            self._release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # An error is on its way out, and the ranks may no longer be in step: no collectives.
        # A save in flight still commits (or fails) on its own; wait for it here, bounded.
        with contextlib.suppress(Exception):
            if self._pending is not None and self._pending.response is not None:
                self._pending.response.exception()
        self._pending = None
        self._release()

    # ------------------------------------------------------------------ storage hooks

    def _root_for(self, directory: PathLike, storage_options: dict[str, Any] | None) -> _Root:
        return _open_root(directory, storage_options)

    def _storage_writer(self, name: str) -> StorageWriter:
        # PLUG (incremental): hand the previous committed step (self._root.step_path of
        # step_dir_name(self.latest_step())) to the save here, so unchanged chunks are
        # referenced instead of written.
        return self._root.writer(name)

    def _storage_reader(self, name: str) -> StorageReader:
        # PLUG (incremental): a reader that resolves references to earlier steps' files
        # inside self.directory.
        return self._root.reader(name)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the CheckpointManager of {self.directory!r} is closed")

    def _on_coordinator(self, phase: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the coordinator; every rank gets its result, or every rank raises."""
        coord = self._coord
        return coord.exchange(phase, lambda: fn() if coord.is_coordinator else None)[coord.coordinator_rank]

    def _start(self) -> None:
        found: dict[str, Any] = {}

        def discover() -> dict[int, dict[str, Any] | None]:
            self._root.make_root()
            self._claim()
            infos, listing, parsed = _scan(self._root)
            for info in infos:
                name = step_dir_name(info.step)
                if info.state == "uncommitted":
                    found.setdefault("sweep", []).append(name)
                elif info.state == "unreadable":
                    warnings.warn(f"CheckpointManager: {info.error}; step {info.step} is ignored and left in "
                                  "place (`hyper-dcp verify` it, or move it away)", stacklevel=4)
                else:
                    debris = unreferenced_files(_Listed(listing[name]), self._referenced_files(parsed[info.step]))
                    if debris:
                        found.setdefault("debris", []).append((name, debris))
            return {i.step: i.metrics for i in infos if i.state == "committed"}

        self._steps = self._on_coordinator("manager start (listing the directory)", discover)
        if self._deleter is not None:
            for name in found.get("sweep", []):
                self._deleter.submit("step", name)
            for name, files in found.get("debris", []):
                self._deleter.submit("files", name, files)

    def _referenced_files(self, meta: md.Metadata) -> list[str]:
        # PLUG (incremental): add the files of this step's directory that later steps reference.
        return meta.files

    def _claim(self) -> None:
        """Become the directory's owner (coordinator), or refuse while a live owner holds it."""
        raw = self._root.read_owner()
        if raw is not None:
            try:
                owner = json.loads(raw)
            except ValueError:
                owner = {}
            if isinstance(owner, dict) and _owner_alive(owner):
                raise CheckpointError(
                    f"{self.directory!r} is in use by another CheckpointManager (pid {owner.get('pid')} on "
                    f"{owner.get('host')}, since {owner.get('since')}): one job writes a directory at a time. "
                    "Close that manager or use another directory")
        pid = os.getpid()
        self._root.write_owner(json.dumps({
            "host": socket.gethostname(), "pid": pid, "started": _process_start(pid), "token": self._token,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode())
        _OPEN_TOKENS.add(self._token)

    def _check_owner(self) -> None:
        raw = self._root.read_owner()
        try:
            owner = json.loads(raw) if raw is not None else None
        except ValueError:
            owner = None
        if not isinstance(owner, dict) or owner.get("token") != self._token:
            who = (f"pid {owner.get('pid')} on {owner.get('host')}" if isinstance(owner, dict)
                   else "someone (the owner file is gone)")
            raise CheckpointError(
                f"another writer took over {self.directory!r} ({who}); this manager stops saving there. "
                "Two jobs must not share a checkpoint directory")

    def _agree(self, what: str, step: int | None) -> None:
        """Every rank names the same ``step`` (the coordinator also checks it still owns the
        directory and that no deletion of that step's directory is pending)."""
        def check() -> int | None:
            if self._coord.is_coordinator:
                self._check_owner()
                if step is not None and what == "save":
                    self._deleter.wait_for(step_dir_name(step))  # type: ignore[union-attr]
            return step

        steps = self._coord.exchange(f"manager {what} (step {step})", check)
        if len(set(steps)) > 1:
            raise ValueError(f"CheckpointManager.{what}: the ranks passed different steps {steps} (by rank); "
                             "every rank must call it with the same step")

    def _settle(self) -> None:
        """Every rank learns the outcome of the last save; the coordinator updates the steps,
        plans retention, and starts the deletions after everyone agreed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        own_error: BaseException | None = None
        meta = pending.meta
        response = pending.response
        if response is not None:
            try:
                meta = response.result()
            except BaseException as exc:  # reported to every rank below
                own_error = exc
                # ...and by us alone: the checkpointer would raise it again at the next save.
                with contextlib.suppress(AsyncSaveError, TimeoutError):
                    self._async.wait(timeout=0)  # type: ignore[union-attr]
            self._timings.append(SaveTiming(pending.step, pending.blocking_s,
                                            response.total_s if own_error is None else None))
        else:
            self._timings.append(SaveTiming(pending.step, pending.blocking_s, pending.blocking_s))
        name = step_dir_name(pending.step)
        plan: dict[str, Any] = {}

        def bookkeeping() -> tuple[str | None, Any]:
            error = None if own_error is None else f"{type(own_error).__name__}: {own_error}"
            if not self._coord.is_coordinator:
                return error, None
            committed = meta
            finished = response is None or response.done()
            if own_error is not None and finished:  # the save may have committed all the same
                committed = self._probe(name)
            steps = dict(self._steps)
            if committed is not None:
                steps[pending.step] = _metrics_of(committed)
                doomed = self._retention(steps, protect={pending.step})
                for s in doomed:
                    del steps[s]
                plan["delete"] = doomed
            elif finished:
                plan["cleanup"] = True
            return error, (committed is not None, steps)

        results = self._coord.exchange(f"manager (settling the save of step {pending.step})", bookkeeping)
        committed, self._steps = results[self._coord.coordinator_rank][1]
        if self._deleter is not None:
            for s in plan.get("delete", []):
                self._deleter.submit("step", step_dir_name(s))
            if plan.get("cleanup"):
                self._deleter.submit("step", name)
        failures = {r: e for r, (e, _) in enumerate(results) if e is not None}
        if not failures:
            return
        detail = "; ".join(f"rank {r}: {e}" for r, e in failures.items())
        where = self.step_path(pending.step)
        if committed:
            warnings.warn(f"CheckpointManager: step {pending.step} is committed at {where}, but its save "
                          f"reported errors: {detail}", stacklevel=3)
            return
        raise AsyncSaveError(f"the async save of step {pending.step} to {where} failed ({detail}); the newest "
                             f"committed step is {self.latest_step()}") from own_error

    def _probe(self, name: str) -> md.Metadata | None:
        """The step's committed metadata, or None when it has none (or it does not parse)."""
        try:
            return md.Metadata.from_json(self._root.read_metadata(name))
        except NotACheckpointError:
            return None
        except CheckpointError as exc:
            warnings.warn(f"CheckpointManager: {self._root.step_path(name)}: {exc}", stacklevel=4)
            return None

    def _retention(self, steps: dict[int, dict[str, Any] | None], protect: set[int]) -> list[int]:
        return plan_retention(steps, keep_latest=self.keep_latest, keep_every_steps=self.keep_every_steps,
                              keep_best=self.keep_best, best_metric=self.best_metric, best_mode=self.best_mode,
                              protect=protect, references=self._references)

    def _references(self, step: int) -> tuple[int, ...]:
        # PLUG (incremental): the steps whose files ``step`` names (from references_of of its
        # metadata, remembered at discovery and at each commit).
        return ()

    def _release(self) -> None:
        """Free threads, groups and the owner file (no collectives)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._async is not None:
                with contextlib.suppress(AsyncSaveError):
                    self._async.close()
        finally:
            if self._deleter is not None:
                self._deleter.wait_for()
                self._deleter.stop()
                with contextlib.suppress(Exception):
                    raw = self._root.read_owner()
                    if raw is not None and json.loads(raw).get("token") == self._token:
                        self._root.remove_owner()
            _OPEN_TOKENS.discard(self._token)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, steps={self.all_steps()}, "
                f"in_flight={self._pending.step if self._pending else None})")


def _plain_metrics(metrics: Any) -> dict[str, Any]:
    """``metrics`` with 0-d tensors and numpy scalars turned into numbers; validated."""
    if not isinstance(metrics, dict) or not all(type(k) is str for k in metrics):
        raise ValueError(f"metrics must be a dict with str keys, got {metrics!r:.200}")
    plain = {k: v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v for k, v in metrics.items()}
    if not md.is_json_value(plain):
        raise ValueError(f"metrics values must be numbers, strings, bools, None, or lists/dicts of them (or 0-d "
                         f"tensors), got {metrics!r:.200}")
    return plain


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
