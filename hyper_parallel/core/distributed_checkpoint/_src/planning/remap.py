"""Loads into tensors named and laid out differently from the checkpoint's: :class:`RemapLoadPlanner`.

A Hugging Face checkpoint stores a layer's query, key and value projections as three tensors
where a model holds one fused, interleaved tensor, and a block's experts one tensor apiece where
a model stacks them. This planner loads such a checkpoint without ever putting a checkpoint
tensor together in memory. It is given, per state-dict entry, the :class:`~.remap_blocks.RemapBlock`
entries that fill it (which box of the entry comes from which region of which checkpoint tensor,
through an affine index map and elementwise ``post`` operations). Each rank cuts the blocks to
the shards it holds (a DTensor's local box, a plain tensor's ``chunk_info`` chunk, a RaggedShard
run's boxes, the whole of a plain tensor) and plans reads of exactly the checkpoint regions those
parts need, one read per saved chunk a region overlaps. A part that is a plain region of the
checkpoint in another order (unit steps, no ``post``) is read straight into a view of the
destination; anything else is read into a buffer in the checkpoint's dtype, then gathered, run
through ``post`` and cast into place (:mod:`.region_buffers`). What no block describes goes to a
:class:`~.deferred_reads.DeferredRead`: whole checkpoint tensors handed to a function once.

Shards several ranks load the same (a ``Replicate`` placement) are marked in the global step with
a ``BroadcastSource`` (:mod:`.replica_sources`), when ``broadcast_replicated_tensors`` is on, so
that a driver that broadcasts reads them once.

The planner speaks both load-planner protocols, calling the same code:

===================================  =====================================  ===========================
step                                 torch DCP (``LoadPlanner``)            HyperParallel's names
===================================  =====================================  ===========================
every rank: take the state dict      ``set_up_planner(sd, md, is_coord)``   ``configure_planner(sd, md, **kw)``
every rank: this rank's reads        ``create_local_plan()``                ``build_local_plan()``
global step                          ``create_global_plan(plans)`` (the     ``build_global_plan(plans)``
                                     coordinator; every rank's plan back)   (every rank; its own plan)
every rank: the plan to execute      ``finish_plan(plan)``                  ``finalize_plan(plan)``
per read: where it lands             ``resolve_tensor(item)``               ``acquire_tensor(item)``
per read: it has landed              ``commit_tensor(item, tensor)``        ``apply_tensor(item, tensor)``
per byte item                        ``load_bytes(item, BytesIO)``          ``apply_bytes(item, bytes)``
===================================  =====================================  ===========================

The plan's records are built in one place, :func:`read_item` (and :class:`LoadPlan`), so their
class can change without touching the planning.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlanner
from torch.distributed.tensor import DTensor

from ..base.box import Box, first_overlap, uncovered
from ..base.dtypes import torch_dtype
from ..format.chunk_info import CHUNK_INFO
from ..sharding.records import is_ragged_dtensor
from ..state.nested_paths import flatten_state_dict as _flatten
from .chunk_lists import create_chunk_list_for_tensor
from .deferred_reads import DeferredGathering, DeferredRead
from .ragged_items import get_ragged_box_tensor
from .records import LoadItemType, LoadPlan, ReadItem
from .region_buffers import RegionBuffer
from .remap_blocks import BlockPiece, RemapBlock, direct_view, gather
from .replica_sources import mark_sources, shard_key, shard_sources

__all__ = ["RemapLoadPlanner", "read_item", "DEFERRED_FQN_PREFIX"]

DEFERRED_FQN_PREFIX = "<deferred>/"
"""Deferred reads land in no state-dict entry; their items name ``<deferred>/{i}/{source}``
(``i``: the read's position in ``deferred``), which no dotted state-dict key can be."""


def read_item(dest_index: MetadataIndex, dest_offsets: Sequence[int], storage_index: MetadataIndex,
              storage_offsets: Sequence[int], lengths: Sequence[int], broadcastable: bool = True) -> ReadItem:
    """A tensor read of the plan: ``lengths`` elements of the saved chunk ``storage_index`` from
    ``storage_offsets`` (relative to the chunk), for the destination shard ``dest_index`` at
    ``dest_offsets`` (relative to the shard)."""
    return ReadItem(type=LoadItemType.TENSOR, dest_index=dest_index, dest_offsets=torch.Size(dest_offsets),
                    storage_index=storage_index, storage_offsets=torch.Size(storage_offsets),
                    lengths=torch.Size(lengths), broadcastable=broadcastable)


def _item_key(item: Any) -> tuple:
    """What tells the reads of one plan apart, whatever marks the global step put on them."""
    return (shard_key(item.dest_index), tuple(item.dest_offsets), shard_key(item.storage_index),
            tuple(item.storage_offsets))


@dataclass(frozen=True)
class _Landing:
    """Where one read of the plan lands: straight into ``dest`` (a box of the destination, in
    global coordinates) through ``walker``, or into ``buffer`` (when it is not None) at ``part``
    (the read's box of the checkpoint tensor)."""

    fqn: str
    dest_index: Any
    part: Box
    dest: Box | None = None
    walker: tuple[int, ...] | None = None
    buffer: RegionBuffer | None = None


def _dtype_of(md: Any, source: str) -> torch.dtype:
    """The checkpoint dtype of a tensor's metadata (a torch dtype, or a name: "bfloat16", "torch.bfloat16")."""
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    try:
        return torch_dtype(name)
    except ValueError:
        found = getattr(torch, name, None)
        if isinstance(found, torch.dtype):
            return found
    raise ValueError(f"checkpoint tensor {source!r} has dtype {dtype!r}, which is not a torch dtype")


def _backend_handles(device: torch.device) -> bool:
    """Whether the default process group can broadcast a tensor on ``device`` (True without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    backend = str(dist.get_backend()).lower()
    if ":" in backend:  # "cpu:gloo,cuda:nccl"
        return device.type in {pair.split(":")[0] for pair in backend.split(",")}
    capable = dist.Backend.backend_capability.get(backend)
    return capable is None or device.type in capable


class RemapLoadPlanner(LoadPlanner):
    """Load planner for a checkpoint whose tensors are named and laid out differently from the
    state dict: each entry of ``table`` is filled by its blocks, read region by region.

    Args:
        table: ``{state-dict key (flattened, dotted): [RemapBlock, ...]}``; the blocks of one entry
            must not overlap. Entries of the state dict not in ``table`` are left as they are.
            Default None (no entries; a subclass may fill ``self.table`` before planning).
        deferred: whole-tensor reads for what no block describes. Default ().
        broadcast_replicated_tensors: mark the shards several ranks load the same so that one rank
            reads each and broadcasts it (a driver that broadcasts carries it out; torch's ``load``
            reads every item anyway). HyperParallel's ``configure_planner`` and this class's
            ``set_up_planner`` may override it per load. Default False.

    Raises:
        ValueError: a table value is not a sequence of :class:`RemapBlock`, two blocks of an entry
            overlap or differ in dimensions, or ``deferred`` holds something else than
            :class:`DeferredRead`. While planning: an entry the state dict lacks or that is not a
            tensor, a block outside its entry's shape, a checkpoint tensor that is missing, has
            another number of dimensions than the block's ``base``, or is smaller than a block
            reads (the message names the checkpoint tensor).

    Example::

        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
        planner = RemapLoadPlanner({"attn.qk": [
            RemapBlock((0, 0), (4, 3), "q", (0, 0), ((1, 0), (0, 1))),
            RemapBlock((4, 0), (2, 3), "k", (0, 0), ((1, 0), (0, 1)))]})
        load(state_dict, storage_reader=HuggingFaceStorageReader(path), planner=planner)
    """

    def __init__(self, table: Mapping[str, Sequence[RemapBlock]] | None = None,
                 deferred: Sequence[DeferredRead] = (), broadcast_replicated_tensors: bool = False) -> None:
        self.table: dict[str, tuple[RemapBlock, ...]] = {}
        for fqn, blocks in (table or {}).items():
            self.table[fqn] = self._checked_blocks(fqn, blocks)
        self.deferred: tuple[DeferredRead, ...] = tuple(deferred)
        for read in self.deferred:
            if not isinstance(read, DeferredRead):
                raise ValueError(f"deferred must hold DeferredRead records, found {type(read).__name__}")
        self.broadcast_replicated_tensors = bool(broadcast_replicated_tensors)
        self.state_dict: dict[str, Any] | None = None
        self.original_state_dict: Any = None
        self.metadata: Any = None
        self.is_coordinator = False
        self.rank = 0
        self._landings: dict[tuple, _Landing] = {}
        self._shards: dict[tuple, torch.Tensor] = {}
        self._local_plan: LoadPlan | None = None

    @staticmethod
    def _checked_blocks(fqn: str, blocks: Any) -> tuple[RemapBlock, ...]:
        if isinstance(blocks, RemapBlock) or not isinstance(blocks, Sequence):
            raise ValueError(f"table[{fqn!r}] must be a sequence of RemapBlock, found {type(blocks).__name__}")
        blocks = tuple(blocks)
        for block in blocks:
            if not isinstance(block, RemapBlock):
                raise ValueError(f"table[{fqn!r}] holds a {type(block).__name__}; expected RemapBlock records")
        if len({block.box.ndim for block in blocks}) > 1:
            raise ValueError(f"the blocks of {fqn!r} differ in their number of dimensions: "
                             f"{[block.offsets for block in blocks]}")
        clash = first_overlap([block.box for block in blocks])
        if clash is not None:
            a, b = (blocks[i] for i in clash)
            raise ValueError(f"two blocks of {fqn!r} overlap: {a.box} (from {a.source!r}) and {b.box} "
                             f"(from {b.source!r}); each element of an entry comes from one place")
        return blocks

    # ------------------------------------------------------------------ set-up

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False, *,
                       rank: int | None = None, broadcast_replicated_tensors: bool | None = None,
                       flatten_state_dict: bool = True) -> None:
        """torch DCP's step 0, on every rank: the state dict to fill and the checkpoint's metadata
        (anything with ``state_dict_metadata``). ``rank`` defaults to this process's global rank."""
        if metadata is None or not hasattr(metadata, "state_dict_metadata"):
            raise ValueError("RemapLoadPlanner needs the checkpoint's metadata (with state_dict_metadata), "
                             f"got {type(metadata).__name__}")
        self.original_state_dict = state_dict
        flat = dict(state_dict)
        if flatten_state_dict and any(isinstance(v, Mapping) for v in flat.values()):
            flat = _flatten(state_dict)[0]
        self.state_dict = flat
        self.metadata = metadata
        self.is_coordinator = bool(is_coordinator)
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = int(rank)
        if broadcast_replicated_tensors is not None:
            self.broadcast_replicated_tensors = bool(broadcast_replicated_tensors)
        self._landings = {}
        self._shards = {}
        self._local_plan = None

    def configure_planner(self, state_dict: Any, metadata: Any, **kwargs: Any) -> None:
        """HyperParallel's name for :meth:`set_up_planner` (keywords ``is_coordinator``, ``rank``,
        ``broadcast_replicated_tensors``, ``flatten_state_dict``; others are ignored)."""
        self.set_up_planner(state_dict, metadata, kwargs.get("is_coordinator", False), rank=kwargs.get("rank"),
                            broadcast_replicated_tensors=kwargs.get("broadcast_replicated_tensors"),
                            flatten_state_dict=kwargs.get("flatten_state_dict", True))

    # ------------------------------------------------------------------ plans

    def create_local_plan(self) -> LoadPlan:
        """This rank's reads: the part of every block inside each shard it holds, one read per
        saved chunk that part's region overlaps, then the deferred reads' whole tensors."""
        if self.state_dict is None or self.metadata is None:
            raise RuntimeError("RemapLoadPlanner is not set up: call set_up_planner (or configure_planner) first")
        self._landings = {}
        self._shards = {}
        items: list[ReadItem] = []
        for fqn, blocks in self.table.items():
            if fqn not in self.state_dict:
                raise ValueError(f"the remap table names {fqn!r}, which the state dict does not have")
            items.extend(self._plan_entry(fqn, self.state_dict[fqn], blocks))
        for position, read in enumerate(self.deferred):
            items.extend(self._plan_deferred(position, read))
        self._local_plan = LoadPlan(items=items)
        return self._local_plan

    build_local_plan = create_local_plan

    def _sources_of(self, plans: Sequence[Any]) -> dict:
        if not self.broadcast_replicated_tensors or len(plans) < 2:
            return {}
        return shard_sources(plans, self._shard_element_size)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        """torch DCP's global step (on the coordinator): every rank's plan, the items of shared
        shards marked with who reads them."""
        sources = self._sources_of(global_plan)
        return [mark_sources(plan, sources) for plan in global_plan]

    def build_global_plan(self, all_plans: list[Any]) -> LoadPlan:
        """HyperParallel's global step (on every rank, over every rank's plan in rank order; the
        plans may be :meth:`~.records.LoadPlan.identity` copies): this rank's own plan, marked."""
        if self._local_plan is None:
            raise RuntimeError("build_global_plan before build_local_plan: this rank has no plan to mark")
        return mark_sources(self._local_plan, self._sources_of(all_plans))

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        """The plan to execute, as the global step left it."""
        return central_plan

    finalize_plan = finish_plan

    def _shard_element_size(self, index: Any) -> int:
        """Bytes per element of the shard ``index`` names (the state dict's dtype; 4 for a
        deferred read, which fills no entry): what broadcasting it moves."""
        obj = self.state_dict.get(index.fqn) if self.state_dict else None
        dtype = getattr(obj, "dtype", None)
        return dtype.itemsize if isinstance(dtype, torch.dtype) else 4

    # ------------------------------------------------------------------ planning one entry

    def _checkpoint_tensor(self, source: str) -> Any:
        md = self.metadata.state_dict_metadata.get(source)
        if md is None:
            raise ValueError(f"the checkpoint has no tensor {source!r} (a remap block or deferred read names it)")
        if getattr(md, "chunks", None) is None or getattr(md, "size", None) is None:
            raise ValueError(f"checkpoint entry {source!r} is not a tensor ({type(md).__name__}); "
                             "a remap block or deferred read can only read tensors")
        return md

    def _broadcastable(self, fqn: str, local: torch.Tensor) -> bool:
        for read in self.deferred:
            if read.targets is None or fqn in read.targets:
                return False  # a broadcast would overwrite what the deferred function wrote here
        return _backend_handles(local.device)

    def _plan_entry(self, fqn: str, obj: Any, blocks: tuple[RemapBlock, ...]) -> list[ReadItem]:
        if not isinstance(obj, torch.Tensor):
            raise ValueError(f"the remap table names {fqn!r}, whose state-dict value is a {type(obj).__name__}, "
                             "not a tensor")
        info = getattr(obj, CHUNK_INFO, None) if not isinstance(obj, DTensor) else None
        shape = tuple(info.global_shape) if info is not None else tuple(obj.shape)
        whole = Box.full(shape)
        for block in blocks:
            if block.box.ndim != whole.ndim or not whole.contains(block.box):
                raise ValueError(f"a block of {fqn!r} (from {block.source!r}) covers {block.box}, outside the "
                                 f"entry's shape {shape}")
            self._check_source(block)
        items: list[ReadItem] = []
        local = obj.to_local() if isinstance(obj, DTensor) else obj
        broadcastable = self._broadcastable(fqn, local)
        for local_index, chunk in enumerate(create_chunk_list_for_tensor(obj)):
            shard = Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
            dest_index = MetadataIndex(fqn=fqn, offset=torch.Size(shard.offsets), index=local_index)
            for block in blocks:
                piece = block.cut(shard)
                if piece is not None:
                    items.extend(self._plan_piece(fqn, dest_index, shard, piece, broadcastable))
        return items

    def _check_source(self, block: RemapBlock) -> None:
        """The whole block reads inside its checkpoint tensor (checked whole, so every rank fails
        the same way whatever shard it holds)."""
        md = self._checkpoint_tensor(block.source)
        size = tuple(int(n) for n in md.size)
        region = block.whole_region
        if region.ndim != len(size) or not Box.full(size).contains(region):
            raise ValueError(f"a block reads {region} of checkpoint tensor {block.source!r}, which has size {size}")

    def _saved_parts(self, source: str, md: Any, region: Box) -> list[tuple[MetadataIndex, Box, Box]]:
        """``(storage index, saved chunk box, part of region in it)`` for each saved chunk ``region`` overlaps."""
        parts = []
        for j, chunk in enumerate(md.chunks):
            saved = Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes))
            part = region.intersect(saved)
            if part is not None:
                parts.append((MetadataIndex(fqn=source, offset=torch.Size(saved.offsets), index=j), saved, part))
        missing = uncovered(region, [part for _, _, part in parts])
        if missing:
            raise ValueError(f"checkpoint tensor {source!r} has no saved data for {missing[0]}, which a read of "
                             f"region {region} needs")
        return parts

    def _plan_piece(self, fqn: str, dest_index: MetadataIndex, shard: Box, piece: BlockPiece,
                    broadcastable: bool) -> list[ReadItem]:
        source = piece.block.source
        md = self._checkpoint_tensor(source)
        parts = self._saved_parts(source, md, piece.region)
        buffer = None
        if not piece.direct:
            buffer = RegionBuffer(piece.region, _dtype_of(md, source), len(parts),
                                  partial(self._place, fqn, dest_index, shard, piece))
        items = []
        for storage_index, saved, part in parts:
            dest = piece.dest_part(part) if piece.direct else piece.dest
            item = read_item(dest_index, [o - s for o, s in zip(dest.offsets, shard.offsets, strict=True)],
                             storage_index, [o - s for o, s in zip(part.offsets, saved.offsets, strict=True)],
                             part.sizes, broadcastable)
            self._landings[_item_key(item)] = _Landing(fqn, dest_index, part, dest, piece.walker, buffer)
            items.append(item)
        return items

    def _plan_deferred(self, position: int, read: DeferredRead) -> list[ReadItem]:
        gathering = DeferredGathering(read)
        items = []
        for source in read.sources:
            md = self._checkpoint_tensor(source)
            whole = Box.full(tuple(int(n) for n in md.size))
            dtype = _dtype_of(md, source)
            parts = self._saved_parts(source, md, whole)
            if not whole.numel:  # nothing to read: it has arrived
                gathering.arrived(source, torch.empty(whole.sizes, dtype=dtype))
                continue
            buffer = RegionBuffer(whole, dtype, len(parts), partial(gathering.arrived, source))
            dest_index = MetadataIndex(fqn=f"{DEFERRED_FQN_PREFIX}{position}/{source}", offset=torch.Size(()))
            for storage_index, saved, part in parts:
                item = read_item(dest_index, part.offsets, storage_index,
                                 [o - s for o, s in zip(part.offsets, saved.offsets, strict=True)], part.sizes,
                                 broadcastable=False)  # the function runs on every rank that reads
                self._landings[_item_key(item)] = _Landing(dest_index.fqn, dest_index, part, buffer=buffer)
                items.append(item)
        return items

    # ------------------------------------------------------------------ reads landing

    def _landing(self, item: Any) -> _Landing:
        landing = self._landings.get(_item_key(item))
        if landing is None:
            raise RuntimeError(f"a read of {item.storage_index.fqn!r} into {item.dest_index.fqn!r} at "
                               f"{tuple(item.dest_offsets)} is not part of this planner's current plan")
        return landing

    def _shard_tensor(self, fqn: str, dest_index: Any) -> torch.Tensor:
        """The local tensor holding the shard ``dest_index`` names, detached (written in place);
        found once per shard and plan (every read of the shard asks, twice)."""
        key = (fqn, tuple(dest_index.offset or ()))
        found = self._shards.get(key)
        if found is None:
            found = self._shards[key] = self._find_shard_tensor(fqn, dest_index)
        return found

    def _find_shard_tensor(self, fqn: str, dest_index: Any) -> torch.Tensor:
        obj = self.state_dict[fqn]
        if isinstance(obj, DTensor):
            local = get_ragged_box_tensor(obj, dest_index) if is_ragged_dtensor(obj) else obj.to_local()
        else:
            local = obj
        return local.detach()

    def _dest_view(self, landing: _Landing) -> torch.Tensor:
        """The destination box a straight read fills, in the shape and order of what it reads."""
        tensor = self._shard_tensor(landing.fqn, landing.dest_index)
        box = tensor[tuple(slice(o - s, o - s + n) for o, s, n in zip(
            landing.dest.offsets, landing.dest_index.offset, landing.dest.sizes, strict=True))]
        return direct_view(box, landing.walker, landing.part.sizes)

    def _place(self, fqn: str, dest_index: Any, shard: Box, piece: BlockPiece, region: torch.Tensor) -> None:
        """A gathered piece's region has landed whole: pick, post-process, cast into place."""
        target = self._shard_tensor(fqn, dest_index)[piece.dest.relative_to(shard)]
        target.copy_(gather(piece, region))

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        """Where one read is copied to (a tensor of the read's ``lengths``): a view of the
        destination for a read that lands straight, else the read's part of a buffer."""
        landing = self._landing(read_item)
        if landing.buffer is not None:
            return landing.buffer.part(landing.part)
        return self._dest_view(landing)

    acquire_tensor = resolve_tensor

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        """One read has landed in ``tensor`` (what :meth:`resolve_tensor` returned, or a tensor of
        the same values): count it in, placing its piece once the piece's last read is in."""
        landing = self._landing(read_item)
        if landing.buffer is None:
            view = self._dest_view(landing)
            if tensor.data_ptr() != view.data_ptr():
                view.copy_(tensor)
            return
        landing.buffer.landed(_item_key(read_item), landing.part, tensor)

    apply_tensor = commit_tensor

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        """A remap plan reads tensors only; a byte item is not one of its reads."""
        raise ValueError(f"RemapLoadPlanner plans no byte reads, but was handed one for {read_item.dest_index.fqn!r}")

    def apply_bytes(self, read_item: Any, value: bytes) -> None:
        """HyperParallel's name for :meth:`load_bytes`."""
        self.load_bytes(read_item, io.BytesIO(value))
