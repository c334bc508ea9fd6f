"""Staging buffers: where a snapshot's tensors are copied, and the pool that reuses them.

One flat host allocation per state-dict *structure* (keys, kinds, dtypes, shapes, layouts of
the tensors), every tensor at a :data:`TENSOR_ALIGN`-byte aligned offset (large ones, and
column bands, on :data:`DIRECT_IO_ALIGN` boundaries), one copy per tensor. A later snapshot of
the same structure reuses the buffer (:class:`BufferPool`); :class:`StagingStats` counts
allocations. Buffers are pinned when the tensors live on an accelerator.

Used by the async checkpointer (:mod:`.checkpointer`) and by the checkpoint manager's local
tier. This module copies; it does not decide when (no threads, no saves).
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..base.alignment import DIRECT_IO_ALIGN, TENSOR_ALIGN
from ..format.data_file import ALIGNED_PAYLOAD_MIN
from ..planning.staged_bands import BandedSnapshot
from ..sharding.grid import band_columns

__all__ = ["StagingStats", "StagingBuffer", "BufferPool",
           "tensor_spec", "copy_value", "copy_into"]

# Large tensors start on O_DIRECT block boundaries (and the buffer on one), as the data file
# places them, so the background write hands their memory to O_DIRECT as it is, with no copy
# through a bounce buffer; smaller ones at TENSOR_ALIGN.


@dataclass
class StagingStats:
    """Counters of a checkpointer's staging buffers.

    ``allocations``: staging buffers allocated so far (one per new structure, or per extra save
    in flight); ``allocated_bytes``: their total size; ``reuses``: snapshots taken into an
    existing buffer; ``held_bytes``: bytes of the buffers held now (in use or cached).
    """

    allocations: int = 0
    allocated_bytes: int = 0
    reuses: int = 0
    held_bytes: int = 0



def tensor_spec(value: Any) -> tuple | None:
    """What fixes a leaf's place in a staging buffer, or None for a value copied otherwise."""
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
                self.targets[key] = _Bands(views, cols)
                self.banded[key] = BandedSnapshot(logical, views, cols)
                self.staged[key] = _wrap_dtensor(logical, templates[key]) if kind == "dtensor" else logical
                continue
            (off, n), = parts
            raw = self.flat[off:off + n]
            if kind == "ndarray":
                view = raw.numpy().view(dtype).reshape(shape)
                self.targets[key] = self.staged[key] = view
                continue
            view = raw.view(dtype).view(shape)
            self.targets[key] = view
            self.staged[key] = _wrap_dtensor(view, templates[key]) if kind == "dtensor" else view


def _part_bytes(spec: tuple, cols: list[tuple[int, int]] | None) -> list[int]:
    """Bytes of each part a leaf is staged as: itself, or each of its column bands ``cols``."""
    if not cols:
        return [_nbytes(spec)]
    shape = spec[2]
    per_col = spec[1].itemsize * int(np.prod((shape[0], *shape[2:]), dtype=np.int64))
    return [size * per_col for _, size in cols]


class _Bands(NamedTuple):
    """A staging target made of column bands: ``views[k]`` takes columns ``cols[k]``."""

    views: list[torch.Tensor]
    cols: list[tuple[int, int]]


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


def _wrap_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
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

