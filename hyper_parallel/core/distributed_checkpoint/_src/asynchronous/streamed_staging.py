"""The staging side of ``AsyncCheckpointer(max_host_bytes=...)``: a snapshot copied piece by
piece into a bounded ring while the save writes it.

:class:`BudgetStream` implements :class:`~..planning.streamed_snapshot.SnapshotStream`. The
staged state dict holds meta stand-ins; when the saver announces the regions it will write
(``expect``), a stager thread copies them, in that order, in pieces of at most
``piece_bytes``, into the :class:`~.buffers.StagingRing`, waiting whenever the ring is full
until the saver has written (and dropped) older pieces. The snapshot is complete, and the
caller may change its tensors again, once the last piece is copied: then at most the ring's
bytes are still unwritten. A tensor larger than the ring is cut into row slabs (and a row
larger than a piece into parts of rows), so any budget above the minimum works.

Why the minimum (:data:`MIN_RING_BYTES` per data file a rank writes): a storage writer may
keep some parts before it writes them (the O_DIRECT writer gathers 8 MiB per system call),
and those pieces come back only once it has more; the ring must hold them and the next piece.
A writer that keeps more raises a clear error after ``stall_s`` instead of hanging.

What it is not: the checkpointer that decides when a save runs (:mod:`.checkpointer`).
"""

from __future__ import annotations

import math
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from ..base.alignment import DIRECT_IO_ALIGN, TENSOR_ALIGN
from ..base.errors import CheckpointError
from ..base.priority import lower_this_thread
from ..format.data_file import ALIGNED_PAYLOAD_MIN
from ..planning.streamed_snapshot import Region, SnapshotStream, StreamedTensor
from . import buffers
from .buffers import StagingRing
from .response import AsyncStagingError

__all__ = ["BudgetStream", "forget_locals", "MIN_HOST_BYTES", "MIN_RING_BYTES", "piece_bytes_for", "slabs"]

MIN_RING_BYTES = 13 << 20  # per data file written at once (piece_bytes_for)
MIN_HOST_BYTES = 16 << 20  # the least max_host_bytes per data file: the ring's least, and room for small numpy arrays
MAX_PIECE_BYTES = 16 << 20  # larger pieces overlap copying and writing less, and gain nothing
STALL_S = 120.0  # no piece written back for this long while the ring is full: an error


def piece_bytes_for(limit: int, files: int) -> int:
    """The largest piece a ring of ``limit`` bytes takes when ``files`` are written at once.

    Each file's writer may keep up to 8 MiB of parts plus two pieces (one it is still reading,
    one partly gathered) until it is given more; a ring frees memory oldest first, so its free
    bytes may lie in two runs (after the head, before the tail) and one piece's room can be
    lost at the end: with pieces of 1/16 of the ring per file, 13 MiB per file always leaves
    a run for the next piece (8 MiB + 2/16 + 3/16 of it < 13 MiB)."""
    return max(TENSOR_ALIGN, min(MAX_PIECE_BYTES, limit // (16 * max(1, files))))


def slabs(t: torch.Tensor, limit: int) -> Iterator[torch.Tensor]:
    """``t`` as views of at most ``limit`` bytes whose row-major bytes, in order, are ``t``'s:
    runs of whole rows (a multiple of 4 KiB where rows allow), else parts of a row."""
    size = t.element_size()
    if t.dim() == 0 or t.numel() * size <= limit:
        yield t
        return
    if t.is_contiguous():
        step = max(1, limit // size)
        if step * size >= DIRECT_IO_ALIGN:
            step -= step % (DIRECT_IO_ALIGN // math.gcd(size, DIRECT_IO_ALIGN))
        flat = t.reshape(-1)
        for i in range(0, flat.numel(), step):
            yield flat[i:i + step]
        return
    row = t[0].numel() * size
    if row > limit:
        for r in range(t.shape[0]):
            yield from slabs(t[r], limit)
        return
    rows = limit // row
    whole = DIRECT_IO_ALIGN // math.gcd(row, DIRECT_IO_ALIGN)  # rows that make a multiple of 4 KiB
    if rows >= whole:
        rows -= rows % whole
    for r0 in range(0, t.shape[0], rows):
        yield t[r0:r0 + rows]


def _region_key(tensor: StreamedTensor, index: tuple[slice, ...]) -> tuple:
    return id(tensor), tuple((s.start, s.stop) for s in index)


class _Region:
    """One expected region: the pieces copied for it and not yet read, and whether all are."""

    def __init__(self, tensor: StreamedTensor, index: tuple[slice, ...]):
        self.tensor, self.index = tensor, index
        self.pieces: deque[np.ndarray] = deque()
        self.copied = False

    @property
    def nbytes(self) -> int:
        view = self.tensor.logical[self.index]
        return view.numel() * view.element_size()


class BudgetStream(SnapshotStream):
    """One save's streamed snapshot: live tensors, copied through ``ring`` as they are written.

    ``on_staged()`` runs once, when every announced region is copied (or the copying failed,
    or the stream is closed): from then on the live tensors are not read again.
    """

    def __init__(self, ring: StagingRing, limit: int, on_staged: Callable[[], None], nice: int = 0,
                 events: dict[torch.device, Any] | None = None, stall_s: float = STALL_S):
        self.ring = ring
        self.limit = limit  # bytes of the ring this save may hold at once
        self.stall_s = stall_s
        self._on_staged = on_staged
        self._staged_once = threading.Lock()
        self._nice = nice
        self._events = events or {}  # CUDA: training-stream marks the copies wait for
        self._tensors: dict[int, StreamedTensor] = {}
        self._regions: dict[tuple, deque[_Region]] = {}  # not yet read, by (tensor, index)
        self._all: list[_Region] = []
        self._cond = threading.Condition()
        self._expected = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.piece_bytes = piece_bytes_for(limit, 1)

    # ------------------------------------------------------------------ building the snapshot

    def add(self, source: torch.Tensor) -> torch.Tensor:
        """Stream ``source`` (a live tensor); return the meta tensor that stands for it."""
        logical = torch.empty(source.shape, dtype=source.dtype, device="meta")
        self._tensors[id(logical)] = StreamedTensor(self, logical, source)
        return logical

    def begin(self) -> None:
        """The save starts (on the writer thread): the ring is this save's from now on."""
        self.ring.start(self.limit)

    # ------------------------------------------------------------------ SnapshotStream

    def tensor_for(self, logical: torch.Tensor) -> StreamedTensor | None:
        tensor = self._tensors.get(id(logical))
        return tensor if tensor is not None and tensor.logical is logical else None

    def expect(self, files: Sequence[Sequence[Region]]) -> None:
        with self._cond:
            if self._expected:
                raise CheckpointError("a streamed snapshot is written once; its regions were announced already")
            self._expected = True
            if self._closed:
                return
            order_by_file = []
            for regions in files:
                mine = [_Region(t, index) for t, index in regions]
                for r in mine:
                    self._regions.setdefault(_region_key(r.tensor, r.index), deque()).append(r)
                order_by_file.append(mine)
                self._all.extend(mine)
        self.piece_bytes = piece_bytes_for(self.limit, len(files))
        order = _interleaved(order_by_file)
        if not order:
            self._staged()
            return
        self._thread = threading.Thread(target=self._copy_all, args=(order,), name="hp-dcp-async_stream",
                                        daemon=True)
        self._thread.start()

    def region(self, tensor: StreamedTensor, index: tuple[slice, ...]) -> Iterator[np.ndarray]:
        with self._cond:
            queue = self._regions.get(_region_key(tensor, index))
            region = queue.popleft() if queue else None
            expected = self._expected
        if region is None:
            if expected:  # the live tensor may have changed since the snapshot was declared complete
                raise CheckpointError(f"a streamed snapshot was asked for a region it was not told of "
                                      f"({[(s.start, s.stop) for s in index]} of a {tuple(tensor.logical.shape)} "
                                      "tensor); the saver must announce every region it writes")
            yield from self._copy_now(tensor, index)  # never announced: copied as it is read
            return
        while True:
            with self._cond:
                while not region.pieces and not region.copied and self.error is None and not self._closed:
                    self._cond.wait()
                if self.error is not None:
                    raise AsyncStagingError(f"copying the snapshot into the staging memory failed: "
                                            f"{type(self.error).__name__}: {self.error}") from self.error
                if self._closed:
                    raise CheckpointError("the streamed snapshot was closed while the save still read it")
                if not region.pieces:
                    return
                piece = region.pieces.popleft()
            yield piece
            piece = None  # noqa: F841 (the ring reuses its memory once nobody refers to it)

    # ------------------------------------------------------------------ the copies

    def _copy_all(self, order: list[_Region]) -> None:
        lower_this_thread(self._nice)
        try:
            streams = self._side_streams()
            for region in order:
                for piece in self._pieces(region.tensor, region.index, streams):
                    with self._cond:
                        if self._closed:
                            return
                        region.pieces.append(piece)
                        self._cond.notify_all()
                    piece = None
                with self._cond:
                    region.copied = True
                    self._cond.notify_all()
        except BaseException as exc:  # handed to the reader of the region, which fails the save
            with self._cond:
                self.error = exc
                self._cond.notify_all()
        finally:
            for tensor in self._tensors.values():  # never read again: the caller may free them
                tensor.source = None
            self._staged()

    def _copy_now(self, tensor: StreamedTensor, index: tuple[slice, ...]) -> Iterator[np.ndarray]:
        for piece in self._pieces(tensor, index, self._side_streams()):
            yield piece
            piece = None  # noqa: F841

    def _pieces(self, tensor: StreamedTensor, index: tuple[slice, ...], streams: dict) -> Iterator[np.ndarray]:
        """Copy ``tensor.source[index]`` piece by piece into the ring; yield each piece."""
        source = tensor.source
        if source is None:
            raise CheckpointError("the streamed snapshot is closed; its tensors are not read any more")
        view = source[index] if index else source
        for slab in slabs(view.detach(), self.piece_bytes):
            n = slab.numel() * slab.element_size()
            if not n:
                continue
            target, piece = self.ring.take(n, DIRECT_IO_ALIGN if n >= ALIGNED_PAYLOAD_MIN else TENSOR_ALIGN,
                                           self.stall_s)
            try:
                target = target.view(slab.dtype).view(slab.shape)
                stream = streams.get(slab.device)
                if stream is None:
                    buffers.copy_into([(target, slab)])
                else:
                    with torch.cuda.stream(stream):
                        buffers.copy_into([(target, slab)])  # synchronises the side stream
            except BaseException:
                del piece  # back to the ring
                raise
            target = None
            yield piece
            piece = None

    def _side_streams(self) -> dict[Any, Any]:
        """CUDA: a side stream per device that starts after the training stream's mark."""
        streams = {}
        for device, event in self._events.items():
            stream = torch.cuda.Stream(device)
            stream.wait_event(event)
            streams[device] = stream
        return streams

    # ------------------------------------------------------------------ end

    def _staged(self) -> None:
        if self._staged_once.acquire(blocking=False):
            self._on_staged()

    def close(self, timeout: float = 30.0) -> None:
        """The save is over (committed or failed): stop copying, give back every piece not
        read, forget the live tensors, and declare the snapshot done if it was not."""
        with self._cond:
            self._closed = True
            self._regions.clear()
            for region in self._all:  # pieces copied ahead for a save that failed go back to the ring
                region.pieces.clear()
            self._cond.notify_all()
        self.ring.stop(CheckpointError("the save ended before the snapshot was copied"))
        if self._thread is not None:
            self._thread.join(timeout)
        for tensor in self._tensors.values():
            tensor.source = None
        self._staged()


def forget_locals(error: BaseException | None) -> None:
    """Clear the local variables of the finished frames in ``error``'s tracebacks (and its
    causes'): a failed save's error, kept by its response, must not keep staged pieces (parts
    the writer was holding when it failed) from going back to the ring."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


def _interleaved(files: list[list[_Region]]) -> list[_Region]:
    """One copy order for regions read by parallel file writers: each file's regions in its
    order, the files taking turns by bytes (no writer waits long behind another's)."""
    if len(files) == 1:
        return list(files[0])
    cursors, sent, out = [0] * len(files), [0] * len(files), []
    while True:
        open_files = [f for f in range(len(files)) if cursors[f] < len(files[f])]
        if not open_files:
            return out
        f = min(open_files, key=lambda i: sent[i])
        region = files[f][cursors[f]]
        out.append(region)
        sent[f] += region.nbytes
        cursors[f] += 1

