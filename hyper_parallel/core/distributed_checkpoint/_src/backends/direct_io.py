"""Aligned memory and O_DIRECT helpers for the local-filesystem backend (bytes only, no torch).

O_DIRECT moves data between user memory and the device without the page cache: less CPU
per byte and no cache to fill and evict, but every request must be aligned: its file
offset, its length and its memory address. Format-v2 data files put every large payload on
a 4 KiB boundary (:mod:`.data_file`), so a writer can stream a file in aligned blocks:
large payloads whose memory is aligned go to the device as they are, everything else
through an aligned bounce buffer.

- :data:`~..base.alignment.DIRECT_IO_ALIGN`: the alignment used for offsets, lengths and
  memory (4 KiB covers every common device; the kernel's own minimum is often 512 bytes).
- :func:`direct_io_default`: whether O_DIRECT is the automatic choice on a filesystem
  (local block filesystems; not tmpfs, FUSE or network filesystems, where it either fails,
  gains nothing, or bypasses a cache other readers rely on).
- :class:`AlignedPool`: reusable aligned buffers. Fresh memory costs a page fault per
  4 KiB (several times a memcpy), so copies go into buffers that are handed back to the
  pool automatically once nothing references them.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import weakref
from collections.abc import Iterator

import numpy as np

from ..base.alignment import DIRECT_IO_ALIGN

O_DIRECT: int = getattr(os, "O_DIRECT", 0)

# statfs f_type of filesystems where O_DIRECT is the automatic choice.
DIRECT_FILESYSTEMS = {
    0xEF53: "ext2/3/4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xF2F52010: "f2fs",
    0xCA451A4E: "bcachefs",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
}
_NAMES = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x6969: "nfs", 0x65735546: "fuse", 0x794C7630: "overlayfs",
          0xFF534D42: "cifs", 0x5346414F: "afs", 0x00C36400: "ceph"}

_libc = None


def _statfs_type(path: str) -> int | None:
    global _libc
    try:
        if _libc is None:
            # the process's own symbols include libc (find_library would spawn ldconfig: ~6 ms)
            _libc = ctypes.CDLL(None, use_errno=True)
        buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first member (a long)
        if _libc.statfs(os.fsencode(path), buf) != 0:
            return None
        return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF
    except (OSError, AttributeError, TypeError):
        return None


def filesystem_name(path: str) -> str:
    """The kind of filesystem ``path`` is on, for messages (``"0x..."`` when unknown)."""
    magic = _statfs_type(path)
    if magic is None:
        return "unknown"
    return DIRECT_FILESYSTEMS.get(magic) or _NAMES.get(magic) or f"{magic:#x}"


MEMORY_FILESYSTEMS = {0x01021994, 0x858458F6}  # tmpfs, ramfs


def is_memory_filesystem(path: str) -> bool:
    """Whether ``path`` is on a filesystem kept in memory (tmpfs, ramfs)."""
    return _statfs_type(path) in MEMORY_FILESYSTEMS


def direct_io_default(path: str) -> bool:
    """Whether writing files under ``path`` with O_DIRECT is the automatic choice."""
    return bool(O_DIRECT) and _statfs_type(path) in DIRECT_FILESYSTEMS


def address(view: memoryview) -> int:
    """The memory address of a buffer's first byte."""
    return np.frombuffer(view, dtype=np.uint8).ctypes.data if view.nbytes else 0


def is_aligned(view: memoryview, align: int = DIRECT_IO_ALIGN) -> bool:
    """Whether a buffer starts on an ``align`` boundary."""
    return address(view) % align == 0


def aligned_array(nbytes: int, align: int = DIRECT_IO_ALIGN) -> np.ndarray:
    """A new uint8 array of ``nbytes`` whose first byte lies on an ``align`` boundary."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    off = -raw.ctypes.data % align
    return raw[off:off + nbytes]


def is_einval(exc: OSError) -> bool:
    return exc.errno == errno.EINVAL


class AlignedPool:
    """Reusable aligned buffers: ``get(n)`` returns a writable memoryview of ``n`` bytes
    that goes back to the pool when the last reference to it is dropped (slices of the
    memoryview, and ``np.frombuffer``/``torch.frombuffer`` over it, hold one; numpy slices
    of an array do not, so derive everything from the memoryview).

    Buffers come in power-of-two sizes from ``min_size`` to ``size`` (a request gets the
    smallest that fits, so at most half of it is unused); larger requests get memory of
    their own. The pool keeps at most ``keep`` bytes of idle buffers, plus what :meth:`held`
    reserves while bulk work runs; a buffer handed back when that is full evicts the idle
    buffers handed back longest ago, so the sizes in use now stay (idle small buffers once
    kept every large read buffer out, and each large read faulted in fresh memory: a quarter
    of a cold load's CPU went to the kernel zeroing pages).
    """

    def __init__(self, size: int = 8 << 20, keep: int = 64 << 20, min_size: int = 64 << 10):
        self.size, self.keep, self.min_size = size, keep, min(min_size, size)
        self._free: dict[int, list[np.ndarray]] = {}
        self._order: dict[int, np.ndarray] = {}  # idle buffers by id, oldest first
        self._idle = 0
        self._held = 0
        self._lock = threading.Lock()

    def _class(self, nbytes: int) -> int:
        c = self.min_size
        while c < nbytes:
            c *= 2
        return min(c, self.size) if nbytes <= self.size else nbytes

    def get(self, nbytes: int) -> memoryview:
        if nbytes > self.size:
            return memoryview(aligned_array(nbytes))
        c = self._class(nbytes)
        with self._lock:
            free = self._free.get(c)
            base = free.pop() if free else None
            if base is not None:
                self._idle -= c
                del self._order[id(base)]
        if base is None:
            base = aligned_array(c)
        out = base[:nbytes]
        weakref.finalize(out, self._put, base)
        return memoryview(out)

    def _put(self, base: np.ndarray) -> None:
        with self._lock:
            limit = self.keep + self._held
            if base.nbytes > limit:
                return
            self._evict(limit - base.nbytes)
            self._free.setdefault(base.nbytes, []).append(base)
            self._order[id(base)] = base
            self._idle += base.nbytes

    def _evict(self, limit: int) -> None:
        """Drop the oldest idle buffers until at most ``limit`` bytes are idle (lock held)."""
        while self._idle > limit:
            old = self._order.pop(next(iter(self._order)))
            self._free[old.nbytes].remove(old)
            self._idle -= old.nbytes

    @contextlib.contextmanager
    def held(self, nbytes: int) -> Iterator[None]:
        """Keep up to ``nbytes`` more idle memory while the block runs: the working set of a
        load or save (its buffers in flight) is reused from one read to the next instead of
        faulted in afresh, and what exceeds ``keep`` is freed when the last holder leaves.
        Nested and concurrent holders add up."""
        with self._lock:
            self._held += nbytes
        try:
            yield
        finally:
            with self._lock:
                self._held -= nbytes
                self._evict(self.keep + self._held)

    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle


POOL = AlignedPool(size=32 << 20)  # the loader's largest read (READ_SLICE)
