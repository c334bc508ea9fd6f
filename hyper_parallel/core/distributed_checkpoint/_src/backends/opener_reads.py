"""Data-file reads through a safetensors opener that a caller put in place of the library's.

HyperParallel's filesystem storage opens every safetensors file it reads with
``filesystem_storage.safe_open``, a module global looked up at call time, and its users
replace it to count, trace or redirect what a load opens (its own tests wrap it with
``mock.patch.object(..., wraps=...)`` and check that a resharding load went through it). Our
filesystem reader reads byte ranges with ``preadv`` instead, so the contract would silently
stop holding. The face registers itself here (:func:`use_opener_from`); while its
``safe_open`` is anything but ``safetensors.safe_open``, :class:`~.filesystem.FileSystemReader`
reads the byte ranges of ``.safetensors`` files through it (:class:`OpenerReads`):

- a file's header is read and validated once (:func:`..format.safetensors.parse_header`): it
  says which entries tile the data area;
- a byte range is assembled from the entries that cover it, each read with the opened file's
  ``get_slice`` over whole rows of dim 0 (``get_tensor`` for a 0-d entry), as bytes;
- bytes before the data area are the header's own.

Every byte a load uses still comes back through the loader's crc32c checks. The default opener
leaves the fast path alone: one attribute read per call. Reads through an opener are slower
(one copy more, no O_DIRECT); they serve instrumentation and custom openers, not speed.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import safetensors
import torch

from ..base.errors import CorruptCheckpointError
from ..format.safetensors import HEAD, parse_header, read_header_bytes
from .protocol import Buffer

__all__ = ["use_opener_from", "installed_opener", "OpenerReads", "OpenedFiles", "FILES_KEPT"]

FILES_KEPT = 8
"""Safetensors files one read keeps open: reads return to a file again and again, and opening
one (which parses its whole header) costs far more than the slice read it serves."""
SUFFIX = ".safetensors"

_source: Any = None


def use_opener_from(module: Any) -> None:
    """Look up ``safe_open`` on ``module`` (HyperParallel's ``filesystem_storage`` face) at each read."""
    global _source
    _source = module


def installed_opener() -> Callable[..., Any] | None:
    """The face's ``safe_open`` when a caller replaced it, else None (the library's own: our reads)."""
    found = getattr(_source, "safe_open", None) if _source is not None else None
    return None if found is None or found is safetensors.safe_open else found


class OpenedFiles:
    """The files one read holds open, least recently used first: ``reader(path)`` gives the open
    file (opening it with ``open_one(path)``, and closing the oldest with ``close_one`` once
    ``capacity`` are held); :meth:`close` lets every one go. Not thread-safe: its user locks."""

    def __init__(self, capacity: int, open_one: Callable[[str], Any], close_one: Callable[[Any], Any]) -> None:
        self._capacity = max(1, int(capacity))
        self._open_one = open_one
        self._close_one = close_one
        self._open: dict[str, Any] = {}

    def reader(self, path: str) -> Any:
        handle = self._open.pop(path, None)
        if handle is None:
            while len(self._open) >= self._capacity:
                self._close_one(self._open.pop(next(iter(self._open))))
            handle = self._open_one(path)
        self._open[path] = handle
        return handle

    def close(self) -> None:
        for handle in self._open.values():
            self._close_one(handle)
        self._open.clear()


class _Opened:
    """One file opened through an opener: the handle, its header bytes, and its entries by start."""

    def __init__(self, handle: Any, head: bytes, entries: list[tuple[int, int, str, tuple[int, ...]]]):
        self.handle = handle
        self.head = head  # the file's first bytes: the length and the JSON header
        self.entries = entries  # (absolute start, bytes, name, shape), by start, tiling the data area
        self.starts = [e[0] for e in entries]

    def close(self) -> None:
        exit_ = getattr(self.handle, "__exit__", None)
        if exit_ is not None:
            exit_(None, None, None)


class OpenerReads:
    """Byte ranges of a directory's safetensors files, read through an opener.

    Args:
        header_source: reads a file's size and header bytes (the reader's own ``preadv``: the
            header says where entries lie, it is not tensor data).
        full_path: a file name of the checkpoint -> the path given to the opener.
    """

    def __init__(self, header_source: Any, full_path: Callable[[str], str]):
        self._source = header_source
        self._full_path = full_path
        self._open: OpenedFiles | None = None  # opened through the opener of the last read
        self._opener: Any = None
        self._lock = threading.Lock()

    @staticmethod
    def serves(name: str) -> bool:
        return name.endswith(SUFFIX)

    def _file(self, name: str, opener: Callable[..., Any]) -> _Opened:  # under the lock
        if opener is not self._opener or self._open is None:  # a new opener: nothing the last one opened is used
            self.close_all()
            self._opener = opener
            self._open = OpenedFiles(FILES_KEPT, lambda n: self._opened(n, opener), _Opened.close)
        return self._open.reader(name)

    def _opened(self, name: str, opener: Callable[..., Any]) -> _Opened:
        where = f"data file {self._full_path(name)!r}"
        size = self._source.file_size(name)
        raw = read_header_bytes(self._source, name, where, size=size)
        header = parse_header(raw, size, where)
        entries = sorted((t.start, t.nbytes, n, t.shape) for n, t in header.tensors.items() if t.nbytes)
        handle = opener(self._full_path(name), framework="pt", device="cpu")
        return _Opened(handle, len(raw).to_bytes(HEAD, "little") + bytes(raw), entries)

    def read_into(self, name: str, offset: int, buffer: Buffer, opener: Callable[..., Any]) -> None:
        """Bytes ``offset:offset+len(buffer)`` of file ``name`` into ``buffer``, through ``opener``.
        One read at a time: a file another thread opens may close the least recently used one."""
        with self._lock:
            self._read_into(name, offset, buffer, opener)

    def _read_into(self, name: str, offset: int, buffer: Buffer, opener: Callable[..., Any]) -> None:
        view = memoryview(buffer).cast("B")
        out = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
        opened = self._file(name, opener)
        pos, end = offset, offset + view.nbytes
        if pos < len(opened.head):
            upto = min(end, len(opened.head))
            out[:upto - pos] = np.frombuffer(opened.head[pos:upto], dtype=np.uint8)
            pos = upto
        i = bisect.bisect_right(opened.starts, pos) - 1
        while pos < end:
            if i < 0 or i >= len(opened.entries) or pos >= opened.entries[i][0] + opened.entries[i][1]:
                raise CorruptCheckpointError(
                    f"data file {self._full_path(name)!r}: bytes {pos}..{end} lie past its last entry; "
                    "the file is shorter than the checkpoint says")
            start, nbytes, entry, shape = opened.entries[i]
            lo, hi = pos - start, min(end, start + nbytes) - start
            part = _entry_bytes(opened.handle, entry, shape, nbytes, lo, hi)
            out[pos - offset:pos - offset + hi - lo] = part
            pos, i = start + hi, i + 1

    def close_all(self) -> None:  # under the lock
        if self._open is not None:
            self._open.close()
            self._open = None

    def close(self) -> None:
        with self._lock:
            self.close_all()


def _entry_bytes(handle: Any, name: str, shape: tuple[int, ...], nbytes: int, lo: int, hi: int) -> np.ndarray:
    """Bytes ``lo:hi`` of entry ``name``, read as the whole rows of dim 0 that hold them."""
    if shape and shape[0]:
        row = nbytes // shape[0]
        first, last = lo // row, math.ceil(hi / row)
        tensor = handle.get_slice(name)[first:last]
        lo, hi = lo - first * row, hi - first * row
    else:
        tensor = handle.get_tensor(name)
    raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return raw[lo:hi]
