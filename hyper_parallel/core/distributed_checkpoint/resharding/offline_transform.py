"""Offline transforms and conversions, in one process, without a process group, in bounded memory.

:func:`offline_transform` rewrites a checkpoint for a new parallel layout (TP=8 -> TP=4)
through :func:`~.reshard.reshard`. Every converter streams: it holds one tensor (or one
chunk) at a time plus one read buffer, never the whole model, so it works on the models
that need distributed checkpoints.

- DCP checkpoint <-> Hugging Face sharded safetensors
  (:func:`save_state_dict_as_huggingface_format`, :func:`convert_full_checkpoint_to_dcp`,
  :func:`parse_checkpoint_from_huggingface`).
- DCP checkpoint <-> full state dict in memory (:func:`dcp_to_full_state_dict`,
  :func:`full_state_dict_to_dcp_format`).
- A checkpoint written by ``torch.distributed.checkpoint`` -> ours (:func:`import_torch_dcp`;
  its metadata is a pickle, so it needs ``trust=True``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import struct
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from ..backends.locations import location
from ..backends.protocol import StorageReader, StorageWriter
from ..backends.resolve import reader_for, writer_for
from ..base.atomic_file import sync_directory, write_atomically
from ..base.box import Box
from ..base.coordination import Coordinator
from ..base.dtypes import dtype_from_safetensors, dtype_name, itemsize, safetensors_dtype, torch_dtype
from ..base.errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError
from ..base.limits import MAX_NDIM
from ..engine.commit import commit_and_agree, write_and_report
from ..engine.metadata_reader import read_checkpoint_metadata
from ..format import metadata as md
from ..format.chunks import largest_chunk_bytes
from ..format.validation import validate_file_name
from ..format.values import is_json_value
from ..interop.huggingface import check_safetensors_file
from ..planning.leaves import bytes_tensor, numpy_tensor
from ..planning.planner import EntrySpec, SavePlan, WriteItem
from ..sharding.layout import Layout, TensorLayout
from ..sharding.layout_files import load_layout
from ..sharding.strategy import LayoutStrategy
from ..state.flatten import path_from_parts
from ..state.topology_mapper import MapperLike
from ..transfer.loader import read_box
from ..transfer.saver import WriteResult, build_metadata, data_file_names, tensor_bytes, write_plan

HF_INDEX = "model.safetensors.index.json"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


SMALL_TENSOR = 4 << 20  # the default memory budget grows to keep tensors up to this size cached


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000; ``"512MiB"`` -> 536870912; ints pass through."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"cannot read size {size!r}; use e.g. 5GB, 512MiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def _reader(path: str | os.PathLike | StorageReader) -> StorageReader:
    return path if isinstance(path, StorageReader) else reader_for(path)


def _check_destination(dst: str | os.PathLike | StorageWriter, overwrite: bool) -> None:
    """Refuse to replace a checkpoint at ``dst`` (a path, an fsspec URL or a writer) unless told to."""
    writer = dst if isinstance(dst, StorageWriter) else writer_for(dst)
    try:
        committed = writer.read_committed()
    except (NotADirectoryError, IsADirectoryError):
        raise CheckpointError(f"{_where(dst)!r} exists and is not a directory; a checkpoint is a directory") from None
    if not overwrite and committed is not None:
        raise CheckpointError(
            f"{_where(dst)!r} already holds a checkpoint; pass overwrite=True to replace it")


def _where(dst: str | os.PathLike | StorageWriter) -> str:
    if isinstance(dst, StorageWriter):
        return str(getattr(dst, "url", None) or getattr(dst, "path", None) or type(dst).__name__)
    return os.fspath(dst)


class _Lazy:
    """The saver's data resolver: produces each item's tensor only when it is written."""

    def __init__(self, produce: Callable[[WriteItem], Any]):
        self.produce = produce

    def resolve_data(self, item: WriteItem) -> Any:
        return self.produce(item)


def write_streaming(
    dst: str | os.PathLike,
    entries: dict[str, EntrySpec],
    files: list[list[WriteItem]],
    produce: Callable[[WriteItem], Any],
    *,
    overwrite: bool = False,
    sync_files: bool = True,
    user_metadata: dict[str, Any] | None = None,
) -> md.Metadata:
    """Write a checkpoint whose data is produced item by item (one data file per list).

    Object entries get their value from ``produce(WriteItem(key, Box((), ()), 0))``.
    """
    writer = writer_for(dst, sync_files)
    _check_destination(writer, overwrite)
    writer.set_up(0, True)
    writer.prepare()
    save_id = uuid.uuid4().hex[:16]
    objects = [k for k, e in entries.items() if e.kind == "object"]
    resolver = _Lazy(produce)
    # Chunks of each key get ids 0..n-1 in the order given (they form the key's table).
    counts: dict[str, int] = {}
    numbered = []
    for items in files or [[]]:
        row = []
        for item in items:
            row.append(WriteItem(item.key, item.box, item.nbytes, counts.get(item.key, 0)))
            counts[item.key] = counts.get(item.key, 0) + 1
        numbered.append(row)
    specs = {k: EntrySpec(e.kind, e.path, e.dtype, e.shape, e.layout) for k, e in entries.items()}
    # A layout's mesh may be larger than the number of files (replicas written once).
    world = max([len(files), 1] + [math.prod(e.layout["mesh_shape"]) for e in entries.values() if e.layout])
    coord = Coordinator(None, no_dist=True)
    own = [n for r in range(len(numbered)) for n in data_file_names(r, save_id, 1)]
    what = f"writing {_where(dst)}"

    def write_all() -> list[WriteResult]:
        return [write_plan(SavePlan(specs, items, objects if rank == 0 else []), resolver, writer, rank, save_id)
                for rank, items in enumerate(numbered)]

    results = write_and_report(coord, writer, "write", write_all, own, what, save_id)[0]
    meta = commit_and_agree(
        coord, writer, "commit",
        lambda: build_metadata(specs, results, save_id, world, user_metadata or {}),
        own, what, save_id)
    assert meta is not None
    return meta


# ---------------------------------------------------------------------------- layout transform


def _as_strategy(value: Any) -> LayoutStrategy | None:
    if isinstance(value, (str, os.PathLike)):
        return load_layout(value)
    if isinstance(value, Mapping) and value and all(isinstance(v, TensorLayout) for v in value.values()):
        return LayoutStrategy(value)
    if isinstance(value, TensorLayout):
        raise TypeError("a single TensorLayout is not a strategy; pass {'*': layout} or a Layout (mesh)")
    return None


def _check_src_layout(meta: md.Metadata, src_layout: Any) -> None:
    strategy = _as_strategy(src_layout)
    if strategy is None:
        want = Layout.of(src_layout)
        for key, e in meta.entries.items():
            if e.layout and list(e.layout["mesh_shape"]) != list(want.mesh_shape):
                raise ValueError(f"src_layout mesh {list(want.mesh_shape)} does not match {key!r}, which was "
                                 f"saved on mesh {e.layout['mesh_shape']}")
        return
    for key, e in meta.entries.items():
        expected = strategy.match(key)
        if expected is None or e.layout is None:
            continue
        saved = TensorLayout.from_record(e.layout, ndim=len(e.shape or ()))
        if saved.tensor_map != expected.with_ndim(len(e.shape or ())).tensor_map or \
                tuple(saved.layout.mesh_shape) != tuple(expected.layout.mesh_shape):
            raise ValueError(f"src_layout says {key!r} has layout {expected}, but it was saved as {saved}")


def offline_transform(
    src_path: str | os.PathLike,
    dst_path: str | os.PathLike,
    src_layout: Any = None,
    dst_layout: Any = None,
    *,
    max_memory: int | None = None,
    verify: bool = True,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    topology_mapper: MapperLike | None = None,
) -> md.Metadata:
    """Rewrite a checkpoint for another parallel layout, offline, in one process.

    ``topology_mapper`` renames keys on the way, e.g. for another pipeline split: a PP=2
    checkpoint whose stages numbered their layers from 0 becomes one whose keys are the
    whole model's, which a PP=1 job (or any split that uses whole-model names) loads
    without a mapper.

    Args:
        src_path: the checkpoint to convert.
        dst_path: a new directory for the result (``overwrite=True`` to replace a checkpoint).
        src_layout: optional; when given it is checked against the layouts the metadata
            recorded (a strategy, a layout JSON file, a :class:`Layout`, or ``{"tp": 8}``).
        dst_layout: the target: a strategy ``{name or glob: TensorLayout}``, a JSON file
            written by :func:`save_layout`, a :class:`Layout`/``DeviceMesh``, or a mesh
            mapping like ``{"tp": 4}`` (each tensor keeps its placements per mesh dim name).
        max_memory: bytes of tensor data held at once (default: four times the largest
            saved chunk, at least 64 MiB, raised to twice the total of the small tensors,
            up to 512 MiB, so that each small tensor split into thousands of destination
            chunks is read once); never the model size.
        verify: check the source's checksums while reading.
        progress: called with a byte count as each chunk is done (e.g. ``tqdm.update``).
        topology_mapper: the new name of each source key (source -> new, the direction a
            rewrite walks; a load planner's mapper goes target -> checkpoint): a
            :class:`~.topology_mapper.TopologyMapper`, a ``{source name: new name}``
            mapping, a callable, or ``(regex, replacement)`` rules; unmapped names stay.
            ``src_layout`` is checked against the source names, a ``dst_layout`` strategy
            matches the new names.

    Raises:
        ValueError: ``src_layout`` disagrees with the checkpoint, the target mesh cannot
            hold a tensor, or ``topology_mapper`` maps two source keys to one name (the
            message names both).
        CheckpointError: ``dst_path`` already holds a checkpoint (without ``overwrite``).

    Example::

        offline_transform("ckpt_tp8", "ckpt_tp4", src_layout={"tp": 8}, dst_layout={"tp": 4})

        # PP=2 -> PP=1: stage s saved {"stage<s>": stage_sd} with 2 layers numbered from 0
        offline_transform("ckpt_pp2", "ckpt_pp1", dst_layout={"dp": 1}, topology_mapper=[
            (r"^stage(\\d+)\\.layers\\.(\\d+)\\.", lambda m: f"layers.{2 * int(m[1]) + int(m[2])}.")])
    """
    from .reshard import reshard

    if dst_layout is None:
        raise ValueError("offline_transform needs dst_layout: a strategy, a layout file, a Layout or {'tp': 4}")
    if location(src_path) == location(dst_path):
        raise ValueError("dst_path must differ from src_path")
    _check_destination(dst_path, overwrite)
    reader = reader_for(src_path)
    meta = read_checkpoint_metadata(reader)
    if src_layout is not None:
        _check_src_layout(meta, src_layout)
    if max_memory is None:
        largest = max((largest_chunk_bytes(meta, e) for e in meta.entries.values()), default=0)
        small = sum(e.nbytes for e in meta.entries.values() if e.kind != "object" and e.nbytes <= SMALL_TENSOR)
        max_memory = max(64 << 20, 4 * largest, min(512 << 20, 2 * small))
    strategy = _as_strategy(dst_layout)
    if strategy is not None:
        meshes = {tl.layout for tl in strategy.values()}
        if len(meshes) != 1:
            raise ValueError(f"dst_layout uses {len(meshes)} meshes; a checkpoint is laid out for one")
        dst_mesh, rules = meshes.pop(), strategy
    else:
        dst_mesh, rules = dst_layout, None
    result = reshard(src_path, dst_path, dst_mesh=dst_mesh, rules=rules, max_memory=max_memory, verify=verify,
                     storage_reader=reader, progress=progress, topology_mapper=topology_mapper)
    assert result is not None
    return result


# ---------------------------------------------------------------------------- full state dicts


def dcp_to_full_state_dict(src_path: str | os.PathLike | None = None, *, verify: bool = True,
                           allow_pickle: bool = False, src_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Load a whole checkpoint, whatever layout saved it, as full CPU tensors and plain values.

    ``src_dir`` is HyperParallel's name for ``src_path``.

    Example::

        sd = dcp_to_full_state_dict("/ckpt/step100")
        torch.save(sd["model"], "model.pt")
    """
    from ..engine.checkpoint import load

    src_path = _one_of(src_path, src_dir, "src_path", "src_dir", "dcp_to_full_state_dict")
    return load(path=src_path, no_dist=True, verify=verify, allow_pickle=allow_pickle)


def full_state_dict_to_dcp_format(state_dict: dict[str, Any], dst_path: str | os.PathLike | None = None, *,
                                  overwrite: bool = False, allow_pickle: bool = False,
                                  dst_dir: str | os.PathLike | None = None) -> md.Metadata:
    """Save an in-memory full state dict (plain tensors) as a checkpoint, in one process.

    ``dst_dir`` is HyperParallel's name for ``dst_path``.
    """
    from ..engine.checkpoint import save

    dst_path = _one_of(dst_path, dst_dir, "dst_path", "dst_dir", "full_state_dict_to_dcp_format")

    _check_destination(dst_path, overwrite)
    meta = save(state_dict, dst_path, no_dist=True, allow_pickle=allow_pickle)
    assert meta is not None
    return meta


# ---------------------------------------------------------------------------- safetensors IO


_ST_RESERVED = "__metadata__"  # the safetensors header's own member: no tensor may be named so


def _safetensors_header(tensors: list[tuple[str, str, tuple[int, ...]]], extra: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": extra} if extra else {}
    pos = 0
    for name, dtype, shape in tensors:
        st = safetensors_dtype(dtype)
        if st is None:
            raise UnsupportedValueError(f"{name!r}: dtype {dtype} has no safetensors name; convert it first")
        n = itemsize(dtype)
        for s in shape:
            n *= s
        header[name] = {"dtype": st, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _write_safetensors(path: str, tensors: list[tuple[str, str, tuple[int, ...]]],
                       produce: Callable[[str], torch.Tensor], extra: dict[str, str]) -> None:
    """Write a safetensors file at ``path`` (a temporary name: the caller renames it), synced."""
    try:
        with open(path, "wb") as f:
            f.write(_safetensors_header(tensors, extra))
            for name, _, _ in tensors:
                f.write(tensor_bytes(produce(name)))
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise


def _tensor_entries(meta: md.Metadata, prefix: str) -> list[md.Entry]:
    return [e for k, e in meta.entries.items() if e.kind in ("tensor", "ndarray") and k.startswith(prefix)]


def save_state_dict_as_huggingface_format(
    src: str | os.PathLike | Mapping[str, Any] | None = None,
    dst_dir: str | os.PathLike | Mapping[str, Any] | None = None,
    max_shard_size: int | str = "5GB",
    *,
    prefix: str = "",
    verify: bool = True,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    save_directory: str | os.PathLike | None = None,
    state_dict: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Export tensors as Hugging Face sharded safetensors, streaming one tensor at a time.

    Writes ``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_size`` each
    (a single larger tensor gets a file of its own) and ``model.safetensors.index.json``.
    With one shard the file is named ``model.safetensors`` and no index is written, as
    ``transformers`` does. Shards are written under temporary names and renamed at the end,
    so an export killed midway (``overwrite=True`` too) leaves the earlier export whole, the new
    one whole, or shards without an index, which readers refuse; never a mix of the two.

    Two argument orders are accepted: ours, ``(src, dst_dir)`` with ``src`` a checkpoint path
    or a state dict; and HyperParallel's, ``(save_directory, state_dict, max_shard_size)``,
    recognised by a state dict in second place (or by the keywords ``save_directory=`` and
    ``state_dict=``). Non-tensor values of a state dict are left out.

    Args:
        src: a checkpoint path, or an in-memory state dict of full tensors.
        dst_dir: the output directory.
        max_shard_size: bytes per shard file: an int or a string like ``"5GB"``.
        prefix: export only keys starting with it, with it removed (e.g. ``"model."``).
        progress: called with each tensor's byte count once it is written.
        save_directory, state_dict: HyperParallel's names for ``dst_dir`` and ``src``.

    Returns:
        The index dict (``{"metadata": {"total_size": ...}, "weight_map": {...}}``).

    Raises:
        TypeError: neither order fits the arguments.
        CheckpointError: no tensors to export; the directory already holds safetensors files
            and ``overwrite`` is False.

    Example::

        save_state_dict_as_huggingface_format("/ckpt/step100", "/hf", prefix="model.")
        save_state_dict_as_huggingface_format("/hf", model.state_dict(), max_shard_size="1GB")
    """
    if isinstance(dst_dir, Mapping) and src is not None and not isinstance(src, Mapping):
        src, dst_dir = dst_dir, src  # HyperParallel's order: (save_directory, state_dict)
    if save_directory is not None or state_dict is not None:
        if (save_directory is not None and dst_dir is not None) or (state_dict is not None and src is not None):
            raise TypeError("pass the directory and the state dict once each")
        dst_dir = save_directory if save_directory is not None else dst_dir
        src = state_dict if state_dict is not None else src
    if src is None or dst_dir is None or isinstance(dst_dir, Mapping):
        raise TypeError("save_state_dict_as_huggingface_format needs (src, dst_dir) or "
                        "(save_directory, state_dict)")
    limit = parse_size(max_shard_size)
    os.makedirs(dst_dir, exist_ok=True)
    if not overwrite and any(f.endswith(".safetensors") or f == HF_INDEX for f in os.listdir(dst_dir)):
        raise CheckpointError(f"{os.fspath(dst_dir)!r} already holds safetensors files; pass overwrite=True")
    if isinstance(src, Mapping):
        from ..state.flatten import flatten

        flat = {k: leaf.value for k, leaf in flatten(dict(src)).leaves.items()
                if isinstance(leaf.value, torch.Tensor) and k.startswith(prefix)}
        from torch.distributed.tensor import DTensor

        sharded = [k for k, v in flat.items() if isinstance(v, DTensor)]
        if sharded:
            raise UnsupportedValueError(
                f"{sharded[0]!r} is a DTensor ({len(sharded)} in all): a Hugging Face export needs full tensors. "
                "Pass a checkpoint path instead, or a full state dict (get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True)) on rank 0)")
        tensors = [(k[len(prefix):], dtype_name(v.dtype), tuple(v.shape)) for k, v in flat.items()]
        produce: Callable[[str], torch.Tensor] = lambda name: flat[prefix + name]
        close = lambda: None
    else:
        reader = _reader(src)
        meta = read_checkpoint_metadata(reader)
        entries = {e.key[len(prefix):]: e for e in _tensor_entries(meta, prefix)}
        tensors = [(name, e.dtype, tuple(e.shape)) for name, e in entries.items()]
        produce = lambda name: read_box(entries[name], reader, verify=verify)[0]
        close = reader.close
    if not tensors:
        raise CheckpointError(f"no tensors to export (prefix {prefix!r})")
    if any(name == _ST_RESERVED for name, _, _ in tensors):
        raise UnsupportedValueError(
            f"tensor {prefix + _ST_RESERVED!r}: safetensors reserves the name {_ST_RESERVED!r} for its header's "
            "metadata, so no tensor can have it; rename the tensor before exporting")
    shards: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for t in tensors:
        n = itemsize(t[1])
        for s in t[2]:
            n *= s
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += n
    total = len(shards)
    weight_map, total_size = {}, 0
    tag = uuid.uuid4().hex[:8]
    written: list[tuple[str, str]] = []  # (temporary path, final name)
    try:
        for i, shard in enumerate(shards, 1):
            name = "model.safetensors" if total == 1 else f"model-{i:05d}-of-{total:05d}.safetensors"
            tmp = os.path.join(dst_dir, f"{name}{_TMP}{tag}")
            _write_safetensors(tmp, shard, produce, {"format": "pt"})
            written.append((tmp, name))
            for tname, dtype, shape in shard:
                weight_map[tname] = name
                n = itemsize(dtype)
                for s in shape:
                    n *= s
                total_size += n
                if progress is not None:
                    progress(n)
    except BaseException:
        for tmp, _ in written:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        raise
    finally:
        close()
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    _swap_in_export(dst_dir, written, index if total > 1 else None)
    return index


_HF_SHARD = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors$")
_TMP = ".tmp-"  # a file being written: "<final name>.tmp-<8 hex digits>"
_HF_DEBRIS = re.compile(r"^model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?\.tmp-[0-9a-f]{8}$")


def _swap_in_export(dst_dir: str | os.PathLike, written: list[tuple[str, str]], index: dict[str, Any] | None) -> None:
    """Replace an earlier export in ``dst_dir`` by the shards ``written`` (synced, under temporary
    names) so that a crash at any point leaves the old export whole, the new one whole, or a
    directory no reader takes for a checkpoint (never old and new shards under one index):

    1. the old index goes first (shards named ``-of-N`` without an index are refused), and so
       does an old ``model.safetensors`` the new export does not replace (transformers would
       take it over the new index);
    2. the new shards take their names, the directory is synced;
    3. the new index is written (the commit; none for a single ``model.safetensors``);
    4. shards of the old export the new index does not name, and debris of killed exports, go.
    """
    index_path = os.path.join(dst_dir, HF_INDEX)
    stale = _previous_export(dst_dir) - {name for _, name in written}
    if os.path.exists(index_path):
        os.remove(index_path)
        sync_directory(dst_dir)
    # Before any rename: what a reader would take instead of the new export. Without a new
    # index, every old shard (an old model.safetensors or its shards would win over the new
    # single file, half renamed); with one, an old model.safetensors (transformers looks for
    # it before the index).
    early = stale if index is None else stale & {"model.safetensors"}
    if early:
        for name in sorted(early):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(dst_dir, name))
        stale -= early
        sync_directory(dst_dir)
    for tmp, name in written:
        os.replace(tmp, os.path.join(dst_dir, name))
    sync_directory(dst_dir)
    if index is not None:
        write_atomically(index_path, json.dumps(index, indent=2).encode())
    for name in sorted(stale | {f for f in os.listdir(dst_dir) if _HF_DEBRIS.match(f)}):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(dst_dir, name))



def _previous_export(dst_dir: str | os.PathLike) -> set[str]:
    """Shard files of an earlier export in ``dst_dir`` (by its index, else by HF's naming)."""
    names = {f for f in os.listdir(dst_dir) if _HF_SHARD.match(f)}
    try:
        with open(os.path.join(dst_dir, HF_INDEX)) as f:
            names |= {n for n in json.load(f).get("weight_map", {}).values()
                      if isinstance(n, str) and _HF_SHARD.match(n)}
    except (OSError, ValueError, AttributeError):
        pass
    return names


def _hf_sources(src: str | os.PathLike) -> dict[str, set[str] | None]:
    """The safetensors files of a Hugging Face checkpoint (a directory or one file), each with
    the tensor names to take from it: those its index's ``weight_map`` assigns to it (a name
    another shard also holds is read from the one the index names), or None (all) without an
    index."""
    src = os.fspath(src)
    if os.path.isfile(src):
        return {src: None}
    if not os.path.isdir(src):
        raise CheckpointError(f"{src!r}: no such file or directory (expected Hugging Face safetensors)")
    index = os.path.join(src, HF_INDEX)
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        names: dict[str, set[str] | None] = {}
        for tensor, n in sorted(weight_map.items(), key=lambda kv: (kv[1], kv[0])):
            validate_file_name(n, where=index)
            names.setdefault(os.path.join(src, n), set()).add(tensor)  # type: ignore[union-attr]
        return names
    files = sorted(f for f in os.listdir(src) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{src!r} holds no safetensors files and no {HF_INDEX}")
    sharded = [f for f in files if _HF_SHARD.match(f) and f != "model.safetensors"]
    if sharded:  # transformers, too, reads sharded files only through their index
        raise CheckpointError(
            f"{src!r} holds Hugging Face shard files ({sharded[0]!r}, {len(sharded)} in all) but no {HF_INDEX}: "
            "an export or download that did not finish; without the index nothing says which shards make the "
            "checkpoint")
    return {os.path.join(src, f): None for f in files}


def _hf_names(path: str, wanted: set[str] | None, keys: Iterable[str], seen: dict[str, str]) -> list[str]:
    """The names to read from one file of :func:`_hf_sources`; a name two files hold without
    an index saying which is an error naming both."""
    keys = list(keys)
    if wanted is not None and not wanted <= set(keys):
        lost = sorted(wanted - set(keys))
        raise CheckpointError(f"{HF_INDEX} places {lost[0]!r} ({len(lost)} tensor(s)) in {path!r}, which does not "
                              "hold it")
    out = []
    for name in keys:
        if wanted is not None and name not in wanted:
            continue
        if name in seen:
            raise CheckpointError(f"tensor {name!r} is in both {seen[name]!r} and {path!r}, and no "
                                  f"{HF_INDEX} says which holds it")
        seen[name] = path
        out.append(name)
    return out


def parse_checkpoint_from_huggingface(src: str | os.PathLike | None = None, *, prefix: str = "",
                                      resume_from_checkpoint: str | os.PathLike | None = None
                                      ) -> dict[str, torch.Tensor]:
    """Read a Hugging Face safetensors checkpoint (a directory or one file) into a state dict.

    Keys get ``prefix`` prepended (e.g. ``"model."`` to match ``{"model": model.state_dict()}``).
    With an index, each tensor comes from the shard its ``weight_map`` names.
    ``resume_from_checkpoint`` is HyperParallel's name for ``src``.
    """
    src = _one_of(src, resume_from_checkpoint, "src", "resume_from_checkpoint", "parse_checkpoint_from_huggingface")
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    seen: dict[str, str] = {}
    for path, wanted in _hf_sources(src).items():
        check_safetensors_file(path)
        with safe_open(path, framework="pt") as f:
            for name in _hf_names(path, wanted, f.keys(), seen):
                out[prefix + name] = f.get_tensor(name)
    return out


_SRC_PLATFORMS = {"huggingface": "huggingface", "hf": "huggingface", "safetensors": "huggingface",
                  "torch": "torch", "pytorch": "torch", "pt": "torch", "mindspore": "mindspore", "ms": "mindspore"}


def _one_of(ours: object, theirs: object, name: str, alias: str,
            func: str = "convert_full_checkpoint_to_dcp") -> str:
    """An argument given under our name or HyperParallel's (not both, not neither)."""
    if (ours is None) == (theirs is None):
        raise TypeError(f"{func}() needs exactly one of {name}= and {alias}=")
    return os.fspath(ours if ours is not None else theirs)


def _looks_like_mindspore(path: str) -> bool:
    """A file starting like MindSpore's protobuf (field 1 or 2, length-delimited). Not by its
    ``.ckpt`` suffix: Lightning's torch checkpoints have it too (torch files start with a zip
    header or a pickle opcode)."""
    try:
        with open(path, "rb") as f:
            first = f.read(1)
    except OSError:
        return False
    return first in (b"\x0a", b"\x12")


def convert_full_checkpoint_to_dcp(
    src: str | os.PathLike | None = None,
    dst_path: str | os.PathLike | None = None,
    src_platform: str | None = None,
    *,
    prefix: str = "",
    allow_pickle: bool = False,
    overwrite: bool = False,
    src_ckpt: str | os.PathLike | None = None,
    dst_dir: str | os.PathLike | None = None,
) -> md.Metadata:
    """Convert a full checkpoint (HF safetensors dir/file, a torch ``.pt``/``.bin``, or MindSpore's) to DCP.

    safetensors sources stream one tensor at a time. torch files are opened with
    ``torch.load(weights_only=True, mmap=True)`` — tensors are paged in as they are written;
    a file that needs full unpickling is refused unless ``allow_pickle=True``.

    Args:
        src: a Hugging Face directory, a ``.safetensors`` file, a torch file, or (with
            ``src_platform="mindspore"``) a MindSpore ``.ckpt`` or safetensors file.
        dst_path: the new checkpoint directory.
        src_platform: HyperParallel's argument naming the source: ``"huggingface"``,
            ``"torch"`` or ``"mindspore"`` (read without MindSpore by
            :func:`~.mindspore_format.import_mindspore`, which also takes MindSpore's
            distributed checkpoints). None (default) tells safetensors from torch files by
            the path.
        prefix: prepended to every key (e.g. ``"model."``).
        src_ckpt, dst_dir: HyperParallel's names for ``src`` and ``dst_path`` (its code
            calls ``convert_full_checkpoint_to_dcp(src_ckpt=..., dst_dir=..., src_platform=...)``).

    Raises:
        ValueError: an unknown ``src_platform``, or one that does not fit ``src``.

    Example::

        convert_full_checkpoint_to_dcp("/hf/llama", "/ckpt/llama", src_platform="huggingface")
        convert_full_checkpoint_to_dcp("lenet.ckpt", "/ckpt/lenet", src_platform="mindspore")
    """
    src = _one_of(src, src_ckpt, "src", "src_ckpt")
    dst_path = _one_of(dst_path, dst_dir, "dst_path", "dst_dir")
    is_st = os.path.isdir(src) or src.endswith(".safetensors")
    if src_platform is not None:
        kind = _SRC_PLATFORMS.get(str(src_platform).lower())
        if kind is None:
            raise ValueError(f"src_platform={src_platform!r}: expected 'huggingface', 'torch' or 'mindspore'")
        if kind == "mindspore":
            from ..interop.mindspore import import_mindspore

            return import_mindspore(src, dst_path, prefix=prefix, overwrite=overwrite)
        if kind == "huggingface" and not is_st:
            raise ValueError(f"src_platform='huggingface' needs a directory or a .safetensors file, got {src!r}")
        if kind == "torch" and os.path.isdir(src):
            raise ValueError(f"src_platform='torch' needs a torch file (.pt/.bin), got the directory {src!r}")
    if is_st:
        from safetensors import safe_open

        where: dict[str, tuple[str, str]] = {}
        entries: dict[str, EntrySpec] = {}
        items: list[WriteItem] = []
        seen: dict[str, str] = {}
        for path, wanted in _hf_sources(src).items():
            check_safetensors_file(path)
            with safe_open(path, framework="pt") as f:
                for name in _hf_names(path, wanted, f.keys(), seen):
                    sl = f.get_slice(name)
                    dtype = _st_dtype(sl.get_dtype(), name, path)
                    shape = tuple(sl.get_shape())
                    key = prefix + name
                    where[key] = (path, name)
                    entries[key] = EntrySpec("tensor", _prefixed_path(prefix, name), dtype, shape)
                    nbytes = itemsize(dtype)
                    for s in shape:
                        nbytes *= s
                    if nbytes:
                        items.append(WriteItem(key, Box.full(shape), nbytes))

        handles: dict[str, Any] = {}  # one open file each: safe_open parses the whole header
        lock = threading.Lock()

        def produce(item: WriteItem) -> torch.Tensor:
            path, name = where[item.key]
            with lock:
                f = handles.get(path)
                if f is None:
                    f = handles[path] = stack.enter_context(safe_open(path, framework="pt"))
                return f.get_tensor(name)

        with contextlib.ExitStack() as stack:
            return write_streaming(dst_path, entries, [items], produce, overwrite=overwrite)
    if not os.path.isfile(src):
        raise CheckpointError(f"{src!r}: no such file or directory (expected HF safetensors, a torch "
                              "file or a MindSpore checkpoint)")
    try:
        sd = torch.load(src, map_location="cpu", weights_only=not allow_pickle, mmap=True)
    except Exception as exc:
        if src_platform is None and _looks_like_mindspore(src):
            raise CheckpointError(
                f"{src!r} is not a torch file; it looks like a MindSpore checkpoint: pass "
                "src_platform='mindspore'") from None
        if allow_pickle or isinstance(exc, OSError):  # the caller's trust, or the system's error: as it is
            raise
        if not isinstance(exc, pickle.UnpicklingError):  # weights_only refusals are UnpicklingErrors
            raise CheckpointError(
                f"{src!r} is not a checkpoint this tool reads (HF safetensors, a torch file or a MindSpore "
                f"checkpoint): torch.load failed with {exc.__class__.__name__}: {str(exc)[:200]}") from exc
        raise UnsupportedValueError(
            f"{src!r} cannot be loaded with weights_only=True ({exc.__class__.__name__}); it holds "
            "arbitrary pickled objects. Pass allow_pickle=True only if you trust the file") from None
    if not isinstance(sd, dict):
        raise CheckpointError(f"{src!r} holds a {type(sd).__name__}, expected a state dict")
    if prefix:
        sd = {prefix + k: v for k, v in sd.items()}
    return full_state_dict_to_dcp_format(sd, dst_path, overwrite=overwrite, allow_pickle=allow_pickle)


def _prefixed_path(prefix: str, name: str) -> tuple[str, ...]:
    """``("model", "layers.0.weight")`` for prefix ``"model."``: flat names stay one key."""
    return (*(p for p in prefix.split(".") if p), name)


def _st_dtype(st: str, name: str, path: str) -> str:
    dtype = dtype_from_safetensors(st)
    if dtype is None:
        raise UnsupportedValueError(f"{path}: tensor {name!r} has unsupported dtype {st}")
    return dtype


# ---------------------------------------------------------------------------- torch DCP import


IMPORT_BATCH_BYTES = 256 << 20  # torch-DCP import: tensors loaded per torch load call


def _check_torch_chunks(key: str, m: Any, dtype: str, storage: Mapping[Any, Any], src: str,
                        file_sizes: dict[str, int]) -> None:
    """Check a tensor of torch's ``.metadata`` against the files before a buffer of its shape is
    allocated: its chunks lie inside the shape and cover it, and each chunk's stored bytes
    lie inside an existing file and (unless a storage transform, e.g. compression, wrote
    them) are at least the chunk's bytes. A forged shape or size then fails here, naming the
    key, instead of allocating whatever it says.

    Raises CorruptCheckpointError (MetadataError for a file name that is not a plain name).
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex

    where = f"{src}/{md.METADATA_FILE}: {key!r}"
    shape = tuple(m.size)
    if len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise CorruptCheckpointError(f"{where}: shape {list(shape)[:8]} is no tensor shape")
    held = 0
    for c in m.chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or not all(
                type(v) is int for v in offsets + sizes) or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise CorruptCheckpointError(f"{where}: chunk at {list(offsets)} of sizes {list(sizes)} lies outside "
                                         f"its shape {list(shape)}")
        numel = math.prod(sizes)
        held += numel
        if not numel:
            continue
        info = storage.get(MetadataIndex(key, c.offsets))
        if info is None:
            raise CorruptCheckpointError(f"{where}: chunk at {list(offsets)} has no storage record")
        name = validate_file_name(info.relative_path, f"{src}/{md.METADATA_FILE}")
        if name not in file_sizes:
            try:
                file_sizes[name] = os.stat(os.path.join(src, name)).st_size
            except FileNotFoundError:
                raise CorruptCheckpointError(f"{src}/{name} is missing: {key!r} is stored there") from None
        nbytes = numel * itemsize(dtype)
        if (info.offset < 0 or info.length < 0 or info.offset + info.length > file_sizes[name]
                or (not getattr(info, "transform_descriptors", None) and info.length < nbytes)):
            raise CorruptCheckpointError(
                f"{where}: chunk at {list(offsets)} ({nbytes} bytes) is stored at bytes {info.offset}.."
                f"{info.offset + info.length} of {src}/{name}, which has {file_sizes[name]}; the metadata is "
                "damaged or does not belong to these files")
    if held < math.prod(shape):
        raise CorruptCheckpointError(f"{where}: its chunks hold {held} of the {math.prod(shape)} elements of shape "
                                     f"{list(shape)}; the checkpoint is incomplete or its metadata damaged")


def import_torch_dcp(src_path: str | os.PathLike, dst_path: str | os.PathLike, *, trust: bool = False,
                     overwrite: bool = False) -> md.Metadata:
    """Convert a checkpoint written by ``torch.distributed.checkpoint`` into this format.

    torch's ``.metadata`` is a pickle, and loading a pickle can run code; this therefore
    requires ``trust=True``. Tensors stream in batches of up to IMPORT_BATCH_BYTES (peak
    memory: that, or the largest tensor); non-tensor values come through torch's own reader.
    """
    if not trust:
        raise UnsupportedValueError(
            f"{os.fspath(src_path)!r} is a torch.distributed.checkpoint checkpoint; its metadata is a "
            "Python pickle, and unpickling can execute code. Pass trust=True (CLI: --trust) only if you "
            "trust where it came from")
    if location(src_path) == location(dst_path):
        raise ValueError(f"dst_path {os.fspath(dst_path)!r} is the source checkpoint; write to a new path")
    import torch.distributed.checkpoint as tdcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    reader = tdcp.FileSystemReader(os.fspath(src_path))
    tmeta = reader.read_metadata()
    entries: dict[str, EntrySpec] = {}
    items: list[WriteItem] = []
    objects: list[str] = []
    paths = tmeta.planner_data if isinstance(tmeta.planner_data, dict) else {}

    def path_of(key: str) -> tuple[Any, ...]:
        # torch records how it flattened nested containers: {fqn: (part, ...)}, dict keys as
        # str and list indices as int (our paths write those ("i", n))
        p = paths.get(key)
        return path_from_parts(p) or (key,)

    file_sizes: dict[str, int] = {}
    for key, m in tmeta.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            dtype = dtype_name(m.properties.dtype)
            shape = tuple(m.size)
            _check_torch_chunks(key, m, dtype, tmeta.storage_data, os.fspath(src_path), file_sizes)
            entries[key] = EntrySpec("tensor", path_of(key), dtype, shape)
            nbytes = itemsize(dtype)
            for s in shape:
                nbytes *= s
            if nbytes:
                items.append(WriteItem(key, Box.full(shape), nbytes))
        elif isinstance(m, BytesStorageMetadata):
            objects.append(key)

    def load_keys(keys: Iterable[str], template: dict[str, Any]) -> dict[str, Any]:
        planner = tdcp.DefaultLoadPlanner(allow_partial_load=True)
        sd = {k: template[k] for k in keys}
        tdcp.load(sd, storage_reader=tdcp.FileSystemReader(os.fspath(src_path)), planner=planner, no_dist=True)
        return sd

    values = load_keys(objects, {k: None for k in objects}) if objects else {}
    for key in objects:
        v = values[key]
        kind = "tensor"
        if isinstance(v, np.ndarray):  # stored as our own save stores them, no pickle needed to load
            kind, v = "ndarray", numpy_tensor(v, key)
        elif isinstance(v, (bytes, bytearray)):
            kind, v = "bytes", bytes_tensor(v)
        if isinstance(v, torch.Tensor):
            values[key] = v
            entries[key] = EntrySpec(kind, path_of(key), dtype_name(v.dtype), tuple(v.shape))
            if v.numel():
                items.append(WriteItem(key, Box.full(tuple(v.shape)), v.numel() * v.element_size()))
        elif is_json_value(v):
            entries[key] = EntrySpec("object", path_of(key))
        else:
            raise UnsupportedValueError(f"{key!r}: torch checkpoint value of type {type(v).__name__} "
                                        "is neither a tensor nor a plain value")

    # torch's load re-reads and unpickles .metadata per call: tensors come in batches of up to
    # IMPORT_BATCH_BYTES, in write order (one call per tensor made 4000 tensors quadratic)
    order = [item.key for item in items]
    position = {k: i for i, k in enumerate(order)}
    sizes = {item.key: item.nbytes for item in items}
    batch: dict[str, Any] = {}
    lock = threading.Lock()

    def produce(item: WriteItem) -> Any:
        if item.key in values:
            return values[item.key]
        with lock:
            if item.key not in batch:
                keys, total = [], 0
                for k in order[position[item.key]:]:
                    if k in values or k in batch:
                        continue
                    if keys and total + sizes[k] > IMPORT_BATCH_BYTES:
                        break
                    keys.append(k)
                    total += sizes[k]
                template = {k: torch.empty(entries[k].shape, dtype=torch_dtype(entries[k].dtype)) for k in keys}
                batch.update(load_keys(keys, template))
            return batch.pop(item.key)

    return write_streaming(dst_path, entries, [items], produce, overwrite=overwrite)
