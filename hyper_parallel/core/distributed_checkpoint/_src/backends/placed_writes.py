"""Byte runs written at their places in a file that several ranks and threads fill at once.

A consolidated Hugging Face file is one tensor after another, and every rank holds boxes of
them: each writes its boxes' contiguous runs at their offsets (:func:`box_runs`). Whole 4 KiB
blocks of a run go with O_DIRECT, the rest through the page cache, so the two kinds of write
never meet on one page (:class:`PlacedWrites`).

The buffered pieces go on a thread of their own. On ext4 (and most local filesystems) a
buffered write takes the file's inode lock exclusively and so waits for every O_DIRECT write
in flight on the file, the other ranks' included: written by the caller, the two partial
blocks of each box stalled the thread that copies the next bounce buffer for ~1.3 ms each
(a 2-rank ``Shard(0)`` save of 1 GiB in 436 tensors: ~580 such writes per rank, 0.77 s of a
~1.4 s save). Queued, they wait on their own thread while the copies and O_DIRECT writes go on.
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading

import numpy as np

from ..base.alignment import DIRECT_IO_ALIGN
from ..base.box import Box
from . import direct_io
from .filesystem import WriteQueue, pwrite_all


def box_runs(shape: tuple[int, ...], box: Box, itemsize: int) -> tuple[np.ndarray, int]:
    """Where ``box``'s contiguous runs start in a row-major tensor of ``shape`` (byte offsets from
    the tensor's start, in the box's own row-major order) and the bytes of each run."""
    i = len(shape) - 1
    while i >= 0 and box.sizes[i] == shape[i]:  # trailing dims the box spans whole
        i -= 1
    if i < 0:
        return np.zeros(1, dtype=np.int64), box.numel * itemsize
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    offsets = np.zeros(1, dtype=np.int64)
    for d in range(i):
        offsets = (offsets[:, None] + np.arange(box.sizes[d], dtype=np.int64) * strides[d]).reshape(-1)
    start = sum(box.offsets[d] * strides[d] for d in range(i + 1))
    return (offsets + start) * itemsize, box.sizes[i] * strides[i] * itemsize


DIRECT_MIN = 64 << 10  # runs shorter than this are written through the page cache
BOUNCE_BYTES = 8 << 20  # bytes of a run copied into aligned memory and written with O_DIRECT at a time
QUEUED = 2  # bounce buffers waiting for a file's writer thread
BUFFERED_QUEUED = 1024  # buffered pieces (copies of at most DIRECT_MIN bytes) waiting for theirs


class PlacedWrites:
    """Byte runs written at their offsets in one file that several ranks (and threads) fill.

    With ``direct``, a run's whole 4 KiB blocks go with O_DIRECT (from aligned memory: the
    run's own where it is aligned, else a reused bounce buffer), its partial blocks at either
    end through the page cache. A block is then either whole in one run, written directly, or
    shared by neighbours (another tensor, another rank's part, the header), every byte of it
    buffered: the two kinds of write never meet on one page. EINVAL from O_DIRECT (a
    filesystem that takes the flag but not the write) turns it off for the rest of the file.

    Bounce buffers are written by a thread of the file while the caller copies the next one
    (at most ``QUEUED`` waiting): copying and the disk overlap, as in our own saver. Runs
    written from the caller's own aligned memory are written before :meth:`write` returns,
    so the caller may reuse that memory at once. With ``direct``, the buffered pieces (a run's
    partial blocks, runs under ``DIRECT_MIN``) are copied and written by a second thread of
    the file, so the caller never waits on the inode lock that O_DIRECT writes in flight hold
    (see the module docstring). :meth:`drain` waits for every queued write.
    """

    def __init__(self, path: str, direct: bool):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # RDWR: a shared mapping needs it
        self.direct_fd: int | None = None
        if direct:
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | direct_io.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    os.close(self.fd)
                    raise
        self.direct = self.direct_fd is not None
        self._writes: WriteQueue | None = None  # the file's writer thread, started by the first bounce buffer
        self._buffered: WriteQueue | None = None  # its thread of buffered pieces (direct only), started alike
        self._lock = threading.Lock()

    def write(self, data: memoryview, offset: int) -> None:
        view = memoryview(data).cast("B")
        head = -offset % DIRECT_IO_ALIGN
        body = (view.nbytes - head) // DIRECT_IO_ALIGN * DIRECT_IO_ALIGN
        if not self.direct:
            pwrite_all(self.fd, [view], offset)
            return
        if view.nbytes < DIRECT_MIN or body <= 0:
            self._submit_buffered(view, offset)
            return
        if head:
            self._submit_buffered(view[:head], offset)
        if head + body < view.nbytes:
            self._submit_buffered(view[head + body:], offset + head + body)
        for pos in range(head, head + body, BOUNCE_BYTES):
            piece = view[pos:min(head + body, pos + BOUNCE_BYTES)]
            if direct_io.is_aligned(piece):
                self._write_direct(piece, offset + pos)
                continue
            bounce = direct_io.POOL.get(piece.nbytes)
            bounce[:] = piece
            self._submit(bounce, offset + pos)

    def _write_direct(self, piece: memoryview, offset: int) -> None:
        if self.direct:
            try:
                pwrite_all(self.direct_fd, [piece], offset)  # type: ignore[arg-type]
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct = False
        pwrite_all(self.fd, [piece], offset)

    def _submit(self, piece: memoryview, offset: int) -> None:
        with self._lock:  # several threads may place runs in one file
            if self._writes is None:
                fd = self.direct_fd if self.direct else self.fd
                self._writes = WriteQueue(fd, fallback=fd == self.direct_fd, depth=QUEUED)  # type: ignore[arg-type]
        self._writes.submit([piece], offset)

    def _submit_buffered(self, piece: memoryview, offset: int) -> None:
        """Queue a copy of ``piece`` (at most ``DIRECT_MIN`` bytes) for the buffered thread."""
        with self._lock:
            if self._buffered is None:
                self._buffered = WriteQueue(self.fd, fallback=False, depth=BUFFERED_QUEUED)
        self._buffered.submit([memoryview(bytes(piece))], offset)

    def drain(self, raise_error: bool = True) -> None:
        """Wait for every queued write; raise the first error."""
        with self._lock:
            queues, self._writes, self._buffered = (self._writes, self._buffered), None, None
        first: BaseException | None = None
        for writes in queues:  # both, even when the first fails: no thread is left writing
            if writes is None:
                continue
            try:
                writes.finish(raise_error)
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def copy_box(self, data: memoryview, start: int, shape: tuple[int, ...], box: Box, itemsize: int) -> None:
        """Copy ``box``'s row-major bytes ``data`` into the tensor of ``shape`` at byte ``start``
        through a shared mapping of the file (one strided copy, no call per run): for boxes of
        many short runs (a ``Shard(1)`` box has one per row), on a filesystem of this node."""
        rows = shape[:-1] + (shape[-1] * itemsize,)  # the last dim in bytes: any dtype, any alignment
        nbytes = math.prod(rows)
        base = start // mmap.ALLOCATIONGRANULARITY * mmap.ALLOCATIONGRANULARITY
        with mmap.mmap(self.fd, start + nbytes - base, offset=base) as mapped:
            whole = np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=start - base).reshape(rows)
            index = (*box.relative_to(Box.full(shape))[:-1],
                     slice(box.offsets[-1] * itemsize, box.ends[-1] * itemsize))
            src = np.frombuffer(data, dtype=np.uint8).reshape(box.sizes[:-1] + (box.sizes[-1] * itemsize,))
            np.copyto(whole[index], src)
            del whole, src  # the mapping closes only without views into it

    def close(self) -> None:
        self.drain(raise_error=False)  # never leave the thread writing into a closed fd
        for fd in (self.fd, self.direct_fd):
            if fd is not None:
                os.close(fd)
