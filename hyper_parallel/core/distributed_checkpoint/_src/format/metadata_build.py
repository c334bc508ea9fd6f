"""Building a checkpoint's metadata from what every rank wrote: the coordinator's merge.

Each rank's writer reports the data files it wrote, the values it records in the metadata,
the chunks of table-stored keys and the chunks it reused from earlier steps' files
(:class:`..transfer.saver.WriteResult`). The coordinator merges them with the plan's entry specs
into one :class:`.metadata.Metadata`: O(files + tensors), never a loop over chunks. It sits
beside the records it builds; the writers above hand it their results.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import numpy as np

from ..base.box import Box
from ..base.gc_pause import paused_gc
from ..sharding.grid import Grid
from ..sharding.records import storable_layout
from . import metadata as md
from .validation import check_shape

__all__ = ["build_metadata", "EntryLike", "WrittenLike"]


class EntryLike(Protocol):
    """What the merge reads of a planned entry (the planner's ``EntrySpec``)."""

    kind: str
    path: Any
    dtype: Any
    shape: Any
    layout: Any
    store: Any


class WrittenLike(Protocol):
    """What the merge reads of one rank's write result (the saver's ``WriteResult``)."""

    files: list[md.FileRecord]
    objects: dict[str, Any]
    rows: list[tuple[str, int, Box, str, str]]
    reused: list[tuple[str, int, md.FileRecord]]


def build_metadata(
    entries: dict[str, EntryLike], results: Iterable[WrittenLike], save_id: str, world_size: int,
    user: dict[str, Any], extra_files: Iterable[md.FileRecord] = (), dirs: list[str] | None = None,
) -> md.Metadata:
    """The coordinator's merge of every rank's write results into the checkpoint's metadata."""
    with paused_gc():
        return _build_metadata(entries, list(results), save_id, world_size, user, list(extra_files), dirs)


def _build_metadata(entries: dict[str, EntryLike], results: list[WrittenLike], save_id: str, world_size: int,
                    user: dict[str, Any], extra_files: list[md.FileRecord], dirs: list[str] | None) -> md.Metadata:
    files = list(extra_files) + [f for r in results for f in r.files]
    dirs = list(dirs or [""])
    reused: dict[str, list[tuple[int, str]]] = {}
    for r in results:  # chunks left in earlier steps' files: their files join this checkpoint's list
        for key, sub, f in r.reused:
            if f.dir not in dirs:
                dirs.append(f.dir)
            reused.setdefault(key, []).append((sub, f.dir))
            files.append(f)
    files = list({(f.dir, f.name): f for f in files}.values())
    file_index = {(f.dir, f.name): i for i, f in enumerate(files)}
    objects: dict[str, Any] = {}
    rows: dict[str, list[tuple[int, Box, tuple[str, str]]]] = {}
    for r in results:
        objects.update(r.objects)
        for key, sub, box, d, name in r.rows:
            rows.setdefault(key, []).append((sub, box, (d, name)))
    out = {}
    for key, spec in entries.items():
        if spec.kind != "object":  # what the reader would refuse is never written (e.g. an import's [-1, 0])
            check_shape(tuple(spec.shape or ()), "the checkpoint being written", key)
        # a RaggedShard layout has no name in the format: its boxes are a table, its entry has no layout
        entry = md.Entry(key, spec.kind, spec.path, spec.dtype, spec.shape, storable_layout(spec.layout),
                         objects.get(key), spec.store)
        if spec.kind != "object" and spec.store is None:
            entry.store = _table(key, spec, sorted(rows.get(key, [])), file_index)
        elif key in reused:
            entry.store = _with_where(spec, reused[key], dirs)
        out[key] = entry
    return md.Metadata(out, save_id, world_size, user=user, files=files, dirs=dirs).attach()


def _with_where(spec: EntryLike, reused: list[tuple[int, str]], dirs: list[str]) -> md.GridStore:
    """The key's grid store, saying which step directory holds each reused box (runs)."""
    store = spec.store
    layout = store.layout if store.layout is not None else (spec.layout if store.writer is None else None)
    grid = Grid(spec.shape or (), layout["mesh_shape"], layout["placements"], layout.get("rank_list"), store.tiles) \
        if layout is not None else Grid(spec.shape or (), (1,), ["R"], [store.writer], store.tiles)
    where = np.zeros(grid.num_boxes, dtype=np.int64)
    for sub, d in reused:
        where[sub // store.tiles] = dirs.index(d)
    change = np.flatnonzero(np.diff(where)) + 1
    starts = np.concatenate([[0], change])
    ends = np.concatenate([change, [len(where)]])
    runs = [(int(e - b), int(where[b])) for b, e in zip(starts, ends, strict=True)]
    return md.GridStore(store.tiles, store.offset, store.copies, store.writer, store.layout, runs)


def _table(key: str, spec: EntryLike, rows: list[tuple[int, Box, tuple[str, str]]], file_index: dict) -> md.TableStore:
    ndim = len(spec.shape or ())
    if [s for s, _, _ in rows] != list(range(len(rows))):
        raise ValueError(f"{key!r}: table chunks must have sub ids 0..n-1, found {[s for s, _, _ in rows][:10]}")
    return md.TableStore(
        np.array([b.offsets for _, b, _ in rows], dtype=np.int64).reshape(len(rows), ndim),
        np.array([b.sizes for _, b, _ in rows], dtype=np.int64).reshape(len(rows), ndim),
        np.array([file_index[f] for _, _, f in rows], dtype=np.int32))
