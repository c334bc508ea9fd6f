"""HyperParallel's planner calls on :class:`~.standard_planner.StandardPlanner`.

HyperParallel's newer DCP drives a planner itself, with its own names and plan records, and its
code builds ``StandardSavePlanner``/``StandardLoadPlanner`` and calls them directly. Those two
names are our :class:`~.standard_planner.StandardPlanner`, which gets these calls from
:class:`HyperParallelPlannerCalls` (one object serves both: ``configure_planner`` with a ``metadata``
sets it up for a load, without one for a save):

=====================================================  ============================================
save                                                   load
=====================================================  ============================================
``configure_planner(state_dict, rank=, use_collectives=,``  ``configure_planner(state_dict, metadata, rank=,``
``enable_plan_caching=, remove_redundancy=, ...)``     ``broadcast_replicated_tensors=, ...)``
``build_local_plan()``: a ``SavePlan`` of write items  ``build_local_plan()``: a ``LoadPlan`` of read items
``build_global_plan(all_plans)``: (this rank's plan,   ``build_global_plan(all_plans)``: this rank's plan,
the checkpoint's ``Metadata``)                         its replicated shards marked with a ``BroadcastSource``
``get_data(item)``                                     ``acquire_tensor(item)`` / ``apply_tensor`` / ``apply_bytes``
``get_cached()`` / ``cache_result(plan, metadata)``
=====================================================  ============================================

The records are :mod:`.records`' and :mod:`..format.records`' (torch's classes in
HyperParallel's form). What the calls do, as HyperParallel's planner does it:

- a state dict is flattened by HyperParallel's rule (:mod:`..state.nested_paths`); a DTensor
  is written as the box this rank holds (the boxes of its run for a RaggedShard), a tensor with
  a ``chunk_info`` as that chunk of its global tensor (our own ``save`` takes only a whole
  tensor's), a plain tensor whole, any other value as a ``BYTE_IO`` item;
- the global save plan drops the copies of replicated items (:func:`.ownership.plan_ownership_masks`),
  numbers each tensor's chunks and describes every tensor once; ranks that describe a tensor
  differently are refused, naming it;
- a load reads, for each chunk this rank holds (:func:`.chunk_lists.create_chunk_list_for_tensor`),
  the overlap with every saved chunk (:func:`create_read_items_for_chunk_list`), straight into a
  view of the target; the global load plan picks one reader per shard several ranks hold
  (:func:`.replica_sources.shard_sources`);
- a save's cache entry is keyed by the planner's class and the flattened keys, and keeps the
  metadata (``_enable_plan_caching``: off without collectives).

Where it differs: a load's missing key is a :class:`~..base.errors.StateDictMismatchError` unless
``allow_partial_load`` (HyperParallel skips missing ``*step`` keys silently); a saved tensor that
does not cover what a rank asks for is a :class:`~..base.errors.CorruptCheckpointError`; a
destination in host memory is broadcast when the default group's backend handles the host (gloo),
where HyperParallel never broadcasts one; ``apply_bytes`` unpickles plain data only (containers,
numbers, strings) unless the planner was built with ``allow_pickle=True``.

Names a face exposes for patching (HyperParallel's tests patch ``standard_planner._is_on_host``)
are read through :func:`use_patch_points` at call time.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..base.allowlist_pickle import AllowlistUnpickler
from ..base.box import Box
from ..base.errors import CorruptCheckpointError, StateDictMismatchError, UnsupportedValueError
from ..format.chunk_info import CHUNK_INFO, ChunkInfo
from ..format.records import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
    dtype_element_size,
)
from ..sharding.records import dtensor_box, is_ragged_dtensor
from ..state.nested_paths import flatten_state_dict, set_element
from .chunk_lists import create_chunk_list_for_tensor
from .ownership import plan_ownership_masks
from .ragged_items import create_ragged_write_items, get_ragged_box_tensor
from .records import LoadItemType, LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType
from .replica_sources import mark_sources, shard_sources

__all__ = ["HyperParallelPlannerCalls", "create_read_items_for_chunk_list", "is_on_host", "use_patch_points",
           "plain_loads"]

_patch_points: Any = None


def use_patch_points(module: Any) -> None:
    """Read the replaceable functions (``_is_on_host``) from ``module`` at call time: the face
    that exposes them, so patching them there changes what the planner does."""
    global _patch_points
    _patch_points = module


def is_on_host(obj: Any) -> bool:
    """Whether a state-dict entry's local buffer is in host memory (a DTensor: its shard)."""
    local = obj.to_local() if isinstance(obj, DTensor) else obj
    return getattr(getattr(local, "device", None), "type", None) == "cpu"


def _on_host(obj: Any) -> bool:
    check = getattr(_patch_points, "_is_on_host", None) if _patch_points is not None else None
    return (check or is_on_host)(obj)


def _group_sends_host() -> bool:
    """Whether the default process group can broadcast host memory (gloo can; none: no)."""
    if not (dist.is_available() and dist.is_initialized()):
        return False
    backend = str(dist.get_backend()).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return "cpu" in {pair.split(":")[0] for pair in backend.split(",")}
    return "cpu" in (dist.Backend.backend_capability.get(backend) or ())


def create_read_items_for_chunk_list(fqn: str, checkpoint_md: Any, local_chunks: Sequence[Any],
                                     topology_mapper: Any = None, *, broadcastable: bool = True) -> list[ReadItem]:
    """The reads that fill ``local_chunks`` of tensor ``fqn`` from the saved chunks of
    ``checkpoint_md``: one per overlap, ``dest_index=MetadataIndex(fqn, local offsets, i)``,
    ``dest_offsets`` relative to the local chunk, ``storage_index=MetadataIndex(fqn, saved
    offsets, j)``, ``storage_offsets`` relative to the saved chunk, ``lengths``.

    ``topology_mapper`` (HyperParallel's ``TopologyMapper``): read from the checkpoint name it
    maps ``fqn`` to (its ``compute_required_shards``). A bool in its place is ``broadcastable``
    (HyperParallel's other signature).

    Raises:
        CorruptCheckpointError: a local chunk is not covered by the saved chunks (names the
            tensor and the chunk).

    Example::

        md = TensorStorageMetadata(TensorProperties("float32"), (4, 4), [ChunkStorageMetadata((0, 0), (4, 4))])
        create_read_items_for_chunk_list("w", md, [ChunkStorageMetadata((0, 0), (2, 4))])[0].lengths  # (2, 4)
    """
    if isinstance(topology_mapper, bool):
        topology_mapper, broadcastable = None, topology_mapper
    if topology_mapper is not None:
        items = topology_mapper.compute_required_shards(fqn, checkpoint_md, list(local_chunks))
        return [ReadItem(type=LoadItemType.TENSOR, dest_index=i.dest_index, dest_offsets=i.dest_offsets,
                         storage_index=i.storage_index, storage_offsets=i.storage_offsets, lengths=i.lengths,
                         broadcastable=broadcastable) for i in items]
    saved = [Box(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)) for c in checkpoint_md.chunks]
    items: list[ReadItem] = []
    for local_idx, chunk in enumerate(local_chunks):
        local = Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
        covered = 0
        for storage_idx, box in enumerate(saved):
            overlap = local.intersect(box)
            if overlap is None or (not overlap.numel and local.numel):
                continue
            covered += overlap.numel
            items.append(ReadItem(
                type=LoadItemType.TENSOR,
                dest_index=MetadataIndex(fqn, local.offsets, local_idx),
                dest_offsets=tuple(o - lo for o, lo in zip(overlap.offsets, local.offsets, strict=True)),
                storage_index=MetadataIndex(fqn, box.offsets, storage_idx),
                storage_offsets=tuple(o - so for o, so in zip(overlap.offsets, box.offsets, strict=True)),
                lengths=overlap.sizes,
                broadcastable=broadcastable))
        if covered < local.numel:
            raise CorruptCheckpointError(
                f"{fqn!r}: the checkpoint's chunks cover {covered} of the {local.numel} elements of the chunk at "
                f"offsets {local.offsets} sizes {local.sizes} this rank loads; a saved chunk is missing")
    return items


class _PlainUnpickler(AllowlistUnpickler):
    """Containers, numbers, strings and bytes only: a pickle naming any class or function is
    refused, so decoding runs no code from the checkpoint. ``where`` is the value's key."""

    def refusal(self, what: str) -> Exception:
        if what.startswith("a persistent id"):
            return UnsupportedValueError(f"{self.where!r}: the saved value holds a persistent reference")
        return UnsupportedValueError(
            f"{self.where!r}: the saved value is a pickled {what}; loading it would run code from the "
            "checkpoint. Build the planner with allow_pickle=True only if you trust where it came from")


def plain_loads(value: bytes, key: str) -> Any:
    """Unpickle ``value`` if it holds plain data only (see :class:`_PlainUnpickler`)."""
    return _PlainUnpickler(value, key).load()


def _own_plan_index(all_plans: Sequence[Any], rank: int) -> int:
    own = rank if len(all_plans) > 1 else 0
    if not 0 <= own < len(all_plans):
        raise ValueError(f"rank {rank} has no plan among the {len(all_plans)} gathered plans; pass every rank's "
                         "local plan, in rank order")
    return own


def _tensor_item(fqn: str, chunk: ChunkStorageMetadata, dtype: torch.dtype, size: Sequence[int]) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn, tuple(chunk.offsets)), type=WriteItemType.TENSOR,
                     tensor_data={"chunk": chunk, "properties": TensorProperties(dtype=str(dtype)),
                                  "size": torch.Size(size)})


class HyperParallelPlannerCalls:
    """HyperParallel's planner calls (see the module docstring), mixed into StandardPlanner.

    Uses the planner's ``enable_plan_caching``, ``allow_partial_load``, ``allow_pickle``,
    ``dedup_save_to_lowest_rank``, ``remove_redundancy`` and ``broadcast_replicated_tensors``
    options as defaults; ``configure_planner``'s keywords override them for one save or load.
    """

    enable_plan_caching: bool
    allow_partial_load: bool
    allow_pickle: bool
    dedup_save_to_lowest_rank: bool
    remove_redundancy: bool = True
    broadcast_replicated_tensors: bool = False
    _cached_plans_key: str | None
    _enable_plan_caching: bool  # the save planner's (save_planner.BoxSavePlanner); configure_planner sets it

    # ------------------------------------------------------------------ both

    def configure_planner(self, state_dict: dict[str, Any], metadata: Any = None, **kwargs: Any) -> None:
        """Set up a save (no ``metadata``) or a load (``metadata``: the checkpoint's
        ``Metadata``) of ``state_dict``, a nested or flat state dict.

        Keywords: ``is_coordinator``, ``rank`` (default 0), ``flatten_state_dict`` (default
        True); a save's ``use_collectives`` (False: no dedup, no plan cache), ``incremental``
        (no plan cache), ``enable_plan_caching``, ``remove_redundancy``,
        ``save_to_minimum_rank``; a load's ``broadcast_replicated_tensors``.
        """
        self.is_coordinator = bool(kwargs.get("is_coordinator", False))
        self.rank = int(kwargs.get("rank", 0) or 0)
        self._seed_flatten = bool(kwargs.get("flatten_state_dict", True))
        self.original_state_dict = state_dict
        if self._seed_flatten:
            self.state_dict, self.name_mapping = flatten_state_dict(state_dict)
        else:
            self.state_dict, self.name_mapping = dict(state_dict), {}
        if metadata is not None:
            self._seed_load = True
            self.metadata = metadata
            self.broadcast_replicated_tensors = bool(kwargs.get("broadcast_replicated_tensors",
                                                                self.broadcast_replicated_tensors))
            return
        self._seed_load = False
        self.remove_redundancy = bool(kwargs.get("remove_redundancy", self.remove_redundancy))
        self.save_to_minimum_rank = bool(kwargs.get("save_to_minimum_rank", self.dedup_save_to_lowest_rank))
        caching = self.enable_plan_caching
        if not kwargs.get("use_collectives", True):
            self.remove_redundancy, caching = False, False
        elif kwargs.get("incremental", False):
            caching = False
        elif "enable_plan_caching" in kwargs:
            caching = bool(kwargs["enable_plan_caching"])
        self._enable_plan_caching = caching
        self._cached_plans_key = f"{type(self).__name__}:{'||'.join(self.state_dict)}"

    def _configured(self, load: bool) -> None:
        if getattr(self, "_seed_load", None) is not load:
            raise RuntimeError(f"configure_planner(state_dict{', metadata' if load else ''}, ...) must set the "
                               f"planner up for a {'load' if load else 'save'} first")

    def build_local_plan(self) -> SavePlan | LoadPlan:
        """This rank's local plan: a save's write items or a load's read items."""
        if getattr(self, "_seed_load", None) is None:
            raise RuntimeError("configure_planner(...) must set the planner up first")
        return self._local_load_plan() if self._seed_load else self._local_save_plan()

    def build_global_plan(self, all_plans: list[Any]) -> Any:
        """Every rank's local plans (in rank order) to this rank's plan: a save's with chunk
        indices, and the checkpoint's ``Metadata``; a load's with its shared shards marked."""
        if getattr(self, "_seed_load", None) is None:
            raise RuntimeError("configure_planner(...) must set the planner up first")
        return self._global_load_plan(all_plans) if self._seed_load else self._global_save_plan(all_plans)

    def finalize_plan(self, plan: Any) -> Any:
        """The plan to carry out (as it is)."""
        return plan

    # ------------------------------------------------------------------ save

    def _local_save_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, DTensor):
                if is_ragged_dtensor(obj):
                    items.extend(create_ragged_write_items(fqn, obj))
                    continue
                box = dtensor_box(obj, fqn)
                if box is not None:
                    chunk = ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))
                    items.append(_tensor_item(fqn, chunk, obj.dtype, obj.shape))
            elif isinstance(obj, torch.Tensor):
                info = getattr(obj, CHUNK_INFO, None)
                if info is not None and not isinstance(info, ChunkInfo):
                    raise ValueError(f"{fqn!r}: its {CHUNK_INFO!r} attribute must be a ChunkInfo, found "
                                     f"{type(info).__name__}")
                if info is not None:
                    items.append(_tensor_item(fqn, info.chunk, obj.dtype, info.global_shape))
                else:
                    chunk = ChunkStorageMetadata(offsets=torch.Size((0,) * obj.dim()), sizes=torch.Size(obj.shape))
                    items.append(_tensor_item(fqn, chunk, obj.dtype, obj.shape))
            else:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        return SavePlan(items=items, planner_data=self.name_mapping if self._seed_flatten else None)

    def _global_save_plan(self, all_plans: list[Any]) -> tuple[SavePlan, Metadata]:
        own = _own_plan_index(all_plans, self.rank)
        masks = (plan_ownership_masks(all_plans, save_to_minimum_rank=self.save_to_minimum_rank)
                 if self.remove_redundancy and len(all_plans) > 1 else None)
        tensors: dict[str, tuple[Any, Any, list[Any]]] = {}
        described: dict[str, Any] = {}
        own_items: list[Any] = []
        for plan_index, plan in enumerate(all_plans):
            for position, item in enumerate(plan.items):
                if masks is not None and not masks[plan_index][position]:
                    continue
                if item.type == WriteItemType.TENSOR and item.tensor_data is not None:
                    data = item.tensor_data
                    fqn = item.index.fqn
                    known = tensors.setdefault(fqn, (data.properties, tuple(data.size), []))
                    if known[0] != data.properties or known[1] != tuple(data.size):
                        raise ValueError(f"{fqn!r}: ranks describe it differently: {known[0]} of size {known[1]} "
                                         f"and {data.properties} of size {tuple(data.size)}")
                    if plan_index == own:
                        own_items.append(dataclasses.replace(
                            item, index=dataclasses.replace(item.index, index=len(known[2]))))
                    known[2].append(data.chunk)
                elif item.type == WriteItemType.BYTE_IO:
                    if plan_index == own:
                        own_items.append(item)
                    described[item.index.fqn] = BytesStorageMetadata()
                else:
                    raise ValueError(f"{item.index.fqn!r}: unsupported write item type {item.type}")
        for fqn, (properties, size, chunks) in tensors.items():
            described[fqn] = TensorStorageMetadata(properties=properties, size=torch.Size(size), chunks=chunks)
        metadata = Metadata(state_dict_metadata=described)
        if self._seed_flatten:
            mapping: dict[str, Any] = {}
            for p in all_plans:
                mapping.update(p.planner_data or {})
            metadata.planner_data = mapping
        return dataclasses.replace(all_plans[own], items=own_items), metadata

    def get_data(self, item: Any) -> Any:
        """A write item's data now: a tensor item's as a detached host tensor (a RaggedShard
        box shaped as the box), a ``BYTE_IO`` item's value as it is."""
        fqn = item.index.fqn
        if fqn not in self.state_dict:
            raise KeyError(f"{fqn!r} is not in the state dict this planner was configured with")
        obj = self.state_dict[fqn]
        if item.type == WriteItemType.BYTE_IO:
            return obj
        if isinstance(obj, DTensor):
            local = get_ragged_box_tensor(obj, item.index) if is_ragged_dtensor(obj) else obj.to_local()
            return local.detach().to("cpu")
        if isinstance(obj, torch.Tensor):
            return obj.detach().to("cpu")
        raise TypeError(f"{fqn!r}: a tensor write item, but the state dict holds a {type(obj).__name__}")

    # ------------------------------------------------------------------ load

    def _local_load_plan(self) -> LoadPlan:
        entries = self.metadata.state_dict_metadata
        items: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = entries.get(fqn)
            if md is None:
                if self.allow_partial_load:
                    continue
                raise StateDictMismatchError(f"{fqn!r} is not in the checkpoint; load with allow_partial_load=True "
                                             "to leave it as it is")
            if not isinstance(md, TensorStorageMetadata):
                items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(fqn), dest_offsets=(0,),
                                      storage_index=MetadataIndex(fqn), storage_offsets=(0,), lengths=(0,)))
                continue
            info = getattr(obj, CHUNK_INFO, None) if isinstance(obj, torch.Tensor) else None
            shape = getattr(info, "global_shape", None) if info is not None else getattr(obj, "shape", None)
            if shape is None or tuple(md.size) != tuple(shape):
                raise StateDictMismatchError(f"{fqn!r}: the checkpoint holds shape {tuple(md.size)}, the target "
                                             f"{None if shape is None else tuple(shape)}")
            sendable = not _on_host(obj) or _group_sends_host()
            items.extend(create_read_items_for_chunk_list(fqn, md, create_chunk_list_for_tensor(obj),
                                                          broadcastable=sendable))
        return LoadPlan(items=items)

    def _global_load_plan(self, all_plans: list[Any]) -> LoadPlan:
        own = all_plans[_own_plan_index(all_plans, self.rank)]
        if not self.broadcast_replicated_tensors or len(all_plans) < 2:
            return own
        entries = self.metadata.state_dict_metadata

        def element_size(index: Any) -> int:
            properties = getattr(entries.get(index.fqn), "properties", None)
            return dtype_element_size(getattr(properties, "dtype", None))

        return mark_sources(own, shard_sources(all_plans, element_size))

    def acquire_tensor(self, read_item: Any) -> torch.Tensor:
        """The view of the target that ``read_item`` fills (a RaggedShard box's view of the flat
        local tensor, a DTensor's local shard, or the tensor), detached so a leaf that requires
        grad can be written."""
        fqn = read_item.dest_index.fqn
        if fqn not in self.state_dict:
            raise KeyError(f"{fqn!r} is not in the state dict this planner was configured with")
        target = self.state_dict[fqn]
        if isinstance(target, DTensor):
            local = get_ragged_box_tensor(target, read_item.dest_index) if is_ragged_dtensor(target) \
                else target.to_local()
        else:
            local = target
        local = local.detach()
        offsets, lengths = tuple(read_item.dest_offsets), tuple(read_item.lengths)
        if not offsets or not lengths or local.dim() == 0:
            return local
        return local[tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offsets, lengths, strict=True))]

    def apply_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        """Nothing left to do: the reader wrote into the view :meth:`acquire_tensor` gave; a
        tensor that is not that view is copied into it."""
        view = self.acquire_tensor(read_item)
        if tensor.data_ptr() != view.data_ptr() or tensor.shape != view.shape:
            with torch.no_grad():
                view.copy_(tensor)

    def apply_bytes(self, read_item: Any, value: bytes) -> None:
        """Put a ``BYTE_IO`` entry's value in the state dict (and the nested one it came from):
        ``value`` unpickled, plain data only unless ``allow_pickle``."""
        fqn = read_item.dest_index.fqn
        obj = pickle.loads(value) if self.allow_pickle else plain_loads(bytes(value), fqn)
        self.state_dict[fqn] = obj
        if self._seed_flatten and fqn in self.name_mapping:
            set_element(self.original_state_dict, self.name_mapping[fqn], obj)

