"""Objects ranks exchange through files in the checkpoint directory instead of collectives.

HyperParallel's child-process ``async_save`` can coordinate its ranks through storage: each rank
writes its local plan (``LOCAL_PLAN_<rank>.pkl``) or its write results
(``STORAGE_DATA_<rank>.pkl``) into the checkpoint directory, and the ranks that need them poll
for the others' files. This module is that exchange:

- :func:`write_file` pickles the object and appends :data:`COMPLETE_FLAG` last, so a reader
  that opens a file mid-write finds no flag and comes back for it later;
- :func:`load_file` returns ``None`` for a file not written yet or not complete, and deletes a
  ``STORAGE_DATA`` file once read (a ``LOCAL_PLAN`` file stays: every rank reads each one);
- :func:`batch_read_worker` polls one batch of ranks' files round-robin until all are read,
  :func:`parallel_read_files` spreads the ranks over threads, and
  :func:`gather_all_results_from_storage` is the whole step (write this rank's file, then
  read every rank's, or, for ``STORAGE_DATA``, only the coordinator reads).

The files are unpickled with an allow-list (:class:`RecordUnpickler`, also what HyperParallel's
pickled ``.metadata`` is read with): plan and metadata records (dataclasses and enums of
``hyper_parallel`` and ``torch.distributed.checkpoint``), ``torch.Size``, dtypes, layouts and
plain containers; any other class or function in a file is refused, so a file planted in a
shared directory cannot run code.
"""

from __future__ import annotations

import dataclasses
import enum
import io
import os
import pickle
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .allowlist_pickle import AllowlistUnpickler

__all__ = ["FileType", "COMPLETE_FLAG", "RecordUnpickler", "assemble_file_path", "write_file", "load_file",
           "construct_file_batches", "batch_read_worker", "parallel_read_files",
           "gather_all_results_from_storage"]

COMPLETE_FLAG = b"\x00__PICKLE_WRITE_COMPLETE__\x00"
"""Written after the pickle: a file without it at its end is still being written."""

READ_TIMEOUT_SECONDS = 1800.0
"""How long :func:`batch_read_worker` waits for the other ranks' files."""


class FileType(enum.Enum):
    """What an exchange file holds: a rank's local save plan, or its write results."""

    LOCAL_PLAN = enum.auto()
    STORAGE_DATA = enum.auto()


_RECORD_MODULES = ("hyper_parallel.", "torch.distributed.checkpoint.")
_PACKAGE = "hyper_parallel.core.distributed_checkpoint."
# Where releases before 4 kept the record classes a pickle names (inside the package, before the
# internals moved under _src/): read as the public faces that export the same classes now.
_MOVED_RECORD_MODULES = {
    _PACKAGE + "format.records": _PACKAGE + "metadata",
    _PACKAGE + "format.storage_info": _PACKAGE + "storage",
    _PACKAGE + "planning.records": _PACKAGE + "planner",
}
_BUILTINS = {"set", "frozenset", "complex", "slice", "range", "bytearray"}
_RECONSTRUCTORS = {("copyreg", "_reconstructor"), ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"),
                   ("collections", "OrderedDict"),
                   ("torch.serialization", "_get_layout")}  # a layout by its name (torch.strided)


class RecordUnpickler(AllowlistUnpickler):
    """Unpickles plan and metadata records and plain data only (see the module docstring);
    ``where`` names the file in the error raised for anything else."""

    def admit(self, module: str, name: str) -> Any | None:
        if (module, name) in _RECONSTRUCTORS or (module == "builtins" and name in _BUILTINS):
            return pickle.Unpickler.find_class(self, module, name)
        if module == "torch" and name in ("Size", "device"):
            return pickle.Unpickler.find_class(self, module, name)
        if module.startswith(_RECORD_MODULES) or module == "torch":
            found = pickle.Unpickler.find_class(self, _MOVED_RECORD_MODULES.get(module, module), name)
            if isinstance(found, (torch.dtype, torch.memory_format, torch.layout)):
                return found
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        return None

    def refusal(self, what: str) -> Exception:
        if what.startswith("a persistent id"):
            return pickle.UnpicklingError(f"{self.where}: this file holds no persistent references")
        return pickle.UnpicklingError(f"{self.where}: refusing {what}; only plan and metadata records and plain "
                                      "data are read from this file")


def assemble_file_path(checkpoint_id: str | os.PathLike, file_type: FileType, file_id: int) -> str:
    """``<checkpoint_id>/<LOCAL_PLAN|STORAGE_DATA>_<file_id>.pkl``: rank ``file_id``'s file."""
    return os.path.join(os.fspath(checkpoint_id), f"{file_type.name}_{int(file_id)}.pkl")


def write_file(checkpoint_id: str | os.PathLike, file_type: FileType, file_id: int, content: Any) -> None:
    """Write ``content`` as rank ``file_id``'s file of ``file_type``, the completion flag last."""
    with open(assemble_file_path(checkpoint_id, file_type, file_id), "wb") as f:
        pickle.dump(content, f, protocol=pickle.HIGHEST_PROTOCOL)
        f.write(COMPLETE_FLAG)


def load_file(checkpoint_id: str | os.PathLike, file_type: FileType, file_id: int) -> Any:
    """Rank ``file_id``'s file of ``file_type``, or ``None`` while it is missing or incomplete.

    A ``STORAGE_DATA`` file is deleted once read (only the coordinator reads it); a delete
    that fails (someone else removed it, a read-only mount) does not undo the read.

    Raises:
        pickle.UnpicklingError: the file holds something other than records and plain data.
    """
    path = assemble_file_path(checkpoint_id, file_type, file_id)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None  # not written yet: the caller comes back for it
    if len(raw) < len(COMPLETE_FLAG) or not raw.endswith(COMPLETE_FLAG):
        return None  # still being written
    result = RecordUnpickler(io.BytesIO(raw[:-len(COMPLETE_FLAG)]), path).load()
    if file_type is FileType.STORAGE_DATA:
        try:
            os.remove(path)
        except OSError:
            pass  # already gone, or left behind: what it held has been read
    return result


def construct_file_batches(file_list: Sequence[int], max_workers: int) -> tuple[list[tuple[int, ...]], int]:
    """Split ``file_list`` into at most ``max_workers`` contiguous batches; returns the batches
    and the worker count (``max_workers`` clamped to the number of files).

    Raises:
        ValueError: no files (zero workers).
    """
    n = len(file_list)
    workers = min(max_workers, n)
    if workers <= 0:
        raise ValueError(f"cannot split {n} exchange files over {max_workers} readers: nothing to read")
    size = (n + workers - 1) // workers
    batches = [tuple(file_list[i * size:(i + 1) * size]) for i in range(workers)]
    return [b for b in batches if b], workers


def batch_read_worker(file_batch: Sequence[int], checkpoint_id: str | os.PathLike, file_type: FileType, *,
                      load: Callable[[Any, FileType, int], Any] = load_file,
                      timeout: float = READ_TIMEOUT_SECONDS) -> list[Any]:
    """Read every file of ``file_batch``, going round the ones not ready yet until all are
    read; returns their contents in batch order. No sleeping between rounds: a file is read
    the round after it lands.

    Raises:
        TimeoutError: some files are still missing after ``timeout`` seconds (names them).
    """
    results: list[Any] = [None] * len(file_batch)
    position = {file_id: i for i, file_id in enumerate(file_batch)}
    pending = tuple(file_batch)
    deadline = time.monotonic() + timeout
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout:.0f} s the {file_type.name} files of ranks {list(pending)} under "
                               f"{os.fspath(checkpoint_id)} are still not complete")
        left = []
        for file_id in pending:
            got = load(checkpoint_id, file_type, file_id)
            if got is None:
                left.append(file_id)
            else:
                results[position[file_id]] = got
        pending = tuple(left)
    return results


def parallel_read_files(file_list: Sequence[int], checkpoint_id: str | os.PathLike, file_type: FileType,
                        max_workers: int = 32) -> list[Any]:
    """Every file of ``file_list``, read by up to ``max_workers`` threads, in list order."""
    if not file_list:
        return []
    batches, workers = construct_file_batches(file_list, max_workers)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dcp-exchange") as pool:
        parts = list(pool.map(lambda b: batch_read_worker(b, checkpoint_id, file_type), batches))
    return [r for part in parts for r in part]


def gather_all_results_from_storage(checkpoint_id: str | os.PathLike, is_coordinator: bool, world_size: int,
                                    results: Any, file_type: FileType, file_id: int) -> list[Any]:
    """All-gather through storage: write ``results`` as rank ``file_id``'s file, then read all
    ``world_size`` ranks' files, in rank order. For ``STORAGE_DATA`` only the coordinator
    reads (others get ``[]``)."""
    write_file(checkpoint_id, file_type, file_id, results)
    if file_type is FileType.STORAGE_DATA and not is_coordinator:
        return []
    cpus = os.cpu_count() or 1
    workers = min(16, max(cpus // 32, 1)) if file_type is FileType.LOCAL_PLAN else min(64, max(cpus // 2, 1))
    return parallel_read_files(tuple(range(world_size)), checkpoint_id, file_type, max_workers=workers)
