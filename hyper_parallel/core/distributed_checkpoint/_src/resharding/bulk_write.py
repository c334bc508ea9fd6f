"""Writing a reshard's destination files in bulk: tens of thousands of ranks of tiny chunks.

A reshard to N ranks of T tensors writes N files of T chunks each. The general path
(:func:`..transfer.saver.write_plan` per rank) handles every case but costs a few
microseconds of Python per (rank, chunk): 65,536 ranks x 1,000 tensors is 65 million
chunks. Here, when every chunk is small (below ``ALIGNED_PAYLOAD_MIN``: packed densely,
one checksum each), the work per chunk is numpy's:

- keys laid out alike (one shared :class:`~..sharding.grid.Grid` per shape, mesh,
  placements and dtype) form a *group*; a rank holds one box of each group, and ranks whose
  boxes have the same sizes (and hold the same keys) share one file plan, a
  :class:`~..format.data_file.FileTemplate` whose header text only lacks each group's box
  offsets;
- ranks are taken in batches; for each batch, every key of a group is read once as the
  bounding box of the batch's boxes (memory bounded by the budget), each rank's chunks of a
  group are one numpy slice of that stack, and their checksums are computed for the whole
  batch at once (:func:`~..format.row_checksums.row_crc32c`);
- each file is then written as three buffers (header, payloads, index).

The files are byte for byte those the general path writes (tests compare them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import torch

from ..backends.protocol import StorageWriter
from ..base.box import Box
from ..base.dtypes import itemsize
from ..format import metadata as md
from ..format.data_file import (
    ALIGNED_PAYLOAD_MIN,
    BLOCK_BYTES,
    FileTemplate,
    Item,
    index_columns,
    key_id,
    plan_template,
)
from ..format.file_table import data_file_name
from ..format.row_checksums import row_crc32c
from ..sharding.grid import Grid
from ..transfer.saver import WriteResult

KINDS = ("tensor", "ndarray")
MAX_GROUPS = 64  # distinct layouts; more: the per-rank work per group outgrows the general path's
SUB_BATCH = 1024  # ranks whose chunks are copied (and checksummed) at once
FILE_THREADS = 3  # files written at once (the writer's own thread per file mostly waits)


@dataclass
class _Group:
    """Keys laid out alike: one grid, one dtype."""

    grid: Grid
    dtype: str
    itemsize: int
    keys: list[str]
    offsets: np.ndarray  # each key's writer offset (copies "one")
    all_copies: bool


@dataclass
class _Plan:
    """One file plan (a template) shared by ranks whose boxes have the same sizes."""

    template: FileTemplate
    order: np.ndarray  # item positions sorted by key id (the index's row order)
    ids: bytes  # sorted key ids (u64)
    crc_first: bytes  # sorted (u32)
    rel_sorted: np.ndarray  # u64
    item_group: np.ndarray  # group of each sorted row
    rel: np.ndarray  # each item's payload start (file order)
    first: np.ndarray  # each item's checksum position (file order)
    groups: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)
    # per group held: (group index, key indices into the group's keys, item positions in the file)
    select: dict[int, Any] = field(default_factory=dict)  # group -> its keys in file order (a slice when all, in order)


def _groups(plan: Any) -> list[_Group] | None:
    """The plan's keys grouped for bulk writing, or None when some chunk is too large or
    not a plain tensor (the general path then writes every file)."""
    by: dict[tuple, _Group] = {}
    largest: dict[int, int] = {}  # id(grid) -> elements of its largest box (keys of one shape share a grid)
    ranks: dict[int, Any] = {}
    for key, grid in plan.grids.items():
        spec = plan.entries[key]
        if spec.kind not in KINDS or grid.tiles != 1 or not spec.dtype:
            return None
        size = itemsize(spec.dtype)
        most = largest.get(id(grid))
        if most is None:
            most = largest[id(grid)] = math.prod(max((n for _, n in grid.intervals[d]), default=0)
                                                 if d in grid.intervals else s for d, s in enumerate(grid.shape))
        if not size or most * size >= ALIGNED_PAYLOAD_MIN or most * size > BLOCK_BYTES:
            return None
        sig = (_ranks(grid, ranks), grid.shape, grid.mesh_shape,
               tuple((d, tuple(ms)) for d, ms in grid.split_by.items()), tuple(grid.replica_dims),
               spec.dtype, spec.store.copies == "all")
        g = by.get(sig)
        if g is None:
            g = by[sig] = _Group(grid, spec.dtype, size, [], np.zeros(0, np.int64), spec.store.copies == "all")
        g.keys.append(key)
    for g in by.values():
        g.offsets = np.array([plan.entries[k].store.offset for k in g.keys], dtype=np.int64)
    return list(by.values())


def _ranks(grid: Grid, seen: dict[int, Any]) -> Any:
    """A hashable form of the grid's rank list (computed once per grid object)."""
    found = seen.get(id(grid))
    if found is None:
        rl = grid.rank_list
        found = seen[id(grid)] = (rl.start, rl.stop, rl.step) if isinstance(rl, range) else tuple(rl)
    return found


def _held(g: _Group, box: int, q: int) -> np.ndarray | None:
    """Indices of the group's keys a rank holding replica ``q`` of ``box`` writes (None: all)."""
    if g.all_copies or g.grid.replicas == 1:
        return None
    return np.flatnonzero((g.offsets + box) % g.grid.replicas == q)


class BulkWriter:
    """Writes the destination files of ``ranks`` for a reshard plan (see the module doc)."""

    def __init__(self, plan: Any, groups: list[_Group], source: Any, writer: StorageWriter, save_id: str,
                 budget: int, progress: Callable[[int], None] | None = None):
        self.plan, self.groups, self.source, self.writer = plan, groups, source, writer
        self.save_id, self.budget, self.progress = save_id, max(1, budget), progress
        self._plans: dict[tuple, _Plan] = {}

    # ---------------------------------------------------------------- per rank

    def _locate(self, rank: int) -> list[tuple[Box, np.ndarray | None, int] | None]:
        """Per group: (box, held key indices or None for all, box id), or None when the rank holds nothing."""
        out: list[tuple[Box, np.ndarray | None, int] | None] = []
        for g in self.groups:
            pos = g.grid.position(rank)
            if pos is None:  # a grid of merged boxes over some of the ranks: this rank writes none of it
                out.append(None)
                continue
            b, q = g.grid.locate(pos)
            box = g.grid.box(b)
            held = _held(g, b, q)
            out.append(None if not box.numel or (held is not None and not len(held)) else (box, held, b))
        return out

    def _file_plan(self, where: list[tuple[Box, np.ndarray | None, int] | None]) -> _Plan:
        sig = tuple(None if w is None else (w[0].sizes, None if w[1] is None else w[1].tobytes()) for w in where)
        found = self._plans.get(sig)
        if found is not None:
            return found
        rows: list[tuple[str, int, int, Box]] = []  # (key, group, key index, box)
        for gi, (g, w) in enumerate(zip(self.groups, where, strict=True)):
            if w is None:
                continue
            held = range(len(g.keys)) if w[1] is None else w[1].tolist()
            rows += [(g.keys[k], gi, k, Box((0,) * len(w[0].sizes), w[0].sizes)) for k in held]
        rows.sort(key=lambda r: r[0])  # the general path writes a file's chunks in key order
        items = [Item(key, 0, box, self.groups[gi].dtype, box.numel * self.groups[gi].itemsize)
                 for key, gi, _, box in rows]
        template = plan_template(items, [gi for _, gi, _, _ in rows], self.save_id)
        ids = np.array([key_id(k) for k, _, _, _ in rows], dtype=np.uint64)
        order = np.argsort(ids, kind="stable")  # one chunk per key: rows sort by key id alone
        item_group = np.array([gi for _, gi, _, _ in rows], dtype=np.int64)
        p = _Plan(template, order, ids[order].tobytes(), np.array(template.crc_first, dtype=np.uint32)[order].tobytes(),
                  np.array(template.rel, dtype=np.uint64)[order], item_group[order],
                  np.asarray(template.rel, dtype=np.int64), np.asarray(template.crc_first, dtype=np.int64))
        for gi in sorted(set(item_group.tolist())):
            at = np.flatnonzero(item_group == gi)
            keys = np.array([rows[i][2] for i in at], dtype=np.int64)
            p.groups.append((gi, keys, at))
            whole = len(keys) == len(self.groups[gi].keys) and (keys == np.arange(len(keys))).all()
            p.select[gi] = slice(None) if whole else keys
        self._plans[sig] = p
        return p

    # ---------------------------------------------------------------- batches

    def _batches(self, ranks: list[int]) -> list[tuple[list[int], list, list[Box | None]]]:
        """Ranks in batches whose bounding boxes (per group, all keys) fit the budget."""
        out = []
        cur: list[int] = []
        located: list = []
        bounds: list[tuple[list[int], list[int]] | None] = [None] * len(self.groups)

        def cost(bs: list) -> int:
            return sum(len(g.keys) * math.prod(hi - lo for lo, hi in zip(*b, strict=True)) * g.itemsize
                       for g, b in zip(self.groups, bs, strict=True) if b is not None)

        def close() -> None:
            out.append((list(cur), list(located),
                        [None if b is None else Box(tuple(b[0]), tuple(hi - lo for lo, hi in zip(*b, strict=True)))
                         for b in bounds]))

        for rank in ranks:
            where = self._locate(rank)
            grown = list(bounds)
            for gi, w in enumerate(where):
                if w is None:
                    continue
                lo, hi = list(w[0].offsets), [o + s for o, s in zip(w[0].offsets, w[0].sizes, strict=True)]
                b = grown[gi]
                grown[gi] = (lo, hi) if b is None else ([min(x, y) for x, y in zip(b[0], lo, strict=True)],
                                                        [max(x, y) for x, y in zip(b[1], hi, strict=True)])
            if cur and cost(grown) > self.budget:
                close()
                cur, located = [], []
                bounds = [None] * len(self.groups)
                grown = [None if w is None else (list(w[0].offsets),
                                                 [o + s for o, s in zip(w[0].offsets, w[0].sizes, strict=True)])
                         for w in where]
            cur.append(rank)
            located.append(where)
            bounds = grown
        if cur:
            close()
        return out

    def _stack(self, g: _Group, bbox: Box) -> np.ndarray:
        """Every key of the group read as ``bbox``: uint8 ``(keys, *bbox sizes)`` with the
        last dim in bytes (a 0-d tensor as one row of its bytes)."""
        sizes = bbox.sizes if bbox.sizes else (1,)
        stack = np.empty((len(g.keys), *sizes[:-1], sizes[-1] * g.itemsize), dtype=np.uint8)
        for k, key in enumerate(g.keys):
            t = self.source._read(self.source.meta.entries[key], bbox)
            stack[k] = t.reshape(sizes).contiguous().view(-1).view(torch.uint8).numpy().reshape(stack.shape[1:])
        if self.progress is not None:
            self.progress(stack.nbytes)
        return stack

    def write(self, ranks: list[int]) -> list[WriteResult]:
        """Write the files of ``ranks``; returns each rank's result, in rank order."""
        results: list[WriteResult] = []
        with ThreadPoolExecutor(FILE_THREADS, thread_name_prefix="dcp-reshard") as pool:
            for batch, located, bboxes in self._batches(sorted(ranks)):
                stacks = [None if b is None else self._stack(g, b) for g, b in zip(self.groups, bboxes, strict=True)]
                for lo in range(0, len(batch), SUB_BATCH):
                    hi = lo + SUB_BATCH
                    chunks, crcs = self._chunks(located[lo:hi], stacks, bboxes)
                    results.extend(pool.map(self._write_file, batch[lo:hi], located[lo:hi], chunks, crcs))
        return results

    def _chunks(self, located: list, stacks: list[np.ndarray | None], bboxes: list[Box | None]) -> tuple[list, list]:
        """Each rank's chunks per group (rows in file order), then their checksums, computed
        for all these ranks at once per row width."""
        chunks: list[list[np.ndarray | None]] = []
        widths: dict[int, list[tuple[int, int, np.ndarray]]] = {}
        for i, where in enumerate(located):
            mine: list[np.ndarray | None] = []
            select = self._file_plan(where).select if any(w is not None for w in where) else {}
            for gi, (g, w) in enumerate(zip(self.groups, where, strict=True)):
                if w is None:
                    mine.append(None)
                    continue
                box, bb = w[0], bboxes[gi]
                idx = tuple(slice(o - bo, o - bo + s) for o, bo, s in zip(box.offsets, bb.offsets, box.sizes,
                                                                           strict=True))
                if idx:
                    last = idx[-1]
                    idx = idx[:-1] + (slice(last.start * g.itemsize, last.stop * g.itemsize),)
                part = stacks[gi][(select[gi], *idx)]  # the keys in file order; only the rank's box is copied
                arr = np.ascontiguousarray(part).reshape(part.shape[0], -1)
                mine.append(arr)
                widths.setdefault(arr.shape[1], []).append((i, gi, arr))
            chunks.append(mine)
        crcs: list[dict[int, np.ndarray]] = [{} for _ in located]
        for parts in widths.values():
            sums = row_crc32c(np.concatenate([a for _, _, a in parts]))
            at = 0
            for i, gi, a in parts:
                crcs[i][gi] = sums[at:at + len(a)]
                at += len(a)
        return chunks, crcs

    def _write_file(self, rank: int, where: list, chunks: list[np.ndarray | None],
                    crcs: dict[int, np.ndarray]) -> WriteResult:
        result = WriteResult()
        if rank == self.plan.object_rank:
            result.objects.update({k: self.source.meta.entries[k].value for k in self.plan.objects})
        if all(w is None for w in where):
            return result  # holds nothing: no file (as the general path)
        p = self._file_plan(where)
        t = p.template
        header = t.header(t.text.format(*(",".join(map(str, w[0].offsets)) if w is not None else ""
                                          for w in where)))
        base = len(header)
        data = np.zeros(t.index_rel, dtype=np.uint8)
        table = np.zeros(t.n_crcs, dtype=np.uint32)
        rel, first = p.rel, p.first
        subs_of_group = np.zeros(len(self.groups), dtype=np.uint32)
        for gi, _, at in p.groups:
            arr = chunks[gi]
            width = arr.shape[1]
            starts = rel[at]
            if len(at) and (starts[-1] - starts[0] == width * (len(at) - 1)) and \
                    (len(at) < 2 or (np.diff(starts) == width).all()):
                data[starts[0]:starts[0] + arr.size] = arr.reshape(-1)
            else:
                data[(starts[:, None] + np.arange(width)).reshape(-1)] = arr.reshape(-1)
            table[first[at]] = crcs[gi]
            subs_of_group[gi] = where[gi][2]
        index = index_columns(np.frombuffer(p.ids, dtype=np.uint64), subs_of_group[p.item_group],
                              np.frombuffer(p.crc_first, dtype=np.uint32), p.rel_sorted + np.uint64(base), table)
        if len(index) != t.index_length:
            raise AssertionError("index size differs from its plan")
        name = data_file_name(rank, 0, self.save_id)
        pad = bytes(t.index_span - len(index))
        written = self.writer.write_file(name, [memoryview(header), memoryview(data), memoryview(index + pad)])
        result.files.append(md.FileRecord(name, "", rank, base + t.index_rel, t.index_length, crc32c.crc32c(index),
                                          base + t.index_rel + t.index_span))
        result.nbytes = written
        return result


def bulk_groups(plan: Any) -> list[_Group] | None:
    """The plan's keys grouped for :class:`BulkWriter`, or None when the general path must
    write it (a chunk of 64 KiB or more, a value that is not a tensor or ndarray, column
    bands, more than ``MAX_GROUPS`` distinct layouts)."""
    groups = _groups(plan)
    return groups if groups is not None and len(groups) <= MAX_GROUPS else None
