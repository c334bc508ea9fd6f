"""Executes a rank's save plan: writes its chunks into format-v2 data files.

Each data file is laid out by :func:`.data_file.plan_file` before a byte is written (so the
safetensors header, padding and index positions are known), then streamed in order:
header, payloads, index, in slices of at most ``SLICE_BYTES``. Contiguous host tensors go
from their memory to storage with no intermediate copy, unless an O_DIRECT writer would
have to copy them anyway (their memory is not page-aligned); others (column bands, strided
views, accelerator tensors) are copied slab by slab into reused 4 KiB-aligned buffers,
never into fresh memory. What the saver copies on the host it checksums as it copies, a
piece at a time while the piece is in cache (:func:`.host_copy.copy_fed`); other slices are
checksummed just before they are handed to storage. Either way checksumming the next slice
overlaps with the storage writing this one (the filesystem writer writes on a thread of
its own). A resolver may produce a chunk
as several row slabs (an iterable of tensors), which bounds the memory of offline tools;
checksums run across slab boundaries.

The coordinator then merges every rank's write results into the checkpoint's metadata
(:func:`..format.metadata_build.build_metadata`).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import torch

from ..backends import direct_io
from ..backends.protocol import StorageWriter
from ..base.alignment import DIRECT_IO_ALIGN
from ..base.box import Box
from ..base.gc_pause import paused_gc
from ..base.priority import BACKGROUND_NICE, lower_this_thread
from ..format import metadata as md
from ..format.data_file import (
    ALIGNED_PAYLOAD_MIN,
    BLOCK_BYTES,
    ContentHash,
    Item,
    block_rows,
    encode_index,
    plan_file,
    tensor_bytes,
)
from ..format.file_table import data_file_name
from ..planning.planner import SavePlan, SavePlanner, WriteItem
from .chunk_checks import ChunkChecks
from .host_copy import copy_fed, copy_into, gather_fed, side_by_side
from .streams import StreamFence
from .unchanged import UnchangedStats, Verdict


@dataclass
class WriteResult:
    """What one rank wrote: its data files, the JSON values it records, table chunks it wrote.

    ``rows`` are ``(key, sub, box, file dir, file name)`` of chunks of table-stored keys (those
    whose spec has no store), written now (dir "") or reused from an earlier step's file;
    ``digests`` the content hash of every chunk written, when asked for (incremental saves
    keep them, with each chunk's ``verdicts`` and the ``stats`` of the checks; none of these
    is sent to the coordinator).
    """

    files: list[md.FileRecord] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)
    rows: list[tuple[str, int, Box, str, str]] = field(default_factory=list)
    nbytes: int = 0
    reused: list[tuple[str, int, md.FileRecord]] = field(default_factory=list)  # (key, sub, earlier step's file)
    # kept on the rank (incremental saves), not sent to the coordinator:
    digests: dict[tuple[str, int], tuple[bytes, Box, str]] = field(default_factory=dict)  # hash, box, file name
    known_reused: dict[tuple[str, int], Any] = field(default_factory=dict)
    verdicts: dict[tuple[str, int], Verdict] = field(default_factory=dict)  # every chunk's check (see .unchanged)
    stats: UnchangedStats | None = None
    # The per-item form torch DCP's and HyperParallel's storage layers use (keyword only, so the
    # fields above keep their places): the item written (a MetadataIndex), its byte count, and
    # where it lies (a format.storage_info.StorageInfo). Our own writers leave them None.
    index: Any = field(default=None, kw_only=True)
    size_in_bytes: int | None = field(default=None, kw_only=True)
    storage_data: Any = field(default=None, kw_only=True)

    def for_coordinator(self) -> WriteResult:
        return WriteResult(self.files, self.objects, self.rows, self.nbytes, self.reused)


def _split_files(items: list[WriteItem], n: int) -> list[list[WriteItem]]:
    """Items into at most ``n`` files of similar size, each in (key, sub) order."""
    order = operator.attrgetter("key", "sub")
    if n <= 1 or len(items) <= 1:
        return [sorted(items, key=order)] if items else []
    bins: list[list[WriteItem]] = [[] for _ in range(min(n, len(items)))]
    loads = [0] * len(bins)
    for item in sorted(items, key=lambda i: -i.nbytes):
        j = loads.index(min(loads))
        bins[j].append(item)
        loads[j] += item.nbytes
    for b in bins:
        b.sort(key=order)
    return [b for b in bins if b]


def data_file_names(rank: int, save_id: str, thread_count: int, hashes: bool = False) -> list[str]:
    """The names ``write_plan(..., thread_count, hashes)`` may use for a rank (to clean up after
    a failed save): a file per thread, and with ``hashes`` as many again for the chunks that an
    incremental save finds changed only by hashing them."""
    return [data_file_name(rank, i, save_id) for i in range(max(1, thread_count) * (2 if hashes else 1))]


SLICE_BYTES = 8 << 20  # bytes handed to storage at a time (checksummed just before)


def _pieces(value: Any) -> Iterator[memoryview]:
    """A resolved chunk as byte slices: one tensor, raw bytes, or an iterable of row slabs."""
    if isinstance(value, (torch.Tensor, np.ndarray, bytes, bytearray, memoryview)):
        value = [value]
    for part in value:
        if isinstance(part, torch.Tensor):
            yield from _tensor_slices(part)
            continue
        if isinstance(part, np.ndarray):
            view = memoryview(np.ascontiguousarray(part).reshape(-1).view(np.uint8)).cast("B")
        else:
            view = memoryview(part).cast("B")
        for off in range(0, view.nbytes, SLICE_BYTES):
            yield view[off:off + SLICE_BYTES]


def _tensor_slices(t: torch.Tensor) -> Iterator[memoryview]:
    """A tensor's row-major bytes in slices of at most SLICE_BYTES (whole rows when copied)."""
    t = t.detach()
    if t.device.type == "cpu" and t.is_contiguous() or t.dim() == 0 or not t.numel():
        view = tensor_bytes(t)
        for off in range(0, view.nbytes, SLICE_BYTES):
            yield view[off:off + SLICE_BYTES]
        return
    yield from _copied_slices(t, None)


def _copy_first(t: torch.Tensor, direct: bool) -> bool:
    """Whether a host tensor is copied into aligned slices by the saver, checksummed as it is
    copied: when it is not contiguous (it must be copied), or when an O_DIRECT writer would
    otherwise copy it through a bounce buffer after the checksum had read it once already."""
    if t.device.type != "cpu" or t.dim() == 0 or not t.numel():
        return False
    if not t.is_contiguous():
        return True
    return direct and t.numel() * t.element_size() >= ALIGNED_PAYLOAD_MIN and t.data_ptr() % DIRECT_IO_ALIGN != 0


def _copied_slices(t: torch.Tensor, consume: Callable[[memoryview], None] | None) -> Iterator[memoryview]:
    """A tensor's row-major bytes copied into aligned slices, each piece passed to ``consume``
    as it is copied. A contiguous tensor is cut into SLICE_BYTES slices; a strided one into
    slabs of whole rows (at most SLICE_BYTES unless one row is larger), a multiple of 4 KiB
    where rows allow, so an O_DIRECT writer takes every slab but the last as it is."""
    if t.is_contiguous():
        t = t.reshape(-1)
    row = max(1, t[0].numel() * t.element_size())
    rows = max(1, SLICE_BYTES // row)
    whole = DIRECT_IO_ALIGN // math.gcd(row, DIRECT_IO_ALIGN)  # rows that make a multiple of DIRECT_IO_ALIGN
    if rows >= whole:
        rows -= rows % whole
    for r0 in range(0, t.shape[0], rows):
        slab = t[r0:r0 + rows]
        buf = direct_io.POOL.get(slab.numel() * slab.element_size())
        if consume is None or not copy_fed(buf, slab, consume):
            copy_into(torch.frombuffer(buf, dtype=torch.uint8).view(t.dtype).view(slab.shape), slab)
            if consume is not None:
                consume(buf)
        yield buf


BAND_GROUP_BYTES = SLICE_BYTES  # a box's column bands up to this size are gathered in one copy


def _band_run(plan: SavePlan, witems: list[WriteItem], items: list[Item], starts: list[int], i: int) -> int:
    """How many items from ``i`` on are every column band of one box, of equal sizes, laid
    out at one pitch and spanning at most BAND_GROUP_BYTES (1 when they are not)."""
    tiles = _tiles(plan, witems[i].key)
    if tiles <= 1 or witems[i].sub % tiles or i + tiles > len(witems) or not items[i].nbytes:
        return 1
    last = i + tiles - 1
    pitch = starts[i + 1] - starts[i]
    if starts[last] - starts[i] + items[last].nbytes > BAND_GROUP_BYTES:
        return 1
    for k in range(i + 1, last + 1):
        if (witems[k].key != witems[i].key or witems[k].sub != witems[i].sub + k - i
                or items[k].nbytes != items[i].nbytes or starts[k] - starts[i] != (k - i) * pitch):
            return 1
    return tiles


def _view_of_more(value: Any, n: int) -> bool:
    """Whether ``value`` is a host tensor viewing storage that could hold ``n`` of it (a
    column band of a tensor, whose other bands are then views as well)."""
    return (isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.dim() >= 2
            and value.untyped_storage().nbytes() >= n * value.numel() * value.element_size())


def _banded(values: list[torch.Tensor], pitch: int) -> torch.Tensor | None:
    """Equal column bands of one tensor as one ``(bands, *band shape)`` view, or None (also
    when the file's ``pitch`` between them is not a whole number of elements)."""
    first = values[0]
    step = side_by_side(values)
    if step is None or pitch % first.element_size():
        return None
    return first.as_strided((len(values), *first.shape), (step, *first.stride()), first.storage_offset())


def _gather_bands(bands: torch.Tensor, pitch: int, items: list[Item], crcs: list[int],
                  hashers: list[ContentHash | None] | None = None) -> memoryview:
    """Copy a box's column bands into one aligned buffer as they lie in the file (band ``k``
    at ``k * pitch``, zeros between), append each band's checksums to ``crcs`` (and feed band
    ``k`` to ``hashers[k]`` where there is one: incremental saves)."""
    nbytes = items[0].nbytes
    span = pitch * (len(items) - 1) + nbytes
    buf = direct_io.POOL.get(span)
    step = _crc_step(items[0])
    if pitch > nbytes:
        for k in range(1, len(items)):
            buf[k * pitch - (pitch - nbytes):k * pitch] = bytes(pitch - nbytes)
    sums = [_Checksums(step) for _ in items]
    hashers = hashers or [None] * len(items)

    def feed(k: int, data: memoryview) -> None:
        sums[k].feed(data)
        if hashers[k] is not None:
            hashers[k].feed(data)

    if not gather_fed(buf, pitch, bands, feed):  # numpy cannot view them: torch copies, then we sum
        for k in range(len(items)):
            band = buf[k * pitch:k * pitch + nbytes]
            copy_into(torch.frombuffer(band, dtype=torch.uint8).view(bands.dtype).view(bands.shape[1:]), bands[k])
            feed(k, band)
    for s in sums:
        crcs.extend(s.finish())
    return buf


def _crc_step(item: Item) -> int:
    """Bytes per checksum block of a chunk: whole rows, at most BLOCK_BYTES (or one row)."""
    if not item.nbytes:
        return 1
    rows = max(1, item.box.sizes[0] if item.box.sizes else 1)
    return max(1, item.nbytes // rows * block_rows(item.box.sizes, item.nbytes, BLOCK_BYTES))


class _Checksums:
    """crc32c of fixed-size blocks over a stream of pieces (blocks may span pieces)."""

    def __init__(self, step: int):
        self.step, self.crcs, self.crc, self.filled = step, [], 0, 0

    def feed(self, data: memoryview) -> None:
        pos = 0
        while pos < data.nbytes:
            take = min(self.step - self.filled, data.nbytes - pos)
            self.crc = crc32c.crc32c(data[pos:pos + take], self.crc)
            self.filled += take
            pos += take
            if self.filled == self.step:
                self.crcs.append(self.crc)
                self.crc, self.filled = 0, 0

    def finish(self) -> list[int]:
        if self.filled:
            self.crcs.append(self.crc)
        return self.crcs


def write_plan(
    plan: SavePlan,
    planner: SavePlanner,
    writer: StorageWriter,
    rank: int,
    save_id: str,
    thread_count: int = 1,
    hashes: bool = False,
    reuse: dict[tuple[str, int], Any] | None = None,
) -> WriteResult:
    """Write every item of ``plan`` (this rank's share of the global plan).

    ``hashes`` (incremental saves): store each chunk's content hash in its file's index and
    return it in ``WriteResult.digests``; check every chunk against ``reuse``, the chunks
    stored earlier by (key, sub id) (see :mod:`.unchanged`): one found unchanged is not
    written but returned in ``WriteResult.reused``.
    """
    result = WriteResult()
    fence = StreamFence()  # device tensors are copied to the host on writer threads
    for key in plan.objects:
        result.objects[key] = planner.resolve_data(WriteItem(key, Box((), ()), 0))
    known: dict[tuple[str, int], bytes] = {}  # chunks hashed by the checks (not hashed again when written)
    tables = {k for k, spec in plan.entries.items() if spec.store is None and spec.kind != "object"}
    checks = ChunkChecks(plan, reuse, lambda key: _tiles(plan, key), tables) if hashes else None
    # incremental: what the cheap checks find changed is written first, while the rest is hashed
    items = checks.triage(planner, fence) if checks is not None else plan.items
    groups = _split_files(items, thread_count)
    prepare = getattr(planner, "prepare_writes", None)  # optional (SavePlanner's protocol)
    if prepare is not None:
        prepare(groups)
    direct = getattr(writer, "uses_direct_io", None) is True  # decided by prepare()

    def write_group(index: int, witems: list[WriteItem]) -> tuple[md.FileRecord, dict, int]:
        name = data_file_name(rank, index, save_id)
        items = [Item(w.key, w.sub, w.box, plan.entries[w.key].dtype, w.nbytes) for w in witems]
        layout = plan_file(items, save_id, hashes)
        crcs: list[int] = []
        digests: dict[tuple[str, int], bytes] = {}
        index_blob: list[bytes] = []

        def write_one(witem: WriteItem, item: Item, value: Any) -> Iterator[memoryview]:
            if (item.nbytes <= BLOCK_BYTES and not hashes and isinstance(value, torch.Tensor)
                    and value.device.type == "cpu" and value.is_contiguous() and not _copy_first(value, direct)):
                value = tensor_bytes(value)  # one block, written as it is: one checksum call, no per-chunk state
            if type(value) is memoryview and item.nbytes <= BLOCK_BYTES and not hashes:
                # small chunks (and the offline tools' byte ranges of cached tensors): one block
                if value.nbytes != item.nbytes:
                    raise ValueError(f"{item.key!r}: planned {item.nbytes} bytes, found {value.nbytes}")
                if item.nbytes:
                    crcs.append(crc32c.crc32c(value))
                    yield value
                return
            if isinstance(value, torch.Tensor):
                fence.before_copy(value)
            sums = _Checksums(_crc_step(item))
            hashed = known.get((item.key, item.sub))  # hashed already, by the reuse check
            hasher = ContentHash() if hashes and hashed is None else None

            def consume(data: memoryview) -> None:
                sums.feed(data)
                if hasher is not None:
                    hasher.feed(data)

            fed = isinstance(value, torch.Tensor) and _copy_first(value, direct)
            got = 0
            for data in _copied_slices(value.detach(), consume) if fed else _pieces(value):
                if not fed:
                    consume(data)
                got += data.nbytes
                yield data
            value = data = None  # free this chunk before the next one is produced
            if got != item.nbytes:
                raise ValueError(f"{item.key!r}: planned {item.nbytes} bytes, found {got}")
            crcs.extend(sums.finish())
            if hashes:
                digests[(item.key, item.sub)] = hashed if hashed is not None else hasher.digest()

        def parts() -> Iterator[memoryview]:
            yield memoryview(layout.header)
            pos, i = layout.base, 0
            while i < len(witems):
                witem, start = witems[i], layout.starts[i]
                n = _band_run(plan, witems, items, layout.starts, i)
                values = [planner.resolve_data(witem)]
                # bands of a row-major tensor are strided: gather them in one copy (bands staged
                # contiguously by an async save are written as they are, one by one)
                if n > 1 and _view_of_more(values[0], n) and not values[0].is_contiguous():
                    values += [planner.resolve_data(w) for w in witems[i + 1:i + n]]
                    pitch = layout.starts[i + 1] - start
                    bands = _banded(values, pitch)
                    if bands is not None:  # every column band of a box, in one copy
                        if start > pos:
                            yield memoryview(bytes(start - pos))
                        subs = [(w.key, w.sub) for w in witems[i:i + n]]
                        hashers = [None if ks in known else ContentHash() for ks in subs] if hashes else None
                        yield _gather_bands(bands, pitch, items[i:i + n], crcs, hashers)
                        if hashes:
                            digests.update((ks, known[ks] if h is None else h.digest())
                                           for ks, h in zip(subs, hashers, strict=True))
                        pos, i = layout.starts[i + n - 1] + items[i + n - 1].nbytes, i + n
                        continue
                for k in range(i, i + n):  # one by one, each resolved just before it is written
                    if layout.starts[k] > pos:
                        yield memoryview(bytes(layout.starts[k] - pos))
                    value = values.pop(0) if values else planner.resolve_data(witems[k])
                    yield from write_one(witems[k], items[k], value)
                    value = None
                    pos = layout.starts[k] + items[k].nbytes
                i += n
            if layout.index_offset > pos:
                yield memoryview(bytes(layout.index_offset - pos))
            blob = encode_index(layout, items, crcs, [digests[(i.key, i.sub)] for i in items] if hashes else None)
            index_blob.append(blob)
            yield memoryview(blob)

        written = writer.write_file(name, parts())
        record = md.FileRecord(name, "", rank, layout.index_offset, layout.index_length,
                               crc32c.crc32c(memoryview(index_blob[0])[:layout.index_length]), layout.size)
        return record, digests, written

    def write_round(round_groups: list[list[WriteItem]], first: int) -> list[tuple[md.FileRecord, dict, int]]:
        if len(round_groups) > 1:
            with ThreadPoolExecutor(len(round_groups), thread_name_prefix="dcp-write") as pool:
                return list(pool.map(lambda a: write_group(*a), enumerate(round_groups, first)))
        return [write_group(i, g) for i, g in enumerate(round_groups, first)]

    # The per-chunk records, views and slices of a save hold no cycles; a collection of the
    # whole process's objects, triggered by them, cost ~6% of a 436-tensor save.
    with paused_gc():
        if checks is not None and checks.pending and groups:  # hash the undecided chunks meanwhile
            with ThreadPoolExecutor(1, thread_name_prefix="dcp-check") as background:
                checking = background.submit(_niced, checks.hash_pending, _full_digest)
                outs = write_round(groups, 0)
                later, hashed = checking.result()
        else:
            outs = write_round(groups, 0)
            later, hashed = checks.hash_pending(_full_digest) if checks is not None else ([], {})
        if later:  # chunks the hashes found changed: into files of their own
            known.update(hashed)
            more = _split_files(later, thread_count)
            if prepare is not None:
                prepare(more)
            outs += write_round(more, len(groups))
            groups += more
    for (record, digests, written), witems in zip(outs, groups, strict=True):
        result.files.append(record)
        result.nbytes += written
        if digests:
            boxes = {(w.key, w.sub): w.box for w in witems}
            result.digests.update({ks: (d, boxes[ks], record.name) for ks, d in digests.items()})
        if tables:
            result.rows.extend((w.key, w.sub, w.box, "", record.name) for w in witems if w.key in tables)
    if checks is not None:
        checks.finish({ks: d for ks, (d, _, _) in result.digests.items()})
        result.stats, result.verdicts = checks.stats, checks.verdicts
        result.reused, result.known_reused = checks.reused, checks.known_reused
        result.rows.extend(checks.rows)
    return result


def _niced(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on this thread at background niceness: the checks that overlap the writes
    take the CPU the writes leave, so the disk is kept busy (on 2 cores, checks at equal
    priority stretched a step's 8 MiB writes from ~5 ms to ~11 ms)."""
    lower_this_thread(BACKGROUND_NICE)
    return fn(*args)


def _tiles(plan: SavePlan, key: str) -> int:
    store = plan.entries[key].store
    return store.tiles if isinstance(store, md.GridStore) else 1


def _full_digest(value: Any) -> bytes | None:
    """The content hash of a chunk's data, or None when it comes in slabs (hashing would
    consume them)."""
    if not isinstance(value, (torch.Tensor, np.ndarray, bytes, bytearray, memoryview)):
        return None
    hasher = ContentHash()
    for data in _pieces(value):
        hasher.feed(data)
    return hasher.digest()
