"""A torch-protocol load plan executed on a checkpoint of this library's format.

A planner written on torch DCP's protocol (torch's own, a user's subclass, HyperParallel's remap
planner) plans reads against a ``Metadata`` (our readers give a
:class:`~..format.torch_view.TorchView`) and expects the storage to fill, for each ``ReadItem``,
the tensor ``planner.resolve_tensor(item)`` returns, then to call ``planner.commit_tensor``; and to
hand each non-tensor item to ``planner.load_bytes`` as a ``torch.save`` stream. This module is
that storage side for our format: each tensor item is the region ``storage_index.offset +
storage_offsets`` (``lengths`` long) of the saved key, read with the loader's checked, parallel
reads (:func:`.loader.read_plan`) from whichever saved chunks hold it — the saved chunking need
not match the planner's chunk records. Values are verified against their checksums as usual.

Non-tensor items: JSON values and byte strings are handed over as ``torch.save`` streams of the
value (plain data: unpickling them runs nothing); a value saved with ``allow_pickle=True`` is only
unpickled when this load opted in too.

:class:`OwnFormatReader` puts one of our readers on torch's reader protocol with these reads, so
that the protocol driver (``engine.protocol_run``) runs a torch planner on our format like on any
torch storage.

What it is not: the call order of a torch-protocol load (``engine.protocol_run``), nor our own
planner's reads (:mod:`.loader`).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import storage as _torch_storage
from torch.futures import Future

from ..backends.protocol import StorageReader
from ..base.box import Box
from ..base.dtypes import torch_dtype
from ..base.errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError
from ..format import metadata as md
from ..format.chunks import overlapping
from ..format.torch_view import TorchView, leaf_value
from ..planning.planner import LoadPlan as BoxPlan
from ..planning.planner import ReadItem as BoxRead
from .loader import DEFAULT_BUFFER_BYTES, read_box, read_plan

__all__ = ["read_torch_items", "OwnFormatReader"]


class _Destinations:
    """The loader's target resolver over one tensor per torch item (by its position)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def resolve_target(self, key: str) -> torch.Tensor:
        return self.tensors[key]


def _entry(meta: md.Metadata, fqn: str, where: str) -> md.Entry:
    entry = meta.entries.get(fqn)
    if entry is None:
        raise CheckpointError(f"{where}: the load plan reads {fqn!r}, which the checkpoint does not hold")
    return entry


def _region(item: Any, entry: md.Entry, where: str) -> Box:
    """The global box a torch read item copies (checked to lie inside the saved tensor)."""
    shape = tuple(entry.shape or ())
    base = tuple(item.storage_index.offset) if item.storage_index.offset else (0,) * len(shape)
    starts = tuple(b + int(o) for b, o in zip(base, item.storage_offsets, strict=False))
    lengths = tuple(int(n) for n in item.lengths)
    if len(starts) != len(shape) or len(lengths) != len(shape) or any(
            s < 0 or n < 0 or s + n > d for s, n, d in zip(starts, lengths, shape, strict=True)):
        raise CheckpointError(
            f"{where}: the read of {entry.key!r} at {list(starts)} x {list(lengths)} is outside its saved "
            f"shape {list(shape)}")
    return Box(starts, lengths)


def _value(meta: md.Metadata, entry: md.Entry, reader: StorageReader, allow_pickle: bool, verify: bool) -> Any:
    if entry.kind == "object":
        return entry.value
    data, _ = read_box(entry, reader, verify=verify, meta=meta)
    raw = data.numpy().tobytes()
    if entry.kind == "bytes":
        return raw
    if entry.kind == "pickle":
        if not allow_pickle:
            raise UnsupportedValueError(
                f"{entry.key!r} was saved as a pickle; load it with allow_pickle=True if you trust the checkpoint")
        return pickle.loads(raw)  # noqa: S301 - the caller opted in
    raise CheckpointError(f"{entry.key!r} is a {entry.kind} entry, not a value a BYTE_IO read can load")


def read_torch_items(meta: md.Metadata, reader: StorageReader, items: Sequence[Any], planner: Any, *,
                     where: str = "checkpoint", allow_pickle: bool = False, thread_count: int = 4,
                     verify: bool = True, buffer_bytes: int = DEFAULT_BUFFER_BYTES) -> None:
    """Carry out torch ``ReadItem``s of ``planner`` on our checkpoint ``meta`` read through ``reader``.

    Tensor items: ``planner.resolve_tensor(item)`` is filled with the saved region (converted to
    its dtype when it differs), then ``planner.commit_tensor(item, tensor)``. Byte items:
    ``planner.load_bytes(item, stream)`` with a ``torch.save`` stream of the saved value.

    Raises:
        CheckpointError: an item names a key the checkpoint lacks or a region outside it, or the
            tensor ``resolve_tensor`` gives has another shape than the item's ``lengths``.
        CorruptCheckpointError: a byte read fails its checksum or a file is short.
    """
    reads: list[BoxRead] = []
    targets: dict[str, Box] = {}
    dests: dict[str, torch.Tensor] = {}
    commits: list[tuple[Any, torch.Tensor, torch.Tensor]] = []  # (item, planner's tensor, what was read into)
    for n, item in enumerate(items):
        fqn = item.storage_index.fqn
        if item.type.name == "BYTE_IO":
            leaf = leaf_value(meta, fqn) if fqn not in meta.entries else None
            value = leaf[1] if leaf is not None else _value(meta, _entry(meta, fqn, where), reader, allow_pickle,
                                                            verify)
            stream = io.BytesIO()
            torch.save(value, stream)
            stream.seek(0)
            planner.load_bytes(item, stream)
            continue
        entry = _entry(meta, fqn, where)
        region = _region(item, entry, where)
        tensor = planner.resolve_tensor(item).detach()
        if tuple(tensor.shape) != region.sizes:
            raise CheckpointError(
                f"{where}: {fqn!r}: the planner's tensor for a read of {list(region.sizes)} has shape "
                f"{list(tensor.shape)}")
        saved = torch_dtype(entry.dtype)
        direct = tensor.dtype == saved and tensor.device.type == "cpu"
        dest = tensor if direct else torch.empty(region.sizes, dtype=saved)
        key = f"{n}"
        targets[key], dests[key] = region, dest
        covered = 0
        for ref in overlapping(meta, entry, region):
            part = ref.box.intersect(region)
            reads.append(BoxRead(key, ref, part))
            covered += part.numel
        if covered != region.numel:
            raise CorruptCheckpointError(
                f"{where}: {fqn!r}: saved chunks cover {covered} of the {region.numel} elements of {region}")
        commits.append((item, tensor, dest))
    if reads:
        read_plan(BoxPlan(reads, targets), _Destinations(dests), reader, thread_count, buffer_bytes, verify=verify)
    for item, tensor, dest in commits:
        if dest is not tensor:
            with torch.no_grad():
                tensor.copy_(dest)
        planner.commit_tensor(item, tensor)


class OwnFormatReader(_torch_storage.StorageReader):
    """One of this library's readers (our format) on torch's reader protocol, for a load whose
    planner speaks torch's (or HyperParallel's) protocol.

    ``read_metadata()`` is torch's ``Metadata`` view of the checkpoint's document (``document``:
    the one the load read and every rank received, merged fragments included), and
    ``read_data(plan, planner)`` carries out the plan with :func:`read_torch_items`. The steps our
    readers need not do (``prepare_*_plan``) return the plans unchanged.
    """

    def __init__(self, storage: StorageReader, document: md.Metadata, *, where: str = "checkpoint",
                 allow_pickle: bool = False, thread_count: int = 4, verify: bool = True) -> None:
        super().__init__()
        self.storage, self.document, self.where = storage, document, where
        self.allow_pickle, self.thread_count, self.verify = allow_pickle, thread_count, verify
        self._view: TorchView | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Nothing to do: the reader is already set up on the checkpoint the load reads."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> TorchView:
        if self._view is None:
            self._view = TorchView(self.document, checkpoint_id=self.where)
        return self._view

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: the load set the reader up before reading the metadata."""

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Future:
        read_torch_items(self.document, self.storage, plan.items, planner, where=self.where,
                         allow_pickle=self.allow_pickle, thread_count=self.thread_count, verify=self.verify)
        done: Future = Future()
        done.set_result(None)
        return done

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
