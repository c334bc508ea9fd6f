"""Import checkpoints written by HyperParallel's own DCP (``mindspore-ai/hyper-parallel``).

A HyperParallel checkpoint directory holds a pickled ``..metadata`` (or, saved with
``use_collectives=False``, one rank-local ``.rank<r>_metadata`` / ``<r>.metadata`` per rank)
and per-rank data files: ``_rank<r>_.safetensors`` (a real safetensors file in current
HyperParallel; a ``torch.save`` archive under that name in older ones) and non-tensor values
in ``_rank<r>_.bytes`` (packed, with offsets) or ``<key>_rank<r>.bytes`` (older). See
``docs/hyper_parallel_compat_notes.md`` for the whole format.

:func:`import_hyper_parallel` rewrites such a checkpoint in this package's format, keeping
every saved shard as its own chunk, so ``load`` reshards it into any layout. It streams one
chunk at a time.

The metadata is a pickle, and unpickling can run code, so the import needs ``trust=True``;
even then the pickle goes through :class:`HyperParallelUnpickler`, which knows HyperParallel's
few metadata classes (mapped to the small stand-ins below) and ``torch.Size`` (read as a
tuple), and refuses every other global before anything is called. Non-tensor values are
pickles too: plain ones (numbers, strings, lists, dicts) are read with an unpickler that
allows no global at all; anything else is refused, or with ``allow_pickle=True`` copied over
still pickled (never unpickled here), for ``load(..., allow_pickle=True)`` to read.
"""

from __future__ import annotations

import math
import os
import pickle
import pickletools
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...backends.locations import location
from ...base.allowlist_pickle import AllowlistUnpickler
from ...base.box import Box, first_overlap
from ...base.dtypes import itemsize, torch_dtype
from ...base.errors import CheckpointError, CorruptCheckpointError, MetadataError, UnsupportedValueError
from ...base.limits import MAX_NDIM
from ...engine.streaming_writer import write_streaming
from ...format import metadata as md
from ...format.validation import validate_file_name
from ...format.values import plain_value_problem
from ...planning.planner import EntrySpec, WriteItem
from ...state.flatten import path_from_parts
from .single_file import is_torch_zip

__all__ = ["import_hyper_parallel", "read_hyper_parallel_metadata", "HyperParallelUnpickler"]

# ------------------------------------------------------------------ stand-ins for its classes
# Plain dataclasses: unpickling creates them empty (NEWOBJ) and fills their __dict__ (BUILD),
# so no code of ours or theirs runs; defaults cover fields older versions do not have.


@dataclass
class HPTensorProperties:
    dtype: Any = None
    requires_grad: Any = False
    memory_format: Any = None


@dataclass
class HPChunkStorageMetadata:
    offsets: Any = ()
    sizes: Any = ()


@dataclass
class HPTensorStorageMetadata:
    properties: Any = None
    size: Any = ()
    chunks: Any = field(default_factory=list)


@dataclass
class HPBytesStorageMetadata:
    pass


@dataclass
class HPChunkInfo:
    chunk: Any = None
    global_shape: Any = ()
    replica_rank_list: Any = None


@dataclass(eq=False)
class HPMetadataIndex:
    fqn: Any = ""
    offset: Any = ()
    index: Any = None

    def ident(self) -> tuple[Any, ...]:
        return (self.fqn, tuple(self.offset) if isinstance(self.offset, (tuple, list)) else self.offset)

    def __eq__(self, other: object) -> bool:  # as HyperParallel's newest: index is not identity
        return isinstance(other, HPMetadataIndex) and self.ident() == other.ident()

    def __hash__(self) -> int:
        return hash(self.ident())


@dataclass
class HPStorageInfo:
    relative_path: Any = ""
    offset: Any = 0
    length: Any = -1
    tensor_key: Any = None


@dataclass
class HPMetadata:
    state_dict_metadata: Any = field(default_factory=dict)
    planner_data: Any = None
    storage_data: Any = None
    version: Any = "1.0"


def _torch_size(dims: Any = ()) -> tuple[int, ...]:
    """``torch.Size(dims)`` in a pickle, read as a plain tuple of ints."""
    if not isinstance(dims, (tuple, list)) or any(type(d) is not int for d in dims):
        raise pickle.UnpicklingError(f"torch.Size with non-integer dimensions {dims!r}")
    return tuple(dims)


_METADATA_MODULES = ("hyper_parallel.core.distributed_checkpoint", "hyper_parallel.core.checkpoint")
_ALLOWED: dict[tuple[str, str], Any] = {("torch", "Size"): _torch_size}
for _pkg in _METADATA_MODULES:
    for _name, _cls in (("Metadata", HPMetadata), ("MetadataIndex", HPMetadataIndex),
                        ("TensorStorageMetadata", HPTensorStorageMetadata),
                        ("BytesStorageMetadata", HPBytesStorageMetadata),
                        ("ChunkStorageMetadata", HPChunkStorageMetadata),
                        ("TensorProperties", HPTensorProperties), ("ChunkInfo", HPChunkInfo)):
        _ALLOWED[(f"{_pkg}.metadata", _name)] = _cls
    _ALLOWED[(f"{_pkg}.storage", "StorageInfo")] = HPStorageInfo


class HyperParallelUnpickler(AllowlistUnpickler):
    """Unpickles HyperParallel's checkpoint metadata and nothing else.

    It admits only HyperParallel's metadata classes (by module path and name, both package
    locations it has used), answered with this module's stand-ins, and ``torch.Size`` with a
    tuple builder; any other global raises :class:`UnsupportedValueError` naming it, before it
    is imported or called. Persistent ids are refused too.
    """

    def admit(self, module: str, name: str) -> Any | None:
        return _ALLOWED.get((module, name))

    def refusal(self, what: str) -> Exception:
        return UnsupportedValueError(
            f"{self.where}: refusing to unpickle {what}: it is not one of HyperParallel's checkpoint metadata "
            "classes (the file may be corrupt or hostile)")


class _NoGlobals(AllowlistUnpickler):
    """Plain values only: numbers, strings, bytes, None, bools, lists, tuples, dicts, sets."""

    def refusal(self, what: str) -> Exception:
        return _NeedsGlobal(what)


class _NeedsGlobal(Exception):
    pass


# ------------------------------------------------------------------------------ reading


@dataclass
class _Chunk:
    box: Box
    file: str  # relative path of the data file
    key: str  # name of the tensor inside it


@dataclass
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    chunks: list[_Chunk]


@dataclass
class _Value:
    file: str
    offset: int
    length: int


@dataclass
class HyperParallelCheckpoint:
    """What a HyperParallel checkpoint holds, validated: tensors, values, key paths."""

    mode: str  # "collective" or "rank-local"
    version: str
    tensors: dict[str, _Tensor]
    values: dict[str, _Value]
    paths: dict[str, tuple[Any, ...]]


_RANK_LOCAL = (re.compile(r"^\.rank(\d+)_metadata$"), re.compile(r"^(\d+)\.metadata$"))
_MAX_METADATA_BYTES = 1 << 30
_PACKED_BYTES = re.compile(r"^_rank\d+_\.bytes$")


def _unpickle_metadata(path: str) -> HPMetadata:
    where = path
    size = os.path.getsize(path)
    if size > _MAX_METADATA_BYTES:
        raise MetadataError(f"{where}: {size} bytes is too large for checkpoint metadata")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        meta = HyperParallelUnpickler(raw, where).load()
    except UnsupportedValueError:
        raise
    except Exception as exc:
        raise MetadataError(f"{where}: not a readable HyperParallel metadata pickle ({exc})") from None
    if not isinstance(meta, HPMetadata):
        raise MetadataError(f"{where}: holds a {type(meta).__name__}, expected HyperParallel's Metadata")
    return meta


def _ints(v: Any, what: str, where: str, ndim: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or any(type(x) is not int or x < 0 for x in v):
        raise MetadataError(f"{where}: {what} {v!r} is not a tuple of non-negative integers")
    if ndim is not None and len(v) != ndim:
        raise MetadataError(f"{where}: {what} {v!r} should have {ndim} dimensions")
    if len(v) > MAX_NDIM:
        raise MetadataError(f"{where}: {what} has {len(v)} dimensions")
    return tuple(v)


def _dtype_name(v: Any, key: str, where: str) -> str:
    # "torch.float32" from torch; MindSpore's names ("Float32", "BFloat16") lower-case to ours
    name = v.removeprefix("torch.").lower() if isinstance(v, str) else None
    try:
        torch_dtype(name)
    except (MetadataError, TypeError, KeyError):
        raise UnsupportedValueError(f"{where}: {key!r} has dtype {v!r}, which this format cannot hold") from None
    return name


def _file_name(v: Any, where: str) -> str:
    validate_file_name(v, where=where)
    return v


def _parse(meta: HPMetadata, where: str, tensors: dict[str, _Tensor], values: dict[str, _Value],
           paths: dict[str, tuple[Any, ...]]) -> None:
    """Validate one metadata document and merge what it describes into the three maps."""
    sdm, storage = meta.state_dict_metadata, meta.storage_data
    if not isinstance(sdm, dict) or not isinstance(storage, dict):
        raise MetadataError(f"{where}: state_dict_metadata and storage_data must be dicts")
    infos: dict[tuple[Any, ...], HPStorageInfo] = {}
    for index, info in storage.items():
        if not isinstance(index, HPMetadataIndex) or not isinstance(info, HPStorageInfo):
            raise MetadataError(f"{where}: storage_data maps {type(index).__name__} to {type(info).__name__}")
        infos[index.ident()] = info
    if isinstance(meta.planner_data, dict):
        for key, p in meta.planner_data.items():
            path = path_from_parts(p)
            if isinstance(key, str) and path is not None and ".".join(map(str, p)) == key:
                paths[key] = path
    for key, entry in sdm.items():
        if not isinstance(key, str) or not key:
            raise MetadataError(f"{where}: key {key!r} is not a non-empty string")
        if isinstance(entry, HPBytesStorageMetadata):
            info = infos.get((key, ()))
            if info is None:
                raise MetadataError(f"{where}: no storage record for the value {key!r}")
            offset, length = info.offset, info.length
            if type(offset) is not int or type(length) is not int or offset < 0:
                raise MetadataError(f"{where}: {key!r} has a bad byte range ({offset!r}, {length!r})")
            values.setdefault(key, _Value(_file_name(info.relative_path, where), offset, length))
            continue
        if not isinstance(entry, HPTensorStorageMetadata) or not isinstance(entry.properties, HPTensorProperties):
            raise MetadataError(f"{where}: {key!r} has metadata of type {type(entry).__name__}")
        shape = _ints(entry.size, "size", f"{where}: {key!r}")
        dtype = _dtype_name(entry.properties.dtype, key, where)
        t = tensors.setdefault(key, _Tensor(dtype, shape, []))
        if (t.dtype, t.shape) != (dtype, shape):
            raise MetadataError(f"{where}: {key!r} is {dtype} {list(shape)} here but {t.dtype} {list(t.shape)} "
                                "in another rank's metadata")
        if not isinstance(entry.chunks, list):
            raise MetadataError(f"{where}: {key!r} chunks is not a list")
        seen = {c.box for c in t.chunks}
        for c in entry.chunks:
            if not isinstance(c, HPChunkStorageMetadata):
                raise MetadataError(f"{where}: {key!r} has a chunk of type {type(c).__name__}")
            box = Box(_ints(c.offsets, "chunk offsets", f"{where}: {key!r}", len(shape)),
                      _ints(c.sizes, "chunk sizes", f"{where}: {key!r}", len(shape)))
            if any(o + s > n for o, s, n in zip(box.offsets, box.sizes, shape, strict=True)):
                raise MetadataError(f"{where}: {key!r} chunk {box} reaches outside its shape {list(shape)}")
            if box in seen:  # a replica another rank also wrote (rank-local checkpoints)
                continue
            info = infos.get((key, box.offsets))
            if info is None:
                raise MetadataError(f"{where}: no storage record for {key!r} chunk at {list(box.offsets)}")
            name = info.tensor_key if isinstance(info.tensor_key, str) and info.tensor_key else key
            t.chunks.append(_Chunk(box, _file_name(info.relative_path, where), name))
            seen.add(box)


def _check_coverage(key: str, t: _Tensor, src: str) -> None:
    """The chunks must tile the tensor: pairwise disjoint (within its shape) and of full volume.

    Overlaps are found by :func:`~..box.first_overlap` (a sweep: thousands of shards cost
    little more than sorting them).
    """
    total = math.prod(t.shape)
    if total == 0:
        return
    if not t.shape:
        if not t.chunks:
            raise CheckpointError(f"{src}: the scalar {key!r} has no saved chunk")
        return
    boxes = [c.box for c in t.chunks]
    pair = first_overlap(boxes)
    if pair is not None:
        raise MetadataError(f"{src}: {key!r} has overlapping chunks {boxes[pair[0]]} and {boxes[pair[1]]}")
    covered = sum(b.numel for b in boxes)
    if covered != total:
        raise CheckpointError(
            f"{src}: the saved chunks of {key!r} cover {covered} of its {total} elements "
            f"(shape {list(t.shape)}): a rank's metadata or data is missing from the checkpoint")


def read_hyper_parallel_metadata(src: str | os.PathLike, *, trust: bool = False) -> HyperParallelCheckpoint:
    """Read and validate the metadata of a HyperParallel checkpoint directory (no tensor data).

    Args:
        src: the checkpoint directory.
        trust: must be True: the metadata is a pickle (read with :class:`HyperParallelUnpickler`).

    Raises:
        UnsupportedValueError: ``trust`` is False, or the pickle names a class that is not
            HyperParallel's metadata.
        NotADirectoryError / CheckpointError: no such directory, no metadata, missing ranks,
            chunks that do not cover a tensor.
        MetadataError: anything malformed.
    """
    src = os.fspath(src)
    if not trust:
        raise UnsupportedValueError(
            f"{src!r} is a HyperParallel checkpoint; its metadata is a Python pickle, and unpickling "
            "can execute code. It is read with an unpickler that only accepts HyperParallel's metadata "
            "classes, but pass trust=True (CLI: --trust) only if you trust where it came from")
    if not os.path.isdir(src):
        raise NotADirectoryError(f"{src!r} is not a directory")
    tensors: dict[str, _Tensor] = {}
    values: dict[str, _Value] = {}
    paths: dict[str, tuple[Any, ...]] = {}
    shared = os.path.join(src, md.METADATA_FILE)
    if os.path.isfile(shared):
        with open(shared, "rb") as f:
            if f.read(1) != b"\x80":
                raise MetadataError(f"{shared}: not a pickle; is this already a checkpoint of this package? "
                                    "(load it directly)")
        meta = _unpickle_metadata(shared)
        _parse(meta, shared, tensors, values, paths)
        mode, version = "collective", meta.version
    else:
        ranks: dict[int, str] = {}
        for name in os.listdir(src):
            for pattern in _RANK_LOCAL:
                m = pattern.match(name)
                if m:
                    ranks[int(m.group(1))] = name
        if not ranks:
            raise CheckpointError(f"{src!r} holds no HyperParallel metadata (.metadata, .rank<r>_metadata "
                                  "or <r>.metadata)")
        missing = sorted(set(range(max(ranks) + 1)) - set(ranks))
        if missing:
            raise CheckpointError(f"{src!r} is a rank-local HyperParallel checkpoint of ranks "
                                  f"{sorted(ranks)}: the metadata of rank(s) {missing} is missing")
        version = "?"
        for r in sorted(ranks):
            meta = _unpickle_metadata(os.path.join(src, ranks[r]))
            _parse(meta, os.path.join(src, ranks[r]), tensors, values, paths)
            version = meta.version
        mode = "rank-local"
    for key, t in tensors.items():
        _check_coverage(key, t, src)
    files = {c.file for t in tensors.values() for c in t.chunks} | {v.file for v in values.values()}
    absent = sorted(f for f in files if not os.path.isfile(os.path.join(src, f)))
    if absent:
        raise CheckpointError(f"{src!r}: data file(s) {absent} named by its metadata are missing")
    return HyperParallelCheckpoint(mode, str(version), tensors, values, paths)


class _SourceFiles:
    """Opens HyperParallel's tensor files one at a time (safetensors, or torch.save archives)."""

    def __init__(self, src: str):
        self.src, self.name, self.handle, self.tensors = src, None, None, None

    def tensor(self, name: str, key: str) -> torch.Tensor:
        from safetensors import SafetensorError, safe_open

        path = os.path.join(self.src, name)
        if name != self.name:
            self.close()
            if is_torch_zip(path):
                with open(path, "rb") as f:  # weights_only: tensors and plain containers, nothing else
                    try:
                        self.tensors = torch.load(f, map_location="cpu", weights_only=True, mmap=False)
                    except Exception as exc:  # a damaged archive fails in zip, pickle or torch code
                        raise CorruptCheckpointError(f"{path}: not a readable torch.save archive "
                                                     f"({type(exc).__name__}: {exc!s:.200})") from None
                if not isinstance(self.tensors, dict):
                    raise CheckpointError(f"{path}: holds a {type(self.tensors).__name__}, expected a dict")
            else:
                try:  # the library checks the header (negative dims, offsets); its errors name no file
                    self.handle = safe_open(path, framework="pt")
                except SafetensorError as exc:
                    raise CorruptCheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
                self.handle.__enter__()
            self.name = name
        if self.handle is not None:
            if key not in self.handle.keys():
                raise CheckpointError(f"{path}: no tensor {key!r} in it")
            try:
                return self.handle.get_tensor(key)
            except SafetensorError as exc:
                raise CorruptCheckpointError(f"{path}: tensor {key!r} cannot be read ({exc})") from None
        t = self.tensors.get(key)
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"{os.path.join(self.src, name)}: no tensor {key!r} in it")
        return t

    def close(self) -> None:
        if self.handle is not None:
            self.handle.__exit__(None, None, None)
        self.name, self.handle, self.tensors = None, None, None


def _decode_value(raw: bytes, key: str, where: str, allow_pickle: bool) -> tuple[str, Any]:
    """A stored value's kind and data: ("object", value), ("bytes", raw) or ("pickle", raw)."""
    if raw[:1] == b"\x80" and _is_one_pickle(raw):
        try:
            value = _NoGlobals(raw, where).load()
        except _NeedsGlobal as need:
            if allow_pickle:
                return "pickle", raw
            raise UnsupportedValueError(
                f"{where}: the value {key!r} is a pickle that needs {need.args[0]}; pass allow_pickle=True "
                "to carry it over still pickled (load it with allow_pickle=True), or re-save it as "
                "tensors / plain values") from None
        except Exception as exc:  # well-formed opcodes that do not build a value (a bad memo, say)
            raise CorruptCheckpointError(f"{where}: the value {key!r} is a damaged pickle ({type(exc).__name__}: "
                                         f"{exc})") from None
        # a cycle, deep nesting or shared lists (2**45 JSON items in 287 bytes) are no plain
        # value: found in bounded steps, they stay pickled (with allow_pickle) or are refused
        fault = plain_value_problem(value)
        if fault is None:
            return "object", value
        if isinstance(value, (bytes, bytearray)):
            return "bytes", bytes(value)
        if allow_pickle:
            return "pickle", raw
        where_in = "".join(f"[{k!r}]" for k in fault.path)
        raise UnsupportedValueError(
            f"{where}: the value {key!r} is a {type(value).__name__} that this format stores only pickled: "
            f"{key}{where_in}: {fault.why}; pass allow_pickle=True to carry it over still pickled")
    return "bytes", raw  # HyperParallel writes bytes values as they are


def _is_one_pickle(raw: bytes) -> bool:
    """True when ``raw`` is exactly one well-formed pickle (raw bytes rarely are)."""
    try:
        end = 0
        for op, _, pos in pickletools.genops(raw):
            end = pos
            if op.name == "STOP":
                return end + 1 == len(raw)
    except Exception:
        return False
    return False


def import_hyper_parallel(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    trust: bool = False,
    allow_pickle: bool = False,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> md.Metadata:
    """Convert a checkpoint written by HyperParallel's DCP into this package's format.

    Reads a collective checkpoint (one ``..metadata``) or a rank-local one (one metadata per
    rank, from ``save(..., use_collectives=False)``; replicas every rank wrote are kept once).
    Every saved shard becomes one chunk of the same box, so ``load`` reshards the result into
    any layout; keys keep HyperParallel's flattened names (``"model.layers.0.weight"``).
    Tensors stream one chunk at a time (peak memory: the largest chunk, or one whole data file
    of an older HyperParallel that wrote them with ``torch.save``).

    Args:
        src: the HyperParallel checkpoint directory.
        dst: the new checkpoint directory.
        trust: must be True; see :func:`read_hyper_parallel_metadata`.
        allow_pickle: carry values that are pickles of more than plain data over as ``pickle``
            entries (never unpickled here); refused by default.
        overwrite: replace a checkpoint already at ``dst``.
        progress: called with each chunk's byte count once it is written.

    Returns:
        The new checkpoint's :class:`~..metadata.Metadata`.

    Raises:
        UnsupportedValueError: ``trust`` is False; a hostile or unknown class in the metadata
            pickle; a value that needs pickle without ``allow_pickle``.
        CheckpointError: missing metadata, rank or data file; chunks that do not cover a tensor.

    Example::

        import_hyper_parallel("/hp/ckpt/step100", "/ckpt/step100", trust=True)
        load(model.state_dict(), "/ckpt/step100")
    """
    src = os.fspath(src)
    if location(src) == location(dst):
        raise ValueError(f"dst {os.fspath(dst)!r} is the source checkpoint; write to a new path")
    ckpt = read_hyper_parallel_metadata(src, trust=trust)

    def path_of(key: str) -> tuple[str, ...]:
        return ckpt.paths.get(key, (key,))

    entries: dict[str, EntrySpec] = {}
    by_file: dict[str, list[WriteItem]] = {}
    where: dict[tuple[str, Box], _Chunk] = {}
    for key, t in ckpt.tensors.items():
        entries[key] = EntrySpec("tensor", path_of(key), t.dtype, t.shape)
        for c in t.chunks:
            nbytes = itemsize(t.dtype) * c.box.numel
            if nbytes:
                by_file.setdefault(c.file, []).append(WriteItem(key, c.box, nbytes))
                where[(key, c.box)] = c
    raw_values: dict[str, Any] = {}
    for key, v in ckpt.values.items():
        path = os.path.join(src, v.file)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # a packed _rank<r>_.bytes holds many values at offsets; an older <key>_rank<r>.bytes
            # holds one, and HyperParallel reads all of it whatever length was recorded
            packed = _PACKED_BYTES.match(v.file) is not None
            length = v.length if packed and v.length >= 0 else size - v.offset
            if v.offset + length > size:
                raise CheckpointError(f"{path}: the value {key!r} at bytes [{v.offset}, {v.offset + length}) "
                                      f"lies beyond the file's {size} bytes")
            f.seek(v.offset)
            raw = f.read(length)
        kind, data = _decode_value(raw, key, path, allow_pickle)
        if kind == "object":
            entries[key] = EntrySpec("object", path_of(key))
        else:
            entries[key] = EntrySpec(kind, path_of(key), "uint8", (len(data),))
            if data:
                by_file.setdefault(v.file, []).append(WriteItem(key, Box.full((len(data),)), len(data)))
        raw_values[key] = data
    if not entries:
        raise CheckpointError(f"{src!r}: the HyperParallel checkpoint holds no entries")

    files = _SourceFiles(src)

    def produce(item: WriteItem) -> Any:
        if item.key in raw_values:
            data = raw_values[item.key]
            if entries[item.key].kind == "object":
                return data
            return torch.frombuffer(bytearray(data), dtype=torch.uint8)
        c = where[(item.key, item.box)]
        t = files.tensor(c.file, c.key)
        spec = entries[item.key]
        if tuple(t.shape) != item.box.sizes or t.dtype != torch_dtype(spec.dtype):
            raise CheckpointError(
                f"{os.path.join(src, c.file)}: {c.key!r} is {str(t.dtype).removeprefix('torch.')} "
                f"{list(t.shape)}, but the metadata says {spec.dtype} {list(item.box.sizes)}")
        if progress is not None:
            progress(item.nbytes)
        return t.contiguous()

    ordered = [by_file[name] for name in sorted(by_file)]
    try:
        return write_streaming(dst, entries, ordered, produce, overwrite=overwrite,
                               user_metadata={"imported_from": "hyper-parallel", "hyper_parallel_mode": ckpt.mode,
                                              "hyper_parallel_version": ckpt.version})
    finally:
        files.close()
