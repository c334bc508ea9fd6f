"""HyperParallel's storage calls on our filesystem writer and reader, over HyperParallel's files.

HyperParallel code that drives storage itself (its ``_save_impl``/``load``, its tests, offline
tools) calls a writer's ``configure_writer`` / ``execute_write(plan, planner)`` /
``finalize_checkpoint(metadata, results)`` and a reader's ``load_metadata`` /
``configure_reader`` / ``execute_read(plan, planner, groups, batch_bytes)``, with the plan
records of :mod:`...planning.records`. :class:`FileSystemWriter` and :class:`FileSystemReader`
here are our filesystem writer and reader (:mod:`...backends.filesystem`) with those calls added;
they write and read HyperParallel's own layout, not this library's format:

- ``_rank<r>_.safetensors``: rank ``r``'s tensor items, each under its name, or
  ``<name>.__dcp_chunk_<i>`` when the rank writes several chunks of one tensor;
- ``_rank<r>_.bytes``: its ``BYTE_IO`` items, pickled back to back (one that needs a class or
  function to rebuild only with the planner's ``allow_pickle``). ``bytes`` values are pickled
  too, so the planner's ``apply_bytes`` gets them back (HyperParallel writes them raw, and then
  its own ``apply_bytes`` cannot unpickle them);
- ``..metadata`` (the coordinator, with collectives) or ``<r>.metadata`` (each rank, without):
  the checkpoint's ``Metadata`` record, pickled, its ``storage_data`` mapping each item to a
  :class:`~...format.storage_info.StorageInfo` (file, byte range, key in the file).

Metadata is read back with an allow-list (:class:`~...base.file_exchange.RecordUnpickler`: records
and plain data only) and its file names must be plain names inside the directory.

``execute_read`` is HyperParallel's pipeline: the shards the plan marks with a ``BroadcastSource``
are taken first, one at a time in the order every rank derives the same way (fqn, offset,
index); this rank reads the ones it is the source of and every shard is handed to the
broadcast batcher as soon as it is in place, so a send runs while the next shard is read. The
shards nobody shares come last, read a file at a time. Open safetensors files are kept in a
small least-recently-used cache (:class:`OpenFiles`). The functions it goes through
(``_open_checkpoint_files``, ``_fetch_tensor_file``, ``_apply_fetched``, ``BroadcastBatcher``,
``wait_broadcasts``, ``safe_open``) are read at call time from the module passed to
:func:`use_patch_points` (the ``filesystem_storage`` face), where HyperParallel's tests replace them.
"""

from __future__ import annotations

import io
import os
import pickle
from collections import Counter, deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch
import torch.distributed as dist

from ...backends import filesystem as _fs
from ...backends import opener_reads
from ...backends.opener_reads import FILES_KEPT
from ...backends.opener_reads import OpenedFiles as OpenFiles
from ...base.file_exchange import RecordUnpickler
from ...format.metadata import METADATA_FILE
from ...format.records import CURRENT_CHECKPOINT_VERSION
from ...format.storage_info import StorageInfo
from ...format.validation import validate_file_name
from ...planning.hyper_parallel_plans import plain_loads
from ...planning.records import LoadItemType, WriteItemType
from ...transfer.broadcasts import BroadcastBatcher, wait_broadcasts
from ...transfer.saver import WriteResult

__all__ = ["FileSystemWriter", "FileSystemReader", "OpenFiles", "open_checkpoint_files", "fetch_tensor_file",
           "apply_fetched", "tensor_size", "use_patch_points", "FILES_KEPT"]


_patch_points: Any = None


def use_patch_points(module: Any) -> None:
    """Read the pipeline's functions from ``module`` (the face) at call time; its ``safe_open``
    also serves :func:`load`'s filesystem reads while a caller has replaced it
    (:mod:`...backends.opener_reads`)."""
    global _patch_points
    _patch_points = module
    opener_reads.use_opener_from(module)


def _point(name: str, default: Any) -> Any:
    found = getattr(_patch_points, name, None) if _patch_points is not None else None
    return default if found is None else found


def _rank() -> int:
    try:
        return int(dist.get_rank())
    except (RuntimeError, ValueError):
        return 0


def tensor_size(tensor: Any) -> tuple[int, ...] | None:
    """A tensor's shape as a tuple (``size()`` or ``shape``), None for what has neither."""
    size = getattr(tensor, "size", None)
    if callable(size):
        return tuple(size())
    shape = getattr(tensor, "shape", None)
    return None if shape is None else tuple(shape)


def open_checkpoint_files() -> OpenFiles:
    """An :class:`OpenFiles` of :data:`FILES_KEPT` safetensors files, opened with ``safe_open``
    (the face's, at call time) on the host."""
    def open_one(path: str) -> Any:
        return _point("safe_open", safetensors.safe_open)(path, framework="pt", device="cpu")
    return OpenFiles(FILES_KEPT, open_one, lambda handle: handle.__exit__(None, None, None))


def _storage_info(req: Any, storage_data: dict[Any, StorageInfo]) -> StorageInfo:
    info = storage_data.get(req.storage_index)
    if info is None:
        raise KeyError(f"{req.storage_index.fqn!r}: the checkpoint's storage_data has no entry for the saved chunk "
                       f"at offsets {tuple(req.storage_index.offset or ())}")
    return info


def fetch_tensor_file(tensor_file: Any, reqs: list[Any], storage_data: dict[Any, StorageInfo]) -> list[tuple]:
    """``(item, region)`` for each item, sliced off an open safetensors file (a 0-d tensor whole)."""
    out = []
    for req in reqs:
        key = _storage_info(req, storage_data).tensor_key or req.storage_index.fqn
        slices = tuple(slice(int(o), int(o) + int(n)) for o, n in zip(req.storage_offsets, req.lengths, strict=True))
        out.append((req, tensor_file.get_slice(key)[slices] if slices else tensor_file.get_tensor(key)))
    return out


def _fetch_bytes_file(path: str, reqs: list[Any], storage_data: dict[Any, StorageInfo]) -> list[tuple]:
    out = []
    with open(path, "rb") as f:
        for req in reqs:
            info = _storage_info(req, storage_data)
            f.seek(info.offset)
            data = f.read(info.length)
            if len(data) != info.length:
                raise OSError(f"{path}: {req.dest_index.fqn!r} needs bytes {info.offset}..{info.offset + info.length}"
                              f", the file ends at {info.offset + len(data)}")
            out.append((req, data))
    return out


def apply_fetched(fetched: list[tuple], planner: Any) -> None:
    """Put what was read in place through ``planner``: ``apply_bytes`` for a ``BYTE_IO`` item,
    else copied into ``acquire_tensor(item)`` (same shape, or an AssertionError naming the
    item) and handed to ``apply_tensor``."""
    for req, payload in fetched:
        if req.type == LoadItemType.BYTE_IO:
            planner.apply_bytes(req, payload)
            continue
        target = planner.acquire_tensor(req)
        if isinstance(target, torch.Tensor):
            target = target.detach()
        want, got = tensor_size(target), tensor_size(payload)
        if want is not None and got is not None and want != got:
            raise AssertionError(f"{req.storage_index.fqn!r}: the read region has shape {got}, its destination {want}")
        with torch.no_grad():
            target.copy_(payload)
        planner.apply_tensor(req, target)


class FileSystemWriter(_fs.FileSystemWriter):
    """Our filesystem writer, which also writes HyperParallel's files through its calls (see the
    module docstring); as a writer of ours (``save(storage_writer=...)``) it writes our format."""

    is_coordinator: bool = False
    rank: int = 0
    use_collectives: bool = True

    @property
    def checkpoint_dir(self) -> Path:
        """The checkpoint directory (HyperParallel's name for ``path``)."""
        return Path(self.path)

    def initialize_writer(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Write into ``checkpoint_id`` from now on (None: the same directory)."""
        if checkpoint_id:
            self.reset(checkpoint_id)

    def configure_writer(self, is_coordinator: bool, **kwargs: Any) -> None:
        """Set up one save: ``rank`` (default: the process group's, else 0), ``use_collectives``
        (False: every rank commits its own ``<rank>.metadata``). Creates the directory."""
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs["rank"]) if kwargs.get("rank") is not None else _rank()
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        self.prepare()

    def optimize_local_plan(self, plan: Any) -> Any:
        return plan

    def optimize_global_plan(self, plan: Any) -> Any:
        return plan

    def execute_write(self, plan: Any, planner: Any) -> list[WriteResult]:
        """Write this rank's items (``planner.get_data(item)``) to its files; one
        ``WriteResult(index=, storage_data=StorageInfo)`` per item.

        Raises:
            UnsupportedValueError: a value that needs pickle to rebuild, without the planner's
                ``allow_pickle`` (names the key).
        """
        results = self._write_bytes(plan, planner)
        tensors: dict[str, torch.Tensor] = {}
        keys: dict[Any, str] = {}
        items = [i for i in plan.items if i.type == WriteItemType.TENSOR and i.tensor_data is not None]
        counts = Counter(i.index.fqn for i in items)
        used: set[str] = set()
        chunk_no: dict[str, int] = {}
        for item in items:
            tensor = planner.get_data(item)
            if tensor is None:
                raise RuntimeError(f"{item.index.fqn!r}: the planner gave no data for the chunk at "
                                   f"{tuple(item.index.offset or ())}")
            key = fqn = item.index.fqn
            if counts[fqn] > 1:
                n = chunk_no.get(fqn, 0)
                chunk_no[fqn] = n + 1
                key = f"{fqn}.__dcp_chunk_{n}"
                while key in counts or key in used:
                    key += "_"
            used.add(key)
            tensors[key] = tensor.detach().to("cpu").contiguous()
            keys[item.index] = key
        if tensors:
            name = f"_rank{self.rank}_.safetensors"
            self.write_file(name, [safetensors.torch.save(tensors)])
            results.extend(WriteResult(index=i.index, storage_data=StorageInfo(relative_path=name, offset=0,
                                                                                length=-1, tensor_key=keys[i.index]))
                           for i in items)
        return results

    def _write_bytes(self, plan: Any, planner: Any) -> list[WriteResult]:
        items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
        if not items:
            return []
        name = f"_rank{self.rank}_.bytes"
        parts, results, at = [], [], 0
        allow_pickle = bool(getattr(planner, "allow_pickle", False))
        for item in items:
            data = planner.get_data(item)
            payload = pickle.dumps(bytes(data) if isinstance(data, (bytearray, memoryview)) else data)
            if not allow_pickle:
                plain_loads(payload, item.index.fqn)  # refuses what needs code to rebuild
            parts.append(payload)
            results.append(WriteResult(index=item.index, storage_data=StorageInfo(relative_path=name, offset=at,
                                                                                  length=len(payload))))
            at += len(payload)
        self.write_file(name, parts)
        return results

    def finalize_checkpoint(self, metadata: Any, results: Iterable[Iterable[WriteResult]]) -> None:
        """Record every rank's write results in ``metadata.storage_data`` and commit it, pickled:
        ``..metadata`` by the coordinator (with collectives), ``<rank>.metadata`` by each rank
        (without); other ranks do nothing."""
        if self.use_collectives and not self.is_coordinator:
            return
        metadata.storage_data = {r.index: r.storage_data for rank_results in results for r in rank_results}
        name = METADATA_FILE if self.use_collectives else f"{self.rank}{METADATA_FILE}"
        self.commit(pickle.dumps(metadata), name)


class FileSystemReader(_fs.FileSystemReader):
    """Our filesystem reader, which also reads HyperParallel's files through its calls (see the
    module docstring); as a reader of ours (``load(storage_reader=...)``) it reads our format."""

    storage_data: dict[Any, StorageInfo] | None = None
    is_coordinator: bool = False
    rank: int = 0

    @property
    def checkpoint_dir(self) -> Path:
        """The checkpoint directory (HyperParallel's name for ``path``)."""
        return Path(self.path)

    def initialize_reader(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Read ``checkpoint_id`` from now on (None: the same directory)."""
        if checkpoint_id:
            self.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint as ``Metadata`` (see the torch reader's), stamped with HyperParallel's
        record version ("2.0") as its reader stamps what it reads."""
        view = super().read_metadata(*args, **kwargs)
        view.version = CURRENT_CHECKPOINT_VERSION
        return view

    def load_metadata(self, **kwargs: Any) -> Any:
        """The checkpoint's pickled ``Metadata`` record: ``<rank>.metadata`` when ``rank`` is
        given (a save without collectives), else ``..metadata``.

        Raises:
            FileNotFoundError: the file is not there (names it).
            pickle.UnpicklingError: it names a class or function other than records and plain data.
            ValueError: it is not a pickle (this library's own ``..metadata``: use ``load``).
        """
        rank = kwargs.get("rank")
        path = self.checkpoint_dir / (METADATA_FILE if rank is None else f"{rank}{METADATA_FILE}")
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise FileNotFoundError(f"Metadata file not found: {path}") from None
        if not raw.startswith(b"\x80"):
            raise ValueError(f"{path} is not HyperParallel's pickled metadata (this library's own format is read "
                             "by load(); HyperParallel's reader calls read what its writer calls wrote)")
        return RecordUnpickler(io.BytesIO(raw), str(path)).load()

    def configure_reader(self, metadata: Any, is_coordinator: bool = False, **kwargs: Any) -> None:
        """Set up one load: where each item is (``metadata.storage_data``), ``rank`` (default:
        the process group's, else 0)."""
        self.storage_data = getattr(metadata, "storage_data", None)
        self.is_coordinator = bool(is_coordinator)
        self.rank = int(kwargs["rank"]) if kwargs.get("rank") is not None else _rank()

    def optimize_local_plan(self, plan: Any) -> Any:
        return plan

    def optimize_global_plan(self, plan: Any) -> Any:
        return plan

    def _get_storage_path(self, read_item: Any) -> str:
        if self.storage_data is None:
            raise KeyError("the checkpoint's metadata has no storage_data: configure_reader(metadata, ...) first")
        info = _storage_info(read_item, self.storage_data)
        name = validate_file_name(info.relative_path, str(self.checkpoint_dir))
        return str(self.checkpoint_dir / name)

    def _group_items_by_file(self, items: Iterable[Any]) -> dict[str, list[Any]]:
        """The items by the file they are read from (its full path), in first-seen order."""
        per_file: dict[str, list[Any]] = {}
        for item in items:
            per_file.setdefault(self._get_storage_path(item), []).append(item)
        return per_file

    def _fetch(self, items: list[Any], files: Any) -> list[tuple]:
        fetch = _point("_fetch_tensor_file", fetch_tensor_file)
        out: list[tuple] = []
        for path, reqs in self._group_items_by_file(items).items():
            if path.endswith(".bytes"):
                out.extend(_fetch_bytes_file(path, reqs, self.storage_data))
            else:
                out.extend(fetch(files.reader(path), reqs, self.storage_data))
        return out

    def execute_read(self, plan: Any, planner: Any, broadcast_groups: dict[tuple, Any] | None = None,
                     broadcast_batch_bytes: int = 0) -> None:
        """Read ``plan`` into ``planner``'s targets (see the module docstring for the order).

        Args:
            plan: this rank's load plan (items marked with a ``source`` are shared).
            planner: the load planner (``acquire_tensor``, ``apply_tensor``, ``apply_bytes``,
                and its flat ``state_dict`` for the broadcasts).
            broadcast_groups: the group of every shard the plan marks, by rank tuple (build them
                before, e.g. ``broadcast_groups_for_load``: creating one is collective).
            broadcast_batch_bytes: shards under this many bytes are sent together (0: one by one).

        Raises:
            KeyError: a marked shard's group is not in ``broadcast_groups``.
            FileNotFoundError: a file the plan reads is missing (names it).
        """
        groups = broadcast_groups or {}
        by_shard: dict[tuple, list[Any]] = {}
        for item in plan.items:
            index = item.dest_index
            by_shard.setdefault((index.fqn, tuple(index.offset or ()), index.index), []).append(item)
        shared = sorted((k for k, v in by_shard.items() if v[0].source is not None),
                        key=lambda k: (k[0], k[1], -1 if k[2] is None else k[2]))
        private: dict[str, list[Any]] = {}
        for items in by_shard.values():
            if items[0].source is None:
                for item in items:
                    private.setdefault(self._get_storage_path(item), []).append(item)
        apply = _point("_apply_fetched", apply_fetched)
        batcher = _point("BroadcastBatcher", BroadcastBatcher)(broadcast_batch_bytes, groups)
        wait = _point("wait_broadcasts", wait_broadcasts)
        files = _point("_open_checkpoint_files", open_checkpoint_files)()
        in_flight: deque = deque()
        state_dict = getattr(planner, "state_dict", None)
        try:
            for key in shared:
                items = by_shard[key]
                if items[0].source.src_rank == self.rank:
                    apply(self._fetch(items, files), planner)
                batcher.add(in_flight, state_dict, items[0])
            batcher.flush(in_flight)
            for items in private.values():
                apply(self._fetch(items, files), planner)
            wait(in_flight)
        finally:
            files.close()

