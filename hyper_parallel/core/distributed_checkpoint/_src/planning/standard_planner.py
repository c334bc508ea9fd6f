"""StandardPlanner: what every rank writes and reads, from layouts, in O(tensors).

Save: each rank describes its state dict by *structure* (keys, kinds, dtypes, shapes, and
for DTensors the layout: mesh shape, placements, the ranks of the mesh). Ranks with the same
structure share one description, so the exchange sends a digest per rank and each distinct
structure once. From the structures alone every rank computes the same global plan, in
O(tensors) (:mod:`.global_plan`); a rank then works out only its own writes. A DTensor's
layout is recorded as :mod:`..sharding.records` says; leaves become stored tensors, and
targets are checked, as :mod:`.leaves` says.

Load: every target box (a DTensor's local shard, or a whole tensor) is intersected with the
saved chunks by arithmetic (:mod:`.chunks`); the loader copies each overlap straight into
the target's memory. A target of another dtype is filled through a temporary of the saved
dtype and converted (``convert_dtype=False`` refuses instead).
"""

from __future__ import annotations

import hashlib
import math
import pickle
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..base.box import Box, uncovered
from ..base.dtypes import dtype_name, itemsize, torch_dtype
from ..base.errors import CorruptCheckpointError, StateDictMismatchError, UnsupportedValueError
from ..format import metadata as md
from ..format.chunk_info import check_chunk_info
from ..format.chunks import overlapping
from ..format.values import is_json_value
from ..sharding.grid import parse_placement
from ..sharding.ragged import RaggedPiece, ragged_mesh_dim
from ..sharding.records import dtensor_box, is_ragged_dtensor, layout_record, ragged_piece
from ..sharding.sharded_tensor import ShardPieces, is_shard_table, is_sharded_tensor, local_pieces, shard_table
from ..state.flatten import renamed_path
from ..state.topology_mapper import MapperLike, as_topology_mapper, rename_keys
from ..state.version_stamp import VersionStamp, stamp_of
from .global_plan import GlobalPlan
from .hyper_parallel_plans import SeedPlannerCalls
from .leaves import (
    bytes_tensor,
    check_saveable,
    check_writable,
    describe,
    fill_plain,
    kind_of,
    number_kind,
    numpy_tensor,
    numpy_tensor_view,
    part_name,
    pickled_tensor,
    refuse_value,
    shaped_like,
)
from .plan_cache import PLAN_CACHE, CachedSaveResult, PlanCache
from .planner import EntrySpec, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem
from .staged_bands import BandedSnapshot
from .streamed_snapshot import StreamedTensor

__all__ = ["StandardPlanner", "StandardSavePlanner", "StandardLoadPlanner"]


class StandardPlanner(SeedPlannerCalls, SavePlanner, LoadPlanner):
    """The default planner for save and load.

    HyperParallel's planner calls (``configure_planner``, ``build_local_plan``, ...) work on it
    too, for code that drives a planner itself (:mod:`.seed_plans`).

    Hooks for subclasses: :meth:`transform_key` (rename or drop one key) or, for changes
    that need the whole map, :meth:`transform_state_dict` (called on save and on load with
    the flattened ``{key: value}`` map); and every protocol method of
    :class:`~.planner.SavePlanner` / :class:`~.planner.LoadPlanner`. On load, every value
    kind (tensors, plain values, bytes, Stateful objects) goes back to the target key it
    was renamed from.

    Args:
        allow_pickle: save and load values that need pickle.
        enable_plan_caching: reuse the global save plan while the structure is unchanged.
        convert_dtype: on load, fill a target of another dtype through the saved dtype.
        allow_partial_load: HyperParallel's name for ``load(strict=False)``.
        flatten_state_dict: torch DCP's option. True (default): nested containers are stored
            flattened (``"optim.state.0.exp_avg"``) and load returns them nested. False is
            honoured where it means the same thing, a state dict whose values are not nested
            containers; one holding a nested container is refused (torch would store it as one
            pickled object), naming the key.
        flatten_sharded_tensors: torch DCP's option for nested legacy ``ShardedTensor`` values
            (FSDP1 with 2-D parallelism); either value is accepted. A ShardedTensor is saved as its
            shards (each a chunk of the global tensor) and loads in place; one whose local shards
            are not plain tensors is refused, naming the key.
        dedup_replicated_tensors: torch DCP's deprecated option (no effect there either);
            ``remove_redundancy``: HyperParallel's name. Replicated chunks are always written
            once.
        broadcast_replicated_tensors: HyperParallel's load option for plans it drives itself
            (:mod:`.seed_plans`): mark shards several ranks load the same for one reader. Our
            ``load`` shares such reads whatever this says.
        dedup_save_to_lowest_rank: torch DCP's option (``save_to_minimum_rank``: HyperParallel's
            name). False (default): a tensor held whole by several ranks (a plain tensor, a
            replicated DTensor of one box) is written by the least-loaded holder, largest
            first; True: by its lowest rank. The boxes of a sharded tensor with replicas are
            written by the replicas in turn either way (the format derives the writer from the
            layout).
        topology_mapper: renames keys after :meth:`transform_state_dict`: on load, each
            target key to the checkpoint key it is read from; on save, each key to the key
            stored (e.g. a pipeline stage's local layer numbers to the whole model's). A
            :class:`~.topology_mapper.TopologyMapper`, a ``{name: name}`` mapping, a callable
            or ``(regex, replacement)`` rules; two keys mapped to one name raise
            :class:`StateDictMismatchError`.

    Example — save and load every key under a new prefix::

        class Prefixed(StandardPlanner):
            def transform_key(self, key):
                return "v2." + key

    Example — stage 1 of a PP=2 split, whose layers are numbered from 0, loads layers 2-3
    of a whole-model checkpoint::

        mapper = TopologyMapper(rules=[(r"^layers\\.(\\d+)\\.", lambda m: f"layers.{int(m[1]) + 2}.")])
        load(stage.state_dict(), ckpt, planner=StandardPlanner(topology_mapper=mapper))
    """

    def __init__(self, allow_pickle: bool = False, *, enable_plan_caching: bool = True,
                 convert_dtype: bool = True, allow_partial_load: bool = False,
                 topology_mapper: MapperLike | None = None, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True, dedup_replicated_tensors: bool | None = None,
                 dedup_save_to_lowest_rank: bool = False, remove_redundancy: bool = True,
                 save_to_minimum_rank: bool = False, broadcast_replicated_tensors: bool = False):
        del dedup_replicated_tensors  # replicated chunks are always written once
        self.remove_redundancy = remove_redundancy  # HyperParallel's plans only (seed_plans); ours always dedup
        self.broadcast_replicated_tensors = broadcast_replicated_tensors
        for name, value in (("flatten_state_dict", flatten_state_dict),
                            ("flatten_sharded_tensors", flatten_sharded_tensors),
                            ("dedup_save_to_lowest_rank", dedup_save_to_lowest_rank),
                            ("save_to_minimum_rank", save_to_minimum_rank)):
            if not isinstance(value, bool):
                raise TypeError(f"{name} must be True or False, got {value!r}")
        self.flatten_state_dict = flatten_state_dict
        self.flatten_sharded_tensors = flatten_sharded_tensors
        self.dedup_save_to_lowest_rank = dedup_save_to_lowest_rank or save_to_minimum_rank
        self.allow_pickle = allow_pickle
        self.enable_plan_caching = enable_plan_caching
        self.convert_dtype = convert_dtype
        self.allow_partial_load = allow_partial_load
        self.topology_mapper = as_topology_mapper(topology_mapper)
        self.group_ranks: Sequence[int] | None = None  # global rank of each group rank (set by save/load)
        self._values: dict[str, Any] = {}
        self._paths: dict[str, tuple] = {}
        self._held: dict[str, tuple[Box, Any]] = {}
        self._stamps: dict[str, VersionStamp | None] = {}  # key -> its source tensor's stamp
        self._given_stamps: dict[int, VersionStamp | None] | None = None  # a snapshot's, by staged tensor
        self._banded: dict[int, BandedSnapshot] = {}
        self._stream: Any = None  # a streamed snapshot's SnapshotStream (set_up_save)
        self._origin: dict[str, str] = {}
        self._origin_identity = True

    def transform_key(self, key: str) -> str | None:
        """The checkpoint key of one flattened key, or None to leave it out; the identity."""
        return key

    def transform_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Rename or filter flattened keys (default: :meth:`transform_key` on each key).

        Overriding this instead of :meth:`transform_key` works too; on load, renamed keys
        are traced back to the target's keys by value identity, or by calling this on the
        one key alone.
        """
        if type(self).transform_key is StandardPlanner.transform_key:
            return state_dict
        out = {}
        for key, value in state_dict.items():
            new = self.transform_key(key)
            if new is not None:
                out[new] = value
        return out

    def original_key(self, key: str) -> str | None:
        """On load: the target's key that checkpoint key ``key`` was renamed from (None if unknown)."""
        return self._origin.get(key, key if self._origin_identity else None)

    def _transform(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """:meth:`transform_state_dict`, then ``topology_mapper``, remembering where each new
        key came from."""
        out = self.transform_state_dict(state_dict)
        self._origin_identity = out is state_dict
        self._origin = {} if out is state_dict else _trace_origins(self, state_dict, out)
        mapper = self.topology_mapper
        if mapper is not None:
            try:
                names = rename_keys(out, mapper)
            except ValueError as exc:
                raise StateDictMismatchError(str(exc)) from None
            mapped: dict[str, Any] = {}
            origin: dict[str, str] = {}
            paths: dict[str, tuple] = {}
            for key, value in out.items():
                new = names[key]
                mapped[new] = value
                paths[new] = renamed_path(self._path(key), new)  # stays nested where it was
                source = self._origin.get(key, key if self._origin_identity else None)
                if source is not None:
                    origin[new] = source
            out, self._origin, self._origin_identity, self._paths = mapped, origin, False, paths
        return out

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

    def _check_flat(self, state_dict: dict[str, Any], what: str) -> None:
        """``flatten_state_dict=False`` is honoured where flattening changes nothing: refuse a
        value stored through a nested container (torch would store that container as one
        pickled object; this library stores its leaves)."""
        if self.flatten_state_dict:
            return
        nested = next((k for k in state_dict if len(self._path(k)) > 1), None)
        if nested is not None:
            top = self._path(nested)[0]
            raise UnsupportedValueError(
                f"{what}: flatten_state_dict=False, but {top!r} is a nested container (holding {nested!r}): "
                "torch DCP would store it as one pickled object, this library stores each leaf under its "
                "flattened key and returns it nested on load. Use flatten_state_dict=True (the default), or "
                "pass a state dict whose values are not nested containers")

    def _path(self, key: str) -> tuple:
        return self._paths.get(key) or tuple(key.split("."))

    # ------------------------------------------------------------------ save

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
        if type(self).resolve_data is not StandardPlanner.resolve_data:
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
        if any(getattr(cls, name) is not getattr(StandardPlanner, name)
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
        return all(getattr(cls, name) is getattr(StandardPlanner, name)
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

    # ------------------------------------------------------------------ load

    def set_up_load(
        self, state_dict: dict[str, Any] | None, metadata: md.Metadata, is_coordinator: bool, rank: int = 0
    ) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self.rank = rank
        self._paths = dict(getattr(state_dict, "paths", {})) if state_dict is not None else {}
        if state_dict is not None:
            self._check_flat(state_dict, "load")
        self._targets = self._transform(state_dict) if state_dict is not None else None
        self.missing_keys: list[str] = []
        self.unexpected_keys: list[str] = []
        # A destination is a target's tensor, or (shape, dtype) to allocate on first use: the
        # loader checks every file's size before it asks, so a forged shape in .metadata never
        # makes us allocate more than the files can hold.
        self._dest: dict[str, torch.Tensor | tuple[tuple[int, ...], torch.dtype]] = {}
        self._alloc_lock = threading.Lock()
        self._results: dict[str, Any] = {}
        self._convert: dict[str, torch.Tensor] = {}  # key -> target tensor filled from a temporary
        # targets of several boxes (a RaggedShard's run, a ShardedTensor's local shards) read via their bounding box
        self._pieces: dict[str, tuple[RaggedPiece | ShardPieces, Box]] = {}
        self._lossy: list[str] = []  # conversions to a lesser kind of number (complex -> real, float -> int)

    def create_local_load_plan(self) -> LoadPlan:
        entries = self.metadata.entries
        if self._targets is None:
            wanted = {key: None for key in entries}
        else:
            wanted = self._targets
            gathered = self._gather_split_plain(wanted, entries)  # may add sub-keys to missing_keys
            self.missing_keys[:0] = [k for k in wanted if k not in entries and k not in gathered]
            taken = {k for keys in gathered.values() for k in keys}
            self.unexpected_keys = [k for k in entries if k not in wanted and k not in taken]
        items: list[ReadItem] = []
        targets: dict[str, Box] = {}
        for key, target in wanted.items():
            entry = entries.get(key)
            if entry is None:
                continue
            if entry.kind == "object":
                if kind_of(target) in ("tensor", "ndarray", "bytes"):
                    raise self._mismatch(key, entry, target)
                self._results[key] = fill_plain(key, entry.value, target, self.missing_keys)
                continue
            if entry.kind == "pickle" and not self.allow_pickle:
                raise UnsupportedValueError(
                    f"{key!r} holds a pickled Python object; loading it would run code from the "
                    "checkpoint. Pass allow_pickle=True only if you trust where it came from"
                )
            if isinstance(target, torch.Tensor) and not isinstance(target, DTensor):
                check_chunk_info(key, target)
            box, dest = self._destination(key, entry, target)
            if box is None:
                continue
            targets[key] = box
            self._dest[key] = dest
            items.extend(self._reads(key, entry, box))
        if self._lossy:
            warnings.warn(f"load: {len(self._lossy)} target(s) have a lesser kind of dtype than the checkpoint "
                          f"and lose part of each value in the conversion: {', '.join(self._lossy[:8])}"
                          f"{' ...' if len(self._lossy) > 8 else ''}; StandardPlanner(convert_dtype=False) refuses "
                          "instead", stacklevel=4)
        return LoadPlan(items, targets)

    def _gather_split_plain(self, wanted: dict[str, Any], entries: dict[str, md.Entry]) -> dict[str, list[str]]:
        """Plain values the checkpoint holds split into keys of their own (torch DCP, and so
        an imported torch checkpoint, stores ``{"extra": {"step": 1}}`` as ``extra.step`` and
        ``param_groups`` item by item), asked for by a target that holds them whole: each is
        put together from its parts into ``_results``. Returns {target key: the parts used}."""
        asked = [k for k, t in wanted.items() if k not in entries and kind_of(t) == "object"]
        if not asked:
            return {}
        under: dict[tuple[str, ...], list[tuple[str, md.Entry]]] = {}  # path prefix -> entries below it
        for k, e in entries.items():
            names = tuple(part_name(p) for p in e.path)
            for n in range(1, len(names)):
                under.setdefault(names[:n], []).append((k, e))
        out: dict[str, list[str]] = {}
        for key in asked:
            base = tuple(part_name(p) for p in self._paths.get(key, (key,)))
            parts = under.get(base, [])
            # only a value that is plain all through: tensors below it mean the target is not the checkpoint's
            if not parts or any(e.kind != "object" or k in wanted for k, e in parts):
                continue
            tree: dict[str, Any] = {}
            for _, e in parts:
                node = tree
                rest = [part_name(p) for p in e.path[len(base):]]
                for name in rest[:-1]:
                    node = node.setdefault(name, {})
                    if not isinstance(node, dict):
                        break
                else:
                    node[rest[-1]] = e.value
            value = shaped_like(tree, wanted[key])
            self._results[key] = fill_plain(key, value, wanted[key], self.missing_keys)
            out[key] = [k for k, _ in parts]
        return out

    def _destination(self, key: str, entry: md.Entry, target: Any) -> tuple[Box | None, Any]:
        shape, dtype = entry.shape, torch_dtype(entry.dtype)
        if target is None or entry.kind in ("bytes", "pickle"):
            if target is not None and entry.kind != kind_of(target):
                raise self._mismatch(key, entry, target)
            return Box.full(shape), (shape, dtype)
        if entry.kind not in ("tensor", "ndarray") or kind_of(target) not in ("tensor", "ndarray"):
            raise self._mismatch(key, entry, target)
        if is_sharded_tensor(target):
            if tuple(target.size()) != shape or (target.dtype != dtype and not self.convert_dtype):
                raise self._mismatch(key, entry, target)
            return self._shards_destination(key, entry, target, dtype)
        if isinstance(target, np.ndarray):
            if not target.flags.writeable:
                raise StateDictMismatchError(f"{key!r}: target numpy array is read-only")
            target = numpy_tensor_view(target, key)
        if tuple(target.shape) != shape or (target.dtype != dtype and not self.convert_dtype):
            raise self._mismatch(key, entry, target)
        local = target._local_tensor if isinstance(target, DTensor) else target
        check_writable(key, local)
        if is_ragged_dtensor(target):
            return self._ragged_destination(key, target, dtype)
        box = dtensor_box(target, key) if isinstance(target, DTensor) else Box.full(shape)
        if target.dtype != dtype and number_kind(target.dtype) < number_kind(dtype):
            self._lossy.append(f"{key!r} ({entry.dtype} -> {str(target.dtype).removeprefix('torch.')})")
        if target.dtype != dtype and box is not None:
            # read into a temporary of the saved dtype; finish_load converts into the target
            self._convert[key] = local
            return box, (box.sizes, dtype)
        return box, local

    def _ragged_destination(self, key: str, target: DTensor, dtype: torch.dtype) -> tuple[Box | None, Any]:
        """A RaggedShard target: its run is one box (filled in place) or several, read into
        a temporary of their bounding box (only the runs' regions are read, see
        :meth:`_reads`) and copied into the flat local tensor by :meth:`finish_load`."""
        piece = ragged_piece(target, key)
        if piece is None:
            return None, None
        local = piece.flat
        if not local.is_contiguous():
            raise StateDictMismatchError(f"{key!r}: the RaggedShard target's local tensor is not contiguous and cannot "
                                         "be filled in place; load into a contiguous local tensor")
        return self._pieces_destination(key, piece, target.dtype, dtype)

    def _shards_destination(self, key: str, entry: md.Entry, target: Any,
                            dtype: torch.dtype) -> tuple[Box | None, Any]:
        """A ShardedTensor target: each local shard's tensor is filled in place, from
        whatever boxes the checkpoint holds (one shard: read straight into it)."""
        try:
            pieces = local_pieces(target, key)
        except UnsupportedValueError as exc:
            raise StateDictMismatchError(str(exc)) from None
        if pieces is None:
            return None, None
        for tensor in pieces.tensors:
            check_writable(key, tensor)
        if target.dtype != dtype and number_kind(target.dtype) < number_kind(dtype):
            self._lossy.append(f"{key!r} ({entry.dtype} -> {str(target.dtype).removeprefix('torch.')})")
        return self._pieces_destination(key, pieces, target.dtype, dtype)

    def _pieces_destination(self, key: str, piece: RaggedPiece | ShardPieces, target_dtype: torch.dtype,
                            dtype: torch.dtype) -> tuple[Box, Any]:
        """A target of several boxes: one box of the saved dtype is filled in place; several
        (or another dtype) are read into a temporary of their bounding box (only the boxes'
        regions are read, see :meth:`_reads`) and copied into place by :meth:`finish_load`."""
        if len(piece.boxes) == 1 and target_dtype == dtype:
            return piece.boxes[0], piece.view(piece.boxes[0])
        ndim = len(piece.boxes[0].sizes)
        lo = tuple(min(b.offsets[d] for b in piece.boxes) for d in range(ndim))
        hi = tuple(max(b.offsets[d] + b.sizes[d] for b in piece.boxes) for d in range(ndim))
        bbox = Box(lo, tuple(h - o for o, h in zip(lo, hi, strict=True)))
        self._pieces[key] = (piece, bbox)
        return bbox, (bbox.sizes, dtype)

    def _mismatch(self, key: str, entry: md.Entry, target: Any) -> StateDictMismatchError:
        found = describe(target)
        saved = (f"a plain {type(entry.value).__name__}" if entry.kind == "object"
                 else f"{entry.kind} {entry.dtype} shape {list(entry.shape or ())}")
        return StateDictMismatchError(
            f"{key!r}: the checkpoint holds {saved}, but the target is {found} (Size mismatch, in torch DCP's "
            "words); make the target match (or convert after loading into a matching tensor)"
        )

    def _reads(self, key: str, entry: md.Entry, box: Box) -> list[ReadItem]:
        pieces = self._pieces.get(key)
        if pieces is not None:  # only the target's boxes inside the bounding box
            return [r for b in pieces[0].boxes for r in self._box_reads(key, entry, b)]
        return self._box_reads(key, entry, box)

    def _box_reads(self, key: str, entry: md.Entry, box: Box) -> list[ReadItem]:
        reads = []
        covered = 0
        for ref in overlapping(self.metadata, entry, box, self.rank):
            region = ref.box.intersect(box)
            if region is None:  # a column band of an overlapping box that misses the target
                continue
            reads.append(ReadItem(key, ref, region))
            covered += region.numel
        if covered != box.numel:  # saved chunks are disjoint (metadata validation checks it)
            missing = uncovered(box, [r.region for r in reads])
            shown = ", ".join(map(str, missing[:8])) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            if self.metadata.fragment is not None:  # a rank-local load reads its own fragment alone
                raise StateDictMismatchError(
                    f"{key!r}: this rank's fragment of the rank-local checkpoint holds no data for region(s) "
                    f"{shown} of the target region {box}: load(..., use_collectives=False) reads only the "
                    "rank's own shards (the layout it saved). Load with use_collectives=True to read every "
                    "rank's fragment under another layout")
            raise CorruptCheckpointError(
                f"{key!r}: the checkpoint holds no data for region(s) {shown} of the target region {box} "
                f"({box.numel - covered} of {box.numel} elements missing); a rank's chunk is missing from "
                "the checkpoint"
            )
        return reads

    def resolve_target(self, key: str) -> torch.Tensor:
        dest = self._dest[key]
        if isinstance(dest, tuple):
            with self._alloc_lock:
                dest = self._dest[key]
                if isinstance(dest, tuple):
                    dest = self._dest[key] = torch.empty(dest[0], dtype=dest[1])
        return dest

    def finish_load(self) -> dict[str, Any]:
        out = dict(self._results)
        for key in list(self._dest):
            tensor = self.resolve_target(key)
            if key in self._pieces:  # each box of the bounding box into the target's own memory
                piece, bbox = self._pieces[key]
                with torch.no_grad():
                    for b in piece.boxes:
                        piece.view(b).copy_(tensor[b.relative_to(bbox)])
            elif key in self._convert:
                with torch.no_grad():
                    self._convert[key].copy_(tensor)  # the saved dtype into the target's
            kind = self.metadata.entries[key].kind
            target = None if self._targets is None else self._targets.get(key)
            if kind == "ndarray":
                # filled in place: a numpy or torch target stays what it is
                out[key] = target if target is not None else tensor.numpy()
            elif kind == "bytes":
                out[key] = bytes(tensor.numpy().tobytes())
            elif kind == "pickle":
                out[key] = pickle.loads(tensor.numpy().tobytes())  # allow_pickle checked in plan
            else:
                out[key] = target if target is not None else tensor
        return out


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _trace_origins(planner: StandardPlanner, before: dict[str, Any], after: dict[str, Any]) -> dict[str, str]:
    """For a custom ``transform_state_dict``: new key -> original key, where it can be told.

    A value object found under exactly one original key names it; otherwise (equal small
    ints, None...) each candidate is transformed alone and the one that yields the new key
    wins. Keys that stay ambiguous are left out (loading a new value into them then raises).
    """
    by_id: dict[int, list[str]] = {}
    for key, value in before.items():
        by_id.setdefault(id(value), []).append(key)
    origin: dict[str, str] = {}
    for new, value in after.items():
        if new in before and before[new] is value:
            origin[new] = new
            continue
        candidates = by_id.get(id(value), [])
        if len(candidates) > 1:
            candidates = [k for k in candidates if new in planner.transform_state_dict({k: before[k]})]
        if len(candidates) == 1:
            origin[new] = candidates[0]
    return origin


StandardSavePlanner = StandardPlanner
StandardLoadPlanner = StandardPlanner
