"""Local and shared-filesystem storage: aligned O_DIRECT or coalesced buffered writes, ``preadv`` reads, atomic commit.

Writes. Each data file is streamed by the caller's thread (which produces parts and
computes checksums) while a writer thread of the file issues the system calls, so
checksumming overlaps with the device. Two engines:

- *direct* (``O_DIRECT``): used on local block filesystems (ext4, xfs, btrfs, ...) by
  default. Parts whose memory starts on a 4 KiB boundary and that sit at a 4 KiB file
  offset go to the device as they are (format-v2 payloads are placed on such offsets);
  everything else (headers, padding, small chunks, tensors in unaligned memory) is copied
  into aligned bounce buffers. Both are queued in file order and written 8 MiB at a time
  with one ``pwritev``, so a state dict of hundreds of small tensors costs a few system
  calls, not one per tensor, and the device gets large requests. The page cache is
  bypassed: less CPU per byte, and a checkpoint does not evict the training job's memory.
  A final partial block is written padded and the file truncated to its size.
- *buffered*: parts under 256 KiB are gathered into one write; larger ones are written as
  they are. Chosen automatically where O_DIRECT is not supported or not useful (tmpfs,
  FUSE and network filesystems), and when opening or writing with O_DIRECT fails with
  EINVAL.

``FileSystemWriter(path, direct_io=None|True|False)`` selects: None (default) = automatic,
True = O_DIRECT or an error, False = buffered.

Reads. ``read_into`` reads with ``preadv``. Requests aligned on 4 KiB (offset, length and
memory) bypass the page cache with O_DIRECT where writes would use it (or when forced);
the loader aligns the large reads whose bytes it needs, reads them into aligned scratch
memory ahead of use, and copies them out (:attr:`FileSystemReader.read_alignment`).

Commit protocol: ``.metadata`` is written to a unique temporary name, fsynced, renamed over
``.metadata`` (atomic on POSIX filesystems), and the directory is fsynced. Data files of a
save carry the save's id in their names, so a new save never overwrites the files of the
checkpoint it replaces; those are removed only after the new ``.metadata`` is in place.
Data files are fsynced (``sync_files``) whichever engine wrote them: O_DIRECT bypasses the
page cache, not the device's cache or the file's metadata.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import queue
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..base import timeline
from ..base.alignment import DIRECT_IO_ALIGN
from ..base.atomic_file import atomic_file, sync_directory, temporary_name
from ..base.errors import CheckpointError, CorruptCheckpointError, NotACheckpointError
from ..base.torch_options import refuse_private_options
from ..format.metadata import METADATA_FILE
from . import direct_io
from .direct_io import O_DIRECT
from .locations import checkpoint_path
from .open_files import OpenFiles
from .opener_reads import OpenerReads, installed_opener
from .protocol import Buffer, StorageReader, StorageWriter

COALESCE_BYTES = 256 << 10  # buffered: parts under this are gathered into one write
BOUNCE_BYTES = 8 << 20  # direct: size of a bounce buffer
WRITE_BYTES = 8 << 20  # direct: queued aligned views are written together once they reach this
FIRST_WRITE_BYTES = 1 << 20  # direct: ... except the first write of a file, which starts the disk sooner
DIRECT_MIN = 64 << 10  # direct: aligned parts at least this large are written without a copy
QUEUE_DEPTH = 2  # writes queued per file beyond the one in progress

_POOL = direct_io.POOL  # one pool of aligned memory for the saver, the writer and the loader


def pwrite_all(fd: int, views: list[memoryview], offset: int) -> None:
    """Write ``views`` back to back at ``offset`` (one ``pwritev`` unless the kernel writes less)."""
    while views:
        n = os.pwritev(fd, views, offset) if len(views) > 1 else os.pwrite(fd, views[0], offset)
        offset += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if n:
            views = [views[0][n:], *views[1:]]


def _mode_arg(direct_io: bool | None) -> bool | None:
    if not (direct_io is None or direct_io is True or direct_io is False):
        raise ValueError(f"direct_io must be None (automatic), True or False, not {direct_io!r}")
    return direct_io


class WriteQueue:
    """The writer thread of one file: runs ``pwrite``/``pwritev`` jobs in order while the producer goes on.

    With ``fallback`` (automatic mode), an EINVAL from an O_DIRECT write turns O_DIRECT off
    for the file and retries buffered; ``fell_back`` tells the owner.
    """

    def __init__(self, fd: int, fallback: bool, depth: int = QUEUE_DEPTH):
        self.fd, self.fallback = fd, fallback
        self.fell_back = False
        self.error: BaseException | None = None
        self.calls = 0
        self._q: queue.Queue = queue.Queue(depth)
        self._thread = threading.Thread(target=self._run, name="dcp-pwrite", daemon=True)
        self._thread.start()

    def submit(self, views: list[memoryview], offset: int) -> None:
        """Queue ``views`` to be written back to back at ``offset`` (one system call)."""
        if self.error is not None:
            raise self.error
        self._q.put((views, offset))

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            views, offset = job
            job = None
            if self.error is None:
                try:
                    self._write(views, offset)
                except BaseException as exc:  # re-raised in the producer
                    self.error = exc
            views = None  # hand bounce buffers back to the pool at once

    def _write(self, views: list[memoryview], offset: int) -> None:
        self.calls += 1
        try:
            pwrite_all(self.fd, views, offset)
        except OSError as exc:
            if not (self.fallback and exc.errno == errno.EINVAL and not self.fell_back):
                raise
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~O_DIRECT)
            self.fell_back = True
            pwrite_all(self.fd, views, offset)

    def finish(self, raise_error: bool = True) -> None:
        """Wait for every queued write; raise the first error."""
        self._q.put(None)
        self._thread.join()
        if raise_error and self.error is not None:
            raise self.error


class _BufferedSink:
    """Buffered writes: small parts gathered into one write, large ones as they are."""

    def __init__(self, writes: WriteQueue):
        self.writes = writes
        self.pos = 0
        self._buf: memoryview | None = None
        self._fill = 0

    def add(self, view: memoryview) -> None:
        n = view.nbytes
        if n < COALESCE_BYTES:
            if self._buf is not None and self._fill + n > self._buf.nbytes:
                self._flush()
            if self._buf is None:
                self._buf = _POOL.get(BOUNCE_BYTES)
            self._buf[self._fill:self._fill + n] = view
            self._fill += n
            return
        self._flush(view)

    def _flush(self, then: memoryview | None = None) -> None:
        """Write the gathered bytes (and ``then`` after them, in the same call)."""
        views = [self._buf[:self._fill]] if self._fill else []
        if then is not None:
            views.append(then)
        if views:
            self.writes.submit(views, self.pos)
            self.pos += sum(v.nbytes for v in views)
        self._buf, self._fill = None, 0

    def close(self) -> int:
        self._flush()
        return self.pos


GIL_FREE_COPY = 64 << 10  # larger copies go through numpy, which releases the GIL while copying


def _copy(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``; large copies without holding the GIL (a memoryview assignment holds
    it, so reader threads waiting to copy their own data would stall behind it)."""
    if src.nbytes < GIL_FREE_COPY:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


class _DirectSink:
    """O_DIRECT writes in aligned blocks: aligned parts as they are, the rest via bounce buffers.

    Every byte is queued as an aligned view in file order: a bounce buffer's bytes since
    its last queued one (always a multiple of DIRECT_IO_ALIGN: queued when the buffer is full, or
    just before an aligned part, when the tail of one payload and its padding end on a
    block), or an aligned part itself. Queued views are written together in one
    ``pwritev`` once they reach ``WRITE_BYTES``, so payloads of a few hundred KiB (column
    bands, small tensors) still make large device requests. The first write of a file is
    ``FIRST_WRITE_BYTES`` and each next one twice the last, up to ``WRITE_BYTES``: the disk
    starts while the producer fills the rest (a file of 24 MiB began writing ~5 ms after its
    first byte with 8 MiB writes from the start, ~1 ms with the ramp).
    """

    def __init__(self, writes: WriteQueue):
        self.writes = writes
        self.pos = 0  # file offset of the first queued byte
        self._queued: list[memoryview] = []
        self._queued_bytes = 0
        self._buf: memoryview | None = None
        self._start = 0  # bounce bytes [start, fill) are not queued yet
        self._fill = 0
        self._limit = FIRST_WRITE_BYTES  # queued bytes that make the next write

    def add(self, view: memoryview) -> None:
        while view.nbytes:
            if ((self._fill - self._start) % DIRECT_IO_ALIGN == 0 and view.nbytes >= DIRECT_MIN
                    and direct_io.is_aligned(view)):
                self._queue_bounce()
                k = view.nbytes - view.nbytes % DIRECT_IO_ALIGN
                self._queue(view[:k])
                view = view[k:]
                continue
            if self._buf is None:
                self._buf = _POOL.get(BOUNCE_BYTES)
                self._start = self._fill = 0
            take = min(BOUNCE_BYTES - self._fill, view.nbytes)
            _copy(self._buf[self._fill:self._fill + take], view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == BOUNCE_BYTES:
                self._queue_bounce()
                self._buf = None
            elif self._queued_bytes + self._fill - self._start >= self._limit:
                self._queue_bounce(whole_blocks=True)  # a write is due: the copied blocks go with it

    def _queue_bounce(self, whole_blocks: bool = False) -> None:
        """Queue the bounce bytes not queued yet (``whole_blocks``: only their whole blocks;
        otherwise they must end on a block)."""
        end = self._fill - (self._fill - self._start) % DIRECT_IO_ALIGN if whole_blocks else self._fill
        if end > self._start:
            view = self._buf[self._start:end]
            self._start = end
            self._queue(view)

    def _queue(self, view: memoryview) -> None:
        self._queued.append(view)
        self._queued_bytes += view.nbytes
        if self._queued_bytes >= self._limit or len(self._queued) >= 256:
            self._submit()

    def _submit(self) -> None:
        if self._queued:
            self.writes.submit(self._queued, self.pos)
            self.pos += self._queued_bytes
            self._queued, self._queued_bytes = [], 0
            self._limit = min(WRITE_BYTES, 2 * self._limit)

    def close(self) -> tuple[int, bool]:
        """Write the rest (padded to a block); return the file's size and whether it was padded."""
        size = self.pos + self._queued_bytes + self._fill - self._start
        pad = -(self._fill - self._start) % DIRECT_IO_ALIGN
        if pad:
            self._buf[self._fill:self._fill + pad] = bytes(pad)
            self._fill += pad
        self._queue_bounce()
        self._submit()
        self._buf = None
        return size, pad > 0


class FileSystemWriter(StorageWriter):
    """Writes a checkpoint into a directory on a local or shared (POSIX) filesystem.

    The positional order and keywords are torch DCP's ``FileSystemWriter``'s, so code
    written for it runs: ``single_file_per_rank``, ``per_thread_copy_ahead`` and
    ``cache_staged_state_dict`` are accepted (each rank writes one file per writer thread,
    staged through reused aligned memory, either way).

    Args:
        path: the checkpoint directory (created if missing).
        sync_files: fsync data files, metadata and directory before the commit returns, so a
            committed checkpoint survives a power loss. On by default.
        thread_count: data files (and writer threads) per rank, when ``save`` is not given
            its own ``thread_count``.
        overwrite: False refuses to replace a committed checkpoint at ``path``
            (:class:`CheckpointError` before anything is written).
        direct_io: how data files are written: None (default) chooses O_DIRECT on local
            block filesystems (ext4, xfs, btrfs, ...) and buffered writes elsewhere (tmpfs,
            network and FUSE filesystems) or when O_DIRECT fails with EINVAL; True requires
            O_DIRECT (an error where it is refused); False always writes through the page
            cache. See the module docstring.
        defer_sync: with ``sync_files``, sync data files in one batch at :meth:`flush`
            (many threads at once, so the filesystem journals them together) instead of
            each as it is closed: what offline tools writing thousands of small files use.
        serialization_format: torch's choice of data-file encoding (its ``SerializationFormat``),
            accepted so torch code runs; our data files are always safetensors, whichever is given.
        _extensions: torch's private stream transforms: refused unless empty, saying why
            (:mod:`..base.torch_options`).

    Example::

        save(sd, storage_writer=FileSystemWriter("/ckpt/step-100", direct_io=False))
    """

    def __init__(self, path: str | os.PathLike, single_file_per_rank: bool = True, sync_files: bool = True,
                 thread_count: int = 1, per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False,
                 overwrite: bool = True, *, direct_io: bool | None = None, defer_sync: bool = False,
                 serialization_format: Any = None, _extensions: Any = None):
        refuse_private_options("FileSystemWriter", _extensions=_extensions)
        del single_file_per_rank, per_thread_copy_ahead, cache_staged_state_dict  # torch's knobs (see above)
        if serialization_format is not None and type(serialization_format).__name__ != "SerializationFormat":
            raise ValueError(f"serialization_format must be torch's SerializationFormat (or None), got "
                             f"{serialization_format!r}; the data files are safetensors either way")
        if isinstance(thread_count, bool) or not isinstance(thread_count, int) or thread_count < 1:
            raise ValueError(f"thread_count must be an int >= 1, got {thread_count!r}")
        self.path = checkpoint_path(path)
        self.thread_count = thread_count
        self.overwrite = overwrite
        self.sync_files = sync_files
        self.defer_sync = defer_sync
        self._unsynced: list[str] = []
        self.direct_io = _mode_arg(direct_io)
        self._direct: bool | None = None  # decided in prepare() (automatic mode), may turn off later
        self.write_calls = 0  # system calls that wrote data (tests and benchmarks read it)
        self._lock = threading.Lock()

    def reset(self, checkpoint_id: str | os.PathLike) -> None:
        """Point this writer at another checkpoint directory, with the same options (torch DCP's
        ``StorageWriter.reset``: ``save(checkpoint_id=...)`` calls it)."""
        self.path = checkpoint_path(checkpoint_id)
        self._unsynced = []
        self._direct = None  # decided again for the new place, in prepare()

    def prepare(self) -> None:
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path!r} exists and is not a directory; a checkpoint is a directory")
        if not self.overwrite and os.path.exists(os.path.join(self.path, METADATA_FILE)):
            raise CheckpointError(f"{self.path!r} already holds a checkpoint and the writer has overwrite=False")
        os.makedirs(self.path, exist_ok=True)
        self._decide()

    def _decide(self) -> bool:
        if self._direct is None:
            if self.direct_io is None:
                self._direct = direct_io.direct_io_default(self.path)
            else:
                self._direct = self.direct_io and bool(O_DIRECT)
                if self.direct_io and not O_DIRECT:
                    raise CheckpointError("direct_io=True: this platform has no O_DIRECT; pass direct_io=None")
        return self._direct

    @property
    def uses_direct_io(self) -> bool | None:
        """Whether data files are (being) written with O_DIRECT; None before ``prepare``.
        Automatic mode can turn it off during a save (EINVAL on a first write)."""
        return self._direct

    def _open(self, full: str) -> tuple[int, bool]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        if self._decide():
            try:
                return os.open(full, flags | O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                if self.direct_io:
                    raise CheckpointError(
                        f"direct_io=True, but {direct_io.filesystem_name(self.path)} filesystem of {self.path!r} "
                        "refuses O_DIRECT; pass direct_io=None (automatic) or False") from None
                self._direct = False
        return os.open(full, flags, 0o644), False

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        """Stream ``parts`` into file ``name``.

        Parts are written by a thread of the file after this method has asked for later
        ones: a part's memory must stay unchanged until ``write_file`` returns (the saver's
        parts are tensors of the state dict and buffers it does not reuse).
        """
        full = os.path.join(self.path, name)
        fd, direct = self._open(full)
        writes = WriteQueue(fd, fallback=direct and self.direct_io is None)
        sink = _DirectSink(writes) if direct else _BufferedSink(writes)
        try:
            try:
                for part in parts:
                    sink.add(memoryview(part).cast("B"))
                total, padded = sink.close() if direct else (sink.close(), False)
            except BaseException:
                writes.finish(raise_error=False)  # never leave the thread writing into a closed fd
                raise
            writes.finish()
            if padded:
                os.ftruncate(fd, total)
            if writes.fell_back:
                self._direct = False
            if self.sync_files and self.defer_sync:
                with self._lock:
                    self._unsynced.append(full)
            elif self.sync_files:
                os.fsync(fd)
        except OSError as exc:
            if direct and self.direct_io and exc.errno == errno.EINVAL:
                raise CheckpointError(
                    f"direct_io=True, but writing {full!r} with O_DIRECT failed ({exc}); the "
                    f"{direct_io.filesystem_name(self.path)} filesystem may not support it: pass direct_io=None "
                    "or False") from exc
            raise
        finally:
            os.close(fd)
            with self._lock:
                self.write_calls += writes.calls
        return total

    def flush(self) -> None:
        """fsync every data file written since the last flush (``defer_sync``), 32 at a time."""
        with self._lock:
            todo, self._unsynced = self._unsynced, []
        if not todo:
            return

        def sync(full: str) -> None:
            fd = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        with ThreadPoolExecutor(min(32, len(todo)), thread_name_prefix="dcp-fsync") as pool:
            list(pool.map(sync, todo))

    def read_committed(self, name: str = METADATA_FILE) -> bytes | None:
        try:
            with open(os.path.join(self.path, name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def commit(self, metadata: bytes, name: str = METADATA_FILE) -> None:
        # A stray temporary file is harmless (readers only open .metadata; gc sweeps it).
        with atomic_file(os.path.join(self.path, name), sync=self.sync_files, sync_dir=False,
                         tmp=temporary_name(os.path.join(self.path, METADATA_FILE))) as f:
            f.write(metadata)
        # Committed: from here on problems are warnings (see StorageWriter.commit).
        if self.sync_files:
            try:
                sync_directory(self.path)
            except OSError as exc:
                warnings.warn(f"{self.path!r}: the checkpoint is committed, but syncing its directory failed "
                              f"({exc}); the commit may not survive a power loss", stacklevel=2)

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            try:
                os.unlink(os.path.join(self.path, name))
            except FileNotFoundError:
                pass

    def list_files(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.path) if e.is_file(follow_symlinks=False))


class FileSystemReader(StorageReader):
    """Reads a checkpoint directory; data files are opened once and read with ``preadv``
    (at most :func:`~.open_files.default_limit` open at a time: idle ones are closed, least
    recently used first, so a load touching tens of thousands of files stays under the
    process's descriptor limit).

    Symbolic links are refused (``O_NOFOLLOW``), so a checkpoint cannot point a reader at
    files outside its directory; an earlier step's file (``../<step dir>/<file>``, incremental
    checkpoints) is opened one directory at a time, none of them followed if it is a link.

    Args:
        path: the checkpoint directory.
        direct_io: requests aligned on 4 KiB (offset, length and memory) are read with
            O_DIRECT when True (an error where the filesystem refuses it), or when None
            (default) on local block filesystems (ext4, xfs, btrfs, ...); everything else goes
            through the page cache. False: always the page cache. The loader aligns the reads whose bytes it needs (see
            :attr:`read_alignment`) and leaves to the page cache those it reads only partly
            (whole rows of which it wants some columns), which other ranks probably read too.
        _extension_registry: torch's private registry of stream transforms: refused unless
            None, saying why (:mod:`..base.torch_options`).
    """

    def __init__(self, path: str | os.PathLike, _extension_registry: Any = None, *, direct_io: bool | None = None):
        refuse_private_options("FileSystemReader", _extension_registry=_extension_registry)
        self.path = checkpoint_path(path)
        self.direct_io = _mode_arg(direct_io)
        if direct_io and not O_DIRECT:
            raise CheckpointError("direct_io=True: this platform has no O_DIRECT; pass direct_io=None")
        self._direct: bool | None = None if direct_io is None else direct_io and bool(O_DIRECT)
        self._files = OpenFiles(self._open_mode)
        self._through_opener = OpenerReads(_PlainReads(self), lambda name: os.path.join(self.path, name))
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.read_calls = 0

    @property
    def read_alignment(self) -> int:
        """DIRECT_IO_ALIGN when aligned requests are read with O_DIRECT (the loader then aligns its
        reads and scratch memory), else 0."""
        return DIRECT_IO_ALIGN if self._uses_direct() else 0

    def _uses_direct(self) -> bool:
        if self._direct is None:
            self._direct = direct_io.direct_io_default(self.path)
        return self._direct

    def reset(self, checkpoint_id: str | os.PathLike) -> None:
        """Point this reader at another checkpoint directory (torch DCP's
        ``StorageReader.reset``: ``load(checkpoint_id=...)`` calls it)."""
        self.close()
        self.path = checkpoint_path(checkpoint_id)
        self._direct = None if self.direct_io is None else self.direct_io and bool(O_DIRECT)

    def read_metadata_bytes(self) -> bytes:
        meta = os.path.join(self.path, METADATA_FILE)
        if not os.path.isdir(self.path):
            raise NotACheckpointError(f"{self.path!r} is not a checkpoint: no such directory")
        try:
            fd = os.open(meta, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if os.path.exists(os.path.join(self.path, ".rank0_metadata")):  # one lookup: rank-local loads land here
                raise NotACheckpointError(
                    f"{self.path!r} is a rank-local checkpoint of HyperParallel's DCP (.rank<N>_metadata files); "
                    "convert it once with import_hyper_parallel(src, dst, trust=True) "
                    "(hyper-dcp import-hyper-parallel --trust)") from None
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

    def _open(self, name: str, extra: int = 0) -> int:
        full = os.path.join(self.path, name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | extra
        t0 = timeline.start()
        try:
            fd = os.open(full, flags) if "/" not in name else self._open_below(name, flags)
            timeline.record("open", t0, 0, f"{name} {'direct' if extra else 'buffered'}")
            return fd
        except FileNotFoundError:
            raise CorruptCheckpointError(f"data file {full!r} is missing; the checkpoint is incomplete") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CorruptCheckpointError(
                    f"data file {full!r} is a symbolic link, or a directory on its path is a link or no directory; "
                    "refused (a checkpoint reads only files of its own and its sibling steps' directories)") from None
            raise

    def _open_below(self, name: str, flags: int) -> int:
        """Open ``name`` (``../<step dir>/<file>``: an earlier step's file) one component at a
        time from the checkpoint's directory, none of them followed if it is a symbolic link:
        ``O_NOFOLLOW`` alone covers only the last one, and a linked step directory would lead
        the reader outside the manager's directory."""
        parts = name.split("/")
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the path the caller gave
        try:
            for part in parts[:-1]:  # ".." is the directory's real parent, never a link
                below = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                os.close(fd)
                fd = below
            return os.open(parts[-1], flags, dir_fd=fd)
        finally:
            os.close(fd)

    def _open_mode(self, name: str, direct: bool) -> int | None:
        """``name`` opened for reading (``direct``: with O_DIRECT; None where the filesystem
        refuses it and the mode is automatic: those reads go through the page cache)."""
        if not direct:
            return self._open(name)
        try:
            return self._open(name, O_DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            if self.direct_io:
                raise self._refused(name, exc) from None
            return None

    def _refused(self, name: str, exc: OSError) -> CheckpointError:
        return CheckpointError(
            f"direct_io=True, but reading {os.path.join(self.path, name)!r} with O_DIRECT failed ({exc}); the "
            f"{direct_io.filesystem_name(self.path)} filesystem may not support it: pass direct_io=None "
            "(automatic) or False")

    def file_size(self, name: str) -> int:
        with self._files.held(name) as fd:
            return os.fstat(fd).st_size

    def prefetch(self, ranges: Iterable[tuple[str, int, int]]) -> bool:
        """``posix_fadvise(WILLNEED)`` on each range: the kernel reads them in parallel into
        the page cache while the caller goes on (buffered reads then find them there)."""
        advise = getattr(os, "posix_fadvise", None)
        if advise is None:
            return False
        for name, offset, length in ranges:
            try:
                with self._files.held(name) as fd:  # the hint outlives the descriptor
                    advise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            except (OSError, CorruptCheckpointError):
                return False  # only a hint; the read itself reports real problems
        return True

    @property
    def memory_backed(self) -> bool:
        """True on tmpfs and ramfs (see :attr:`StorageReader.memory_backed`)."""
        return direct_io.is_memory_filesystem(self.path)

    def read_into(self, name: str, offset: int, buffer: Buffer) -> None:
        """Bytes ``offset:offset+len(buffer)`` of file ``name``; through HyperParallel's
        ``filesystem_storage.safe_open`` while a caller has replaced it (:mod:`.opener_reads`)."""
        opener = installed_opener()
        if opener is not None and OpenerReads.serves(name):
            self._through_opener.read_into(name, offset, buffer, opener)
            with self._lock:
                self.bytes_read += memoryview(buffer).nbytes
            return
        self._read(name, offset, buffer)

    def _read(self, name: str, offset: int, buffer: Buffer) -> None:
        view = memoryview(buffer).cast("B")
        want = view.nbytes
        calls = 0
        t0 = timeline.start()
        with contextlib.ExitStack() as held:  # the descriptors stay open until the read is done
            fd = None
            if (offset % DIRECT_IO_ALIGN == 0 and want % DIRECT_IO_ALIGN == 0 and want and self._uses_direct()
                    and direct_io.is_aligned(view)):
                fd = held.enter_context(self._files.held(name, direct=True))
            buffered = fd is None
            if buffered:
                fd = held.enter_context(self._files.held(name))
            while view.nbytes:
                try:
                    n = os.preadv(fd, [view], offset)
                except OSError as exc:
                    if exc.errno != errno.EINVAL or buffered:
                        raise
                    if self.direct_io:
                        raise self._refused(name, exc) from None
                    fd, buffered = held.enter_context(self._files.held(name)), True  # O_DIRECT refused it
                    continue
                calls += 1
                if n == 0:
                    raise CorruptCheckpointError(
                        f"data file {os.path.join(self.path, name)!r} ends early: wanted {want} bytes "
                        f"at offset {offset - (want - view.nbytes)}"
                    )
                view = view[n:]
                offset += n
        timeline.record("read", t0, want, "buffered" if buffered else "direct")
        with self._lock:
            self.bytes_read += want
            self.read_calls += calls

    def list_files(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.path) if e.is_file(follow_symlinks=False))

    def list_file_times(self) -> dict[str, float]:
        out = {}
        for e in os.scandir(self.path):
            if e.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):  # removed while listed
                    out[e.name] = e.stat(follow_symlinks=False).st_mtime
        return out

    def close(self) -> None:
        self._through_opener.close()
        self._files.close()


class _PlainReads:
    """A reader's own ``preadv`` reads, whatever opener is installed: where :class:`OpenerReads`
    reads a file's header (structure, not tensor data)."""

    def __init__(self, reader: FileSystemReader):
        self._reader = reader

    def file_size(self, name: str) -> int:
        return self._reader.file_size(name)

    def read_into(self, name: str, offset: int, buffer: Buffer) -> None:
        self._reader._read(name, offset, buffer)
