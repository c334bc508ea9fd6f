"""Staging buffers: where a snapshot's tensors are copied, and the pool that reuses them.

One flat host allocation per state-dict *structure* (keys, kinds, dtypes, shapes, layouts of
the tensors), every tensor at a :data:`TENSOR_ALIGN`-byte aligned offset (large ones, and
column bands, on :data:`DIRECT_IO_ALIGN` boundaries), one copy per tensor. A later snapshot of
the same structure reuses the buffer (:class:`BufferPool`); :class:`StagingStats` counts
allocations. Buffers are pinned when the tensors live on an accelerator.

Under a memory budget (``AsyncCheckpointer(max_host_bytes=...)``) a snapshot is not copied
whole: :class:`StagingRing` is one fixed allocation handed out in pieces and reused as the
saver writes them (:mod:`.streamed_staging` decides what goes in).

Used by the async checkpointer (:mod:`.checkpointer`) and by the checkpoint manager's local
tier. This module copies; it does not decide when (no threads, no saves).
"""

from __future__ import annotations

import copy
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..base.alignment import DIRECT_IO_ALIGN, TENSOR_ALIGN
from ..base.errors import CheckpointError
from ..format.data_file import ALIGNED_PAYLOAD_MIN
from ..planning.staged_bands import BandedSnapshot
from ..sharding.grid import band_columns
from ..sharding.sharded_tensor import host_snapshot, is_sharded_tensor

__all__ = ["StagingStats", "StagingBuffer", "BufferPool", "StagingRing",
           "tensor_spec", "copy_value", "copy_into", "wrap_dtensor"]

# Large tensors start on O_DIRECT block boundaries (and the buffer on one), as the data file
# places them, so the background write hands their memory to O_DIRECT as it is, with no copy
# through a bounce buffer; smaller ones at TENSOR_ALIGN.


@dataclass
class StagingStats:
    """Counters of a checkpointer's staging buffers.

    ``allocations``: staging buffers allocated so far (one per new structure, or per extra save
    in flight, or the ring of a memory budget); ``allocated_bytes``: their total size;
    ``reuses``: snapshots taken into an existing buffer; ``held_bytes``: bytes of the buffers
    held now (in use or cached); ``peak_staged_bytes``: the most bytes of snapshot data one
    save held at once (a whole snapshot's buffer; under a budget, the ring's pieces in use at
    their peak plus numpy arrays copied whole).
    """

    allocations: int = 0
    allocated_bytes: int = 0
    reuses: int = 0
    held_bytes: int = 0
    peak_staged_bytes: int = 0



def tensor_spec(value: Any) -> tuple | None:
    """What fixes a leaf's place in a staging buffer, or None for a value copied otherwise."""
    if is_sharded_tensor(value):  # its local shards, copied by copy_value
        return None
    if isinstance(value, DTensor):
        local = value._local_tensor
        return ("dtensor", local.dtype, tuple(local.shape), local.device.type, value.device_mesh,
                tuple(value.placements), tuple(value.shape), tuple(value.stride()))
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.device.type)
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return ("ndarray", value.dtype, value.shape)
    return None


def _nbytes(spec: tuple) -> int:
    return spec[1].itemsize * int(np.prod(spec[2], dtype=np.int64))


def copy_value(value: Any) -> Any:
    """A snapshot of a non-tensor leaf: immutable values as they are, the rest deep-copied."""
    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    if is_sharded_tensor(value):
        return host_snapshot(value)
    return copy.deepcopy(value)


class StagingBuffer:
    """One flat host allocation holding every tensor of one structure, plus the staged values.

    ``targets[key]`` is what a source is copied into (a typed view, or a numpy view);
    ``staged[key]`` is what the save sees (the view, or a DTensor wrapping it with the
    source's mesh, placements, global shape and stride).
    """

    def __init__(self, signature: tuple, templates: dict[str, Any], pinned: bool, bands: tuple = ()):
        self.signature = signature
        self.key = (signature, bands, pinned)  # a buffer asked for unpinned is never a pinned one
        tiles = dict(bands)  # key -> column bands it is staged as (absent: row-major)
        layout, pos = [], 0  # per leaf: its column bands (None: row-major), (offset, bytes) of each part
        for key, spec in signature:
            cols = band_columns(spec[2][1], tiles[key]) if key in tiles else None
            parts = []
            for n in _part_bytes(spec, cols):
                pos += -pos % (DIRECT_IO_ALIGN if n >= ALIGNED_PAYLOAD_MIN or cols else TENSOR_ALIGN)
                parts.append((pos, n))
                pos += n
            layout.append((cols, parts))
        self.nbytes = pos
        self.flat = _allocate(pos, pinned)
        self.pinned = self.flat.is_pinned() if pos else pinned
        self.targets: dict[str, Any] = {}
        self.staged: dict[str, Any] = {}
        self.banded: dict[str, BandedSnapshot] = {}
        for (key, spec), (cols, parts) in zip(signature, layout, strict=True):
            kind, dtype, shape = spec[0], spec[1], spec[2]
            if cols:  # band k of every row, contiguously, each band on a page boundary
                views = [self.flat[off:off + m].view(dtype).view(shape[0], size, *shape[2:])
                         for (off, m), (_, size) in zip(parts, cols, strict=True)]
                logical = torch.empty(shape, dtype=dtype, device="meta")
                self.targets[key] = _Bands(views, cols, *_all_bands(self.flat, dtype, shape, parts, cols))
                self.banded[key] = BandedSnapshot(logical, views, cols)
                self.staged[key] = wrap_dtensor(logical, templates[key]) if kind == "dtensor" else logical
                continue
            (off, n), = parts
            raw = self.flat[off:off + n]
            if kind == "ndarray":
                view = raw.numpy().view(dtype).reshape(shape)
                self.targets[key] = self.staged[key] = view
                continue
            view = raw.view(dtype).view(shape)
            self.targets[key] = view
            self.staged[key] = wrap_dtensor(view, templates[key]) if kind == "dtensor" else view


def _part_bytes(spec: tuple, cols: list[tuple[int, int]] | None) -> list[int]:
    """Bytes of each part a leaf is staged as: itself, or each of its column bands ``cols``."""
    if not cols:
        return [_nbytes(spec)]
    shape = spec[2]
    per_col = spec[1].itemsize * int(np.prod((shape[0], *shape[2:]), dtype=np.int64))
    return [size * per_col for _, size in cols]


class _Bands(NamedTuple):
    """A staging target made of column bands: ``views[k]`` takes columns ``cols[k]``.

    When the bands are alike (equal widths, the same distance apart in the buffer), ``whole``
    is every band at once, a strided view of shape ``(rows, bands, width, *rest)``, and
    ``split`` the shape that views a source as its bands: then one copy stages the tensor
    instead of one per band. ``ints`` is ``whole`` as a numpy array of same-sized integers
    (None for dtypes numpy cannot hold that way), ``int_dtype`` their torch dtype: numpy
    copies it in the source's row order (a sequential read, the bands written side by side),
    where torch's copy follows the target's order (band by band, each a strided read of the
    source) and reads wide rows slower. numpy copies on one thread, so it is used only where
    torch's copy would too (``torch.get_num_threads() == 1``); with more, torch's copy
    splits the tensor among its threads.
    """

    views: list[torch.Tensor]
    cols: list[tuple[int, int]]
    whole: torch.Tensor | None = None
    split: tuple[int, ...] = ()
    ints: np.ndarray | None = None
    int_dtype: torch.dtype | None = None


#: same-sized integer dtypes, to copy any real dtype's bytes with numpy (which has no bfloat16)
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _all_bands(flat: torch.Tensor, dtype: torch.dtype, shape: tuple, parts: list[tuple[int, int]],
               cols: list[tuple[int, int]]) -> tuple:
    """``(whole, split, ints, int_dtype)`` of :class:`_Bands` for bands at ``parts`` (offset,
    bytes) of ``flat``, or nothing when they are not alike."""
    width = cols[0][1]
    offsets = [off for off, _ in parts]
    step = offsets[1] - offsets[0] if len(offsets) > 1 else 0
    itemsize = torch.empty((), dtype=dtype).element_size()
    if (not width or any(size != width for _, size in cols) or step % itemsize
            or any(b - a != step for a, b in zip(offsets, offsets[1:], strict=False))):
        return ()
    inner = int(np.prod(shape[2:], dtype=np.int64))
    span = step * (len(parts) - 1) + parts[-1][1]
    rest_strides = torch.empty(shape[2:], device="meta").stride()
    split = (shape[0], len(cols), width, *shape[2:])
    whole = flat[offsets[0]:offsets[0] + span].view(dtype).as_strided(
        split, (width * inner, step // itemsize, inner, *rest_strides))
    int_dtype = None if dtype.is_complex else _INTS.get(itemsize)
    ints = whole.view(int_dtype).numpy() if int_dtype is not None else None
    return whole, split, ints, int_dtype


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory starting on a page boundary (pinned if asked and possible)."""
    raw = None
    if pinned:
        try:
            raw = torch.empty(nbytes + DIRECT_IO_ALIGN, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # pageable memory still works, but copies are slower and synchronous
            warnings.warn(f"async_save: pinning a {nbytes}-byte staging buffer failed ({exc}); using pageable "
                          "memory, so snapshots from the accelerator are slower and block on each copy",
                          stacklevel=2)
    if raw is None:
        raw = torch.empty(nbytes + DIRECT_IO_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % DIRECT_IO_ALIGN
    return raw[skip:skip + nbytes]


def wrap_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor over the staged local shard with ``like``'s mesh, placements, shape, stride."""
    mesh = like.device_mesh
    if mesh.device_type == local.device.type:
        return DTensor.from_local(local, mesh, like.placements, shape=like.shape, stride=like.stride(),
                                  run_check=False)
    # from_local would copy the snapshot back onto the mesh's accelerator; wrap it in place.
    return DTensor(local, like._spec, requires_grad=False)


def copy_into(pairs: list[tuple[Any, Any]]) -> None:
    """Copy every source into its staging target: one copy per tensor, no allocation.

    Copies from an accelerator are issued asynchronously into pinned memory on the current
    stream, then each device involved is synchronised before this returns.
    """
    devices: set[torch.device] = set()
    with torch.no_grad():
        for target, source in pairs:
            if isinstance(target, np.ndarray):
                np.copyto(target, source, casting="no")
                continue
            if isinstance(target, _Bands):  # a host tensor staged as its column bands
                if target.whole is not None:
                    bands = source.detach().view(target.split)  # splitting dim 1 is always a view
                    if target.ints is not None and torch.get_num_threads() == 1 and not bands.is_neg():
                        np.copyto(target.ints, bands.view(target.int_dtype).numpy(), casting="no")
                    else:
                        target.whole.copy_(bands)
                    continue
                for view, (lo, size) in zip(target.views, target.cols, strict=True):
                    view.copy_(source[:, lo:lo + size])
                continue
            on_device = source.device.type not in ("cpu", "meta")
            target.copy_(source, non_blocking=on_device and target.is_pinned())
            if on_device:
                devices.add(source.device)
    for device in devices:
        _synchronize(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


class BufferPool:
    """Staging buffers by structure, kept for the ``max_structures`` most recently used ones."""

    def __init__(self, max_structures: int, stats: StagingStats):
        self.max_structures = max(1, max_structures)
        self.stats = stats
        self._free: OrderedDict[tuple, list[StagingBuffer]] = OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, signature: tuple, templates: dict[str, Any], pinned: bool, bands: tuple = ()) -> StagingBuffer:
        key = (signature, bands, pinned)
        with self._lock:
            free = self._free.get(key)
            if free:
                self._free.move_to_end(key)
                self.stats.reuses += 1
                return free.pop()
        buffer = StagingBuffer(signature, templates, pinned, bands)
        with self._lock:
            self.stats.allocations += 1
            self.stats.allocated_bytes += buffer.nbytes
            self.stats.held_bytes += buffer.nbytes
        return buffer

    def release(self, buffer: StagingBuffer) -> None:
        with self._lock:
            self._free.setdefault(buffer.key, []).append(buffer)
            self._free.move_to_end(buffer.key)
            while len(self._free) > self.max_structures:
                _, evicted = self._free.popitem(last=False)
                self.stats.held_bytes -= sum(b.nbytes for b in evicted)

    def clear(self) -> None:
        with self._lock:
            for buffers in self._free.values():
                self.stats.held_bytes -= sum(b.nbytes for b in buffers)
            self._free.clear()



class StagingRing:
    """``capacity`` bytes of host memory (pinned if asked), handed out in pieces and reused.

    Pieces are taken in order at the head of a ring and come back in any order; the oldest
    one's memory is taken again first. :meth:`take` blocks while no room is left. A piece is
    a numpy ``uint8`` array; it comes back when nothing refers to it any more: every view,
    memoryview or slice made from it keeps its base alive, and a finalizer on that base gives
    the memory back. So a storage writer that keeps a part queued keeps it intact, and no
    piece is ever overwritten while a reference to it exists.
    """

    def __init__(self, capacity: int, pinned: bool):
        self.capacity = capacity
        self.flat = _allocate(capacity, pinned)
        self.pinned = self.flat.is_pinned() if capacity else pinned
        self._bytes = memoryview(self.flat.numpy())
        self._cond = threading.Condition(threading.RLock())  # finalizers may run in any thread, inside it too
        self._live: deque[list] = deque()  # [start, end, given back] of each piece, in the order taken
        self._head = 0  # where the next piece goes
        self.limit = capacity  # this save's share (start())
        self.in_use = 0  # bytes of the pieces not given back
        self.peak = 0
        self._stop: BaseException | None = None
        self._moved = time.monotonic()  # when a piece last came back

    def start(self, limit: int) -> None:
        """Begin a save that may hold at most ``limit`` (<= capacity) bytes of pieces at once."""
        with self._cond:
            self.limit = min(limit, self.capacity)
            self.peak = self.in_use
            self._stop = None

    def stop(self, error: BaseException) -> None:
        """Make every :meth:`take` (waiting now or later, until :meth:`start`) raise ``error``."""
        with self._cond:
            self._stop = error
            self._cond.notify_all()

    def take(self, nbytes: int, align: int, stall_s: float | None = None) -> tuple[torch.Tensor, np.ndarray]:
        """A piece of ``nbytes`` bytes starting on an ``align`` boundary, as ``(tensor, array)``
        over the same memory: copy into the tensor, hand out the array (whose life decides when
        the memory is reused; the tensor must be dropped first).

        Raises:
            CheckpointError: no piece came back for ``stall_s`` seconds while this one waited
                (a storage writer that holds every part until the end), or as :meth:`stop` says.
        """
        if nbytes > self.limit:
            raise ValueError(f"a staging piece of {nbytes} bytes cannot fit the ring's {self.limit}")
        with self._cond:
            waited_from = time.monotonic()
            while True:
                if self._stop is not None:
                    raise self._stop
                pos = self._place(nbytes, align)
                if pos is not None:
                    break
                if stall_s is not None and time.monotonic() - max(self._moved, waited_from) > stall_s:
                    raise CheckpointError(
                        f"async save: the {self.limit}-byte staging memory (max_host_bytes) is full and "
                        f"no staged piece was written for {stall_s:.0f}s: the storage writer holds "
                        f"{self.in_use} bytes of parts without writing them. Raise max_host_bytes, or use a "
                        "writer that writes parts as it gets them")
                self._cond.wait(None if stall_s is None else min(1.0, stall_s))
            piece = [pos, pos + nbytes, False]
            self._live.append(piece)
            self._head = pos + nbytes
            self.in_use += nbytes
            self.peak = max(self.peak, self.in_use)
        array = np.frombuffer(self._bytes[pos:pos + nbytes], dtype=np.uint8)
        base = array.base  # a memoryview made for this array: every view of it refers to it
        if base is None or base is self._bytes or isinstance(base, np.ndarray):
            self._give_back(piece)
            raise RuntimeError("numpy did not give the staging piece a base of its own; cannot track its use")
        weakref.finalize(base, self._give_back, piece)
        return self.flat[pos:pos + nbytes], array

    def _place(self, nbytes: int, align: int) -> int | None:
        """Where a piece of ``nbytes`` fits now, or None."""
        if not self._live:
            self._head = 0
            return 0
        tail = self._live[0][0]
        pos = -(-self._head // align) * align
        if self._head > tail:  # in use: [tail, head); room after head, else from 0 up to tail
            if pos + nbytes <= self.limit:
                return pos
            return 0 if nbytes <= tail else None
        return pos if pos + nbytes <= tail else None  # wrapped: in use [tail, end) and [0, head)

    def _give_back(self, piece: list) -> None:
        with self._cond:
            piece[2] = True
            self.in_use -= piece[1] - piece[0]
            while self._live and self._live[0][2]:
                self._live.popleft()
            self._moved = time.monotonic()
            self._cond.notify_all()
