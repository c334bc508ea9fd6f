"""Object-store and other fsspec backends (``s3://``, ``gs://``, ``memory://`` ...).

Commit protocol: data files are uploaded first (multipart where the store supports it);
``.metadata`` is then written with one whole-object PUT, which object stores make visible
atomically, so a reader sees the old checkpoint or the new one, never a partial one.
Data files carry the save id in their names, so a new save never overwrites the files of
the checkpoint it replaces; those are deleted after the commit.

Example::

    from hyper_parallel.core.distributed_checkpoint import save, load
    from hyper_parallel.core.distributed_checkpoint._src.backends.fsspec import FsspecWriter, FsspecReader

    opts = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9000"}}
    save(sd, storage_writer=FsspecWriter("s3://bucket/ckpt/step100", **opts))
    load(sd, storage_reader=FsspecReader("s3://bucket/ckpt/step100", **opts))
"""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ..base.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError, StorageTimeoutError
from ..base.torch_options import refuse_private_options
from ..format.metadata import METADATA_FILE
from .protocol import Buffer, StorageReader, StorageWriter

T = TypeVar("T")
_PART_BYTES = 16 << 20  # upload part size; object stores need >= 5 MiB for all but the last


class BoundedCalls:
    """Runs a storage call on a thread of its own and waits at most ``limit_s`` for it.

    An endpoint that accepts connections and never answers holds a call for as long as the
    client's own timeouts and retries allow (s3fs retries on top of botocore's: measured over
    150 s here, up to tens of minutes with the defaults). A save or load must fail within its
    ``timeout`` instead, as it does for a stuck peer. A blocked socket cannot be interrupted, so
    the call's (daemon) thread is left behind; what it still does is harmless: a read lands in
    bytes the caller no longer looks at (the copy into the caller's buffer happens on the
    caller's thread), and a data file uploaded late is never named by a committed
    ``.metadata``. A ``.metadata`` PUT that times out may still land: the commit then reports
    the outcome as unknown (:class:`~.errors.CommitError` with ``committed=None``), and every
    rank keeps its files, so either checkpoint is whole whichever way it ends.
    """

    def __init__(self, url: str):
        self.url = url
        self.limit_s: float | None = None  # None: calls run on the caller's thread, unbounded

    def bound(self, seconds: float) -> None:
        # beyond what threading can wait for (about 292 years) a bound means none
        self.limit_s = seconds if seconds < threading.TIMEOUT_MAX else None

    def __call__(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self.limit_s is None:
            return fn(*args, **kwargs)
        out: list[Any] = []
        done = threading.Event()

        def run() -> None:
            try:
                out.append((True, fn(*args, **kwargs)))
            except BaseException as exc:  # handed to the caller
                out.append((False, exc))
            finally:
                done.set()

        threading.Thread(target=run, name="dcp-storage-call", daemon=True).start()
        if not done.wait(self.limit_s):
            exc = StorageTimeoutError(
                f"{what} ({self.url}): the storage gave no answer within {self.limit_s:g}s (the save's or "
                "load's timeout); the store or its endpoint is stuck. The client's own limits (for S3: storage "
                "options config_kwargs connect_timeout, read_timeout, retries) end such calls sooner")
            exc.returned = done  # set once the stuck call returns, if ever
            raise exc
        ok, value = out[0]
        if not ok:
            raise value
        return value


def open_filesystem(url: str, options: dict[str, Any]) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the root path inside it (no trailing slash)."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - exercised only without the extra installed
        raise ImportError("object storage needs fsspec: pip install 'hyper-parallel[s3]'") from None
    fs, root = fsspec.core.url_to_fs(url, **options)
    return fs, root.rstrip("/")


class FsspecWriter(StorageWriter):
    """Writes a checkpoint under an fsspec URL; ``storage_options`` go to the filesystem."""

    def __init__(self, url: str, single_file_per_rank: bool = True, sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000, overwrite: bool = True, _extensions: Any = None,
                 serialization_format: Any = None, **storage_options: Any):
        refuse_private_options("FsspecWriter", _extensions=_extensions)
        # torch's FsspecWriter arguments in its order: overwrite and thread_count are honoured; the
        # layout knobs mean what they mean for FileSystemWriter (files per rank are ours either way);
        # everything else is the filesystem's storage options, as in torch
        del single_file_per_rank, sync_files, per_thread_copy_ahead, serialization_format
        self.url = url
        self._options = storage_options
        self.fs, self.root = open_filesystem(url, storage_options)
        self._call = BoundedCalls(url)
        self.thread_count = thread_count
        self.overwrite = overwrite  # False: refuse to replace a committed checkpoint (torch's FsspecWriter option)

    def reset(self, checkpoint_id: str) -> None:
        """Point this writer at another URL with the same storage options (torch DCP's
        ``StorageWriter.reset``: ``save(checkpoint_id=...)`` calls it)."""
        self.url = checkpoint_id
        self.fs, self.root = open_filesystem(checkpoint_id, self._options)
        self._call.url = checkpoint_id

    def bound_calls(self, seconds: float) -> None:
        """Fail a storage call with no answer within ``seconds`` (:class:`StorageTimeoutError`)."""
        self._call.bound(seconds)

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def prepare(self) -> None:
        if not self.overwrite and self._call("looking for a checkpoint", self.fs.exists, self._path(METADATA_FILE)):
            raise CheckpointError(f"{self.url!r} already holds a checkpoint and the writer has overwrite=False")
        self._call("creating the directory", self.fs.makedirs, self.root, exist_ok=True)

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """Upload ``parts`` (produced on this thread) as file ``name``: each write that sends a
        part, and the final completion, is one bounded call."""
        total = 0
        what = f"uploading {name}"
        f = self._call(what, self.fs.open, self._path(name), "wb", block_size=_PART_BYTES)
        try:
            for part in parts:
                self._call(what, f.write, part)
                total += memoryview(part).nbytes
            self._call(what, f.close)  # uploads the last part and completes the upload
        except StorageTimeoutError as exc:
            # the stuck call still uses the file (not thread-safe): abandon it once that returns
            threading.Thread(target=_abandon_after, args=(f, exc.returned), daemon=True).start()
            raise
        except BaseException:
            _abandon(f)
            raise
        return total

    def read_committed(self, name: str = METADATA_FILE) -> bytes | None:
        try:
            return self._call(f"reading {name}", self.fs.cat_file, self._path(name))
        except FileNotFoundError:
            return None

    def commit(self, metadata: bytes, name: str = METADATA_FILE) -> None:
        self._call(f"writing {name}", self.fs.pipe_file, self._path(name), metadata)

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                self._call(f"deleting {name}", self.fs.rm_file, self._path(name))
            except FileNotFoundError:
                pass

    def list_files(self) -> list[str]:
        """Listed anew: the filesystem's cached listing may predate what others removed."""
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)
        return sorted(p.rsplit("/", 1)[-1] for p in self._call("listing the files", self.fs.ls, self.root,
                                                                detail=False))

    @property
    def storage_options(self) -> dict[str, Any]:
        """The fsspec options this writer was made with (for the other places it looks at)."""
        return dict(self._options)


def start_io_thread() -> None:
    """Start fsspec's process-wide I/O thread now, on the calling thread: threads inherit their
    creator's niceness, and every later storage call of the process (the training loop's
    saves and loads too) runs on this one, so a background thread must not be the first to
    need it (see :mod:`.priority`)."""
    with contextlib.suppress(Exception):
        import fsspec.asyn

        fsspec.asyn.get_loop()


def _modified(info: dict[str, Any]) -> float | None:
    """A listed file's modification time in epoch seconds (s3fs: ``LastModified``; local and
    memory filesystems: ``mtime``/``created``), None when the filesystem gives none."""
    for field in ("LastModified", "mtime", "last_modified", "updated", "created"):
        value = info.get(field)
        if value is None:
            continue
        if hasattr(value, "timestamp"):
            return float(value.timestamp())
        with contextlib.suppress(TypeError, ValueError):
            return float(value)
    return None


def _abandon_after(f: Any, returned: threading.Event) -> None:
    """:func:`_abandon` once the call stuck in ``f`` returns; one that never returns leaves its
    upload to the store's lifecycle rules for incomplete multipart uploads."""
    returned.wait()
    _abandon(f)


def _abandon(f: Any) -> None:
    """Drop a file whose write failed without finishing it: closing would upload what it holds,
    and on S3 the parts of its multipart upload stay in the bucket (billed, listed by no one)
    until the upload is aborted, which s3fs's ``discard`` does."""
    with contextlib.suppress(Exception):
        f.discard()
    if getattr(f, "buffer", 0) is None:  # discarded (s3fs): closing now would fail or upload
        f.closed = True
        return
    with contextlib.suppress(Exception):
        f.close()


class FsspecReader(StorageReader):
    """Reads a checkpoint under an fsspec URL with ranged GETs."""

    def __init__(self, url: str, **storage_options: Any):
        self.url = url
        self._options = storage_options
        self.fs, self.root = open_filesystem(url, storage_options)
        self._call = BoundedCalls(url)
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def bound_calls(self, seconds: float) -> None:
        """Fail a storage call with no answer within ``seconds`` (:class:`StorageTimeoutError`)."""
        self._call.bound(seconds)

    def reset(self, checkpoint_id: str) -> None:
        """Point this reader at another URL with the same storage options (torch DCP's
        ``StorageReader.reset``: ``load(checkpoint_id=...)`` calls it)."""
        self.url = checkpoint_id
        self.fs, self.root = open_filesystem(checkpoint_id, self._options)
        self._call.url = checkpoint_id
        self._sizes.clear()

    def _path(self, name: str) -> str:
        if name.startswith("../"):  # a file of an earlier step beside this checkpoint (validated names)
            return f"{self.root.rsplit('/', 1)[0]}/{name[3:]}"
        return f"{self.root}/{name}"

    @property
    def memory_backed(self) -> bool:
        """True for ``memory://``."""
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return "memory" in protocols

    def _missing(self, name: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"data file {self._path(name)!r} is missing; the checkpoint is incomplete")

    def read_metadata_bytes(self) -> bytes:
        try:
            return self._call(f"reading {METADATA_FILE}", self.fs.cat_file, self._path(METADATA_FILE))
        except FileNotFoundError:
            raise NotACheckpointError(
                f"{self.url!r} is not a checkpoint: it has no {METADATA_FILE}"
            ) from None

    def file_size(self, name: str) -> int:
        if name not in self._sizes:
            path = self._path(name)
            try:
                self.fs.invalidate_cache(path)  # a listing made before the files were written may be cached
                self._sizes[name] = int(self._call(f"the size of {name}", self.fs.size, path))
            except FileNotFoundError:
                raise self._missing(name) from None
        return self._sizes[name]

    def list_files(self) -> list[str]:
        return sorted(p.rsplit("/", 1)[-1] for p in self._call("listing the files", self.fs.ls, self.root,
                                                                detail=False))

    def list_file_times(self) -> dict[str, float]:
        with contextlib.suppress(Exception):
            self.fs.invalidate_cache(self.root)
        found = self._call("listing the files", self.fs.ls, self.root, detail=True)
        out = {}
        for info in found:
            when = _modified(info)
            if info.get("type") != "directory" and when is not None:
                out[info["name"].rstrip("/").rsplit("/", 1)[-1]] = when
        return out

    def _current_size(self, name: str) -> int | None:
        """:meth:`file_size` asked anew (the cached size is the one the read was planned with)."""
        self._sizes.pop(name, None)
        with contextlib.suppress(OSError, CorruptCheckpointError):
            return self.file_size(name)
        return None

    def read_into(self, name: str, offset: int, buffer: Buffer) -> None:
        view = memoryview(buffer).cast("B")
        if not view.nbytes:
            return
        try:
            # fetched on the bounded call's thread, copied into the caller's buffer on this one
            data = self._call(f"reading {name}", self.fs.cat_file, self._path(name), start=offset,
                              end=offset + view.nbytes)
        except FileNotFoundError:
            raise self._missing(name) from None
        except OSError as exc:
            # S3 answers a range that starts past the end with 416, which s3fs raises as EINVAL
            size = self._current_size(name) if exc.errno == errno.EINVAL else None
            if size is None or offset < size:
                raise
            raise CorruptCheckpointError(
                f"data file {self._path(name)!r} ends early: wanted {view.nbytes} bytes at offset {offset}, "
                f"and it has {size}") from None
        if len(data) != view.nbytes:
            raise CorruptCheckpointError(
                f"data file {self._path(name)!r} ends early: wanted {view.nbytes} bytes at {offset}"
            )
        view[:] = data
        with self._lock:
            self.bytes_read += view.nbytes
