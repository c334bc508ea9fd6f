"""HuggingFaceStorageWriter: ``save`` writes Hugging Face safetensors straight from every rank.

torch's name and arguments (``torch.distributed.checkpoint.HuggingFaceStorageWriter``), two outputs:

- **Consolidated** (``enable_consolidation=True``, or ``save_distributed=False``, torch's
  default): what ``save_pretrained`` writes, ``model-0000i-of-0000N.safetensors`` files and
  ``model.safetensors.index.json``, each tensor whole in the file ``fqn_to_index_mapping``
  gives it (file 1 of 1 without a mapping). No pass over the data follows the save: a file's
  header depends only on the global shapes and dtypes, which every rank knows from the global
  plan, so every rank computes the same layout and writes each box it holds straight to its
  place in the final file: one write per contiguous run (one for a ``Shard(0)`` box; its whole
  4 KiB blocks with O_DIRECT on local block filesystems). A box of many short runs (a
  ``Shard(1)`` box has one per row, and the ranks' rows share disk blocks) is first regrouped
  over the process group into whole rows (:mod:`...transfer.row_exchange`, in
  :meth:`~HuggingFaceStorageWriter.write_together`): each rank then writes the rows it owns
  of such a tensor as one run (a 2-rank ``Shard(1)`` save of 1 GiB in 436 tensors: 2.32x our own
  save's time before, 1.23-1.38x after; see docs/performance.md). Where nothing is regrouped
  (one process), such a box is one strided copy into a shared mapping of the file on a
  filesystem of this node. Each byte is written once, by one rank. The path must be one directory
  that every rank sees (a shared filesystem for ranks on several nodes). (torch's writer
  writes shards to ``<path>/sharded`` first, then rank 0 reads them all back and writes the
  files; here there is no ``sharded`` directory.)
- **Sharded** (``save_distributed=True`` alone): torch's format of per-rank files, rank ``r``
  writing ``shard-<r+1>-model-<i>-of-<N>.safetensors`` with its boxes under the tensors'
  names and their offsets in the whole tensors in the header's ``DCP_SHARDING_INFO``, so
  torch's ``HuggingFaceStorageReader`` and our :class:`~.reader.TorchShardedSafetensorsReader`
  read it. Replicated data is in one file only (the plan gives each box one writer).

Commit: every file is written under a temporary name no reader takes for a checkpoint file;
after every rank wrote (and synced) its part, the coordinator puts the files in place, with
``..metadata``'s commit step (:meth:`commit`). Consolidated: :func:`.exporting.swap_in_export`
(an earlier export's index goes first, the new files take their names, the new index is
written atomically last: a crash leaves the old checkpoint, the new one, or files without an
index that readers refuse: a set with a shard missing, or one still under its temporary
name). Sharded: torch's format has no index or marker; earlier shard files the save does not
replace are removed, then the new ones renamed.

Not written: ``..metadata`` (the directory is a Hugging Face one; read it with
:class:`~.reader.HuggingFaceStorageReader`). Refused, each with an error naming the key:
values other than tensors (torch's writer writes them into the file before the safetensors
bytes, which no reader can then open), dtypes safetensors has no name for, keys
``fqn_to_index_mapping`` does not map. Also refused: URLs (the files are written in place
with ``pwrite``: a local or shared POSIX filesystem), rank-local saves, and ``user_metadata``
(no ``..metadata`` to keep it in; so also a CheckpointManager's steps, which it finds and
describes by their ``..metadata``: refused at the commit, leaving what the directory held).

torch's own ``save`` (and code written against torch's ``StorageWriter``) drives the writer
by torch's calls, ``write_data`` and ``finish``, into the same files: :mod:`.torch_writes`.

Not here: the safetensors bytes (:mod:`...format.safetensors`), reading these directories
(:mod:`.reader`), exporting a checkpoint of ours (:mod:`.exporting`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ...backends import direct_io
from ...backends.filesystem import FileSystemWriter
from ...backends.locations import checkpoint_path, is_url, local_path
from ...backends.placed_writes import DIRECT_MIN, PlacedWrites, box_runs
from ...base.atomic_file import sync_directory
from ...base.box import Box
from ...base.dtypes import safetensors_dtype
from ...base.errors import CheckpointError, StateDictMismatchError, UnsupportedValueError
from ...coordination.coordinator import Coordinator
from ...format import metadata as md
from ...format.data_file import tensor_bytes
from ...format.safetensors import contiguous_header, encode_header
from ...format.validation import validate_file_name
from ...planning.planner import EntrySpec, SavePlan, SavePlanner, WriteItem
from ...planning.standard_planner import StandardPlanner
from ...transfer.plan_writer import PlanWriter
from ...transfer.row_exchange import regroup_rows
from ...transfer.saver import WriteResult
from .exporting import swap_in_export, temporary_name
from .index import DCP_SHARDING_INFO_KEY, SAVED_OFFSETS_KEY
from .torch_writes import TorchProtocolWrites

__all__ = ["HuggingFaceStorageWriter"]

# torch's names (torch/distributed/checkpoint/_hf_utils.py)
_SHARDING_INFO = DCP_SHARDING_INFO_KEY
_SAVED_OFFSETS = SAVED_OFFSETS_KEY
_TORCH_SHARD = re.compile(r"shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors")

# What a rank holds of one key: a call that resolves its boxes' data, as (box, tensor) pairs
Held = Callable[[], list[tuple[Box, torch.Tensor]]]


def model_file_name(index: int, count: int) -> str:
    """torch's name of consolidated file ``index`` of ``count`` (also ``save_pretrained``'s)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def shard_file_name(shard: int, index: int, count: int) -> str:
    """torch's name of rank ``shard - 1``'s part of file ``index`` of ``count``."""
    return f"shard-{shard:05d}-{model_file_name(index, count)}"


@dataclass(frozen=True)
class _Layout:
    """One output file: its header and where each tensor's data starts (absolute offsets)."""

    name: str
    header: bytes
    starts: dict[str, int]
    size: int


class HuggingFaceStorageWriter(TorchProtocolWrites, PlanWriter):
    """Writes Hugging Face safetensors files from every rank of a save, with no pass after it.

    Pass it to :func:`~..api.save` (every rank, its own shards: DTensors of any placements,
    FSDP2 models, plain tensors)::

        save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(out, enable_consolidation=True))
        AutoModelForCausalLM.from_pretrained(out)    # with the config beside the files

        save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(out, save_distributed=True))
        load(sd, storage_reader=TorchShardedSafetensorsReader(out))    # torch's sharded format

    See the module docstring for the two outputs and the commit.

    Args:
        path: the directory (local or a shared POSIX filesystem).
        fqn_to_index_mapping: the file (1..N) of each tensor key; every tensor saved must be in
            it (keys it maps that the save does not hold are ignored). Default: one file.
        thread_count: threads per rank that write (``save(thread_count=)`` when larger).
        save_distributed: every rank writes its own shards; alone, torch's sharded format.
        enable_consolidation: the output is one Hugging Face checkpoint of whole tensors.
        thread_count_consolidation: with consolidation, at least this many writer threads
            per rank (there is no separate consolidation pass to give them to).
        consolidated_output_path: where the consolidated files go (default: ``path``).
        sync_files: fsync the files before they are put in place (default True).

    Raises (from ``save``, on every rank, inside :class:`~..errors.RankFailedError` when ranks
    save together):
        StateDictMismatchError: a tensor key is not in ``fqn_to_index_mapping``.
        UnsupportedValueError: a value that is not a tensor, a dtype safetensors cannot name
            (complex128, float8_e8m0fnu), a tensor named ``__metadata__``; a rank-local save.
        CheckpointError: the state dict holds no tensor.
        UnsupportedValueError: ``save(..., user_metadata=)`` (which a CheckpointManager passes):
            raised at the commit; the directory keeps what it held.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        fqn_to_index_mapping: Mapping[str, int] | None = None,
        thread_count: int = 1,
        save_distributed: bool = False,
        enable_consolidation: bool = False,
        thread_count_consolidation: int = 1,
        *,
        consolidated_output_path: str | os.PathLike | None = None,
        sync_files: bool = True,
    ) -> None:
        if fqn_to_index_mapping is not None:
            bad = next(((k, i) for k, i in fqn_to_index_mapping.items() if type(i) is not int or i < 1), None)
            if bad is not None:
                raise ValueError(f"fqn_to_index_mapping maps {bad[0]!r} to {bad[1]!r}; file indices are integers "
                                 "from 1 to the number of files")
            if not fqn_to_index_mapping:
                raise ValueError("fqn_to_index_mapping is empty; pass None to write one file")
        for n, what in ((thread_count, "thread_count"), (thread_count_consolidation, "thread_count_consolidation")):
            if type(n) is not int or n < 1:
                raise ValueError(f"{what} must be an integer >= 1, found {n!r}")
        self.fqn_to_index_mapping = dict(fqn_to_index_mapping) if fqn_to_index_mapping is not None else None
        self.thread_count = thread_count
        self.save_distributed = save_distributed
        self.enable_consolidation = enable_consolidation
        self.thread_count_consolidation = thread_count_consolidation
        self.sync_files = sync_files
        self._own_output = consolidated_output_path is not None
        self.path = ""
        self.consolidated_output_path: str | None = None
        self.reset(path)
        if consolidated_output_path is not None:
            self.consolidated_output_path = self._local(consolidated_output_path)
        self._pending: list[tuple[str, str]] = []  # (temporary path, final name) to put in place
        self._index: dict[str, Any] | None = None
        self._temps: set[str] = set()  # files this rank created in this save (removed if it fails)
        self._tag = ""
        self._save = ""  # the save the state above belongs to
        self._regrouped: set[str] = set()  # keys written by write_together in this save
        self._together: set[int] = set()  # the files write_together wrote rows into (synced by write_plan)
        self._together_error: BaseException | None = None  # its writes' first error (raised by write_plan)
        self._direct = self._node_local = False  # decided in prepare()

    @staticmethod
    def _local(path: str | os.PathLike) -> str:
        path = checkpoint_path(path)
        if is_url(path):
            raise UnsupportedValueError(
                f"HuggingFaceStorageWriter({path!r}): every rank writes into shared files in place, which needs a "
                "local or shared POSIX filesystem; save to a local directory and upload it, or use FsspecWriter "
                "for a checkpoint of this library")
        return local_path(path)

    @property
    def consolidates(self) -> bool:
        """Whether the output is a consolidated checkpoint (whole tensors, an index)."""
        return self.enable_consolidation or not self.save_distributed

    @property
    def output_dir(self) -> str:
        """The directory the files of this save go to."""
        return self.consolidated_output_path if self.consolidates else self.path  # type: ignore[return-value]

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        """Point the writer at ``checkpoint_id`` (torch's hook: ``save(checkpoint_id=)`` calls it)."""
        if checkpoint_id is None:
            return
        self.path = self._local(checkpoint_id)
        if self.consolidates and not self._own_output:
            self.consolidated_output_path = self.path

    def prepare(self) -> None:
        os.makedirs(self.output_dir, exist_ok=True)
        # local block filesystems: the bulk of the bytes with O_DIRECT, as our own saves write
        self._direct = direct_io.direct_io_default(self.output_dir)
        # a filesystem of this node only (block device or memory), whose page cache every rank
        # writing the file shares: short runs may then be copied into a shared mapping
        self._node_local = self._direct or direct_io.is_memory_filesystem(self.output_dir)

    # ------------------------------------------------------------------ writing

    def _begin(self, save_id: str) -> None:
        if self._save != save_id:
            self._save, self._tag, self._pending, self._index = save_id, save_id[:8], [], None
            self._temps, self._regrouped = set(), set()
            self._together, self._together_error = set(), None

    def write_together(self, coord: Coordinator, plan: SavePlan, planner: SavePlanner, save_id: str,
                       thread_count: int) -> None:
        """Consolidated, on several ranks: the tensors whose boxes split a trailing dim (a
        ``Shard(1)`` box has one short run per row, whose disk blocks the ranks share) are
        regrouped into whole rows over the group (:mod:`...transfer.row_exchange`), and each
        rank writes the rows it owns as one run, with O_DIRECT where the filesystem takes it.

        The files are not synced here: :meth:`write_plan` (next, inside the exchange that
        reports every rank's failure) raises the first error of these writes and syncs these
        files with its own, one ``fsync`` per file and rank, before any commit (a separate sync
        here cost a cross-rank exchange and a second ``fsync`` of every file)."""
        self._begin(save_id)
        if not self.consolidates or not coord.distributed or coord.world_size < 2:
            return
        try:
            files = self._file_of_keys(plan.entries)
        except CheckpointError:  # the same on every rank: write_plan raises it, on every rank
            return
        layouts = _consolidated_layouts(plan.entries, files, self._count())
        boxes = _boxes_by_key(plan.items)
        shapes = {k: tuple(e.shape or ()) for k, e in plan.entries.items() if len(e.shape or ()) >= 2}
        dtypes = {k: md.torch_dtype(plan.entries[k].dtype) for k in shapes}
        resolved: dict[str, dict[Box, torch.Tensor]] = {}
        fds: dict[int, PlacedWrites] = {}

        def value(key: str, box: Box) -> torch.Tensor:
            if key not in resolved:
                resolved[key] = dict(_resolved(planner, key, boxes[key], plan.entries[key]))
            return resolved[key][box]

        def row_offset(key: str, row: int) -> int:
            return layouts[files[key]].starts[key] + row * math.prod(shapes[key][1:]) * dtypes[key].itemsize

        def write(key: str, row: int, data: memoryview) -> None:
            i = files[key]
            if i not in fds:
                fds[i] = PlacedWrites(self._temporary(layouts[i].name), self._direct)
                os.ftruncate(fds[i].fd, layouts[i].size)  # its final size (every rank alike: nothing is cut)
            fds[i].write(data, row_offset(key, row))
            resolved.pop(key, None)

        try:
            held = {key: _held_boxes(items) for key, items in boxes.items() if key in shapes}
            self._regrouped = set(regroup_rows(coord, shapes, dtypes, held, value, write, row_offset))
            for f in fds.values():  # the queued (buffered) writes: done before the files are synced
                try:
                    f.drain()
                except BaseException as exc:  # raised by write_plan, where every rank learns of it
                    self._together_error = self._together_error or exc
        finally:
            self._together = set(fds)
            for f in fds.values():
                f.close()

    def write_plan(self, plan: SavePlan, planner: SavePlanner, rank: int, save_id: str,
                   thread_count: int) -> WriteResult:
        self._file_of_keys(plan.entries)  # refused before anything is written
        self._begin(save_id)
        if self._together_error is not None:  # a write of write_together's (this rank's) failed
            raise self._together_error
        boxes = {k: v for k, v in _boxes_by_key(plan.items).items() if k not in self._regrouped}
        held = {key: functools.partial(_resolved, planner, key, boxes[key], plan.entries[key])
                for key in sorted(boxes, key=lambda k: -sum(w.nbytes for w in boxes[k]))}
        self.write_tensors(plan.entries, held, rank + 1, thread_count, add_empty=self.is_coordinator)
        return WriteResult()

    def write_tensors(self, entries: Mapping[str, EntrySpec], held: Mapping[str, Held], shard: int,
                      thread_count: int, add_empty: bool = False) -> dict[str, tuple[str, int]]:
        """This rank's part of a save, under the temporary names of the save begun last: the
        boxes ``held[key]()`` gives for each key it holds (written in ``held``'s order), in the
        files of the layout ``entries`` (every tensor of the save, with its global shape and
        dtype) gives, consolidated or as rank ``shard - 1``'s shard files. ``add_empty``: also
        write the empty tensors no rank holds a box of (the coordinator's part, sharded).
        Both protocols write through here: ours (:meth:`write_plan`) and torch's
        (:mod:`.torch_writes`).

        Returns each key this rank wrote: its file's final name and where its data starts in
        the file's data area (safetensors' ``data_offsets``; for a box of a consolidated tensor,
        the tensor's start).

        Raises what :meth:`write_plan` raises (a key the files cannot hold, a planner value of
        the wrong shape).
        """
        files = self._file_of_keys(entries)
        if self.consolidates:
            return self._write_consolidated(entries, held, files,
                                            max(thread_count, self.thread_count_consolidation))
        return self._write_shards(entries, held, files, shard, thread_count, add_empty)

    def _file_of_keys(self, entries: dict[str, EntrySpec]) -> dict[str, int]:
        """Every tensor key's file index (checked on every rank alike, before any write)."""
        out: dict[str, int] = {}
        for key, spec in entries.items():
            if spec.kind != "tensor":
                raise UnsupportedValueError(
                    f"{key!r} is {_kind_text(spec.kind)}: a Hugging Face checkpoint holds tensors only; leave it out "
                    "of the state dict given to HuggingFaceStorageWriter (save it with save(..., path) instead)")
            if safetensors_dtype(spec.dtype) is None:
                raise UnsupportedValueError(
                    f"{key!r} is a {spec.dtype} tensor, a dtype safetensors (and so HuggingFaceStorageWriter) cannot "
                    "store; convert it (e.g. complex128 -> torch.view_as_real) before saving")
            if self.fqn_to_index_mapping is None:
                out[key] = 1
            elif key in self.fqn_to_index_mapping:
                out[key] = self.fqn_to_index_mapping[key]
            else:
                near = sorted(self.fqn_to_index_mapping)[:3]
                raise StateDictMismatchError(
                    f"{key!r} is not in fqn_to_index_mapping (it maps {len(self.fqn_to_index_mapping)} keys, e.g. "
                    f"{near}), so no file is given to it; add it, or leave the key out of the state dict")
        if not out:
            raise CheckpointError("the state dict holds no tensor: a Hugging Face checkpoint needs at least one")
        return out

    def _count(self) -> int:
        return max(self.fqn_to_index_mapping.values()) if self.fqn_to_index_mapping else 1

    def _temporary(self, name: str) -> str:
        tmp = os.path.join(self.output_dir, temporary_name(name, self._tag))
        self._temps.add(tmp)
        return tmp

    def _write_consolidated(self, entries: Mapping[str, EntrySpec], held: Mapping[str, Held],
                            files: dict[str, int], threads: int) -> dict[str, tuple[str, int]]:
        count = self._count()
        layouts = _consolidated_layouts(entries, files, count)
        self._pending = [(self._temporary(lay.name), lay.name) for lay in layouts.values()]
        tmp_of = dict(zip(layouts, (tmp for tmp, _ in self._pending), strict=True))
        self._index = {"metadata": {"total_size": sum(lay.size - len(lay.header) for lay in layouts.values())},
                       "weight_map": {key: layouts[i].name for key, i in files.items()}}
        mine = sorted({files[key] for key in held} | self._together)  # also synced: write_together's rows
        if self.is_coordinator:
            mine = sorted(layouts)
        fds: dict[int, PlacedWrites] = {}
        try:
            for i in mine:
                fds[i] = PlacedWrites(tmp_of[i], self._direct)
                os.ftruncate(fds[i].fd, layouts[i].size)  # its final size (every rank alike: nothing is cut)
            if self.is_coordinator:  # the headers
                for i, lay in layouts.items():
                    fds[i].write(memoryview(lay.header), 0)

            def place(key: str) -> None:
                spec, i = entries[key], files[key]
                start, shape = layouts[i].starts[key], tuple(spec.shape or ())
                for box, value in held[key]():
                    data = tensor_bytes(_tensor(key, value, box))
                    offsets, run = box_runs(shape, box, md.itemsize(spec.dtype))
                    if len(offsets) > 1 and run < DIRECT_MIN and self._node_local:  # many short runs: one copy
                        fds[i].copy_box(data, start, shape, box, md.itemsize(spec.dtype))
                        continue
                    for j, off in enumerate(offsets.tolist()):
                        fds[i].write(data[j * run:(j + 1) * run], start + off)

            _run_all(place, list(held), threads)
            for f in fds.values():
                f.drain()
            if self.sync_files:
                for f in fds.values():
                    os.fsync(f.fd)
        finally:
            for f in fds.values():
                f.close()
        return {key: (layouts[files[key]].name, layouts[files[key]].starts[key] - len(layouts[files[key]].header))
                for key in held}

    def _write_shards(self, entries: Mapping[str, EntrySpec], held: Mapping[str, Held], files: dict[str, int],
                      shard: int, threads: int, add_empty: bool) -> dict[str, tuple[str, int]]:
        count = self._count()
        keys_of: dict[int, list[str]] = {}
        for key in entries:  # in the state dict's order
            if key in held:
                keys_of.setdefault(files[key], []).append(key)
            elif add_empty and not math.prod(entries[key].shape or ()):
                keys_of.setdefault(files[key], []).append(key)  # an empty tensor: no rank holds a box of it
        placed: dict[str, tuple[str, int]] = {}

        def write_file(i: int) -> None:
            parts: list[tuple[str, Box, torch.Tensor]] = []
            for key in keys_of[i]:
                spec = entries[key]
                if key not in held:
                    shape = tuple(spec.shape or ())
                    parts.append((key, Box.full(shape), torch.empty(shape, dtype=md.torch_dtype(spec.dtype))))
                    continue
                got = list(held[key]())
                if len(got) > 1:
                    raise UnsupportedValueError(
                        f"{key!r}: this rank writes {len(got)} separate boxes of it ({got[0][0]}, {got[1][0]}, ...), "
                        "and torch's sharded format holds one box of a tensor per rank and file; use "
                        "enable_consolidation=True, or the default StandardPlanner")
                parts.append((key, got[0][0], _tensor(key, got[0][1], got[0][0])))
            info = {key: {_SAVED_OFFSETS: list(box.offsets)} for key, box, _ in parts}
            layout = contiguous_header([(key, entries[key].dtype, box.sizes) for key, box, _ in parts],
                                       {_SHARDING_INFO: json.dumps(info), "DCP_VERSION": "1.0", "format": "pt"})
            name = shard_file_name(shard, i, count)
            tmp = self._temporary(name)
            out.write_file(os.path.basename(tmp), [memoryview(encode_header(layout)),
                                                   *(tensor_bytes(v) for _, _, v in parts)])
            placed.update((key, (name, layout[key]["data_offsets"][0])) for key, _, _ in parts)

        # a rank's own files: our filesystem writer's (O_DIRECT where it pays, large writes)
        out = FileSystemWriter(self.output_dir, sync_files=self.sync_files, direct_io=self._direct)
        _run_all(write_file, sorted(keys_of), threads)
        return placed

    # ------------------------------------------------------------------ commit

    def read_committed(self, name: str = md.METADATA_FILE) -> bytes | None:
        """None: a Hugging Face directory has no ``..metadata`` of ours (nothing of an earlier save
        is reclaimed through it; :meth:`commit` replaces an earlier export itself)."""
        return None

    def commit(self, metadata: bytes, name: str = md.METADATA_FILE) -> None:
        """Put this save's files in place (the coordinator, after every rank wrote its part);
        ``metadata`` is not written. See the module docstring."""
        if name != md.METADATA_FILE:
            raise UnsupportedValueError("HuggingFaceStorageWriter cannot write rank-local checkpoints; save with "
                                        "use_collectives=True")
        _refuse_user_metadata(metadata, self.output_dir)
        self.put_in_place(None, self._index)

    def put_in_place(self, names: Iterable[str] | None, index: dict[str, Any] | None) -> None:
        """The commit of both protocols (the coordinator, after every rank wrote its part):
        the files of this save take their final names. Consolidated: ``names`` (None: the files
        this rank laid out in this save) that were written under this save's temporary name, or
        are already in place, and then ``index`` (:func:`.exporting.swap_in_export`). Sharded:
        every shard file written under this save's temporary name; earlier shard files go."""
        out = self.output_dir
        if self.consolidates:
            if names is None:
                pending = self._pending
            else:
                pending = []
                for name in sorted(set(names)):
                    validate_file_name(name, out)
                    tmp, final = os.path.join(out, temporary_name(name, self._tag)), os.path.join(out, name)
                    if self._tag and os.path.exists(tmp):
                        pending.append((tmp, name))
                    elif os.path.exists(final):  # already in place: kept (not taken for an earlier export's)
                        pending.append((final, name))
            swap_in_export(out, pending, index)
            return
        suffix = temporary_name("", self._tag)
        new = {n[: -len(suffix)]: n for n in os.listdir(out) if n.endswith(suffix) and _TORCH_SHARD.fullmatch(
            n[: -len(suffix)])}
        for old in sorted(n for n in os.listdir(out) if _TORCH_SHARD.fullmatch(n) and n not in new):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(out, old))
        for final, tmp in sorted(new.items()):
            os.replace(os.path.join(out, tmp), os.path.join(out, final))
        with contextlib.suppress(OSError):  # the files are in place: a failed directory sync is no failure
            sync_directory(out)

    def remove(self, names: Iterable[str]) -> None:
        """Remove ``names`` and the files this rank created in this save (a save that did not commit)."""
        for path in [*(os.path.join(self.output_dir, n) for n in names), *sorted(self._temps)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        self._temps = set()


def _refuse_user_metadata(metadata: bytes, out: str) -> None:
    """Refuse a save that asked to keep ``user_metadata``: a Hugging Face directory has no
    ``..metadata`` to keep it in, and dropping it silently loses what the caller relies on. The
    CheckpointManager is such a caller: it records each step's number and metrics there and
    finds committed steps by their ``..metadata``, so steps written as Hugging Face directories
    vanish from a restarted manager, whose retention then deletes them. Raised before any
    file is put in place (the save fails; what ``out`` held stays)."""
    user = md.Metadata.from_json(metadata).user
    if not user:
        return
    raise UnsupportedValueError(
        f"HuggingFaceStorageWriter({out!r}) cannot keep user_metadata (keys {sorted(user)[:5]}): a Hugging Face "
        "directory has no .metadata to hold it; nothing was put in place. A CheckpointManager keeps its steps' "
        "numbers and metrics there, so its steps cannot be Hugging Face directories (a restarted manager would "
        "not find them, and its retention would delete them): let the manager save steps in this library's "
        "format and export one with save_state_dict_as_huggingface_format(manager.step_path(step), out_dir); or "
        "save without user_metadata")


def _kind_text(kind: str) -> str:
    return {"ndarray": "a numpy array", "bytes": "bytes", "pickle": "an object saved with pickle",
            "object": "a plain value (not a tensor)"}.get(kind, kind)


def _boxes_by_key(items: list[WriteItem]) -> dict[str, list[WriteItem]]:
    out: dict[str, list[WriteItem]] = {}
    for item in items:
        out.setdefault(item.key, []).append(item)
    return out


def _consolidated_layouts(entries: dict[str, EntrySpec], files: dict[str, int], count: int) -> dict[int, _Layout]:
    """Each consolidated file's header and tensor positions, the same on every rank."""
    keys_of: dict[int, list[str]] = {}
    for key, i in files.items():
        keys_of.setdefault(i, []).append(key)
    out = {}
    for i, keys in sorted(keys_of.items()):
        header = contiguous_header([(k, entries[k].dtype, tuple(entries[k].shape or ())) for k in keys],
                                   {"format": "pt"})
        raw = encode_header(header)
        starts = {k: len(raw) + header[k]["data_offsets"][0] for k in keys}
        size = len(raw) + max((header[k]["data_offsets"][1] for k in keys), default=0)
        out[i] = _Layout(model_file_name(i, count), raw, starts, size)
    return out


def _union(items: list[WriteItem]) -> Box | None:
    """The one box ``items`` make together (the column bands of a box), or None."""
    if len(items) <= 1:
        return None
    ndim = items[0].box.ndim
    lo = tuple(min(w.box.offsets[d] for w in items) for d in range(ndim))
    hi = tuple(max(w.box.ends[d] for w in items) for d in range(ndim))
    union = Box(lo, tuple(h - o for o, h in zip(lo, hi, strict=True)))
    return union if union.numel == sum(w.box.numel for w in items) else None


def _held_boxes(items: list[WriteItem]) -> list[Box]:
    """The boxes :func:`_resolved` gives for ``items``."""
    union = _union(items)
    return [union] if union is not None else [w.box for w in items]


def _resolved(planner: SavePlanner, key: str, items: list[WriteItem],
              spec: EntrySpec) -> list[tuple[Box, torch.Tensor]]:
    """This rank's data of ``key`` as (box, tensor) pairs: its write items' boxes put back
    together into one box where they make one (the column bands of a box), so the box is
    written in as few runs as it has; else one pair per item."""
    union = _union(items)
    if union is not None:
        nbytes = union.numel * md.itemsize(spec.dtype)
        if type(planner).resolve_data is StandardPlanner.resolve_data:  # hands out any region of what it holds
            return [(union, _tensor(key, planner.resolve_data(WriteItem(key, union, nbytes, items[0].sub)), union))]
        whole = torch.empty(union.sizes, dtype=md.torch_dtype(spec.dtype))
        for w in items:
            whole[w.box.relative_to(union)] = _tensor(key, planner.resolve_data(w), w.box)
        return [(union, whole)]
    return [(w.box, _tensor(key, planner.resolve_data(w), w.box)) for w in items]


def _tensor(key: str, value: Any, box: Box) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or tuple(value.shape) != box.sizes:
        found = f"shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UnsupportedValueError(f"{key!r}: the planner gave {found} for box {box}; HuggingFaceStorageWriter "
                                    "writes tensors of the planned boxes")
    return value


def _run_all(fn: Any, args: list[Any], threads: int) -> None:
    """``fn(arg)`` for every arg, on up to ``threads`` threads; the first error is raised."""
    if threads <= 1 or len(args) <= 1:
        for a in args:
            fn(a)
        return
    with ThreadPoolExecutor(min(threads, len(args)), thread_name_prefix="hf-write") as pool:
        for f in [pool.submit(fn, a) for a in args]:
            f.result()
