"""The Hugging Face writer on torch DCP's ``StorageWriter`` protocol, for code that drives it itself.

Our ``save`` drives :class:`~.writer.HuggingFaceStorageWriter` by this library's protocol
(``write_plan``, ``commit``). torch's own ``save``, and code written against torch's writer
(its unit tests, tools that run a plan by hand), call torch's methods instead.
:class:`TorchProtocolWrites` gives the writer those calls, writing through the same layout
code (:meth:`~.writer.HuggingFaceStorageWriter.write_tensors`), so the files are the same:

=============================================  =====================================================
torch's call                                   here
=============================================  =====================================================
``set_up_storage_writer(is_coordinator,        this rank (``rank=``, else the process group's, else
rank=)``                                       0); the directory is made
``prepare_local_plan(plan)``                   the plan as it is
``prepare_global_plan(plans)`` (coordinator)   each plan's ``storage_data``: torch's keys
                                               (``fqn_to_index_mapping``; ``shard_index``, 1-based,
                                               with ``save_distributed``) and two of ours: every
                                               key of the save with its global dtype and shape (so
                                               every rank lays out the consolidated files alike),
                                               and the save's id (the temporary names all ranks
                                               write the same files under)
``write_data(plan, planner)``                  this rank's items written; a completed future of one
                                               ``WriteResult`` per item: ``storage_data`` is
                                               torch's ``_StorageInfo(file name, offset, length)``,
                                               the offset where the item's first byte lies in the
                                               file's data area (safetensors' ``data_offsets``)
``finish(metadata, results)`` (coordinator)    the files the results name take their final names;
                                               consolidated, ``model.safetensors.index.json`` last
                                               (``weight_map`` from the results, ``total_size`` the
                                               bytes of the distinct items), as the commit of our
                                               own save does (:func:`.exporting.swap_in_export`)
``storage_meta()``                             ``StorageMeta(checkpoint_id=the directory)``
=============================================  =====================================================

A ``write_data`` without ``prepare_global_plan`` before it (a plan built by hand) takes the
plan for the whole save: the files hold its items, laid out from them alone.

Where it differs from torch's writer, on purpose: files are written under temporary names until
``finish`` (torch writes them in place, so a failed save leaves files a reader takes); a
consolidated save is written straight to the final files from every rank (no ``sharded``
directory, no consolidation pass); values other than tensors are refused, naming the key (torch
writes their bytes into the file before the safetensors data, and nothing can read the file
back). A save that fails leaves its temporary files (torch's protocol has no clean-up call);
the next save into the directory removes them.

What it is not: the writer itself and its layout (:mod:`.writer`), the readers' protocols
(:mod:`.protocols`).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Mapping
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import WriteItemType
from torch.futures import Future

from ...base.box import Box
from ...base.dtypes import dtype_name, itemsize
from ...planning.planner import EntrySpec
from ...transfer.saver import WriteResult
from .protocols import _rank

__all__ = ["TorchProtocolWrites"]

# our keys in a plan's storage_data (beside torch's "fqn_to_index_mapping" and "shard_index")
_TENSORS = "hf_tensors"  # every key of the save: [dtype name, global shape], or ["bytes", None]
_SAVE = "hf_save"  # the save's id: its temporary file names


class TorchProtocolWrites:
    """torch's writer calls on :class:`~.writer.HuggingFaceStorageWriter` (see the module
    docstring). Mixed into the writer, whose ``write_tensors`` and ``put_in_place`` do the work."""

    fqn_to_index_mapping: dict[str, int] | None
    save_distributed: bool
    thread_count: int
    path: str

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """torch's set-up call: this rank, and the directory made."""
        self.set_up(_rank(kwargs.get("rank")), is_coordinator)  # type: ignore[attr-defined]
        self.prepare()  # type: ignore[attr-defined]

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        """Each rank's plan with what every rank needs to write its part (see the module docstring).

        Raises:
            ValueError: two ranks' items give one key different dtypes or shapes.
        """
        tensors: dict[str, list[Any]] = {}
        for plan in plans:
            _add_tensors(tensors, plan.items)
        save = uuid.uuid4().hex
        out = []
        for i, plan in enumerate(plans, start=1):
            data: dict[str, Any] = {_TENSORS: tensors, _SAVE: save}
            if self.fqn_to_index_mapping is not None:
                data["fqn_to_index_mapping"] = dict(self.fqn_to_index_mapping)
            if self.save_distributed:
                data["shard_index"] = i
            out.append(dataclasses.replace(plan, storage_data=data))
        return out

    def write_data(self, plan: Any, planner: Any) -> Future[list[WriteResult]]:
        """Write this rank's items (values from ``planner.resolve_data``) under the save's
        temporary names; the future is complete when it returns.

        Raises (as our ``save`` does, naming the key): UnsupportedValueError for a value that
        is not a tensor or a dtype safetensors cannot name; StateDictMismatchError for a key
        ``fqn_to_index_mapping`` does not map; ValueError for a plan whose
        ``fqn_to_index_mapping`` is not this writer's.
        """
        data = plan.storage_data if isinstance(plan.storage_data, Mapping) else {}
        mapping = data.get("fqn_to_index_mapping")
        if mapping is not None and dict(mapping) != (self.fqn_to_index_mapping or {}):
            raise ValueError("the plan's storage_data has an fqn_to_index_mapping other than this writer's "
                             f"({len(mapping)} keys); the files are laid out by the writer's own mapping "
                             "(give the writer that mapping)")
        if getattr(self, "is_coordinator", None) is None:  # no set-up call: one process, the whole save
            self.set_up(0, True)  # type: ignore[attr-defined]
        self.prepare()  # type: ignore[attr-defined]
        self._begin(str(data.get(_SAVE) or uuid.uuid4().hex))  # type: ignore[attr-defined]
        tensors = data.get(_TENSORS)
        if tensors is None:
            tensors = {}
            _add_tensors(tensors, plan.items)
        done: Future[list[WriteResult]] = Future()
        if not tensors:
            done.set_result([])
            return done
        entries = {key: EntrySpec("object", (key,)) if dtype == "bytes" else
                   EntrySpec("tensor", (key,), dtype, tuple(shape)) for key, (dtype, shape) in tensors.items()}
        items: dict[str, list[tuple[Box, Any]]] = {}
        for item in plan.items:
            items.setdefault(item.index.fqn, []).append((_box(item), item))
        held = {key: _resolver(planner, boxes)
                for key, boxes in sorted(items.items(), key=lambda kv: -sum(b.numel for b, _ in kv[1]))}
        shard = int(data.get("shard_index") or self.rank + 1)  # type: ignore[attr-defined]
        placed = self.write_tensors(entries, held, shard, self.thread_count)  # type: ignore[attr-defined]
        results = []
        for key, boxes in items.items():
            name, start = placed[key]
            spec = entries[key]
            for box, item in boxes:
                length = box.numel * itemsize(spec.dtype)  # type: ignore[arg-type]
                offset = start + _box_start(tuple(spec.shape or ()), box) * itemsize(spec.dtype)  # type: ignore[arg-type]
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(relative_path=name, offset=offset,
                                                                     length=length)))
        done.set_result(results)
        return done

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        """torch's commit (the coordinator, after every rank's ``write_data``): the files the
        results name take their final names; consolidated, the index is written last, from the
        results (``weight_map``: each key's file; ``total_size``: the bytes of the distinct
        items). ``metadata`` (torch's) is not written: the directory is a Hugging Face one."""
        written = [r for rank_results in results for r in rank_results]
        names = [r.storage_data.relative_path for r in written]
        index = None
        if self.consolidates:  # type: ignore[attr-defined]
            sizes = {(r.index.fqn, None if r.index.offset is None else tuple(r.index.offset)): r.storage_data.length
                     for r in written}
            index = {"metadata": {"total_size": sum(sizes.values())},
                     "weight_map": {r.index.fqn: r.storage_data.relative_path for r in written}}
        self.put_in_place(names, index)  # type: ignore[attr-defined]

    def storage_meta(self) -> StorageMeta:
        """What torch's ``save`` hands the planner about the storage: the directory."""
        return StorageMeta(checkpoint_id=self.path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Whether torch may pick this writer for ``checkpoint_id``: a local or shared POSIX path."""
        return isinstance(checkpoint_id, (str, os.PathLike)) and "://" not in os.fspath(checkpoint_id)


def _add_tensors(tensors: dict[str, list[Any]], items: list[Any]) -> None:
    """Record each item's key with its global dtype and shape (byte items as bytes).

    Raises ValueError when items disagree about a key."""
    for item in items:
        key = item.index.fqn
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            found = ["bytes", None]
        else:
            found = [dtype_name(item.tensor_data.properties.dtype), [int(n) for n in item.tensor_data.size]]
        seen = tensors.setdefault(key, found)
        if seen != found:
            raise ValueError(f"{key!r}: the plans' write items disagree about it ({seen[0]} {seen[1]} and "
                             f"{found[0]} {found[1]}); every item of a key must give its dtype and global shape")


def _box(item: Any) -> Box:
    """The region of the whole tensor a tensor write item holds (a byte item: none)."""
    if item.tensor_data is None:
        return Box((), ())
    chunk = item.tensor_data.chunk
    return Box(tuple(int(o) for o in chunk.offsets), tuple(int(n) for n in chunk.sizes))


def _resolver(planner: Any, boxes: list[tuple[Box, Any]]) -> Any:
    """The call that resolves one key's items through torch's planner, as (box, value) pairs."""
    def resolve() -> list[tuple[Box, Any]]:
        return [(box, planner.resolve_data(item)) for box, item in boxes]
    return resolve


def _box_start(shape: tuple[int, ...], box: Box) -> int:
    """Elements before the box's first element in a row-major tensor of ``shape``."""
    start, stride = 0, 1
    for dim in range(len(shape) - 1, -1, -1):
        start += box.offsets[dim] * stride
        stride *= shape[dim]
    return start
