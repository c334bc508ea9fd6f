"""Export a checkpoint in ``torch.distributed.checkpoint``'s own format, offline and streaming.

:func:`export_torch_dcp` writes what ``torch.distributed.checkpoint.save`` would have written
for the same state dict, so any torch DCP job loads it (``dcp.load``, under any layout, or
``format_utils.dcp_to_torch_save``) without this package installed. It is the reverse of
:func:`~..offline_transform.import_torch_dcp`.

What is written is torch's format, not ours:

- ``..metadata`` is torch's ``Metadata`` object, **pickled** (torch's writer does the same):
  ``state_dict_metadata`` (each key's dtype, global size and chunk boxes, or "bytes"),
  ``planner_data`` (each key's path in the nested state dict, so torch un-flattens nested
  dicts as ``dcp.save`` recorded them), ``storage_data`` (file, offset, length of every item).
- ``__<rank>_<id>.distcp`` data files hold each tensor chunk as a ``torch.save`` stream and
  each non-tensor value as a ``torch.save``'d object, which is how torch stores both. There
  are no checksums: torch's format has none (ours are verified while reading the source).

Keys and structure follow torch's own flattening (its ``flatten_state_dict``): nested dicts
become dotted keys, lists holding tensors or dicts are descended, everything else (a tuple, a
list of plain values, a string, ``bytes``, a numpy array) is one torch-saved object. Tensor
chunks keep the boxes of the layout each tensor was saved with (pieces of at most
``max_chunk_bytes``), so a sharded torch job reads only the chunks it overlaps.

Memory: one chunk per writing thread (at most ``max_chunk_bytes``, default 256 MiB, when a tensor's
rows allow), plus whole values for non-tensor keys. Like our own commit, ``..metadata`` is
written last (temporary name, fsync, rename); data files have fresh names, so replacing an
existing checkpoint (``overwrite=True``) never damages it before the new one commits.

Not here: importing torch checkpoints (``offline_transform.import_torch_dcp``) and writing
torch's checkpoints from a running job (that is ``torch.distributed.checkpoint.save``).
"""

from __future__ import annotations

import io
import math
import os
import pickle
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import torch

# torch's own classes for its format. Metadata & co. are public; _StorageInfo (one item's
# file/offset/length) and flatten_state_dict (how dcp.save names nested keys) are what torch's
# FileSystemWriter and DefaultSavePlanner use, so the result is torch's format by construction.
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...backends.filesystem import FileSystemReader
from ...backends.locations import location
from ...backends.protocol import StorageReader
from ...backends.resolve import reader_for
from ...base.atomic_file import atomic_file
from ...base.box import Box
from ...base.dtypes import itemsize, torch_dtype
from ...base.errors import CheckpointError, UnsupportedValueError
from ...base.sizes import parse_size
from ...engine.metadata_reader import read_checkpoint_metadata
from ...format import metadata as md
from ...sharding.layout import TensorLayout
from ...state.flatten import unflatten
from ...transfer.loader import check_files_hold, read_box

try:  # the version torch's FileSystemWriter stamps on its metadata ("1.0.0" in torch 2.13)
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION as _TORCH_DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    _TORCH_DCP_VERSION = "1.0.0"

DISTCP_SUFFIX = ".distcp"
DEFAULT_MAX_CHUNK_BYTES = 256 << 20


@dataclass
class _Deferred:
    """A non-tensor value stored as a tensor in our checkpoint (bytes, ndarray, pickle)."""

    entry: md.Entry


@dataclass
class _TensorChunk:
    fqn: str
    entry: md.Entry
    box: Box
    nbytes: int


@dataclass
class _Object:
    fqn: str
    value: Any  # the skeleton value; read from the source when written


# ---------------------------------------------------------------------------- planning


def _skeleton(meta: md.Metadata) -> tuple[dict[str, Any], dict[int, md.Entry]]:
    """The nested state dict with a meta tensor standing in for every tensor (no data)."""
    placeholders: dict[int, md.Entry] = {}
    items: dict[tuple[Any, ...], Any] = {}
    for e in meta.entries.values():
        if e.kind == "tensor":
            t = torch.empty(tuple(e.shape or ()), dtype=torch_dtype(e.dtype), device="meta")
            placeholders[id(t)] = e
            items[tuple(e.path)] = t
        elif e.kind == "object":
            items[tuple(e.path)] = e.value
        else:
            items[tuple(e.path)] = _Deferred(e)
    return unflatten(items), placeholders


def _layout_boxes(entry: md.Entry) -> list[tuple[Box, list[int]]] | None:
    """Each distinct non-empty box of the layout the tensor was saved with, and its ranks.

    None for a tensor saved without a layout (a plain tensor), or whose recorded layout
    does not tile it: it is then one box.
    """
    if entry.layout is None:
        return None
    shape = tuple(entry.shape or ())
    try:
        holders = TensorLayout.from_record(entry.layout, ndim=len(shape)).holders(shape)
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    if sum(b.numel for b in holders) != math.prod(shape):
        return None
    return [(b, sorted(ranks)) for b, ranks in sorted(holders.items(), key=lambda kv: kv[0].offsets)]


def _plan(meta: md.Metadata, max_chunk_bytes: int
          ) -> tuple[dict[int, list[_TensorChunk | _Object]], dict[str, Any], dict[int, md.Entry]]:
    """Torch's keys and mappings, and every item to write grouped by the rank file it goes to.

    A sharded tensor's boxes go to the file of a rank that held them (replicas: the one with
    the fewest bytes so far); plain tensors and objects then go to the lightest file.
    """
    nested, placeholders = _skeleton(meta)
    flat, mappings = flatten_state_dict(nested)
    files: dict[int, list[_TensorChunk | _Object]] = {}
    load: dict[int, int] = {}

    def put(rank: int | None, items: list[_TensorChunk | _Object]) -> None:
        if rank is None:
            rank = min(load, key=lambda r: (load[r], r)) if load else 0
        files.setdefault(rank, []).extend(items)
        load[rank] = load.get(rank, 0) + sum(i.nbytes for i in items if isinstance(i, _TensorChunk))

    def chunks(fqn: str, entry: md.Entry, box: Box) -> list[_TensorChunk | _Object]:
        size = itemsize(entry.dtype)
        if not box.numel:  # torch writes one empty chunk for an empty tensor
            return [_TensorChunk(fqn, entry, box, 0)]
        return [_TensorChunk(fqn, entry, p, p.numel * size) for p in box.split(max(1, max_chunk_bytes // size))]

    later: list[tuple[str, Any, md.Entry | None]] = []
    for fqn, value in flat.items():
        entry = placeholders.get(id(value)) if isinstance(value, torch.Tensor) else None
        boxes = _layout_boxes(entry) if entry is not None else None
        if not boxes:  # no layout, or an empty tensor (no non-empty box): one chunk, as torch writes
            later.append((fqn, value, entry))
            continue
        for box, ranks in boxes:
            put(min(ranks, key=lambda r: (load.get(r, 0), r)), chunks(fqn, entry, box))
    for fqn, value, entry in later:
        if entry is None:
            put(None, [_Object(fqn, value)])
        else:
            put(None, chunks(fqn, entry, Box.full(tuple(entry.shape or ()))))
    return files, mappings, placeholders


# ---------------------------------------------------------------------------- values


def _materialize(value: Any, reader: StorageReader, placeholders: dict[int, md.Entry], verify: bool) -> Any:
    """The real value of a skeleton value: placeholders and deferred entries read from the source."""
    if isinstance(value, _Deferred):
        e = value.entry
        t, _ = read_box(e, reader, verify=verify)
        if e.kind == "ndarray":
            return t.numpy()
        raw = t.numpy().tobytes()
        return raw if e.kind == "bytes" else pickle.loads(raw)  # pickle: allow_pickle checked up front
    if isinstance(value, torch.Tensor):
        return read_box(placeholders[id(value)], reader, verify=verify)[0]
    if type(value) is dict:
        return {k: _materialize(v, reader, placeholders, verify) for k, v in value.items()}
    if type(value) is list:
        return [_materialize(v, reader, placeholders, verify) for v in value]
    if type(value) is tuple:
        return tuple(_materialize(v, reader, placeholders, verify) for v in value)
    return value


def _write_file(path: str, name: str, items: list[_TensorChunk | _Object], reader: StorageReader,
                placeholders: dict[int, md.Entry], verify: bool, sync_files: bool,
                progress: Callable[[int], None] | None, stop: threading.Event) -> dict[MetadataIndex, _StorageInfo]:
    """Write one ``..distcp`` file: each item a ``torch.save`` stream, back to back."""
    out: dict[MetadataIndex, _StorageInfo] = {}
    with open(os.path.join(path, name), "wb") as f:
        for item in items:
            if stop.is_set():
                raise CheckpointError("export abandoned: writing another file failed")
            start = f.tell()
            if isinstance(item, _TensorChunk):
                tensor, _ = read_box(item.entry, reader, item.box, verify=verify)
                torch.save(tensor, f)
                index = MetadataIndex(item.fqn, item.box.offsets)
                done = item.nbytes
            else:
                buf = io.BytesIO()
                torch.save(_materialize(item.value, reader, placeholders, verify), buf)
                f.write(buf.getbuffer())
                index = MetadataIndex(item.fqn)
                done = 0
            out[index] = _StorageInfo(name, start, f.tell() - start)
            if progress is not None and done:
                progress(done)
        f.flush()
        if sync_files:
            os.fsync(f.fileno())
    return out


def _write_files(dst: str, jobs: list[tuple[str, list[_TensorChunk | _Object]]], reader: StorageReader,
                 placeholders: dict[int, md.Entry], verify: bool, sync_files: bool, thread_count: int,
                 progress: Callable[[int], None] | None) -> dict[MetadataIndex, _StorageInfo]:
    """Write every file (one thread each, up to ``thread_count``); the first error stops the rest."""
    stop = threading.Event()

    def write(job: tuple[str, list[_TensorChunk | _Object]]) -> dict[MetadataIndex, _StorageInfo]:
        return _write_file(dst, job[0], job[1], reader, placeholders, verify, sync_files, progress, stop)

    storage: dict[MetadataIndex, _StorageInfo] = {}
    workers = max(1, min(thread_count, len(jobs)))
    if workers == 1:
        for job in jobs:
            storage.update(write(job))
        return storage
    # reads, torch.save and fsync of different files overlap
    with ThreadPoolExecutor(workers, thread_name_prefix="dcp-export") as pool:
        futures = [pool.submit(write, job) for job in jobs]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f.exception() for f in done if f.exception() is not None]
            if failed:
                raise failed[0]  # the root cause, not another thread's "abandoned"
        except BaseException:
            stop.set()
            raise
    for f in futures:
        storage.update(f.result())
    return storage


def _torch_metadata(files: dict[int, list[_TensorChunk | _Object]], mappings: dict[str, Any],
                    storage: dict[MetadataIndex, _StorageInfo], dst: str, save_id: str) -> Metadata:
    state: dict[str, Any] = {}
    for items in files.values():
        for item in items:
            if isinstance(item, _Object):
                state[item.fqn] = BytesStorageMetadata()
                continue
            m = state.get(item.fqn)
            if m is None:
                e = item.entry
                m = state[item.fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=torch_dtype(e.dtype)), torch.Size(e.shape or ()), [])
            m.chunks.append(ChunkStorageMetadata(torch.Size(item.box.offsets), torch.Size(item.box.sizes)))
    for m in state.values():
        if isinstance(m, TensorStorageMetadata):
            m.chunks.sort(key=lambda c: tuple(c.offsets))
    state = {k: state[k] for k in mappings if k in state}  # torch's key order: the state dict's
    return Metadata(state_dict_metadata=state, planner_data=dict(mappings), storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=dst, save_id=save_id), version=_TORCH_DCP_VERSION)


def _commit(dst: str, tmeta: Metadata, sync_files: bool) -> None:
    """``..metadata`` last: a temporary name, fsync, rename, fsync of the directory."""
    with atomic_file(os.path.join(dst, md.METADATA_FILE), sync=sync_files) as f:
        pickle.dump(tmeta, f)


def _previous_files(dst: str) -> set[str]:
    """Data files of a checkpoint about to be replaced: ``*.distcp``, and ours when it is ours."""
    names = {f for f in os.listdir(dst) if f.endswith(DISTCP_SUFFIX)}
    try:
        names |= set(md.Metadata.from_json(FileSystemReader(dst).read_metadata_bytes()).file_names())
    except (CheckpointError, OSError):
        pass  # torch's pickle (never unpickled here), or no checkpoint
    return names


# ---------------------------------------------------------------------------- entry point


def export_torch_dcp(
    src: str | os.PathLike | StorageReader,
    dst: str | os.PathLike,
    *,
    overwrite: bool = False,
    allow_pickle: bool = False,
    max_chunk_bytes: int | str | None = DEFAULT_MAX_CHUNK_BYTES,
    verify: bool = True,
    sync_files: bool = True,
    thread_count: int = 2,
    progress: Callable[[int], None] | None = None,
) -> Metadata:
    """Write checkpoint ``src`` as a ``torch.distributed.checkpoint`` checkpoint in ``dst``.

    ``torch.distributed.checkpoint.load`` then reads ``dst`` like one of its own: into
    DTensors of any layout on any number of ranks, into plain tensors with ``no_dist=True``,
    or whole via ``format_utils.dcp_to_torch_save``. Tensors are bit-exact; non-tensor values
    (ints, floats, strings, ``bytes``, numpy arrays, tuples, nested dicts) come back as the
    same Python objects, stored the way ``dcp.save`` stores them (``torch.save``'d). Keys
    are torch's: nested dicts flatten to dotted keys exactly as ``dcp.save`` would name them,
    and ``planner_data`` records their paths. Values torch DCP itself never stores (an empty
    dict) are left out, as ``dcp.save`` would.

    Its ``..metadata`` is torch's format: a Python pickle of torch's ``Metadata`` (loading it
    runs ``pickle.load``, as every torch DCP load does). It is written last, atomically.

    Args:
        src: our checkpoint (a path or a :class:`StorageReader`).
        dst: a new directory (``overwrite=True`` to replace a checkpoint there; its old
            data files are removed only after the new ``..metadata`` is in place).
        allow_pickle: export values our checkpoint holds as pickles (saved with
            ``allow_pickle=True``); unpickling them runs code from the checkpoint.
        max_chunk_bytes: largest torch chunk (``int`` or ``"512MiB"``; ``None``: no limit).
            Each tensor keeps the boxes of the layout it was saved with; a larger box is
            cut into row slabs. Bounds this function's memory and what a torch rank reads.
        verify: check our checksums while reading the source.
        sync_files: fsync data files, ``..metadata`` and the directory.
        thread_count: files written at once (one thread each); memory grows with it.
        progress: called with each tensor chunk's byte count once written, from the writing
            threads (``tqdm.update`` is fine).

    Returns:
        The torch ``Metadata`` written to ``dst/.metadata``.

    Raises:
        CheckpointError: ``dst`` already holds a checkpoint (without ``overwrite``), or
            ``dst`` is ``src``; ``NotACheckpointError``/``MetadataError`` for a bad ``src``;
            ``CorruptCheckpointError`` when a source byte fails its checksum (nothing is
            committed then, and the files written so far are removed).
        UnsupportedValueError: ``src`` holds pickled values and ``allow_pickle`` is False.

    Example::

        export_torch_dcp("/ckpt/step100", "/ckpt/step100-torch")
        # in a torch job, on any number of ranks:
        torch.distributed.checkpoint.load({"model": model.state_dict()}, checkpoint_id="/ckpt/step100-torch")
    """
    dst = os.fspath(dst)
    reader = src if isinstance(src, StorageReader) else reader_for(src)
    if not isinstance(src, StorageReader) and location(src) == location(dst):  # symlinks resolved
        raise CheckpointError(f"export_torch_dcp: dst {dst!r} is the source checkpoint; choose a new directory")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise CheckpointError(f"{dst!r} exists and is not a directory; a checkpoint is a directory")
    if os.path.exists(os.path.join(dst, md.METADATA_FILE)) and not overwrite:
        raise CheckpointError(f"{dst!r} already holds a checkpoint; pass overwrite=True to replace it")
    meta = read_checkpoint_metadata(reader)
    check_files_hold(meta, reader, md.METADATA_FILE if isinstance(src, StorageReader)
                     else f"{os.fspath(src)}/{md.METADATA_FILE}")
    pickled = [k for k, e in meta.entries.items() if e.kind == "pickle"]
    if pickled and not allow_pickle:
        raise UnsupportedValueError(
            f"{len(pickled)} value(s) of the checkpoint are pickles (e.g. {pickled[0]!r}); exporting them "
            "means unpickling them, which runs code from the checkpoint. Pass allow_pickle=True (CLI: "
            "--allow-pickle) only if you trust it")
    limit = math.inf if max_chunk_bytes is None else parse_size(max_chunk_bytes)
    if limit < 1:
        raise ValueError(f"max_chunk_bytes must be positive, found {max_chunk_bytes!r}")
    files, mappings, placeholders = _plan(meta, int(min(limit, 1 << 62)))

    os.makedirs(dst, exist_ok=True)
    previous = _previous_files(dst) if overwrite else set()
    save_id = uuid.uuid4().hex[:12]
    names = {rank: f"__{rank}_{save_id}{DISTCP_SUFFIX}" for rank in sorted(files)}
    written = list(names.values())
    try:
        jobs = [(names[rank], files[rank]) for rank in names]
        storage = _write_files(dst, jobs, reader, placeholders, verify, sync_files, thread_count, progress)
        tmeta = _torch_metadata(files, mappings, storage, dst, save_id)
        _commit(dst, tmeta, sync_files)
    except BaseException:
        for name in written:
            try:
                os.unlink(os.path.join(dst, name))
            except FileNotFoundError:
                pass
        raise
    finally:
        if not isinstance(src, StorageReader):
            reader.close()
    for name in previous - set(written):
        try:
            os.unlink(os.path.join(dst, name))
        except (FileNotFoundError, IsADirectoryError):
            pass
    return tmeta
