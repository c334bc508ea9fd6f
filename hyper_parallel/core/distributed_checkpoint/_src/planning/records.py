"""The plan records at the ``planner`` import path, for torch DCP code and HyperParallel code alike.

torch DCP's planner protocol and HyperParallel's newer one describe a plan with the same records
(``WriteItem``, ``ReadItem``, ``SavePlan``, ``LoadPlan``, the item-type enums); HyperParallel's
add fields and defaults. Each class here is a subclass of torch's (so torch's planners, storage
and ``isinstance`` checks take it) that also accepts HyperParallel's form:

- ``WriteItemType``/``LoadItemType`` carry HyperParallel's values (``TENSOR.value == "tensor"``,
  ``"shard"``, ``"byte_io"``), and each member compares equal to, and hashes like, torch's member
  of the same name, so ``item.type == WriteItemType.TENSOR`` holds for items either side built.
- ``WriteItem.tensor_data`` may be torch's ``TensorWriteData`` or HyperParallel's dict
  (``{"chunk", "properties", "size"}``); either is kept as a :class:`TensorWriteData` that reads
  both ways (``data.chunk`` and ``data["chunk"]``). ``tensor_storage_size()`` follows the form:
  torch's counts ``size``, HyperParallel's the chunk's ``sizes`` with a dtype given by name.
- ``ReadItem`` adds ``broadcastable`` (default True) and ``source`` (a :class:`BroadcastSource`:
  which rank reads a replicated shard for its group, default None).
- ``isinstance`` takes torch's records and members for ours (:class:`.TorchRecordType`), so
  ``isinstance(item, WriteItem)`` holds for the items torch's planners build; code that needs
  our fields asks :func:`.is_own_record`.
- ``SavePlan()``/``LoadPlan()`` default to no items; ``LoadPlan.identity()`` is the plan with
  each item's checkpoint location elided (what ranks exchange to agree on broadcasts).

These are the records of the torch-protocol planners this library runs (torch's, HyperParallel's,
users'). Our own planners plan in boxes instead (:mod:`.planner`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any

from torch.distributed.checkpoint import planner as _torch_planner

from ..base.public_path import publish
from ..format.records import MetadataIndex, TorchRecordType, dtype_element_size, is_own_record

__all__ = ["WriteItemType", "LoadItemType", "TensorWriteData", "BytesIOWriteData", "WriteItem", "ReadItem",
           "SavePlan", "LoadPlan", "BroadcastSource"]


BytesIOWriteData = _torch_planner.BytesIOWriteData
_TORCH_ENUMS = (_torch_planner.WriteItemType, _torch_planner.LoadItemType)


class _TorchEqualEnumType(enum.EnumType):
    """The class of an enum that stands for torch's enum of the same name: ``isinstance``
    admits torch's members too (what :class:`.TorchRecordType` does for the records)."""

    def __instancecheck__(cls, instance: Any) -> bool:
        if type.__instancecheck__(cls, instance):
            return True
        kind = type(instance)
        return kind in _TORCH_ENUMS and kind.__name__ == cls.__name__


class _TorchEqualEnum(enum.Enum, metaclass=_TorchEqualEnumType):
    """An enum whose members equal torch's members of the same name (and hash alike)."""

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self is other
        if type(other) in _TORCH_ENUMS and type(other).__name__ == type(self).__name__:
            return self.name == other.name  # type: ignore[attr-defined]
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._name_)  # what enum.Enum hashes, so torch's member and ours share a slot


class WriteItemType(_TorchEqualEnum):
    """What a write item holds: a whole tensor, a shard of one, or serialized bytes."""

    TENSOR = "tensor"
    SHARD = "shard"
    BYTE_IO = "byte_io"


class LoadItemType(_TorchEqualEnum):
    """What a read item fills: (a region of) a tensor, or a non-tensor value from bytes."""

    TENSOR = "tensor"
    BYTE_IO = "byte_io"


@dataclass(frozen=True)
class TensorWriteData(_torch_planner.TensorWriteData, metaclass=TorchRecordType):
    """A tensor write's geometry: ``chunk`` (offsets, sizes), ``properties`` and global ``size``;
    readable as attributes (torch) and as keys (HyperParallel's dict)."""

    def __getitem__(self, name: str) -> Any:
        if name not in ("chunk", "properties", "size"):
            raise KeyError(name)
        return getattr(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return getattr(self, name, default) if name in ("chunk", "properties", "size") else default

    def keys(self) -> tuple[str, ...]:
        return ("chunk", "properties", "size")


def _as_tensor_data(data: Any) -> tuple[TensorWriteData | None, bool]:
    """(the record, whether it came as HyperParallel's dict)."""
    if data is None or is_own_record(data, TensorWriteData):
        return data, False
    if isinstance(data, dict):
        if "chunk" not in data:
            raise ValueError(f"WriteItem tensor_data needs 'chunk' (and 'properties', 'size'); got {sorted(data)}")
        size = data.get("size", data["chunk"].sizes)
        return TensorWriteData(chunk=data["chunk"], properties=data.get("properties"), size=size), True
    if isinstance(data, _torch_planner.TensorWriteData):
        return TensorWriteData(chunk=data.chunk, properties=data.properties, size=data.size), False
    raise TypeError(f"WriteItem tensor_data must be a TensorWriteData or a dict, not {type(data).__name__}")


@dataclass(frozen=True)
class WriteItem(_torch_planner.WriteItem, metaclass=TorchRecordType):
    """One item a rank writes: ``index`` (where it goes), ``type``, and its tensor geometry
    (``tensor_data``) or bytes description (``bytes_io_data``)."""

    def __post_init__(self) -> None:
        data, from_dict = _as_tensor_data(self.tensor_data)
        object.__setattr__(self, "tensor_data", data)
        object.__setattr__(self, "_chunk_sized", from_dict)

    def tensor_storage_size(self) -> int | None:
        """Bytes of the tensor this item writes, or None for a non-tensor item (or no geometry).

        An item built with HyperParallel's dict counts its chunk's elements; torch's form counts
        ``size``, as torch does."""
        data = self.tensor_data
        if data is None or self.type == WriteItemType.BYTE_IO:
            return None
        sizes = data.chunk.sizes if self.__dict__.get("_chunk_sized") else data.size
        return math.prod(sizes) * dtype_element_size(getattr(data.properties, "dtype", None))


@dataclass(frozen=True)
class BroadcastSource:
    """Who reads a replicated shard for whom: ``src_rank`` reads it from storage once and
    broadcasts it to the other ranks of ``group_ranks`` (global ranks, ``src_rank`` among them).

    A planner puts one on each read of a shard several ranks hold whole and the same, so that
    storage serves those bytes once; :mod:`..transfer.broadcasts` carries out the sends. Every
    rank of the group must mark the shard with the same record, or their broadcasts disagree.
    The record does not check that ``src_rank`` is in ``group_ranks`` (HyperParallel's does not
    either); the backend's broadcast refuses one that is not.
    """

    group_ranks: tuple[int, ...]
    src_rank: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_ranks", tuple(int(r) for r in self.group_ranks))
        object.__setattr__(self, "src_rank", int(self.src_rank))


@dataclass(frozen=True)
class ReadItem(_torch_planner.ReadItem, metaclass=TorchRecordType):
    """Copy ``lengths`` elements from ``storage_index`` at ``storage_offsets`` into ``dest_index``
    at ``dest_offsets``; ``source`` says which rank reads it for a group (None: this rank reads)."""

    broadcastable: bool = True
    source: BroadcastSource | None = None


# One shared index stands in for every elided checkpoint location (see LoadPlan.identity).
_STORAGE_ELIDED = MetadataIndex("")


@dataclass(frozen=True)
class SavePlan(_torch_planner.SavePlan, metaclass=TorchRecordType):
    """A rank's writes (``items``, none by default) and what its storage and planner add."""

    items: list[Any] = field(default_factory=list)


@dataclass
class LoadPlan(_torch_planner.LoadPlan, metaclass=TorchRecordType):
    """A rank's reads (``items``, none by default) and what its storage and planner add."""

    items: list[Any] = field(default_factory=list)

    def identity(self) -> LoadPlan:
        """This plan without where each read comes from: every item keeps its type, destination
        and lengths, its storage index and offsets are elided, storage and planner data dropped.

        What ranks exchange to agree which of them reads a shard for whom: smaller on the wire
        (the location is the bulk of an item), and the plan it came from is left untouched.
        """
        items = [replace(i, dest_offsets=(), storage_index=_STORAGE_ELIDED, storage_offsets=())
                 if is_own_record(i, ReadItem) else
                 ReadItem(type=i.type, dest_index=i.dest_index, dest_offsets=(), storage_index=_STORAGE_ELIDED,
                          storage_offsets=(), lengths=i.lengths)
                 for i in self.items]
        return LoadPlan(items=items, storage_data=None, planner_data=None)


publish("hyper_parallel.core.distributed_checkpoint.planner", WriteItemType, LoadItemType, TensorWriteData, WriteItem,
        BroadcastSource, ReadItem, SavePlan, LoadPlan)
