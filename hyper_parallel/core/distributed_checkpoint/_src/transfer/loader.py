"""Executes a rank's load plan: reads overlapping byte ranges straight into target memory.

First the plan's chunk references are resolved into byte ranges and checksums: each data
file involved has its index read once per reader (checked against the crc32c that
``.metadata`` records for it), in parallel across files. Then, for each (saved chunk,
target) overlap the loader reads only the checksum blocks (whole rows of the chunk's dim
0, or of a column band when the chunk was saved in bands) that hold needed rows, verifies
every block it reads, and:

- when a large chunk lies whole inside the target and lands contiguously in a CPU tensor,
  reads it directly into the destination, in slices verified as they land;
- otherwise reads ranges through reused scratch memory in *runs*: nearby ranges of one
  file (small chunks, the bands of a box, parts of chunks) in one read call, read ahead by
  a thread of the file, then each range verified and copied out with one copy.

Each file is read front to back by one thread; files are read in parallel. Memory beyond
the destination tensors stays within ``buffer_bytes`` per file being read (or one block per
run, if a single row is larger).
"""

from __future__ import annotations

import math
import threading
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import crc32c
import numpy as np
import torch

from ..backends import direct_io
from ..backends.protocol import StorageReader, check_range
from ..base import timeline
from ..base.alignment import TENSOR_ALIGN
from ..base.box import Box
from ..base.dtypes import torch_dtype
from ..base.errors import CorruptCheckpointError
from ..format import metadata as md
from ..format.chunks import ChunkRef, overlapping
from ..format.data_file import FileIndex, UncheckedIndex, check_index, tensor_bytes
from ..planning.planner import LoadPlan, ReadItem
from .host_copy import copy_into
from .read_threads import Lane, fetch_pool, file_pool, in_file_thread
from .streams import StreamFence

DEFAULT_BUFFER_BYTES = 96 << 20  # scratch memory per file being read (runs in flight included)
READ_SLICE = 32 << 20  # bytes per read call; what a scratch run holds at most (the pool's largest buffer)
FUSED_BYTES = 1 << 20  # checked, then copied out, at a time (fits a core's L2 cache: see _apply)
DIRECT_READ_MIN = 1 << 20  # whole chunks at least this large are read straight into their destination
GAP_BYTES = 64 << 10  # ranges of one file closer than this are read in one call, the gap dropped
RUN_MIN, RUNS_MIN = 2 << 20, 8  # a file is read in at least 8 runs, each of at least 2 MiB when it can be
PREFETCH = 2  # scratch runs of a file read ahead through the page cache, by one thread (0: none)
PREFETCH_DIRECT = (2, 2)  # with O_DIRECT (no kernel read-ahead): bytes of runs ahead (in largest runs), threads
# With O_DIRECT, runs this small on average (the column bands of a Shard(1) load, hundreds of
# small tensors) are bound by each request's latency, not by bandwidth: more threads keep more
# of them in flight, in the same bytes ahead. A 436-tensor Shard(0)->Shard(1) load of 0.5 GiB
# per rank: 0.72-1.04 s with 2 threads, 0.42-0.49 s with 4.
SMALL_RUN, SMALL_RUN_THREADS = 4 << 20, 4
DENSE = 0.9  # with O_DIRECT, runs needing less than this fraction of their bytes go through the page cache
# Files from which a load needs little data (one tensor of a checkpoint split over thousands
# of ranks; the scattered 0-d optimizer steps of a model) are bound by per-read latency and
# Python work: every range of them is hinted to the storage first (the kernel fetches them
# in parallel), then they are read through the page cache in one thread (more threads only
# contend for the GIL: measured 2x slower with many files).
MANY_FILES, SMALL_FILE_BYTES = 16, 256 << 10
# The hints run this many files ahead of the reads, not all at once. One tensor of a checkpoint
# of 65,536 ranks (a file each), cold: every file hinted first 100 s, no hints 43 s, 256 / 1,024
# / 4,096 files ahead 13.5 / 13.9 / 16.3 s (an open and one small read per file alone: 5.7 s).
# At 4,096 files hints make it 3x faster than none (0.8 s against 2.6 s), window or not.
HINT_WINDOW = 512


@dataclass
class ReadStats:
    bytes_read: int = 0
    bytes_needed: int = 0


def _check_blocks(item: ReadItem, data: memoryview, first_block: int, row_bytes: int, where: str) -> None:
    chunk = item.chunk
    step = chunk.block_rows * row_bytes
    t0 = timeline.start()
    for i, off in enumerate(range(0, data.nbytes, step)):
        b = first_block + i
        got = crc32c.crc32c(data[off:off + step])
        if got != chunk.crc32c[b]:
            lo = chunk.start + b * step
            raise CorruptCheckpointError(
                f"{item.key!r}: checksum mismatch in {where}, bytes {lo}..{lo + min(step, data.nbytes - off)} "
                f"(chunk {Box(chunk.offsets, chunk.sizes)}, block {b}): expected crc32c "
                f"{chunk.crc32c[b]:#010x}, found {got:#010x}. The file is corrupt"
            )
    timeline.record("checksum", t0, data.nbytes)


def _scratch(nbytes: int) -> memoryview:
    """Aligned scratch memory, reused across reads and loads (fresh memory costs a page
    fault per 4 KiB); it returns to the pool when the last view of it is dropped."""
    return direct_io.POOL.get(nbytes)


@dataclass
class _Segment:
    """Rows ``row_lo:row_hi`` of a saved chunk (whole checksum blocks from ``block``), which
    lie at file bytes ``lo:hi``, and where the needed part of them goes."""

    item: ReadItem
    dest: torch.Tensor  # the item's region inside its target
    inner: Box  # the region, relative to the chunk
    block: int
    row_lo: int
    row_hi: int
    lo: int
    hi: int
    need: int  # bytes of the segment the region needs


def _segments(item: ReadItem, dest_view: torch.Tensor, cap: int, verify: bool) -> list[_Segment]:
    """An item's byte ranges: the checksum blocks holding its rows, in groups of <= ``cap``
    bytes (at least one block each). Without verification, only the needed rows."""
    chunk = item.chunk
    rows = chunk.rows
    row_bytes = chunk.length // rows
    inner = Box(tuple(o - c for o, c in zip(item.region.offsets, chunk.offsets, strict=True)), item.region.sizes)
    if not chunk.sizes:  # 0-d: one block
        return [_Segment(item, dest_view, inner, 0, 0, 1, chunk.start, chunk.start + chunk.length, chunk.length)]
    r0, r1 = inner.offsets[0], inner.offsets[0] + inner.sizes[0]
    need_row = row_bytes * math.prod(inner.sizes[1:]) // max(1, math.prod(chunk.sizes[1:]))
    br = chunk.block_rows
    if not verify:
        step = max(1, cap // row_bytes)
        return [_Segment(item, dest_view, inner, 0, a, min(r1, a + step), chunk.start + a * row_bytes,
                         chunk.start + min(r1, a + step) * row_bytes, (min(r1, a + step) - a) * need_row)
                for a in range(r0, r1, step)]
    b0, b1 = r0 // br, -(-r1 // br)
    per = max(1, cap // (br * row_bytes))
    out = []
    for g0 in range(b0, b1, per):
        g1 = min(b1, g0 + per)
        lo_row, hi_row = g0 * br, min(rows, g1 * br)
        need = (min(hi_row, r1) - max(lo_row, r0)) * need_row
        out.append(_Segment(item, dest_view, inner, g0, lo_row, hi_row, chunk.start + lo_row * row_bytes,
                            chunk.start + hi_row * row_bytes, need))
    return out


def _apply(seg: _Segment, data: memoryview, verify: bool) -> None:
    """Verify a segment's blocks (``data`` holds its bytes) and copy the needed part out.

    Verified and copied in one pass: a piece of whole checksum blocks of about ``FUSED_BYTES``
    is checked and then at once copied out while the checksum has left it in the cache, so
    the copy does not read the segment from memory a second time (a 256 MiB column-band
    load: 0.34 CPU s/GiB checking the whole segment first, 0.22-0.28 fused). No byte is
    copied before the block holding it has passed its check.
    """
    item, chunk = seg.item, seg.item.chunk
    row_bytes = chunk.length // chunk.rows
    typed = _typed(data, seg.dest.dtype)
    if not chunk.sizes:
        if verify:
            _check_blocks(item, data, seg.block, row_bytes, chunk.file)
        t0 = timeline.start()
        seg.dest.copy_(typed.reshape(()))
        timeline.record("copy", t0, seg.dest.element_size())
        return
    block = typed.view((seg.row_hi - seg.row_lo, *chunk.sizes[1:]))
    inner = seg.inner
    lo, hi = max(seg.row_lo, inner.offsets[0]), min(seg.row_hi, inner.offsets[0] + inner.sizes[0])
    cols = tuple(slice(o, o + n) for o, n in zip(inner.offsets[1:], inner.sizes[1:], strict=True))
    rows = seg.row_hi - seg.row_lo
    step = chunk.block_rows * max(1, FUSED_BYTES // max(1, _block_bytes(chunk))) if verify else rows
    for r0 in range(seg.row_lo, seg.row_hi, step):
        r1 = min(seg.row_hi, r0 + step)
        if verify:
            _check_blocks(item, data[(r0 - seg.row_lo) * row_bytes:(r1 - seg.row_lo) * row_bytes],
                          seg.block + (r0 - seg.row_lo) // chunk.block_rows, row_bytes, chunk.file)
        a, b = max(r0, lo), min(r1, hi)
        if a < b:
            dest = seg.dest[a - inner.offsets[0]:b - inner.offsets[0]]
            t0 = timeline.start()
            copy_into(dest, block[(slice(a - seg.row_lo, b - seg.row_lo), *cols)])
            timeline.record("copy", t0, dest.numel() * dest.element_size())


def _typed(data: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """Bytes read from a file as a flat tensor of ``dtype``. Densely packed payloads are
    aligned in the file only to 8 bytes: a complex128 one may sit 8 bytes off the 16 its
    element needs, and torch's copy of misaligned complex128 crashes, so such bytes are
    copied into fresh (aligned) memory first."""
    raw = torch.frombuffer(data, dtype=torch.uint8) if data.nbytes else torch.empty(0, dtype=torch.uint8)
    if raw.data_ptr() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


def _run_range(segs: list[_Segment], file_size: int, align: int) -> tuple[int, int]:
    """The bytes a run reads. With O_DIRECT (``align``), whole aligned blocks (format v2 pads
    large payloads to them), unless the run needs under ``DENSE`` of what it reads: those
    bytes (whole rows of which a rank wants some columns) are likely wanted by other ranks
    too, and the page cache lets the device read them once."""
    lo, hi = segs[0].lo, segs[-1].hi
    if align and sum(s.need for s in segs) >= DENSE * (hi - lo):
        lo, hi = lo - lo % align, min(file_size, -(-hi // align) * align)
    return lo, hi


def _fetch(reader: StorageReader, file: str, lo: int, hi: int) -> memoryview:
    """Bytes ``lo:hi`` of a file in scratch memory that sits at the file offset's position
    modulo TENSOR_ALIGN, so payloads land aligned to their dtype."""
    shift = lo % TENSOR_ALIGN
    buf = _scratch(shift + hi - lo)[shift:]
    reader.read_into(file, lo, buf)
    return buf


def _read_whole(item: ReadItem, dest_view: torch.Tensor, reader: StorageReader, verify: bool) -> int:
    """A whole chunk straight into contiguous destination memory, in slices of whole checksum
    blocks, each verified as soon as it lands (while the kernel reads ahead; with O_DIRECT,
    ``_plan_file`` sends here only chunks whose slices are aligned)."""
    chunk = item.chunk
    data = tensor_bytes(dest_view)
    step = _block_bytes(chunk)
    row_bytes = chunk.length // chunk.rows
    piece = max(1, READ_SLICE // step) * step
    for off in range(0, chunk.length, piece):
        part = data[off:off + piece]
        reader.read_into(chunk.file, chunk.start + off, part)
        if verify:
            _check_blocks(item, part, off // step, row_bytes, chunk.file)
    return chunk.length


def _block_bytes(chunk: md.ChunkRecord) -> int:
    return chunk.block_rows * (chunk.length // chunk.rows)


def _plan_file(items: list[_Targeted], dests: list[torch.Tensor], cap: int, verify: bool, align: int) -> list[tuple]:
    """The reads of one file, in file order: ``("whole", item, dest)`` (straight into the
    destination), ``("exact", item, inner, dest)`` (unverified partial rows), or
    ``("run", segments)`` (nearby ranges read in one call through scratch memory)."""
    ops: list[tuple] = []
    run: list[_Segment] = []
    for item, dest in zip(items, dests, strict=True):
        chunk = item.chunk
        cbox = Box(chunk.offsets, chunk.sizes)
        dest_view = dest[item.region.relative_to(item.target)] if dest.dim() else dest
        if (item.region == cbox and chunk.length >= DIRECT_READ_MIN and dest_view.device.type == "cpu"
                and dest_view.is_contiguous()
                and (not align or (chunk.start % align == 0 and _block_bytes(chunk) % align == 0
                                   and dest_view.data_ptr() % align == 0))):
            if run:
                ops.append(("run", run))
                run = []
            ops.append(("whole", item, dest_view))
            continue
        if not verify and cbox.ndim and item.region.sizes[1:] != cbox.sizes[1:]:
            if run:
                ops.append(("run", run))
                run = []
            inner = Box(tuple(o - c for o, c in zip(item.region.offsets, chunk.offsets, strict=True)),
                        item.region.sizes)
            ops.append(("exact", item, inner, dest_view))
            continue
        for seg in _segments(item, dest_view, cap, verify):
            if run and (seg.lo < run[-1].hi or seg.lo - run[-1].hi > GAP_BYTES or seg.hi - run[0].lo > cap):
                ops.append(("run", run))
                run = []
            run.append(seg)
    if run:
        ops.append(("run", run))
    return ops


def _read_file(items: list[_Targeted], dests: list[torch.Tensor], reader: StorageReader, file_size: int,
               buffer_bytes: int, verify: bool, buffered: bool = False) -> int:
    """Read one file's items (sorted by offset) front to back.

    Large whole chunks that land contiguously in CPU memory are read straight into it;
    everything else (small chunks, column bands, parts of chunks) is read through scratch
    memory in runs: nearby byte ranges of consecutive items in one call, then each range
    verified and copied to its destination (one copy per range). A state dict of hundreds
    of small tensors thus costs a few reads, not one per tensor. Runs are read ahead by
    threads of the file, so the device works while ranges are verified and copied; with
    O_DIRECT (the reader's ``read_alignment``) that is the only read-ahead, so it keeps
    several requests in flight (``PREFETCH_DIRECT``).
    """
    # a foreign file's chunks (an UncheckedIndex: Hugging Face files) carry no checksums
    verify = verify and any(i.chunk.crc32c for i in items)
    align = 0 if buffered else getattr(reader, "read_alignment", 0) or 0  # buffered: prefetched small files
    depth, threads = PREFETCH_DIRECT if align else (PREFETCH, 1)
    cap = max(1, min(READ_SLICE, buffer_bytes // (depth + 1)))  # runs in flight + the one being copied
    # At least RUNS_MIN runs when the file is small, so copying one overlaps reading the next.
    total = sum(i.chunk.length for i in items)
    cap = min(cap, max(RUN_MIN, -(-total // RUNS_MIN)))
    ops = _plan_file(items, dests, cap, verify, align)
    file = items[0].chunk.file
    runs = [op for op in ops if op[0] == "run"]
    if align and runs and sum(s[-1].hi - s[0].lo for _, s in runs) < SMALL_RUN * len(runs):
        threads = SMALL_RUN_THREADS
    ahead: deque = deque()  # (future, bytes)
    pool = Lane(fetch_pool, threads) if len(runs) > 1 and depth else None
    next_run = 0

    def fill() -> None:
        # Keep ``depth`` runs' worth of bytes in flight: more runs when they are small (the
        # bands a column reader wants, separated by the ones it skips).
        nonlocal next_run
        budget = depth * cap
        while pool is not None and next_run < len(runs):
            lo, hi = _run_range(runs[next_run][1], file_size, align)
            if ahead and (sum(n for _, n in ahead) + hi - lo > budget or len(ahead) >= 4 * depth):
                break
            ahead.append((pool.submit(_fetch, reader, file, lo, hi), hi - lo))
            next_run += 1

    read = 0
    try:
        for op in ops:
            if op[0] == "whole":
                read += _read_whole(op[1], op[2], reader, verify)
            elif op[0] == "exact":
                read += _read_exact(op[1], op[2], op[3], reader, buffer_bytes)
            else:
                segs = op[1]
                lo, hi = _run_range(segs, file_size, align)
                if pool is not None:
                    fill()
                    t0 = timeline.start()
                    buf = ahead.popleft()[0].result()
                    timeline.record("wait", t0, hi - lo, file)
                    fill()
                else:
                    buf = _fetch(reader, file, lo, hi)
                for seg in segs:
                    _apply(seg, buf[seg.lo - lo:seg.hi - lo], verify)
                buf = None
                read += hi - lo
    finally:
        if pool is not None:
            pool.close()  # reads not started are dropped; running ones finish before we return
    return read


def _read_exact(item: ReadItem, inner: Box, dest_view: torch.Tensor, reader: StorageReader,
                buffer_bytes: int) -> int:
    """Read only the region's bytes (no checksum): one read per contiguous run.

    Runs separated by small gaps (under a tenth of a run) are read as one, gap included.
    """
    chunk = item.chunk
    n = len(chunk.sizes)
    itemsize = chunk.length // math.prod(chunk.sizes)
    strides = [itemsize] * n
    for i in range(n - 2, -1, -1):
        strides[i] = strides[i + 1] * chunk.sizes[i + 1]
    d = n - 1  # innermost dim the region does not fully cover; runs are contiguous inside it
    while d > 0 and inner.sizes[d] == chunk.sizes[d]:
        d -= 1
    run = inner.sizes[d] * strides[d]
    if d > 0 and strides[d - 1] - run <= run // 10:
        d -= 1  # gaps are small: read whole slabs of dim d-1 and slice (< 10% extra)
        span = strides[d] * inner.sizes[d]
    else:
        span = run
    outer = inner.sizes[:d]
    base = chunk.start + sum(o * st for o, st in zip(inner.offsets[: d + 1], strides[: d + 1], strict=True))
    grid = np.indices(outer).reshape(d, -1).T if d else np.zeros((1, 0), dtype=np.int64)
    offsets = base + grid @ np.array(strides[:d], dtype=np.int64)
    runs_per_slab = math.prod(outer[1:]) if d else 1
    slab = span * runs_per_slab
    slabs_per_group = max(1, min(buffer_bytes, READ_SLICE) // max(slab, 1))
    full_rows = span != run  # we read whole slabs of dim d and must slice them
    read_shape = list(inner.sizes)
    if full_rows:
        read_shape[d + 1:] = chunk.sizes[d + 1:]
    read = 0
    total_slabs = inner.sizes[0] if d else 1
    for s0 in range(0, total_slabs, slabs_per_group):
        s1 = min(total_slabs, s0 + slabs_per_group)
        data = _scratch((s1 - s0) * slab)
        for k, off in enumerate(offsets[s0 * runs_per_slab: s1 * runs_per_slab]):
            reader.read_into(chunk.file, int(off), data[k * span:(k + 1) * span])
        read += data.nbytes
        shape = [s1 - s0, *read_shape[1:]] if d else read_shape
        block = _typed(data, dest_view.dtype).reshape(shape)
        if full_rows:
            block = block[(slice(None),) * (d + 1) + tuple(
                slice(o, o + m) for o, m in zip(inner.offsets[d + 1:], inner.sizes[d + 1:], strict=True))]
        t0 = timeline.start()
        copy_into(dest_view[s0:s1], block) if d else copy_into(dest_view, block)
        timeline.record("copy", t0, block.numel() * block.element_size())
    return read


class _Targeted:
    """A resolved read item with the box of its target (what ``_read_file`` works on)."""

    __slots__ = ("key", "chunk", "region", "target")

    def __init__(self, item: ReadItem, target: Box):
        self.key, self.chunk, self.region, self.target = item.key, item.chunk, item.region, target


class TargetResolver(Protocol):
    """What the loader needs of a planner: the destination tensor of a key."""

    def resolve_target(self, key: str) -> torch.Tensor: ...


class _Lazy:
    """One destination, allocated when the first read needs it: after ``read_plan`` has checked
    every chunk against its file, so a forged shape cannot allocate more than the files hold."""

    def __init__(self, sizes: tuple[int, ...], dtype: torch.dtype, dest: torch.Tensor | None = None):
        self.sizes, self.dtype, self.dest = sizes, dtype, dest
        self._lock = threading.Lock()

    def resolve_target(self, key: str) -> torch.Tensor:
        with self._lock:
            if self.dest is None:
                self.dest = torch.empty(self.sizes, dtype=self.dtype)
            return self.dest


class IndexCache:
    """The data-file indexes one reader has read: each read and checked once.

    Cached by the whole file record (name, index position and checksum, size), so a file
    rewritten under the same name between two loads is never looked up in its old index.
    At most ``max_bytes`` of indexes are kept, the oldest dropped first: one tensor of a
    checkpoint of 65,536 ranks reads 65,536 indexes of 28 KiB (1.8 GB), each needed only
    while its file's chunks are found (:func:`_resolve_items` resolves a file's chunks right
    after reading its index).
    """

    def __init__(self, reader: StorageReader, max_bytes: int = 256 << 20):
        self.reader, self.max_bytes = reader, max_bytes
        self._indexes: dict[md.FileRecord, FileIndex | UncheckedIndex] = {}
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, f: md.FileRecord, sizes: dict[str, int] | None = None) -> FileIndex | UncheckedIndex:
        """The index of ``f``; a file whose index is read now has its real size put in ``sizes``."""
        found = self._indexes.get(f)
        if found is not None:
            return found
        t0 = timeline.start()
        index = self.reader.file_index(f)  # a reader of foreign files supplies its own
        if index is None:
            size = check_range(self.reader, f.path, f.index_offset, f.index_length, "its index")
            if sizes is not None:
                sizes[f.path] = size
            raw = bytearray(f.index_length)
            self.reader.read_into(f.path, f.index_offset, memoryview(raw))
            check_index(raw, f.index_crc, f.path)
            index = FileIndex(raw, f.path, f.index_offset)
        timeline.record("index", t0, f.index_length, f.path)
        with self._lock:
            if f not in self._indexes:
                self._indexes[f] = index
                self._bytes += f.index_length
            while self._bytes > self.max_bytes and len(self._indexes) > 1:
                old = next(iter(self._indexes))
                del self._indexes[old]
                self._bytes -= old.index_length
        return index


_CACHES: weakref.WeakKeyDictionary[StorageReader, IndexCache] = weakref.WeakKeyDictionary()


def index_cache(reader: StorageReader) -> IndexCache:
    cache = _CACHES.get(reader)
    if cache is None:
        cache = _CACHES[reader] = IndexCache(reader)
    return cache


def resolve(ref: ChunkRef, cache: IndexCache) -> md.ChunkRecord:
    """The byte range and checksums of a chunk, from the first candidate file that holds it."""
    if ref.record is not None:
        return ref.record
    errors = []
    for f, sub in ref.candidates():
        try:
            found = cache.get(f).find(ref.key, sub, ref.box.sizes, ref.nbytes)
        except CorruptCheckpointError as exc:
            errors.append(str(exc))
            continue
        if found is not None:
            return md.ChunkRecord(ref.box.offsets, ref.box.sizes, f.path, found.start, ref.nbytes,
                                  found.block_rows, found.crc32c)
    names = [f.path for f in ref.files]
    why = f" ({'; '.join(errors)})" if errors else ""
    raise CorruptCheckpointError(
        f"{ref.key!r}: chunk {ref.box} (id {ref.sub}) is in none of the data files that should hold it "
        f"{names or '(no file of its writer is listed)'}{why}; the checkpoint is incomplete or damaged")


@dataclass
class _Resolved:
    """What resolving a plan's chunks learned: the items with byte ranges, the real size of
    each file whose index was read (checked then, not asked again), and the range of each
    file hinted to the storage before its index was read (data inside it needs no hint)."""

    items: list[ReadItem]
    sizes: dict[str, int]
    hinted: dict[str, tuple[int, int]]

    def unhinted(self, ranges: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
        """Those of ``ranges`` (file, start, length) outside what was hinted of their file."""
        out = []
        for r in ranges:
            lo, hi = self.hinted.get(r[0], (0, 0))
            if not lo <= r[1] or r[1] + r[2] > hi:
                out.append(r)
        return out


def _resolve_items(items: list[ReadItem], reader: StorageReader, thread_count: int) -> _Resolved:
    """``items`` with every chunk reference resolved to its byte range and checksums: a file's
    index is read (once per reader), then at once the chunks first looked for in that file."""
    out = list(items)
    done = _Resolved(out, {}, {})
    by_file: dict[str, list[int]] = {}
    files: dict[str, md.FileRecord] = {}
    for n, i in enumerate(items):
        if not isinstance(i.chunk, md.ChunkRecord):
            first = i.chunk.files[:1]
            path = first[0].path if first else ""
            by_file.setdefault(path, []).append(n)
            if first:
                files.setdefault(path, first[0])
    if not by_file:
        return done
    cache = index_cache(reader)

    def resolve_file(path: str) -> None:
        if path in files:
            _try(cache, files[path], done.sizes)
        for n in by_file[path]:
            out[n] = ReadItem(items[n].key, resolve(items[n].chunk, cache), items[n].region)

    paths = list(by_file)
    ahead = {p: _index_hint(files[p]) for p in paths if p in files} if len(files) >= MANY_FILES else {}
    hints = _HintsAhead(reader, [[ahead[p]] if p in ahead else [] for p in paths]) if ahead else None
    if hints is not None and hints.ok:
        done.hinted = {p: (lo, lo + n) for p, (_, lo, n) in ahead.items()}  # each hinted as its index is reached
        for k, path in enumerate(paths):  # hinted: read in order while the storage works in parallel
            hints.reading(k)
            resolve_file(path)
    elif len(files) > 1 and thread_count > 1:  # read the indexes of different files in parallel
        lane = Lane(fetch_pool, min(thread_count, len(files)))
        try:
            for fut in [lane.submit(resolve_file, path) for path in paths]:
                fut.result()
        finally:
            lane.close()
    else:
        for path in paths:
            resolve_file(path)
    return done


def _index_hint(f: md.FileRecord) -> tuple[str, int, int]:
    """The range to hint before reading a file's index: the index and as many bytes before it,
    where the last payloads lie (a file of a many-rank checkpoint holds a few small chunks
    just before its index: they then come from the same read, and need no hint of their own)."""
    lo = max(0, f.index_offset - f.index_length)
    return f.path, lo, f.index_offset + f.index_length - lo


def _prefetch(reader: StorageReader, ranges: list[tuple[str, int, int]]) -> bool:
    hint = getattr(reader, "prefetch", None)  # readers written to the protocol may lack it
    return bool(hint(ranges)) if hint is not None else False


class _HintsAhead:
    """Hints the storage about groups of ranges (a file's each) :data:`HINT_WINDOW` groups ahead
    of the reads that use them, in the order they are read; ``ok`` is False when the reader
    takes no hints (nothing was hinted)."""

    def __init__(self, reader: StorageReader, groups: list[list[tuple[str, int, int]]]):
        self._reader, self._groups, self._hinted = reader, groups, 0
        self.ok = self._hint(HINT_WINDOW)

    def _hint(self, upto: int) -> bool:
        end = min(upto, len(self._groups))
        ranges = [r for g in self._groups[self._hinted:end] for r in g]
        self._hinted = end
        return _prefetch(self._reader, ranges) if ranges else True

    def reading(self, i: int) -> None:
        """The reads have reached group ``i``: keep at least half a window hinted beyond it."""
        if self._hinted < len(self._groups) and self._hinted - i < HINT_WINDOW // 2:
            self._hint(i + HINT_WINDOW)


def _try(cache: IndexCache, f: md.FileRecord, sizes: dict[str, int]) -> None:
    try:
        cache.get(f, sizes)
    except Exception:  # reported by resolve(), with the chunk that needed it
        pass


def read_plan(
    plan: LoadPlan,
    planner: TargetResolver,
    reader: StorageReader,
    thread_count: int = 4,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    verify: bool = True,
) -> ReadStats:
    """Fill every target of ``plan``; raises CorruptCheckpointError on any bad byte or file.

    With ``HP_DCP_LOAD_TIMELINE`` set, its work is recorded (:mod:`..base.timeline`)."""
    timeline.refresh()
    t_plan, since = timeline.start(), timeline.mark()
    try:
        return _read_plan(plan, planner, reader, thread_count, buffer_bytes, verify)
    finally:
        timeline.record("read_plan", t_plan)
        timeline.dump(since)


def _read_plan(plan: LoadPlan, planner: TargetResolver, reader: StorageReader, thread_count: int,
               buffer_bytes: int, verify: bool) -> ReadStats:
    stats = ReadStats()
    resolved = _resolve_items(plan.items, reader, thread_count)
    plan = LoadPlan(resolved.items, plan.targets)
    # Check every range against its file's size before reading (and before trusting sizes).
    sizes = resolved.sizes
    for item in plan.items:
        c = item.chunk
        if c.file not in sizes:
            sizes[c.file] = reader.file_size(c.file)
        if c.start + c.length > sizes[c.file]:
            raise CorruptCheckpointError(
                f"{item.key!r}: data file {c.file!r} is truncated: it has {sizes[c.file]} bytes, "
                f"the chunk needs bytes {c.start}..{c.start + c.length}"
            )
        stats.bytes_needed += item.region.numel * (c.length // max(1, Box(c.offsets, c.sizes).numel))

    fence = StreamFence()  # accelerator targets are filled from reader threads

    # Each file is read front to back by one thread (the kernel's readahead then streams it);
    # different files are read in parallel. Interleaving reads of one file from several
    # threads measured 20-30% slower on a cold cache.
    by_file: dict[str, list[ReadItem]] = {}
    for item in sorted(plan.items, key=lambda i: (i.chunk.file, i.chunk.start)):
        by_file.setdefault(item.chunk.file, []).append(item)
    streams = sorted(by_file.values(), key=lambda items: -sum(i.chunk.length for i in items))
    small = {items[0].chunk.file for items in streams if sum(i.chunk.length for i in items) <= SMALL_FILE_BYTES}
    small_streams = [items for items in streams if items[0].chunk.file in small]
    hints = _HintsAhead(reader, [resolved.unhinted([(i.chunk.file, i.chunk.start, i.chunk.length) for i in items])
                                 for items in small_streams])
    if small and not hints.ok:
        small, small_streams = set(), []  # no hints: read them from several threads as before

    def read_small() -> int:
        total = 0
        for k, items in enumerate(small_streams):
            hints.reading(k)
            total += run_file(items)
        return total

    def run_file(items: list[ReadItem]) -> int:
        dests = []
        for item in items:
            dest = planner.resolve_target(item.key).detach()
            fence.before_copy(dest)
            dests.append(dest)
        with torch.no_grad():
            return _read_file([_Targeted(i, plan.targets[i.key]) for i in items], dests, reader,
                              sizes[items[0].chunk.file], buffer_bytes, verify,
                              buffered=items[0].chunk.file in small)

    large = [items for items in streams if items[0].chunk.file not in small]
    # (a load started on one of the file threads reads its files itself: it may not wait on them)
    workers = 1 if in_file_thread() else max(1, min(thread_count, len(large)))
    # Scratch runs in flight are at most buffer_bytes per file being read: kept for reuse
    # while this load runs, so each read lands in memory already faulted in.
    with direct_io.POOL.held(workers * buffer_bytes):
        if workers > 1:
            lane = Lane(file_pool, workers)
            try:
                done = [lane.submit(run_file, items) for items in large]
                stats.bytes_read = read_small()
                stats.bytes_read += sum(f.result() for f in done)
            finally:
                lane.close()
        else:
            stats.bytes_read = sum(run_file(items) for items in large) + read_small()
    fence.after_copies()
    return stats



def read_box(
    entry: md.Entry,
    reader: StorageReader,
    box: Box | None = None,
    *,
    verify: bool = True,
    buffer_bytes: int = DEFAULT_BUFFER_BYTES,
    out: torch.Tensor | None = None,
    meta: md.Metadata | None = None,
) -> tuple[torch.Tensor, ReadStats]:
    """Read region ``box`` (default: all) of a saved tensor into a new CPU tensor (or ``out``).

    The offline tools' primitive: memory is the region itself plus one bounded read buffer.
    ``meta`` is the checkpoint's metadata (default: the one the entry belongs to).

    Raises CorruptCheckpointError when the saved chunks do not cover the region.
    """
    meta = meta if meta is not None else entry.metadata
    if meta is None:
        raise ValueError(f"read_box({entry.key!r}): pass meta= (the checkpoint's Metadata)")
    shape = tuple(entry.shape or ())
    box = box if box is not None else Box.full(shape)
    dest = _Lazy(box.sizes, torch_dtype(entry.dtype), out)
    reads, covered = [], 0
    for ref in overlapping(meta, entry, box):
        region = ref.box.intersect(box)
        reads.append(ReadItem(entry.key, ref, region))
        covered += region.numel
    if covered != box.numel:
        raise CorruptCheckpointError(
            f"{entry.key!r}: saved chunks cover {covered} of the {box.numel} elements of region {box}; "
            "the checkpoint is missing data for this key")
    stats = read_plan(LoadPlan(reads, {entry.key: box}), dest, reader, thread_count=1,
                      buffer_bytes=buffer_bytes, verify=verify)
    return dest.resolve_target(entry.key), stats  # allocated here when nothing was read (an empty box)


def check_files_hold(meta: md.Metadata, reader: StorageReader, where: str) -> None:
    """Refuse a checkpoint whose tensors need more bytes than all its data files hold.

    Every element of a tensor is stored at least once, in some data file, and payloads do
    not overlap: a larger total is a forged shape. Tools that plan from shapes before they
    read a byte (reshard's row slabs, export's chunks) call it first, so a forged shape fails
    here instead of planning (or allocating) what it says. One ``file_size`` per data file.

    Raises CorruptCheckpointError naming the largest tensor.
    """
    need = sum(e.nbytes for e in meta.entries.values())
    if not need:
        return
    held = sum(reader.file_size(f.path) for f in meta.files)
    if need > held:
        big = max(meta.entries.values(), key=lambda e: e.nbytes)
        raise CorruptCheckpointError(
            f"{where}: its tensors need {need} bytes, its {len(meta.files)} data file(s) hold {held} in all "
            f"(the largest, {big.key!r}, is {big.dtype} of shape {list(big.shape or ())}); the metadata is damaged "
            "or forged")
