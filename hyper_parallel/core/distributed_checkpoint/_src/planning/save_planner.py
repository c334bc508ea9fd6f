"""BoxSavePlanner: what every rank writes, from layouts, in O(tensors).

Each rank describes its state dict by *structure* (keys, kinds, dtypes, shapes, and for
DTensors the layout: mesh shape, placements, the ranks of the mesh). Ranks with the same
structure share one description, so the exchange sends a digest per rank and each distinct
structure once. From the structures alone every rank computes the same global plan, in
O(tensors) (:mod:`.global_plan`); a rank then works out only its own writes. A DTensor's
layout is recorded as :mod:`..sharding.records` says; leaves become stored tensors, and
targets are checked, as :mod:`.leaves` says. A save's global plan may be reused by the next
save of the same structure (:mod:`.plan_cache`; :meth:`BoxSavePlanner.cache_key` scopes it).

What it is not: the load side (:mod:`.load_planner`), the options and key renaming both
sides share (:mod:`.planner_base`), nor the planner that does both
(:class:`~.standard_planner.StandardPlanner`, what ``save`` uses when given none).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..base.box import Box
from ..base.dtypes import dtype_name, itemsize
from ..base.errors import UnsupportedValueError
from ..format import metadata as md
from ..format.chunk_info import check_chunk_info
from ..format.values import is_json_value
from ..sharding.grid import parse_placement
from ..sharding.ragged import RaggedPiece, ragged_mesh_dim
from ..sharding.records import dtensor_box, is_ragged_dtensor, layout_record, ragged_piece
from ..sharding.sharded_tensor import ShardPieces, is_shard_table, is_sharded_tensor, local_pieces, shard_table
from ..state.topology_mapper import MapperLike
from ..state.version_stamp import VersionStamp, stamp_of
from .global_plan import GlobalPlan
from .leaves import bytes_tensor, check_saveable, numpy_tensor, pickled_tensor, refuse_value
from .plan_cache import PLAN_CACHE, CachedSaveResult, PlanCache
from .planner import EntrySpec, SavePlan, SavePlanner, WriteItem
from .planner_base import BoxPlannerBase, check_flags
from .staged_bands import BandedSnapshot
from .streamed_snapshot import StreamedTensor

__all__ = ["BoxSavePlanner"]


class BoxSavePlanner(BoxPlannerBase, SavePlanner):
    """Plans a save: this rank's structure, the global plan, and each write's data.

    :class:`~.standard_planner.StandardPlanner` is this and :class:`~.load_planner.BoxLoadPlanner`
    in one; subclass this one for a planner that only saves.

    Hooks for subclasses: :meth:`transform_key` / :meth:`transform_state_dict` (rename or drop
    keys, :mod:`.planner_base`) and every method of :class:`~.planner.SavePlanner`.

    Args:
        allow_pickle: save values that need pickle.
        enable_plan_caching: reuse the global save plan while the structure is unchanged.
        topology_mapper: renames each key to the key stored (see
            :class:`~.standard_planner.StandardPlanner`).
        flatten_state_dict, flatten_sharded_tensors, dedup_replicated_tensors,
            dedup_save_to_lowest_rank: torch DCP's options, as
            :class:`~.standard_planner.StandardPlanner` takes them.

    Example — save every key under a new prefix::

        class Prefixed(BoxSavePlanner):
            def transform_key(self, key):
                return "v2." + key

        save(model.state_dict(), path, planner=Prefixed())
    """

    def __init__(self, allow_pickle: bool = False, *, enable_plan_caching: bool = True,
                 topology_mapper: MapperLike | None = None, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True, dedup_replicated_tensors: bool | None = None,
                 dedup_save_to_lowest_rank: bool = False) -> None:
        del dedup_replicated_tensors  # replicated chunks are always written once
        check_flags(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                    dedup_save_to_lowest_rank=dedup_save_to_lowest_rank)
        self._set_options(allow_pickle, topology_mapper, flatten_state_dict, flatten_sharded_tensors)
        self._set_save_options(enable_plan_caching, dedup_save_to_lowest_rank)

    def _set_save_options(self, enable_plan_caching: bool, dedup_save_to_lowest_rank: bool) -> None:
        """Store the save options (checked by the caller) and a save's per-call state."""
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank
        self.enable_plan_caching = enable_plan_caching
        self.group_ranks: Sequence[int] | None = None  # global rank of each group rank (set by save)
        self._values: dict[str, Any] = {}
        self._held: dict[str, tuple[Box, Any]] = {}
        self._stamps: dict[str, VersionStamp | None] = {}  # key -> its source tensor's stamp
        self._given_stamps: dict[int, VersionStamp | None] | None = None  # a snapshot's, by staged tensor
        self._banded: dict[int, BandedSnapshot] = {}
        self._stream: Any = None  # a streamed snapshot's SnapshotStream (set_up_save)

    @property
    def _enable_plan_caching(self) -> bool:
        """Whether ``cache_result``/``get_cached`` keep and give plans (HyperParallel's name):
        ``enable_plan_caching`` unless HyperParallel's ``configure_planner`` turned it off
        (:mod:`.hyper_parallel_plans`)."""
        return self.__dict__.get("_seed_plan_caching", self.enable_plan_caching)

    @_enable_plan_caching.setter
    def _enable_plan_caching(self, value: bool) -> None:
        self.__dict__["_seed_plan_caching"] = bool(value)

    def cache_key(self) -> Any:
        """Global save plans are reused while this and every rank's structure are unchanged."""
        return (type(self).__qualname__, self.allow_pickle, self.max_tiles, self.tile_min_chunk_bytes,
                self.tile_min_band_bytes, self.dedup_save_to_lowest_rank)

    # ------------------------------------------------------------------ plan cache
    # HyperParallel's hooks (see :mod:`.plan_cache` for when save calls them). Both names are
    # the one process-wide cache: ``StandardSavePlanner._cached_save_result.clear()`` empties it.
    _cached_save_result: PlanCache = PLAN_CACHE
    cached_save_result: PlanCache = PLAN_CACHE  # HyperParallel's older name
    #: The entry this save's plan is cached under; save sets it before calling the hooks.
    _cached_plans_key: str | None = None
    _plan_cache_decision: tuple[CachedSaveResult | None] | None = None  # set by save around get_cached()

    def get_cached(self) -> CachedSaveResult | None:
        """The cached plan this save uses, or None when it makes a new one.

        ``save`` calls it once per save while plan caching is on, after every rank agreed
        whether the cached plan is used; this returns what they agreed (overriding it to
        return something else changes nothing). Called outside a save: the entry under
        ``_cached_plans_key``, if any.
        """
        if self._plan_cache_decision is not None:
            return self._plan_cache_decision[0]
        if not self._enable_plan_caching:
            return None
        return PLAN_CACHE.get(self._cached_plans_key) if self._cached_plans_key else None

    def cache_result(self, final_plan: SavePlan, metadata: md.Metadata | None) -> None:
        """Store ``final_plan`` (this rank's plan) under ``_cached_plans_key``.

        ``save`` calls it once per save that made a new plan, after the checkpoint is
        committed (``metadata``), while plan caching is on. The entry keeps the plan only: a
        save's metadata holds its plain values (the caller's objects), which the cache would
        keep alive. An override that does not call this caches nothing.

        A plan of HyperParallel's records (a save driven through ``configure_planner``) is kept
        with its ``metadata``, as HyperParallel's planner keeps it, while ``_enable_plan_caching``.
        """
        if not isinstance(final_plan, SavePlan):
            if self._enable_plan_caching and self._cached_plans_key:
                PLAN_CACHE[self._cached_plans_key] = CachedSaveResult(final_plan, metadata)  # type: ignore[arg-type]
            return
        if self.enable_plan_caching and self._cached_plans_key:
            PLAN_CACHE[self._cached_plans_key] = CachedSaveResult(final_plan, None)

    def set_up_save(self, state_dict: dict[str, Any], is_coordinator: bool) -> None:
        self._paths = dict(getattr(state_dict, "paths", {}))
        self._check_flat(state_dict, "save")
        # an async save's snapshot of tensors staged as their column bands, by the meta tensor
        # standing for each (renaming keys keeps the values)
        self._banded = {id(b.logical): b for b in getattr(state_dict, "bands", {}).values()}
        # an async save's snapshot: the stamps of the tensors it was copied from, by the staged
        # tensor standing for each (its local tensor for a DTensor, as this planner holds it)
        given = getattr(state_dict, "stamps", None)
        self._given_stamps = None if given is None else {
            id(_local(state_dict[k])): s for k, s in given.items() if k in state_dict}
        # an async save under a memory budget: tensors whose bytes are copied as they are written
        self._stream = getattr(state_dict, "stream", None)
        self._values = self._transform(state_dict)
        self.is_coordinator = is_coordinator

    def create_local_save_plan(self) -> SavePlan:
        """This rank's entries (structure) and the boxes it holds; no tensor data."""
        group_rank = None if self.group_ranks is None else {g: r for r, g in enumerate(self.group_ranks)}
        entries: dict[str, EntrySpec] = {}
        items: list[WriteItem] = []
        objects: list[str] = []
        self._held = {}
        self._stamps = {}
        for key, value in self._values.items():
            path = self._path(key)
            if is_ragged_dtensor(value):  # its flat run, as the ordinary boxes that hold the same elements
                self._check_saveable(key, value._local_tensor)
                piece = ragged_piece(value, key)
                entries[key] = EntrySpec("tensor", path, dtype_name(value.dtype), tuple(value.shape),
                                         layout_record(value, group_rank))
                if piece is not None:
                    self._hold_ragged(items, key, piece)
                continue
            if is_sharded_tensor(value):  # each local shard a chunk; every rank knows every shard's box
                self._hold_shards(items, entries, key, path, value, group_rank)
                continue
            if isinstance(value, DTensor):
                self._check_saveable(key, value._local_tensor)
                box = dtensor_box(value, key)
                dtype = dtype_name(value.dtype)
                entries[key] = EntrySpec("tensor", path, dtype, tuple(value.shape), layout_record(value, group_rank))
                if box is not None:
                    self._hold(items, key, box, value._local_tensor, stamped=True)
                continue
            if isinstance(value, torch.Tensor):
                check_chunk_info(key, value)
                kind, tensor = "tensor", value
            elif isinstance(value, np.ndarray):
                kind, tensor = "ndarray", numpy_tensor(value, key)
            elif isinstance(value, (bytes, bytearray)):
                kind, tensor = "bytes", bytes_tensor(value)
            elif is_json_value(value):
                entries[key] = EntrySpec("object", path)
                objects.append(key)
                self._held[key] = (Box((), ()), value)
                continue
            elif self.allow_pickle:
                kind, tensor = "pickle", pickled_tensor(key, value)
            else:
                raise refuse_value(key, value)
            self._check_saveable(key, tensor)
            shape = tuple(tensor.shape)
            entries[key] = EntrySpec(kind, path, dtype_name(tensor.dtype), shape)
            if tensor.numel():
                self._hold(items, key, Box.full(shape), tensor, stamped=kind == "tensor")
        return SavePlan(entries, items, objects)

    def _hold(self, items: list[WriteItem], key: str, box: Box, tensor: torch.Tensor, stamped: bool = False) -> None:
        items.append(WriteItem(key, box, box.numel * tensor.element_size()))
        self._held[key] = (box, self._staged(tensor) or tensor)
        if stamped:  # read now, before any byte is: a write after this makes the stamp older, never newer
            given = self._given_stamps
            self._stamps[key] = stamp_of(tensor) if given is None else given.get(id(tensor))

    def _hold_ragged(self, items: list[WriteItem], key: str, piece: RaggedPiece) -> None:
        """Hold a RaggedShard DTensor's local run: one write item per box (the global plan
        decides which rank writes each; sub ids are the global plan's)."""
        local = piece.flat
        staged = self._staged(local)
        if staged is not None:  # a streamed or banded stand-in has no flat data to view
            raise UnsupportedValueError(f"{key!r}: a RaggedShard DTensor cannot be staged in bands or streamed; "
                                        "save it without a staging memory budget")
        size = local.element_size()
        items.extend(WriteItem(key, box, box.numel * size, i) for i, box in enumerate(piece.boxes))
        self._held[key] = (None, piece)
        given = self._given_stamps
        self._stamps[key] = stamp_of(local) if given is None else given.get(id(local))

    def _hold_shards(self, items: list[WriteItem], entries: dict[str, EntrySpec], key: str, path: tuple,
                     value: Any, group_rank: dict[int, int] | None) -> None:
        """Hold a ShardedTensor's local shards: one write item per shard (the global plan,
        from the shard table every rank records alike, numbers them and makes each holder the
        writer of its own)."""
        entries[key] = EntrySpec("tensor", path, dtype_name(value.dtype), tuple(value.size()),
                                 shard_table(value, key, group_rank))
        pieces = local_pieces(value, key)
        if pieces is None:
            return
        for tensor in pieces.tensors:
            if self._staged(tensor) is not None:  # a streamed or banded stand-in is no shard's data
                raise UnsupportedValueError(f"{key!r}: a ShardedTensor cannot be staged in bands or streamed; "
                                            "save it without a staging memory budget")
            check_saveable(key, tensor)
        items.extend(WriteItem(key, box, box.numel * t.element_size(), i)
                     for i, (box, t) in enumerate(zip(pieces.boxes, pieces.tensors, strict=True)))
        self._held[key] = (None, pieces)
        given = self._given_stamps
        if len(pieces.tensors) == 1:  # one stamp per key: several shards are written whenever saved
            local = pieces.tensors[0]
            self._stamps[key] = stamp_of(local) if given is None else given.get(id(local))

    def source_stamp(self, item: WriteItem) -> VersionStamp | None:
        """The stamp of the tensor (a DTensor's local tensor) the caller holds for ``item``'s
        key; None for other values, and in a subclass that resolves write data its own way
        (its bytes need not be that tensor's)."""
        if type(self).resolve_data is not BoxSavePlanner.resolve_data:
            return None
        return self._stamps.get(item.key)

    def _staged(self, tensor: torch.Tensor) -> BandedSnapshot | StreamedTensor | None:
        """What an async save staged for ``tensor`` (its meta stand-in), if anything: its
        column bands, or the streamed tensor whose bytes are copied as they are written."""
        if self._stream is not None and tensor.device.type == "meta":
            streamed = self._stream.tensor_for(tensor)
            if streamed is not None:
                return streamed
        banded = self._banded.get(id(tensor)) if self._banded else None
        return banded if banded is not None and banded.logical is tensor else None

    def _check_saveable(self, key: str, tensor: torch.Tensor) -> None:
        staged = self._staged(tensor)
        if staged is None:
            check_saveable(key, tensor)
        elif isinstance(staged, StreamedTensor):  # the live tensor it is read from
            check_saveable(key, staged.source)
        # staged bands stand for a tensor checked when it was staged

    def structure_digest(self, plan: SavePlan) -> str:
        """Equal for ranks whose local plans have the same entries (the boxes follow from them)."""
        return hashlib.sha256(repr(sorted(plan.entries.items())).encode()).hexdigest()

    def create_global_save_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Every rank's writes, from every rank's entries (items are not needed).

        Ranks with equal structure may share one SavePlan object; the result computes a
        rank's own plan when it is asked for, so each rank does O(tensors) work.
        """
        with md.paused_gc():
            return GlobalPlan(self.tiles, plans, lowest_rank=self.dedup_save_to_lowest_rank)

    #: Column bands (format v2 ``tiles``): a saved chunk of at least ``tile_min_chunk_bytes``
    #: is cut along dim 1 into up to ``max_tiles`` bands (a power of two), each at least
    #: ``tile_min_band_bytes`` wide per row. A reader that wants some columns (a ``Shard(1)``
    #: load of a ``Shard(0)`` save) then reads and verifies only their bands; a reader of
    #: whole rows reads a box's bands in one call and copies each into place. Set
    #: ``max_tiles = 1`` (on the class or an instance) to store chunks whole. Each band is a
    #: chunk with its own records, checks and copies, so small boxes stay whole: at 512 KiB
    #: the bands of an adapter state's 512 KiB tensors cost an incremental step ~23% of its
    #: time, while reading such a box's whole rows for some of its columns cost a column load
    #: nothing measurable (``benchmarks/results/incremental.md``).
    max_tiles = 4
    tile_min_chunk_bytes = 1 << 20
    tile_min_band_bytes = 512

    def tiles(self, key: str, spec: EntrySpec) -> int:
        """Column bands per saved box of ``key`` (1: none); see :attr:`max_tiles`."""
        shape = tuple(spec.shape or ())
        if spec.kind != "tensor" or len(shape) < 2 or not math.prod(shape) or self.max_tiles <= 1:
            return 1
        if is_shard_table(spec.layout):
            return 1  # a ShardedTensor is stored as its shards, never in bands
        if spec.layout is not None and ragged_mesh_dim(spec.layout["placements"]) is not None:
            return 1  # a RaggedShard tensor is stored as its runs' boxes, never in bands
        boxes = cols = 1
        if spec.layout is not None:
            for m, name in zip(spec.layout["mesh_shape"], spec.layout["placements"], strict=False):
                p = parse_placement(name, len(shape))
                if len(p) > 1:  # a shard: more boxes, and fewer columns per box when it splits dim 1
                    boxes *= m
                    cols *= m if p[1] == 1 else 1
        size = itemsize(spec.dtype)
        if math.prod(shape) * size // boxes < self.tile_min_chunk_bytes:
            return 1
        box_cols = shape[1] // cols
        row_bytes = box_cols * math.prod(shape[2:]) * size
        t = min(self.max_tiles, box_cols, row_bytes // max(1, self.tile_min_band_bytes))
        return 1 << (t.bit_length() - 1) if t >= 1 else 1

    def staging_bands(self, key: str, value: Any) -> int:
        """Column bands a save with this planner cuts the local chunk of ``value`` into, so
        that an async save can stage it as those bands (:mod:`.staged_bands`); 1 for none,
        for a tensor off the CPU, and for a subclass that transforms values, resolves write
        data or decides bands its own way (it would not know the staged form, or could decide
        by the renamed key)."""
        cls = type(self)
        if any(getattr(cls, name) is not getattr(BoxSavePlanner, name)
               for name in ("set_up_save", "transform_state_dict", "create_local_save_plan", "resolve_data", "tiles")):
            return 1  # (an own tiles() may decide by the checkpoint key, which renaming changes)
        local = value._local_tensor if isinstance(value, DTensor) else value
        if (not isinstance(local, torch.Tensor) or local.device.type != "cpu" or local.dim() < 2
                or local.is_nested or local.layout != torch.strided or not local.numel()):
            return 1
        try:
            dtype = dtype_name(value.dtype)
            layout = layout_record(value) if isinstance(value, DTensor) else None
            return self.tiles(key, EntrySpec("tensor", (key,), dtype, tuple(value.shape), layout))
        except Exception:  # the save itself reports what it cannot take
            return 1

    def can_stream(self) -> bool:
        """Whether an async save under a memory budget can hand this planner a streamed
        snapshot (:mod:`.streamed_snapshot`): not a subclass that transforms values, holds or
        resolves write data its own way (it would meet meta stand-ins instead of data)."""
        cls = type(self)
        return all(getattr(cls, name) is getattr(BoxSavePlanner, name)
                   for name in ("set_up_save", "transform_state_dict", "create_local_save_plan", "resolve_data",
                                "prepare_writes"))

    def prepare_writes(self, files: list[list[WriteItem]]) -> None:
        """Tell a streamed snapshot the regions it is about to be asked for, in order."""
        if self._stream is None:
            return
        order = []
        for items in files:
            regions = []
            for item in items:
                box, value = self._held[item.key]
                if isinstance(value, StreamedTensor):
                    regions.append((value, item.box.relative_to(box)))
            order.append(regions)
        self._stream.expect(order)

    def resolve_data(self, item: WriteItem) -> torch.Tensor | Any:
        box, value = self._held[item.key]
        if isinstance(value, (RaggedPiece, ShardPieces)):
            return value.view(item.box)
        if isinstance(value, StreamedTensor):
            return value.region(item.box.relative_to(box))
        if isinstance(value, BandedSnapshot):
            return value.region(item.box.relative_to(box))
        if item.box == box or not isinstance(value, torch.Tensor):
            return value
        return value[item.box.relative_to(box)]  # a column band of the held box


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value
