"""Where the saved chunks of a key are: their boxes and the files that may hold them.

The one place that knows both stores of format v2 (and v1's chunk lists): a *grid* derives
its boxes and writers from a layout (:mod:`.grid`), a *table* lists them. Everything here is
boxes and file records; the byte ranges and checksums inside a file come from its index
and are resolved by the loader.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..base.box import Box
from ..base.dtypes import itemsize
from ..sharding.grid import Grid
from . import metadata as md


@dataclass(frozen=True)
class ChunkRef:
    """One saved (sub-)chunk: its box, its id in file indexes, where to look for it.

    ``files`` are candidates in preference order (a rank with several data files, or the
    replicas of a box); ``record`` is set when the byte range is already known (format v1).
    ``sub`` is the chunk's id in its first file: unique per key for grid stores and
    collective tables, but in merged rank-local fragments each rank numbers its own chunks,
    so only (file, key, sub) or (key, box) name a chunk everywhere.
    """

    key: str
    sub: int
    box: Box
    files: tuple[md.FileRecord, ...]
    nbytes: int
    record: md.ChunkRecord | None = None
    subs: tuple[int, ...] | None = None  # the chunk's id in each of ``files`` when they differ

    def candidates(self) -> list[tuple[md.FileRecord, int]]:
        """(file, chunk id in that file) to look in, in order of preference."""
        subs = self.subs if self.subs is not None else (self.sub,) * len(self.files)
        return list(zip(self.files, subs, strict=True))


class _Locator:
    """Per-entry cache: the grid or table, and file lookup by (dir, rank)."""

    def __init__(self, meta: md.Metadata, entry: md.Entry):
        self.meta, self.entry = meta, entry
        store = entry.store
        self.grid: Grid | None = md.entry_grid(entry)
        self.where_ends: list[int] = []
        self.where_dirs: list[str] = []
        if self.grid is not None and store.where is not None:
            total = 0
            for count, d in store.where:
                total += count
                self.where_ends.append(total)
                self.where_dirs.append(meta.dirs[d])

    def dir_of(self, box: int) -> str:
        if not self.where_ends:
            return ""
        return self.where_dirs[bisect.bisect_right(self.where_ends, box)]


def _locator(meta: md.Metadata, entry: md.Entry) -> _Locator:
    cache = meta.__dict__.setdefault("_locators", {})
    loc = cache.get(entry.key)
    if loc is None or loc.entry is not entry:
        loc = cache[entry.key] = _Locator(meta, entry)
    return loc


def files_of(meta: md.Metadata, dir: str, rank: int) -> tuple[md.FileRecord, ...]:
    """The data files rank ``rank`` wrote in directory ``dir`` ("" = this checkpoint)."""
    by = meta.__dict__.get("_files_by")
    if by is None:
        by = {}
        for f in meta.files:
            by.setdefault((f.dir, f.rank), []).append(f)
        by = meta.__dict__["_files_by"] = {k: tuple(v) for k, v in by.items()}
    return by.get((dir, rank), ())


def grid(meta: md.Metadata, entry: md.Entry) -> Grid | None:
    """The chunk grid of a grid-stored entry (None for tables)."""
    return _locator(meta, entry).grid


def _grid_refs(meta: md.Metadata, entry: md.Entry, boxes: list[int], rank: int | None) -> list[ChunkRef]:
    loc = _locator(meta, entry)
    g, store = loc.grid, entry.store
    out = []
    for b in boxes:
        d = loc.dir_of(b)
        if store.writer is not None:
            writers = [store.writer]
        elif store.copies == "all" and g.replicas == 1:
            writers = [g.holder(b, 0)]  # the one holder writes it
        elif store.copies == "all":
            holders = [g.holder(b, q) for q in range(g.replicas)]
            first = g.writer(b, store.offset)
            writers = ([rank] if rank in holders else []) + [first] + [h for h in holders if h not in (rank, first)]
        else:
            writers = [g.writer(b, store.offset)]
        files = tuple(f for w in writers for f in files_of(meta, d, w))
        size = itemsize(entry.dtype)
        for sub, box in g.band_subs(b):
            out.append(ChunkRef(entry.key, sub, box, files, box.numel * size))
    return out


def _table_refs(meta: md.Metadata, entry: md.Entry, rows: np.ndarray, rank: int | None) -> list[ChunkRef]:
    store: md.TableStore = entry.store
    groups: dict[tuple, list[int]] = {}
    for i in rows.tolist():
        groups.setdefault((tuple(store.offsets[i].tolist()), tuple(store.sizes[i].tolist())), []).append(i)
    out = []
    for (offsets, sizes), members in groups.items():
        files = [meta.files[int(store.file[i])] for i in members]
        order = sorted(range(len(members)), key=lambda j: (files[j].rank != rank and not _v1_own(files[j], rank),
                                                           j if rank is None else (j + rank) % len(members)))
        first = members[order[0]]
        record = store.records[first] if store.records is not None else None
        box = Box(offsets, sizes)
        subs = tuple(store.sub(members[j]) for j in order) if store.subs is not None else None
        out.append(ChunkRef(entry.key, store.sub(first), box, tuple(files[j] for j in order),
                            box.numel * itemsize(entry.dtype), record, subs))
    return out


def _v1_own(f: md.FileRecord, rank: int | None) -> bool:
    # v1 file names carry the writing rank: data-r<rank>-...
    return rank is not None and f.rank < 0 and f.name.startswith(f"data-r{rank:05d}-")


def overlapping(meta: md.Metadata, entry: md.Entry, box: Box, rank: int | None = None) -> list[ChunkRef]:
    """The distinct saved chunks that overlap ``box``; ``rank`` prefers replicas in its own files."""
    if not box.numel:
        return []
    loc = _locator(meta, entry)
    if loc.grid is not None:
        refs = _grid_refs(meta, entry, loc.grid.overlapping(box), rank)
        if loc.grid.tiles == 1:
            return refs
        return [r for r in refs if r.box.intersect(box)]  # a box's column bands may miss the region
    store: md.TableStore = entry.store
    if store is None or not len(store):
        return []
    lo = np.array(box.offsets, dtype=np.int64)
    hi = lo + np.array(box.sizes, dtype=np.int64)
    hit = np.all((store.offsets < hi) & (store.offsets + store.sizes > lo), axis=1) if lo.size else \
        np.ones(len(store), dtype=bool)
    return _table_refs(meta, entry, np.nonzero(hit)[0], rank)


def all_chunks(meta: md.Metadata, entry: md.Entry) -> Iterator[ChunkRef]:
    """Every distinct saved chunk of an entry (O(chunks): for verify, inspect, exports)."""
    loc = _locator(meta, entry)
    if loc.grid is not None:
        g = loc.grid
        for b in range(g.num_boxes):
            if g.box(b).numel:
                yield from _grid_refs(meta, entry, [b], None)
        return
    if entry.store is not None:
        yield from _table_refs(meta, entry, np.arange(len(entry.store)), None)


def count(meta: md.Metadata, entry: md.Entry) -> int:
    """Number of distinct saved chunks (a grid's empty boxes excluded)."""
    loc = _locator(meta, entry)
    if loc.grid is not None:
        g = loc.grid
        nonempty = math.prod(sum(1 for _, n in g.intervals[d] if n) for d in g.dims)
        return nonempty * g.tiles if math.prod(entry.shape or ()) else 0
    store: md.TableStore = entry.store
    if store is None:
        return 0
    return len(store.distinct_boxes())


def covered(meta: md.Metadata, entry: md.Entry) -> int:
    """Elements of the tensor that saved chunks hold (each once)."""
    loc = _locator(meta, entry)
    if loc.grid is not None:
        return loc.grid.covered_volume()
    store: md.TableStore = entry.store
    if store is None:
        return 0
    return sum(math.prod(s) for _, s in store.distinct_boxes())


def largest_chunk_bytes(meta: md.Metadata, entry: md.Entry) -> int:
    """Bytes of the entry's largest saved chunk (0 for values without data)."""
    if entry.kind == "object" or not math.prod(entry.shape or ()):
        return 0
    size = itemsize(entry.dtype)
    loc = _locator(meta, entry)
    if loc.grid is not None:
        g = loc.grid
        biggest = math.prod(max((n for _, n in g.intervals[d]), default=0) for d in g.dims)
        rest = math.prod(s for d, s in enumerate(entry.shape) if d not in g.split_by)
        per_box = biggest * rest
        return -(-per_box // g.tiles) * size
    store: md.TableStore = entry.store
    return int(np.prod(store.sizes, axis=1).max()) * size if len(store) else 0
