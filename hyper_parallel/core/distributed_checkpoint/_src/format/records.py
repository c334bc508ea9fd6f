"""The metadata records at the ``metadata`` import path, for torch DCP code and HyperParallel code alike.

Two ecosystems import ``MetadataIndex``, ``TensorProperties``, ``TensorStorageMetadata`` and
``Metadata`` from the same path (torch DCP's ``metadata`` module, with the import swapped, and
HyperParallel's ``distributed_checkpoint.metadata``). Their records have the same fields but
different defaults and value types. Each class here is a subclass of torch's record (so torch's
planners, readers and ``isinstance`` checks take it) that also accepts HyperParallel's form:

========================  ==========================  ==============================  =====================
record                    torch's form                HyperParallel's form            here
========================  ==========================  ==============================  =====================
``MetadataIndex.offset``  ``None`` when not given     ``()`` when not given           ``()``; equal to and
                                                                                      hashed like torch's
                                                                                      ``None`` index
``TensorProperties``      ``dtype`` a ``torch.dtype``  ``dtype`` a string              kept as given;
                          ``memory_format``            ``memory_format=None``          ``memory_format``
                          contiguous by default                                        follows the form
``TensorStorageMetadata`` ``chunks`` required          ``chunks`` default ``[]``       default ``[]``
``Metadata.version``      ``None`` until torch's       ``"2.0"``                        ``"2.0"``
                          writer stamps it
========================  ==========================  ==============================  =====================

The ``MetadataIndex`` choice: HyperParallel's ``MetadataIndex("opt")`` names a non-tensor item
(torch's ``MetadataIndex("opt")`` with offset None does too), so an index of ours with an empty
offset compares equal to, and hashes like, torch's index with ``offset=None``; dictionaries built by
either side can be looked up with the other's index. (The one lookup that does not cross: a 0-d
tensor's chunk indexed by torch as ``offset=torch.Size([])``.)

Records torch builds itself (``create_default_global_save_plan`` makes torch's
``TensorStorageMetadata``, ``create_default_local_save_plan`` torch's ``WriteItem``, ...) are
instances of the class exported here too: each class here is made by :class:`TorchRecordType`,
whose ``isinstance`` admits an instance of the torch record it extends. So ``isinstance(md,
TensorStorageMetadata)`` answers the same for torch's record and ours, whichever class the code
imported. A torch-built record does not gain our methods (``nbytes``...): code that needs them
asks :func:`is_own_record` and converts.

What it is not: our own on-disk document (:mod:`.metadata`, the columnar format every reader here
parses), nor the torch view of it that readers hand to torch-protocol planners (:mod:`.torch_view`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as _torch_md

from ..base.public_path import publish

__all__ = ["CURRENT_CHECKPOINT_VERSION", "TorchRecordType", "is_own_record", "MetadataIndex", "TensorProperties",
           "TensorStorageMetadata", "Metadata",
           "ChunkStorageMetadata", "BytesStorageMetadata", "StorageMeta", "dtype_element_size"]


# The version HyperParallel stamps on its metadata record (see :mod:`.versioning` for older ones).
CURRENT_CHECKPOINT_VERSION = "2.0"

# torch's own, unchanged: their constructors are the same in both ecosystems
ChunkStorageMetadata = _torch_md.ChunkStorageMetadata
BytesStorageMetadata = _torch_md.BytesStorageMetadata
StorageMeta = _torch_md.StorageMeta


class TorchRecordType(type):
    """The class of a record class that extends one of torch DCP's records: ``isinstance(x, C)``
    also holds for an instance of the torch record ``C`` extends directly.

    Why: code reached through our import path (``isinstance(md, TensorStorageMetadata)`` with the
    import swapped) meets records torch's own functions built; to it they are the same record. A
    subclass of such a class that does not itself extend a torch record (``TorchView``, a user's)
    is strict: only its own instances pass.
    """

    def __new__(mcs, name: str, bases: tuple[type, ...], namespace: dict[str, Any], **kwargs: Any) -> TorchRecordType:
        cls = super().__new__(mcs, name, bases, namespace, **kwargs)
        torch_bases = tuple(b for b in bases if b.__module__.startswith("torch."))
        cls._torch_record = torch_bases[0] if torch_bases else None  # type: ignore[attr-defined]
        return cls

    def __instancecheck__(cls, instance: Any) -> bool:
        if type.__instancecheck__(cls, instance):
            return True
        torch_record = cls.__dict__.get("_torch_record")
        return torch_record is not None and type.__instancecheck__(torch_record, instance)


def is_own_record(instance: Any, cls: type) -> bool:
    """True if ``instance`` is an instance of ``cls`` itself (or a subclass), not only a torch
    record that :class:`TorchRecordType` admits: whether it has our fields and methods."""
    return type.__instancecheck__(cls, instance)


def _lookup_key(fqn: str, offset: Any) -> tuple[str, tuple[int, ...] | None]:
    """What two indexes must share to be equal: an empty or missing offset is "no offset"."""
    return fqn, (tuple(offset) if offset else None)


class MetadataIndex(_torch_md.MetadataIndex, metaclass=TorchRecordType):
    """Where an item sits in a state dict or a ``Metadata``: ``fqn``, the chunk's ``offset`` and
    an optional ``index`` hint (ignored by equality, as in torch).

    ``offset`` defaults to ``()`` (HyperParallel's form) and is a ``torch.Size`` when given (torch's).
    Equality and hashing treat ``()`` like torch's ``None``, so either side's index finds the other's.
    """

    def __init__(self, fqn: str, offset: Sequence[int] | None = (), index: int | None = None) -> None:
        super().__init__(fqn, offset if offset is not None else (), index)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _torch_md.MetadataIndex):
            return NotImplemented
        return _lookup_key(self.fqn, self.offset) == _lookup_key(other.fqn, other.offset)

    def __hash__(self) -> int:
        return hash(_lookup_key(self.fqn, self.offset))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.fqn, tuple(self.offset), self.index))


@functools.lru_cache(maxsize=256)
def dtype_element_size(dtype: Any) -> int:
    """Bytes per element of a dtype given as a ``torch.dtype`` or a name ("float32",
    "torch.bfloat16"); 4 for a name this does not know (HyperParallel's estimate for sizing)."""
    if isinstance(dtype, torch.dtype):
        return torch.empty((), dtype=dtype).element_size()
    name = str(dtype).lower()
    for candidate in sorted(_ELEMENT_SIZES, key=len, reverse=True):  # bfloat16 before float16
        if candidate in name:
            return _ELEMENT_SIZES[candidate]
    return 4


_ELEMENT_SIZES = {
    "float64": 8, "double": 8, "int64": 8, "long": 8, "complex64": 8, "uint64": 8, "complex128": 16,
    "float32": 4, "float": 4, "int32": 4, "int": 4, "uint32": 4,
    "bfloat16": 2, "float16": 2, "half": 2, "int16": 2, "short": 2, "uint16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1,
}

def _same_fields(a: Any, b: Any, base: type) -> bool | type(NotImplemented):
    """Dataclass equality across torch's record and ours: same fields, either class."""
    if not isinstance(b, base):
        return NotImplemented
    names = [f.name for f in fields(base)]
    return all(getattr(a, n) == getattr(b, n) for n in names)


_KEEP = object()  # "argument not given": the form decides the default


class TensorProperties(_torch_md.TensorProperties, metaclass=TorchRecordType):
    """How to create a tensor: ``dtype`` (a ``torch.dtype``, or HyperParallel's dtype string,
    kept as given), ``requires_grad``, and torch's deprecated ``layout``/``memory_format``/``pin_memory``.

    ``memory_format`` defaults to torch's contiguous format when ``dtype`` is a ``torch.dtype``
    and to ``None`` when it is a string (HyperParallel's record). Pickles either way.
    """

    def __init__(self, dtype: Any = _KEEP, layout: torch.layout = torch.strided, requires_grad: bool = False,
                 memory_format: Any = _KEEP, pin_memory: bool = False) -> None:
        if dtype is _KEEP:
            dtype = torch.get_default_dtype()
        if memory_format is _KEEP:
            memory_format = None if isinstance(dtype, str) else torch.contiguous_format
        super().__init__(dtype=dtype, layout=layout, requires_grad=requires_grad, memory_format=memory_format,
                         pin_memory=pin_memory)

    def __getstate__(self) -> Any:
        if self.memory_format is None:
            return (self.dtype, self.layout, self.requires_grad, None, self.pin_memory)
        return super().__getstate__()

    def __setstate__(self, state: Any) -> None:
        if state[3] is None:
            self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state
        else:
            super().__setstate__(state)

    def __eq__(self, other: object) -> bool:
        return _same_fields(self, other, _torch_md.TensorProperties)

    __hash__ = None  # type: ignore[assignment]  # mutable, like torch's

    @staticmethod
    def create_from_tensor(tensor: torch.Tensor) -> TensorProperties:
        return TensorProperties(dtype=tensor.dtype, layout=tensor.layout, requires_grad=tensor.requires_grad,
                                pin_memory=tensor.is_pinned())


@dataclass(eq=False)
class TensorStorageMetadata(_torch_md.TensorStorageMetadata, metaclass=TorchRecordType):
    """A saved tensor: its properties, global ``size`` and saved ``chunks`` (default: none yet)."""

    chunks: list[ChunkStorageMetadata] = field(default_factory=list)

    def __eq__(self, other: object) -> bool:
        return _same_fields(self, other, _torch_md.TensorStorageMetadata)

    __hash__ = None  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        """The global tensor's size in bytes (from ``size`` and the dtype)."""
        return math.prod(self.size) * dtype_element_size(self.properties.dtype)


@dataclass
class Metadata(_torch_md.Metadata, metaclass=TorchRecordType):
    """A checkpoint's description in torch DCP's shape: ``state_dict_metadata`` (key -> tensor or
    bytes record), ``planner_data``, ``storage_data`` (index -> where the item's bytes are),
    ``storage_meta`` and ``version`` (HyperParallel's "2.0" by default; see :mod:`.versioning`).

    A custom torch-protocol reader builds one in ``read_metadata``; HyperParallel code builds one
    with ``Metadata(state_dict_metadata=..., version=...)``. Readers of this library return a
    :class:`~.torch_view.TorchView` (a subclass built from our own document).
    """

    version: str | None = CURRENT_CHECKPOINT_VERSION


publish("hyper_parallel.core.distributed_checkpoint.metadata", MetadataIndex, TensorProperties, TensorStorageMetadata,
        Metadata)
