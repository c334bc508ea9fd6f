"""reshard: rewrite a checkpoint for a new mesh, one data file per destination rank.

``reshard(src, dst, dst_mesh={"tp": 4})`` writes a new checkpoint (same format: safetensors
data files, ``.metadata`` committed last) in which every tensor keeps its sharding pattern —
its placement per mesh dim NAME — on the destination mesh, and each destination rank's
shards sit in that rank's own data file. A job with the new parallelism then reads each
rank's data from one place. Boxes that several destination ranks hold (replicated tensors,
plain tensors) are stored in each holder's file as replicas of one chunk, so no rank reads
another's file (``copy_replicas=False`` stores them once instead, to save space).

How it runs: every process computes the same plan from the source metadata (destination
boxes per rank, replicas given to the least-loaded holder, boxes larger than the memory
budget split into row slabs), checks that the source covers every box, then writes the
files of its share of destination ranks. Each chunk is filled by the loader's reader (only
the byte ranges that overlap it) and streamed out by the saver (checksummed blocks), one
chunk at a time, so memory stays within ``max_memory`` whatever the model size. The
coordinator commits ``.metadata`` after every file is written. When every destination chunk
is small (below 64 KiB: tens of thousands of ranks), :mod:`.bulk_write` writes the same files
with numpy over ranks and keys instead (one file plan per distinct rank shape, the source
read once per batch of ranks), so the cost per (rank, tensor) is a few array elements, not a
few Python objects.

In the code, :func:`reshard` checks its keywords once into a :class:`ReshardOptions` and runs
the phases in order, each a function returning what the next needs: read the source metadata,
agree on the plan (every rank plans alone and the ranks compare digests), prepare the
destination, write this process's files, commit the new metadata.

The N-d box math (intersection, subtraction, splitting) lives in :mod:`.box`; :class:`Box`
is re-exported here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import threading
import uuid
import warnings
import zlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch

from ..backends.filesystem import FileSystemWriter
from ..backends.locations import is_url, location
from ..backends.protocol import StorageReader, StorageWriter
from ..backends.resolve import reader_for, writer_for
from ..base.box import Box, uncovered
from ..base.dtypes import itemsize
from ..base.errors import CorruptCheckpointError
from ..base.options import Coordination
from ..coordination.coordinator import Coordinator
from ..engine.commit import commit_and_agree, write_and_report
from ..engine.metadata_reader import metadata_bytes
from ..format import metadata as md
from ..format.chunks import all_chunks, covered
from ..format.data_file import tensor_bytes
from ..format.metadata_build import build_metadata
from ..planning.planner import EntrySpec, SavePlan, WriteItem
from ..sharding.grid import Grid, shared_grid
from ..sharding.layout import Layout, TensorLayout
from ..sharding.placements import placement_to_name
from ..sharding.strategy import match_layout
from ..state.flatten import renamed_path
from ..state.topology_mapper import MapperLike, as_topology_mapper, rename_keys
from ..transfer.loader import check_files_hold, read_box
from ..transfer.saver import WriteResult, data_file_names, write_plan
from .bulk_write import BulkWriter, bulk_groups
from .merged_boxes import merged_layout, ranks_per_chunk

__all__ = ["reshard", "Box", "ReshardPlan", "plan_reshard", "renamed", "DEFAULT_MAX_MEMORY"]

DEFAULT_MAX_MEMORY = 256 << 20
WRITERS = 4  # destination files one process writes at once (see _write_files)
T = TypeVar("T")


def _plan_digest(plan: ReshardPlan) -> int:
    """A digest of what a plan writes (every entry with its destination layout and grid store,
    the ranks, the plain values): ranks of one reshard must agree on it before anything is
    written. Built from the metadata records the plan would commit, so nothing is elided."""
    def plain(o: Any) -> Any:  # numpy arrays whole (a repr elides their middle), records as fields
        if hasattr(o, "tolist"):
            return o.tolist()
        return dataclasses.asdict(o) if dataclasses.is_dataclass(o) else repr(o)

    entries = sorted(((k, e.kind, e.dtype, list(e.shape or ()), e.layout, e.store)
                      for k, e in plan.entries.items()), key=lambda t: t[0])
    text = json.dumps([plan.ranks, plan.object_rank, plan.objects, entries], sort_keys=True, default=plain)
    return zlib.crc32(text.encode())


@dataclass
class ReshardPlan:
    """What a reshard writes: the new checkpoint's entries (with their grid stores on the
    destination mesh) and, per destination rank, the chunks it holds (computed on demand)."""

    entries: dict[str, EntrySpec]
    ranks: list[int]  # destination ranks, in mesh order
    object_rank: int  # the destination rank whose result carries the plain values
    objects: list[str]
    grids: dict[str, Grid] = field(default_factory=dict)
    layouts: dict[str, TensorLayout | None] = field(default_factory=dict)  # destination layout per key
    dropped: dict[str, list[str]] = field(default_factory=dict)  # key -> source mesh dims the new mesh lacks

    def items(self, rank: int) -> list[WriteItem]:
        """The chunks destination rank ``rank`` holds (all replicas with ``copies == "all"``).

        Keys laid out alike (same shape, mesh and placements: the layers of a model) share
        one grid computation per rank, so a rank's items cost a few operations per key.
        """
        out: list[WriteItem] = []
        for grid, keys in self._groups():
            pos = grid.position(rank)
            if pos is None:  # a grid of merged boxes (min_chunk_bytes) over some of the ranks
                continue
            b, q = grid.locate(pos)
            subs = grid.band_subs(b)
            if not subs:
                continue
            for key, size, offset, all_copies in keys:
                if all_copies or q == (offset + b) % grid.replicas:
                    out.extend(WriteItem(key, box, box.numel * size, sub) for sub, box in subs)
        return out

    def _groups(self) -> list[tuple[Grid, list[tuple[str, int, int, bool]]]]:
        """Keys grouped by grid (shape, mesh, placements, tiles): (grid, [(key, itemsize, offset, all copies)])."""
        groups = self.__dict__.get("_by_grid")
        if groups is None:
            by: dict[tuple, tuple[Grid, list[tuple[str, int, int, bool]]]] = {}
            for key, grid in self.grids.items():
                spec = self.entries[key]
                rl = grid.rank_list
                sig = (grid.shape, grid.mesh_shape, tuple((d, tuple(ms)) for d, ms in grid.split_by.items()),
                       tuple(grid.replica_dims), grid.tiles,
                       (rl.start, rl.stop, rl.step) if isinstance(rl, range) else id(rl))
                by.setdefault(sig, (grid, []))[1].append(
                    (key, itemsize(spec.dtype), spec.store.offset, spec.store.copies == "all"))
            groups = self.__dict__["_by_grid"] = list(by.values())
        return groups

    def rank_bytes(self) -> dict[int, int]:
        return {r: sum(i.nbytes for i in self.items(r)) for r in self.ranks}


def _mesh(value: Any, what: str) -> Layout:
    try:
        return Layout.of(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{what}: {exc}") from None


def _source_layout(key: str, entry: md.Entry, src_mesh: Layout | None, dst: Layout) -> TensorLayout | None:
    rec = entry.layout
    if rec is None:
        return None
    shape = tuple(rec.get("mesh_shape") or ())
    names = None
    if src_mesh is not None and src_mesh.mesh_shape == shape:
        names = src_mesh.alias_name
    elif rec.get("mesh_dim_names") is None:
        if dst.ndim != len(shape):
            raise ValueError(
                f"{key!r}: its saved layout {rec} has no mesh dim names, and the destination mesh "
                f"{dst} has {dst.ndim} dims, not {len(shape)}; pass src_mesh= (a Layout or "
                "{name: size} mapping of the saving mesh) to name them")
        names = dst.alias_name  # unnamed meshes of equal rank: match dims by position
    try:
        return TensorLayout.from_record(rec, ndim=len(entry.shape or ()), names=names)
    except ValueError as exc:
        raise ValueError(f"{key!r}: cannot read its saved layout {rec}: {exc}") from None


def _record(tl: TensorLayout) -> dict[str, Any]:
    rec = tl.to_record()
    if not isinstance(tl.layout.rank_list, range):
        rec["rank_list"] = list(tl.layout.rank_list)
    return rec


def renamed(meta: md.Metadata, topology_mapper: MapperLike) -> md.Metadata:
    """``meta`` with every entry under the name ``topology_mapper`` gives its key (source -> new).

    Each entry keeps its source name as ``Entry.key`` (its chunks are found under that name
    in the data files) and gets the new name's nesting ``path``; :func:`plan_reshard` then
    plans, and the reader reads, by the new names. Returns ``meta`` itself when no name changes.

    Raises:
        ValueError: two source keys map to one name (names both), or a name is not a string.
    """
    names = rename_keys(meta.entries, as_topology_mapper(topology_mapper))
    if all(old == new for old, new in names.items()):
        return meta
    entries = {names[key]: dataclasses.replace(entry, path=renamed_path(entry.path, names[key]))
               for key, entry in meta.entries.items()}
    return dataclasses.replace(meta, entries=entries).attach()


def plan_reshard(
    meta: md.Metadata,
    dst_mesh: Any,
    src_mesh: Any = None,
    rules: Mapping[str, TensorLayout] | None = None,
    where: str = "source checkpoint",
    copy_replicas: bool = True,
    min_chunk_bytes: int | None = None,
) -> ReshardPlan:
    """Plan a reshard of ``meta`` onto ``dst_mesh`` (see :func:`reshard`); deterministic, O(tensors).

    Keys are planned under the names ``meta.entries`` gives them: pass ``renamed(meta, mapper)``
    to plan a renaming rewrite (``rules`` then match the new names). With ``min_chunk_bytes``,
    a tensor whose shards would be smaller is stored in chunks of several consecutive ranks'
    shards (:mod:`.merged_boxes`).

    Raises:
        CorruptCheckpointError: the source chunks of a key leave a region uncovered.
        ValueError: a layout or rule does not fit a key, or the meshes cannot be matched.
    """
    dst = _mesh(dst_mesh, "dst_mesh")
    src = _mesh(src_mesh, "src_mesh") if src_mesh is not None else None
    dst_ranks = set(dst.rank_list)
    everywhere = Layout(dst.mesh_shape, dst.alias_name, None if isinstance(dst.rank_list, range) else dst.rank_list)
    entries: dict[str, EntrySpec] = {}
    grids: dict[str, Grid] = {}
    layouts: dict[str, TensorLayout | None] = {}
    dropped: dict[str, list[str]] = {}
    objects: list[str] = []
    copies = "all" if copy_replicas else "one"
    meshes: dict[tuple[int, int], Layout] = {}  # merged meshes, one per (mesh, ranks per chunk)
    for key, entry in meta.entries.items():
        if entry.kind == "object":
            entries[key] = EntrySpec("object", entry.path)
            objects.append(key)
            continue
        shape = tuple(entry.shape or ())
        rule = match_layout(rules, key) if rules else None
        if rule is not None:
            tl = _rule_layout(key, entry, shape, rule)
            outside = sorted(set(tl.layout.rank_list) - dst_ranks)
            if outside:
                raise ValueError(f"{key!r}: rule {rule!r} places data on rank(s) {outside[:8]}, "
                                 f"which are not in the destination mesh {dst}")
        else:
            tl = _source_layout(key, entry, src, dst)
            if tl is not None:
                tl, lost = tl.on_mesh(dst)
                if lost:
                    dropped[key] = lost
        layouts[key] = tl
        _check_coverage(key, meta, entry, shape, where)
        # Tensors without a layout stay whole, held by every destination rank.
        storage = tl if tl is not None else TensorLayout(everywhere, {}, len(shape))
        group = ranks_per_chunk(tl, shape, itemsize(entry.dtype), min_chunk_bytes) if tl is not None else 1
        if group > 1:
            storage = merged_layout(tl, group, meshes)
        grid = _grid(key, shape, storage)
        offset = zlib.crc32(key.encode()) % grid.replicas
        store = md.GridStore(tiles=1, offset=offset, copies=copies,
                             layout=None if storage is tl else _record(storage))
        entries[key] = EntrySpec(entry.kind, entry.path, entry.dtype, shape,
                                 _record(tl) if tl is not None else None, store)
        if math.prod(shape):
            grids[key] = grid
    return ReshardPlan(entries, list(dst.rank_list), min(dst_ranks), objects, grids, layouts, dropped)


def _rule_layout(key: str, entry: md.Entry, shape: tuple[int, ...], rule: Any) -> TensorLayout:
    """The destination layout ``rules`` give ``key``, checked: a TensorLayout, for a tensor of its rank."""
    if entry.kind not in ("tensor", "ndarray"):
        raise ValueError(f"{key!r} is a {entry.kind} value; a layout rule can only split tensors")
    if not isinstance(rule, TensorLayout):
        raise TypeError(f"rules[{key!r}] is a {type(rule).__name__}, expected a TensorLayout")
    try:
        return rule.with_ndim(len(shape))
    except ValueError as exc:
        raise ValueError(f"{key!r} (shape {list(shape)}): rule {rule!r} does not fit: {exc}") from None


def _grid(key: str, shape: tuple[int, ...], storage: TensorLayout) -> Grid:
    """Where ``key``'s chunks go on the destination mesh (laid out as ``storage``)."""
    rank_list = storage.layout.rank_list
    try:
        # the layout's own rank tuple, not a copy: keys on one mesh then share it (ReshardPlan groups by it)
        return shared_grid(shape, storage.layout.mesh_shape, [placement_to_name(p) for p in storage.placements],
                           None if isinstance(rank_list, range) else rank_list)
    except ValueError as exc:
        raise ValueError(f"{key!r}: {exc}; pass rules= to give it another layout") from None


def _check_coverage(key: str, meta: md.Metadata, entry: md.Entry, shape: tuple[int, ...], where: str) -> None:
    full = Box.full(shape)
    if covered(meta, entry) == full.numel:
        return  # distinct boxes are disjoint (metadata validation checks it), so they cover it all
    missing = uncovered(full, [ref.box for ref in all_chunks(meta, entry)])
    shown = ", ".join(str(b) for b in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
    name = repr(key) if entry.key == key else f"{key!r} (source key {entry.key!r})"  # renamed
    raise CorruptCheckpointError(
        f"{name}: {where} holds no data for region(s) {shown} of its shape {list(shape)} "
        f"({sum(b.numel for b in missing)} of {full.numel} elements missing). A rank's chunk is missing "
        "from the checkpoint; reshard cannot invent it")


class _SourceData:
    """Reads destination chunks out of the source checkpoint (the saver's data resolver).

    A source tensor small enough is read whole once and kept (up to ``cache_bytes`` in
    all, least recently used out first), so a tensor split into thousands of small
    destination chunks costs one read; a larger chunk is produced in row slabs of at most
    ``slab_bytes``, which bounds memory. Safe to share between the threads that write
    several destination files at once: a tensor several of them ask for is read once.
    """

    def __init__(self, meta: md.Metadata, reader: StorageReader, options: ReshardOptions, writers: int = 1):
        # ``writers`` destination files are written at once: they share the read budget
        self.meta, self.reader, self.verify, self.progress = meta, reader, options.verify, options.progress
        self.buffer_bytes = max(1, max(1, options.max_memory // 8) // writers)
        self.slab_bytes = max(1, max(1, options.max_memory // 4) // writers)
        self.cache_bytes = self.cache_budget(options)
        self._cache: OrderedDict[str, tuple[torch.Tensor, memoryview]] = OrderedDict()
        self._cached = 0
        self._lock = threading.Lock()
        self._loading: dict[str, threading.Lock] = {}  # one reader per key; the others wait for it
        self.bytes_read = 0
        self.bytes_needed = 0

    def _read(self, entry: md.Entry, box: Box) -> torch.Tensor:
        dest, stats = read_box(entry, self.reader, box, verify=self.verify, buffer_bytes=self.buffer_bytes,
                               meta=self.meta)
        with self._lock:
            self.bytes_read += stats.bytes_read
            self.bytes_needed += stats.bytes_needed
        return dest

    @staticmethod
    def cache_budget(options: ReshardOptions) -> int:
        """Bytes of whole source tensors kept at once: half the memory budget."""
        return options.max_memory // 2

    def keeps_whole(self, entry: md.Entry) -> bool:
        """Whether a tensor is read whole and kept (a quarter of the cache at most)."""
        return _keeps_whole(entry, self.cache_bytes)

    def _whole(self, entry: md.Entry) -> tuple[torch.Tensor, memoryview] | None:
        """The whole source tensor and its bytes, when it is small enough to keep (cached)."""
        if not self.keeps_whole(entry):
            return None
        with self._lock:
            found = self._cache.get(entry.key)
            if found is not None:
                self._cache.move_to_end(entry.key)
                return found
            loading = self._loading.setdefault(entry.key, threading.Lock())
        with loading:
            with self._lock:
                found = self._cache.get(entry.key)
            if found is not None:
                return found
            whole = self._read(entry, Box.full(tuple(entry.shape or ())))
            found = (whole, tensor_bytes(whole))
            with self._lock:
                while self._cache and self._cached + entry.nbytes > self.cache_bytes:
                    old = self._cache.popitem(last=False)[1][0]  # the least recently used
                    self._cached -= old.numel() * old.element_size()
                self._cache[entry.key] = found
                self._cached += entry.nbytes
                self._loading.pop(entry.key, None)
            return found

    def resolve_data(self, item: WriteItem) -> Any:
        entry = self.meta.entries[item.key]
        if entry.kind == "object":
            return entry.value
        if self.progress is not None:
            self.progress(item.nbytes)
        found = self._whole(entry)
        if found is not None:
            whole, raw = found
            shape = tuple(entry.shape or ())
            run = _contiguous_run(shape, item.box)
            if run is not None:  # the chunk is one byte range of the whole tensor: no copy
                size = whole.element_size()
                return raw[run[0] * size:(run[0] + run[1]) * size]
            return whole[item.box.relative_to(Box.full(shape))]
        if item.nbytes <= self.slab_bytes or not item.box.ndim:
            return self._read(entry, item.box)
        return (self._read(entry, slab) for slab in item.box.split(max(1, self.slab_bytes // itemsize(entry.dtype))))


def _keeps_whole(entry: md.Entry, cache_bytes: int) -> bool:
    return entry.nbytes <= cache_bytes // 4


def _contiguous_run(shape: tuple[int, ...], box: Box) -> tuple[int, int] | None:
    """(first element, element count) of ``box`` in a row-major tensor of ``shape`` when
    the box is one contiguous range (dims before the last partial one have size 1), else None."""
    return _run(shape, box.offsets, box.sizes)


@functools.lru_cache(maxsize=1 << 16)
def _run(shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[int, int] | None:
    # keys laid out alike ask for the same box: computed once per (shape, box)
    i = len(shape) - 1
    while i >= 0 and sizes[i] == shape[i]:
        i -= 1
    if i < 0:
        return 0, math.prod(shape)
    if any(sizes[j] != 1 for j in range(i)):
        return None
    start, stride = 0, 1
    for j in range(len(shape) - 1, -1, -1):
        start += offsets[j] * stride
        stride *= shape[j]
    return start, math.prod(sizes)


def _share(plan: ReshardPlan, world: int) -> list[list[int]]:
    """Destination ranks per process: largest first, each to the least-loaded process."""
    if world == 1:
        return [list(plan.ranks)]
    loads = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    sizes = plan.rank_bytes()
    for r in sorted(sizes, key=lambda r: (-sizes[r], r)):
        p = min(range(world), key=lambda i: (loads[i], i))
        out[p].append(r)
        loads[p] += sizes[r]
    return out


@dataclass(frozen=True)
class ReshardOptions:
    """What a reshard writes and how it reads and writes: the keywords of :func:`reshard` other
    than the storage and the process group (its docstring says what each does), built once
    at the call and handed to each phase. Construction checks them: ``dst`` is ``dst_mesh``
    as a :class:`Layout`, ``mapper`` the ``topology_mapper`` as a mapper (or None).

    Raises:
        ValueError: no ``dst_mesh``, ``max_memory`` is not a positive int, or the mesh or the
            mapper cannot be read.
    """

    dst_mesh: Any
    src_mesh: Any = None
    rules: Mapping[str, TensorLayout] | None = None
    copy_replicas: bool = True
    topology_mapper: MapperLike | None = None
    max_memory: int = DEFAULT_MAX_MEMORY
    verify: bool = True
    sync_files: bool = True
    progress: Callable[[int], None] | None = None
    min_chunk_bytes: int | None = None
    dst: Layout = field(init=False, repr=False, compare=False)
    mapper: Any = field(init=False, repr=False, compare=False)  # anything with map_fqn, or None

    def __post_init__(self) -> None:
        if self.dst_mesh is None:
            raise ValueError("reshard needs dst_mesh: a DeviceMesh, a Layout or a {dim name: size} mapping")
        if not isinstance(self.max_memory, int) or self.max_memory < 1:
            raise ValueError(f"max_memory must be a positive number of bytes, found {self.max_memory!r}")
        if self.min_chunk_bytes is not None and (type(self.min_chunk_bytes) is not int or self.min_chunk_bytes < 1):
            raise ValueError(f"min_chunk_bytes must be None or a positive number of bytes, found "
                             f"{self.min_chunk_bytes!r}")
        object.__setattr__(self, "dst", _mesh(self.dst_mesh, "dst_mesh"))  # frozen: set once, here
        object.__setattr__(self, "mapper", as_topology_mapper(self.topology_mapper))


def reshard(
    src_path: str | os.PathLike | None,
    dst_path: str | os.PathLike | None,
    src_mesh: Any = None,
    dst_mesh: Any = None,
    *,
    rules: Mapping[str, TensorLayout] | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    process_group: Any = None,
    verify: bool = True,
    sync_files: bool = True,
    storage_reader: StorageReader | None = None,
    storage_writer: StorageWriter | None = None,
    coordinator_rank: int = 0,
    timeout: timedelta | float | None = None,
    copy_replicas: bool = True,
    progress: Callable[[int], None] | None = None,
    topology_mapper: MapperLike | None = None,
    min_chunk_bytes: int | None = None,
) -> md.Metadata | None:
    """Write a copy of a checkpoint laid out for ``dst_mesh``: one data file per destination rank.

    Every tensor saved as a DTensor keeps its placement per mesh dim name: a tensor split
    over ``"tp"`` on the source mesh is split over ``"tp"`` of the destination mesh (at its
    new size); mesh dims the destination lacks are dropped (a warning lists the keys), new
    ones replicate. Tensors saved without a layout (plain tensors, numpy arrays, bytes) stay
    whole; plain values carry over. ``rules`` overrides the layout of matching keys. The
    new metadata records every tensor's destination layout, so the result can be resharded
    again. ``topology_mapper`` renames keys on the way (e.g. a pipeline split's stage-local
    names to the whole model's).

    Without ``process_group`` it runs in this process alone (no process group needed). With
    one, every rank of the group must call it with the same arguments; the destination
    ranks' files are split among them and the coordinator commits.

    Args:
        src_path: the checkpoint to read (None when ``storage_reader`` is given).
        dst_path: where to write the new checkpoint; must not be ``src_path``. An existing
            checkpoint there stays intact until the new one commits.
        src_mesh: names the saving mesh's dims for tensors whose recorded mesh has the same
            shape (a ``DeviceMesh``, :class:`Layout` or ``{"tp": 8}``); default: the names the
            metadata recorded.
        dst_mesh: the destination mesh: a ``DeviceMesh``, :class:`Layout` or ``{"tp": 4}``
            (dim names -> sizes, in mesh order). Its ``rank_list`` names the data files.
        rules: ``{name or glob: TensorLayout}`` (first match wins) giving destination layouts
            that replace the kept pattern, e.g. to split a tensor saved whole.
        max_memory: bytes of tensor data held at once per process (default 256 MiB).
            Chunks are at most a quarter of it (larger boxes are split into row slabs); at
            most two chunks and two read buffers of an eighth are alive, so at most 3/4 of
            it, plus one checksum block (up to 4 MiB) per read buffer when ``verify`` reads
            part of a chunk. (The process's RSS can grow further by what the C allocator
            keeps cached after frees, and by the writers' I/O buffers: about 32 MiB per
            destination file being written, up to ``WRITERS`` files at once when the
            tensors kept whole outgrow half the budget.)
        process_group: share the work among this group's ranks.
        verify: check the source's crc32c on every byte read (reads whole checksummed rows
            of a chunk). ``verify=False`` reads exactly the overlapping bytes, unchecked.
        sync_files: fsync the new files before the commit.
        storage_reader / storage_writer: custom storage backends for source / destination.
        coordinator_rank: the group rank that reads the source metadata and commits.
        timeout: bound on each cross-rank exchange (seconds or timedelta).
        copy_replicas: store a box that several destination ranks hold (a replicated tensor)
            in each of their files, so every rank reads only its own file (default). False
            stores it once, in the least-loaded holder's file.
        progress: called with the bytes of each chunk this process has read (for a bar).
        topology_mapper: the new name of each source key: a
            :class:`~.topology_mapper.TopologyMapper`, a ``{source name: new name}``
            mapping, a callable, or ``(regex, replacement)`` rules; names it leaves alone
            stay. It maps source -> new (the keys a rewrite walks are the source's), the
            opposite of a load planner's mapper (target -> checkpoint), whose exact names
            turn around with ``TopologyMapper.inverse()``. ``rules`` match the new names.
        min_chunk_bytes: store a tensor whose destination shards would be smaller than this
            in chunks of that size or more, each several consecutive ranks' shards merged
            (1-d meshes; other layouts keep a chunk per rank). A checkpoint for tens of
            thousands of ranks of tiny shards then has fewer files: one tensor is read from
            a few of them, and each rank still reads its shard from one file. Default None:
            a chunk and a file per rank.

    Returns:
        The new checkpoint's :class:`Metadata` (on every rank of the group).

    Raises:
        CorruptCheckpointError: the source lacks data for some region of a key (names the key
            and the regions), or a checksum fails.
        ValueError: no ``dst_mesh``, ``dst_path`` is ``src_path``, a layout does not fit, or
            ``topology_mapper`` maps two source keys to one name (names both).
        RankFailedError: with a process group, when any rank failed (names each rank).

    Example::

        reshard("ckpt_tp8", "ckpt_tp4", dst_mesh={"tp": 4})
        # 4 processes then: load(sd, "ckpt_tp4") — rank r reads its shards from one file

        # a PP=2 checkpoint whose stages saved {"stage0": ..., "stage1": ...} with layers
        # numbered from 0, rewritten for a whole-model job (2 layers per stage):
        reshard("ckpt_pp2", "ckpt_pp1", dst_mesh={"dp": 1}, topology_mapper=[
            (r"^stage(\\d+)\\.layers\\.(\\d+)\\.", lambda m: f"layers.{2 * int(m[1]) + int(m[2])}.")])
    """
    options = ReshardOptions(dst_mesh, src_mesh, rules=rules, copy_replicas=copy_replicas,
                             topology_mapper=topology_mapper, max_memory=max_memory, verify=verify,
                             sync_files=sync_files, progress=progress, min_chunk_bytes=min_chunk_bytes)
    ends = _endpoints(src_path, dst_path, storage_reader, storage_writer, sync_files)
    coordination = Coordination(process_group, process_group is None, coordinator_rank=coordinator_rank,
                                timeout=timeout)
    return _reshard(ends, options, coordination)


# ----------------------------------------------------------------------------- the run, phase by phase
# _reshard calls each phase in turn; each returns what the next needs. Phases that every rank runs
# together go through the Coordinator, so a failure on one rank raises on all of them.


@dataclass(frozen=True)
class _Endpoints:
    """Where a reshard reads and writes, resolved once: the storage objects and the names its
    messages (and the cross-rank argument check) use."""

    reader: StorageReader
    writer: StorageWriter
    own_writer: bool  # made here from dst_path, so its settings are ours to tune
    target: str  # the destination as every rank must name it
    where: str  # the source's metadata file, in messages
    what: str  # "reshard to <destination>", in commit messages


def _endpoints(src_path: str | os.PathLike | None, dst_path: str | os.PathLike | None,
               reader: StorageReader | None, writer: StorageWriter | None, sync_files: bool) -> _Endpoints:
    """The storage a reshard reads and writes (from the paths unless given), checked."""
    if reader is None:
        if src_path is None:
            raise ValueError("say where the source is: src_path or storage_reader")
        reader = reader_for(src_path)
    own_writer = writer is None
    if writer is None:
        if dst_path is None:
            raise ValueError("say where to write: dst_path or storage_writer")
        if src_path is not None and location(src_path) == location(dst_path):
            raise ValueError(f"dst_path {os.fspath(dst_path)!r} is the source checkpoint; write to a new path")
        # one file per destination rank: thousands of small files sync faster as one batch
        writer = writer_for(dst_path, sync_files, defer_sync=True)
    # as given (absolute): nodes may reach one shared filesystem through different real paths
    target = (os.fspath(dst_path) if is_url(dst_path) else os.path.abspath(dst_path)) if dst_path is not None else (
        f"{type(writer).__name__} " + str(getattr(writer, "path", None) or getattr(writer, "url", None) or ""))
    where = f"{os.fspath(src_path) if src_path is not None else 'source'}/{md.METADATA_FILE}"
    what = f"reshard to {os.fspath(dst_path) if dst_path is not None else 'storage'}"
    return _Endpoints(reader, writer, own_writer, target, where, what)


@dataclass(frozen=True)
class _Planned:
    """The source metadata (under the new names) and what this reshard writes from it."""

    meta: md.Metadata
    plan: ReshardPlan
    bulk: Any  # bulk_groups(plan): None unless every destination chunk is small


def _reshard(ends: _Endpoints, options: ReshardOptions, coordination: Coordination) -> md.Metadata:
    """Read the source metadata, agree on the plan, prepare the destination, write this
    process's share of the destination files, commit; the reader is closed in any case."""
    coord = Coordinator(coordination.process_group, coordination.no_dist, coordination.coordinator_rank,
                        coordination.timeout)
    try:
        meta_bytes, save_id = _read_source_metadata(coord, ends)
        planned = _agree_on_plan(coord, ends, options, meta_bytes)
        _prepare_destination(coord, ends, options, planned)
        mine = _share(planned.plan, coord.world_size)[coord.rank]
        files = [n for r in mine for n in data_file_names(r, save_id, 1)]
        write = functools.partial(_write_files, ends, options, planned, mine, save_id)
        results = write_and_report(coord, ends.writer, "reshard (writing data)", write, files, ends.what, save_id)
        new_metadata = functools.partial(_new_metadata, planned, results, save_id, options.dst.world_size)
        return commit_and_agree(coord, ends.writer, "reshard (commit)", new_metadata, files, ends.what, save_id)
    finally:
        ends.reader.close()


def _agreed(coord: Coordinator, phase: str, fn: Callable[[], T],
            share: Callable[[T], Any] | None = None) -> tuple[T | None, list[Any]]:
    """``fn()`` run on this rank, its result kept here; every rank learns every rank's
    ``share(result)`` (None without ``share``), or every rank raises (as
    :meth:`Coordinator.exchange` does) when ``fn`` or ``share`` failed on any. Large results
    (the metadata's bytes, the plan) stay on their rank; only what ``share`` picks travels."""
    try:
        result, failure = fn(), None
    except BaseException as exc:  # reported to every rank by the exchange below, then re-raised
        result, failure = None, exc

    def report() -> Any:
        if failure is not None:
            raise failure
        return share(result) if share is not None else None

    return result, coord.exchange(phase, report)


def _read_source_metadata(coord: Coordinator, ends: _Endpoints) -> tuple[bytes, str]:
    """Every rank sets up its storage; the coordinator reads the source's ``.metadata`` and
    draws the new checkpoint's save id; every rank gets both (bytes, save id)."""
    def set_up() -> tuple[bytes, str] | None:
        ends.reader.set_up(coord.rank, coord.is_coordinator)
        ends.writer.set_up(coord.rank, coord.is_coordinator)
        if not coord.is_coordinator:
            return None
        return metadata_bytes(ends.reader, ends.where), uuid.uuid4().hex[:16]

    read, _ = _agreed(coord, "reshard (reading metadata)", set_up)
    return coord.broadcast(read)


def _plan(coord: Coordinator, ends: _Endpoints, options: ReshardOptions, meta_bytes: bytes) -> _Planned:
    """The source metadata parsed (its files checked on the coordinator, its keys renamed) and planned."""
    meta = md.Metadata.from_json(meta_bytes, where=ends.where).attach()
    if coord.is_coordinator:  # before slabs are planned from the shapes it gives
        check_files_hold(meta, ends.reader, ends.where)
    if options.mapper is not None:
        meta = renamed(meta, options.mapper)  # the reader reads by the new names too
    plan = plan_reshard(meta, options.dst, options.src_mesh, options.rules, ends.where,
                        copy_replicas=options.copy_replicas, min_chunk_bytes=options.min_chunk_bytes)
    return _Planned(meta, plan, bulk_groups(plan))


def _agree_on_plan(coord: Coordinator, ends: _Endpoints, options: ReshardOptions, meta_bytes: bytes) -> _Planned:
    """Every rank plans alone; the ranks compare destination, mesh and plan digest, and all raise
    (before anything is written) when they were called with different arguments."""
    planned, seen = _agreed(coord, "reshard (planning)", functools.partial(_plan, coord, ends, options, meta_bytes),
                            lambda p: (ends.target, str(options.dst), _plan_digest(p.plan)))
    if len(set(seen)) > 1:  # every rank sees the same list: every rank raises
        odd = [f"rank {r}: {t!r} on {m}" for r, (t, m, _) in enumerate(seen) if (t, m) != seen[0][:2]]
        raise ValueError(
            "reshard: the ranks of the group were called with different arguments; every rank must pass "
            f"the same dst_path, dst_mesh, src_mesh, rules and topology_mapper. Rank 0: {seen[0][0]!r} on "
            f"{seen[0][1]}; " + ("; ".join(odd) if odd else "their plans differ (src_mesh, rules or "
                                 "topology_mapper)") + ". Nothing was written")
    assert planned is not None  # _agreed raised if planning failed here
    return planned


def _prepare_destination(coord: Coordinator, ends: _Endpoints, options: ReshardOptions, planned: _Planned) -> None:
    """The writer's ``prepare`` on every rank; the coordinator warns about mesh dims the
    destination lacks (the tensors split over them are stored less split)."""
    if ends.own_writer and planned.bulk is not None and isinstance(ends.writer, FileSystemWriter):
        ends.writer.direct_io = False  # files of tiny chunks: O_DIRECT would pad, then truncate, each one
    coord.exchange("reshard (preparing the destination)", ends.writer.prepare)
    dropped = planned.plan.dropped
    if coord.is_coordinator and dropped:
        lost = sorted({n for names in dropped.values() for n in names})
        keys = list(dropped)
        warnings.warn(
            f"reshard: {len(keys)} tensor(s) were split over mesh dim(s) {lost}, which the "
            f"destination mesh {options.dst} lacks; they are stored less split there (e.g. {keys[:3]}). "
            "Pass rules= to choose their layouts", stacklevel=4)  # reshard's caller: here < _reshard < reshard


def _write_files(ends: _Endpoints, options: ReshardOptions, planned: _Planned, mine: list[int],
                 save_id: str) -> list[WriteResult]:
    """This process's destination files (ranks ``mine``), each chunk read from the source as it
    is written; the results as the coordinator needs them for the metadata."""
    if planned.bulk is not None:  # small chunks only: numpy over ranks and keys, one plan per file shape
        # the source slabs of a batch of ranks take half the budget (their chunks, copied
        # SUB_BATCH ranks at a time, a fraction of the rest)
        source = _SourceData(planned.meta, ends.reader, options)
        bulk = BulkWriter(planned.plan, planned.bulk, source, ends.writer, save_id,
                          max(1, options.max_memory // 2), options.progress)
        return [r.for_coordinator() for r in bulk.write(mine)]
    # When the tensors kept whole outgrow the cache, destination files are written WRITERS at
    # a time: they ask for the same source tensors at about the same time, so the cache serves
    # them all from one read (one file after the other re-read every tensor once per file).
    # The memory budget is split between them.
    cache_bytes = _SourceData.cache_budget(options)
    kept = sum(e.nbytes for e in planned.meta.entries.values() if _keeps_whole(e, cache_bytes))
    writers = max(1, min(WRITERS, len(mine))) if kept > cache_bytes else 1
    source = _SourceData(planned.meta, ends.reader, options, writers)
    one = functools.partial(_write_rank, planned.plan, source, ends.writer, save_id)
    if writers == 1:
        return [one(rank) for rank in sorted(mine)]
    with ThreadPoolExecutor(writers, thread_name_prefix="dcp-reshard") as pool:
        return list(pool.map(one, sorted(mine)))


def _write_rank(plan: ReshardPlan, source: _SourceData, writer: StorageWriter, save_id: str,
                rank: int) -> WriteResult:
    """Destination rank ``rank``'s data file (with the plain values on the plan's object rank)."""
    objects = plan.objects if rank == plan.object_rank else []
    sp = SavePlan(plan.entries, plan.items(rank), objects)
    return write_plan(sp, source, writer, rank, save_id, thread_count=1).for_coordinator()


def _new_metadata(planned: _Planned, results: list[list[WriteResult]] | None, save_id: str,
                  world_size: int) -> md.Metadata:
    """The new checkpoint's metadata, from every process's write results (on the coordinator)."""
    assert results is not None  # the coordinator, the only rank that builds it, got every result
    flat = [r for per_process in results for r in per_process]
    return build_metadata(planned.plan.entries, flat, save_id, world_size, dict(planned.meta.user))
