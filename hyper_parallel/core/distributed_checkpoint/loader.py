"""Executes a rank's load plan: reads overlapping byte ranges straight into target memory.

First the plan's chunk references are resolved into byte ranges and checksums: each data
file involved has its index read once per reader (checked against the crc32c that
``.metadata`` records for it), in parallel across files. Then, for each (saved chunk,
target) overlap the loader reads only the checksum blocks (whole rows of the chunk's dim
0) that hold needed rows, verifies every block it reads, and:

- when the chunk lies whole inside the target and lands contiguously in a CPU tensor, reads
  it directly into the destination (no copy);
- otherwise reads block groups into a bounded scratch buffer and copies the overlap out.

Memory beyond the destination tensors stays within ``buffer_bytes`` per thread (or one
block, if a single row is larger).
"""

from __future__ import annotations

import math
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import crc32c
import numpy as np
import torch

from . import metadata as md
from .box import Box
from .chunks import ChunkRef, overlapping
from .data_file import FileIndex, UncheckedIndex, check_index, tensor_bytes
from .errors import CorruptCheckpointError
from .planner import LoadPlan, ReadItem
from .storage import StorageReader
from .streams import StreamFence

DEFAULT_BUFFER_BYTES = 64 << 20


class _Scratch(threading.local):
    """Per-thread read buffers of one ``read_plan`` call, reused across its reads (fresh
    memory costs a page fault per 4 KiB); freed when the call returns.

    Requests up to ``keep`` bytes are served from one cached buffer; larger ones (a single
    row bigger than the read buffer) get memory of their own that is not kept.
    """

    buf: torch.Tensor | None = None

    def get(self, nbytes: int, keep: int) -> torch.Tensor:
        if nbytes > keep:
            return torch.empty(nbytes, dtype=torch.uint8)
        if self.buf is None or self.buf.numel() < nbytes:
            self.buf = None
            self.buf = torch.empty(max(nbytes, min(keep, 8 << 20)), dtype=torch.uint8)
        return self.buf[:nbytes]


@dataclass
class ReadStats:
    bytes_read: int = 0
    bytes_needed: int = 0


def _check_blocks(item: ReadItem, data: memoryview, first_block: int, row_bytes: int, where: str) -> None:
    chunk = item.chunk
    step = chunk.block_rows * row_bytes
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


def _read_item(
    item: ReadItem,
    dest: torch.Tensor,
    target: Box,
    reader: StorageReader,
    buffer_bytes: int,
    verify: bool,
    pool: _Scratch,
) -> int:
    chunk = item.chunk
    verify = verify and bool(chunk.crc32c)  # a foreign file's chunk (UncheckedIndex) has no checksums
    cbox = Box(chunk.offsets, chunk.sizes)
    where = chunk.file
    rows = chunk.rows
    row_bytes = chunk.length // rows
    dest_view = dest[item.region.relative_to(target)] if dest.dim() else dest
    # Fast path: the whole chunk lands contiguously in CPU memory -> read straight into it.
    if item.region == cbox and dest_view.device.type == "cpu" and dest_view.is_contiguous():
        data = tensor_bytes(dest_view)
        reader.read_into(chunk.file, chunk.start, data)
        if verify:
            _check_blocks(item, data, 0, row_bytes, where)
        return chunk.length
    # General path: read the blocks holding needed rows, a few at a time, copy the overlap.
    if cbox.ndim:
        r0 = item.region.offsets[0] - chunk.offsets[0]
        r1 = r0 + item.region.sizes[0]
    else:
        r0, r1 = 0, 1
    br = chunk.block_rows
    b0, b1 = r0 // br, -(-r1 // br)
    per_group = max(1, buffer_bytes // (br * row_bytes))
    dtype = dest.dtype
    inner = Box(tuple(o - c for o, c in zip(item.region.offsets, chunk.offsets, strict=True)), item.region.sizes)
    if not verify and cbox.ndim:
        return _read_exact(item, inner, dest_view, reader, buffer_bytes, pool)
    read = 0
    for g0 in range(b0, b1, per_group):
        g1 = min(b1, g0 + per_group)
        row_lo, row_hi = g0 * br, min(rows, g1 * br)
        nbytes = (row_hi - row_lo) * row_bytes
        scratch = pool.get(nbytes, buffer_bytes)
        data = tensor_bytes(scratch)
        reader.read_into(chunk.file, chunk.start + row_lo * row_bytes, data)
        if verify:
            _check_blocks(item, data, g0, row_bytes, where)
        read += nbytes
        block = scratch.view(dtype).reshape((row_hi - row_lo, *chunk.sizes[1:]) if cbox.ndim else ())
        if not cbox.ndim:
            dest_view.copy_(block)
            continue
        # Rows of this group that the region needs, in chunk-local and region-local coords.
        lo, hi = max(row_lo, inner.offsets[0]), min(row_hi, inner.offsets[0] + inner.sizes[0])
        cols = tuple(slice(o, o + n) for o, n in zip(inner.offsets[1:], inner.sizes[1:], strict=True))
        src = block[(slice(lo - row_lo, hi - row_lo), *cols)]
        dst = dest_view[lo - inner.offsets[0]:hi - inner.offsets[0]]
        dst.copy_(src)
    return read


def _read_exact(item: ReadItem, inner: Box, dest_view: torch.Tensor, reader: StorageReader,
                buffer_bytes: int, pool: _Scratch) -> int:
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
    slabs_per_group = max(1, buffer_bytes // max(slab, 1))
    full_rows = span != run  # we read whole slabs of dim d and must slice them
    read_shape = list(inner.sizes)
    if full_rows:
        read_shape[d + 1:] = chunk.sizes[d + 1:]
    read = 0
    total_slabs = inner.sizes[0] if d else 1
    for s0 in range(0, total_slabs, slabs_per_group):
        s1 = min(total_slabs, s0 + slabs_per_group)
        scratch = pool.get((s1 - s0) * slab, buffer_bytes)
        data = tensor_bytes(scratch)
        for k, off in enumerate(offsets[s0 * runs_per_slab: s1 * runs_per_slab]):
            reader.read_into(chunk.file, int(off), data[k * span:(k + 1) * span])
        read += scratch.numel()
        shape = [s1 - s0, *read_shape[1:]] if d else read_shape
        block = scratch.view(dest_view.dtype).reshape(shape)
        if full_rows:
            block = block[(slice(None),) * (d + 1) + tuple(
                slice(o, o + m) for o, m in zip(inner.offsets[d + 1:], inner.sizes[d + 1:], strict=True))]
        dest_view[s0:s1].copy_(block) if d else dest_view.copy_(block)
    return read


class TargetResolver(Protocol):
    """What the loader needs of a planner: the destination tensor of a key."""

    def resolve_target(self, key: str) -> torch.Tensor: ...


@dataclass
class _Fixed:
    dest: torch.Tensor

    def resolve_target(self, key: str) -> torch.Tensor:
        return self.dest


class IndexCache:
    """The data-file indexes one reader has read: each read and checked once.

    Cached by the whole file record (name, index position and checksum, size), so a file
    rewritten under the same name between two loads is never looked up in its old index.
    """

    def __init__(self, reader: StorageReader, max_files: int = 1 << 16):
        self.reader, self.max_files = reader, max_files
        self._indexes: dict[md.FileRecord, FileIndex | UncheckedIndex] = {}
        self._lock = threading.Lock()

    def get(self, f: md.FileRecord) -> FileIndex | UncheckedIndex:
        found = self._indexes.get(f)
        if found is not None:
            return found
        index = self.reader.file_index(f)  # a reader of foreign files supplies its own
        if index is None:
            raw = bytearray(f.index_length)
            self.reader.read_into(f.path, f.index_offset, memoryview(raw))
            check_index(raw, f.index_crc, f.path)
            index = FileIndex(raw, f.path, f.index_offset)
        with self._lock:
            if len(self._indexes) >= self.max_files:
                self._indexes.clear()
            self._indexes[f] = index
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


def _resolve_items(items: list[ReadItem], reader: StorageReader, thread_count: int) -> list[ReadItem]:
    refs = [i for i in items if not isinstance(i.chunk, md.ChunkRecord)]
    if not refs:
        return items
    cache = index_cache(reader)
    files = {f.path: f for i in refs for f in i.chunk.files[:1]}
    if len(files) > 1 and thread_count > 1:  # read the indexes of different files in parallel
        with ThreadPoolExecutor(min(thread_count, len(files)), thread_name_prefix="dcp-index") as pool:
            list(pool.map(lambda f: _try(cache, f), files.values()))
    return [i if isinstance(i.chunk, md.ChunkRecord) else ReadItem(i.key, resolve(i.chunk, cache), i.region)
            for i in items]


def _try(cache: IndexCache, f: md.FileRecord) -> None:
    try:
        cache.get(f)
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
    """Fill every target of ``plan``; raises CorruptCheckpointError on any bad byte or file."""
    stats = ReadStats()
    plan = LoadPlan(_resolve_items(plan.items, reader, thread_count), plan.targets)
    # Check every range against its file's size before reading (and before trusting sizes).
    sizes: dict[str, int] = {}
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

    scratch = _Scratch()
    fence = StreamFence()  # accelerator targets are filled from reader threads

    def run(item: ReadItem) -> int:
        dest = planner.resolve_target(item.key).detach()
        fence.before_copy(dest)
        with torch.no_grad():
            return _read_item(item, dest, plan.targets[item.key], reader, buffer_bytes, verify, scratch)

    # Each file is read front to back by one thread (the kernel's readahead then streams it);
    # different files are read in parallel. Interleaving reads of one file from several
    # threads measured 20-30% slower on a cold cache.
    by_file: dict[str, list[ReadItem]] = {}
    for item in sorted(plan.items, key=lambda i: (i.chunk.file, i.chunk.start)):
        by_file.setdefault(item.chunk.file, []).append(item)
    streams = sorted(by_file.values(), key=lambda items: -sum(i.chunk.length for i in items))

    def run_file(items: list[ReadItem]) -> int:
        return sum(run(i) for i in items)

    workers = max(1, min(thread_count, len(streams)))
    if workers > 1:
        with ThreadPoolExecutor(workers, thread_name_prefix="dcp-read") as pool:
            stats.bytes_read = sum(pool.map(run_file, streams))
    else:
        stats.bytes_read = sum(run_file(items) for items in streams)
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
    dest = out if out is not None else torch.empty(box.sizes, dtype=md.torch_dtype(entry.dtype))
    reads, covered = [], 0
    for ref in overlapping(meta, entry, box):
        region = ref.box.intersect(box)
        reads.append(ReadItem(entry.key, ref, region))
        covered += region.numel
    if covered != box.numel:
        raise CorruptCheckpointError(
            f"{entry.key!r}: saved chunks cover {covered} of the {box.numel} elements of region {box}; "
            "the checkpoint is missing data for this key")
    stats = read_plan(LoadPlan(reads, {entry.key: box}), _Fixed(dest), reader, thread_count=1,
                      buffer_bytes=buffer_bytes, verify=verify)
    return dest, stats


def read_metadata(reader: StorageReader, where: str | None = None) -> md.Metadata:
    """Read and validate a checkpoint's ``.metadata`` through ``reader`` (for offline tools)."""
    from .fragments import read_checkpoint_metadata

    return md.Metadata.from_json(read_checkpoint_metadata(reader, where or "checkpoint"),
                                 where=where or md.METADATA_FILE).attach()


from .single_file import load_checkpoint  # noqa: E402, F401  (HyperParallel single-file API)
