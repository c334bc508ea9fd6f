"""torch DCP import: a checkpoint ``torch.distributed.checkpoint`` wrote, rewritten in this format.

torch's ``..metadata`` is a pickle, so :func:`import_torch_dcp` needs ``trust=True``. Each
tensor's chunks are checked against the files before anything of its size is allocated;
tensors then stream through torch's own reader in batches of up to IMPORT_BATCH_BYTES.

Not here: the export to torch DCP (:mod:`.exporting`).
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from ...backends.locations import location
from ...base.box import Box
from ...base.dtypes import dtype_name
from ...base.errors import CorruptCheckpointError, UnsupportedValueError
from ...engine.streaming_writer import write_streaming
from ...format import metadata as md
from ...format.torch_pickles import check_chunks_in_files
from ...format.values import is_json_value
from ...planning.leaves import bytes_tensor, numpy_tensor
from ...planning.planner import EntrySpec, WriteItem
from ...state.flatten import path_from_parts

IMPORT_BATCH_BYTES = 256 << 20  # torch-DCP import: tensors loaded per torch load call


def _check_torch_chunks(key: str, m: Any, src: str) -> None:
    """Check a tensor of torch's ``..metadata`` before a buffer of its shape is allocated: its
    chunks lie inside the shape and cover it (their byte ranges are checked against the files
    by :func:`~...format.torch_pickles.check_chunks_in_files`, as ``load`` does). A forged shape
    then fails here, naming the key, instead of allocating whatever it says.

    Raises CorruptCheckpointError.
    """
    where = f"{src}/{md.METADATA_FILE}: {key!r}"
    shape = tuple(m.size)
    if len(shape) > 64 or not all(type(d) is int and d >= 0 for d in shape):
        raise CorruptCheckpointError(f"{where}: shape {list(shape)[:8]} is no tensor shape")
    held = 0
    for c in m.chunks:
        offsets, sizes = tuple(c.offsets), tuple(c.sizes)
        if len(offsets) != len(shape) or len(sizes) != len(shape) or not all(
                type(v) is int for v in offsets + sizes) or any(
                o < 0 or s < 0 or o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise CorruptCheckpointError(f"{where}: chunk at {list(offsets)} of sizes {list(sizes)} lies outside "
                                         f"its shape {list(shape)}")
        held += math.prod(sizes)
    if held < math.prod(shape):
        raise CorruptCheckpointError(f"{where}: its chunks hold {held} of the {math.prod(shape)} elements of shape "
                                     f"{list(shape)}; the checkpoint is incomplete or its metadata damaged")


def _file_size(src: str) -> Any:
    def size(name: str) -> int:
        try:
            return os.stat(os.path.join(src, name)).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{src}/{name} is missing; the checkpoint's metadata names it") from None
    return size


def import_torch_dcp(src_path: str | os.PathLike, dst_path: str | os.PathLike, *, trust: bool = False,
                     overwrite: bool = False) -> md.Metadata:
    """Convert a checkpoint written by ``torch.distributed.checkpoint`` into this format.

    torch's ``..metadata`` is a pickle, and loading a pickle can run code; this therefore
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

    src = os.fspath(src_path)
    for key, m in tmeta.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            _check_torch_chunks(key, m, src)
    check_chunks_in_files(tmeta, _file_size(src), f"{src}/{md.METADATA_FILE}")
    for key, m in tmeta.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            dtype = dtype_name(m.properties.dtype)
            shape = tuple(m.size)
            entries[key] = EntrySpec("tensor", path_of(key), dtype, shape)
            nbytes = md.itemsize(dtype)
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
                template = {k: torch.empty(entries[k].shape, dtype=md.torch_dtype(entries[k].dtype)) for k in keys}
                batch.update(load_keys(keys, template))
            return batch.pop(item.key)

    return write_streaming(dst_path, entries, [items], produce, overwrite=overwrite)
