"""torch DCP's on-disk format, read without running code from it.

A checkpoint ``torch.distributed.checkpoint`` wrote is a pickled ``.metadata`` (torch's
``Metadata`` record) beside data files whose items are ``torch.save`` archives: one per tensor
chunk, and one per non-tensor value (torch's planner pickles the value into a byte item). A
pickle can name any importable callable and call it, so none of these is read with
``pickle.load`` here:

- ``.metadata`` goes through :func:`read_torch_metadata`: an unpickler that resolves only the
  globals of :data:`ALLOWED_GLOBALS` (torch DCP's metadata records, ``torch.Size``, dtypes,
  layouts, memory formats, ``pathlib`` paths, a few builtins and ``OrderedDict``: a fixed list)
  and refuses any other with a :class:`~..base.errors.MetadataError` naming ``module.name`` and
  the file, before anything is called. What it returns is then checked field by field
  (:func:`check_torch_metadata`): record types, shapes, chunk boxes inside their shapes and
  covering them, plain file names, byte ranges, before any of it sizes an allocation.
- tensor items go through :func:`load_tensor_item` and byte items through
  :func:`load_bytes_item`: ``torch.load(weights_only=True)`` (plus numpy's array records for
  byte items, which hold no code), each failure a CheckpointError naming the key. torch's own
  ``DefaultLoadPlanner.load_bytes`` unpickles byte items with ``weights_only=False``; this
  library does that only when the caller passes ``allow_pickle=True``.

:func:`check_chunks_in_files` compares each chunk's byte range with its file's size (the
loader's check before a load allocates from what ``.metadata`` says, and ``import_torch_dcp``'s).

What it is not: our own format (:mod:`.metadata`), the reader that applies these to a torch
checkpoint's files (:mod:`..backends.torch_format`), the export to torch's format
(:mod:`..interop.torch.exporting`).
"""

from __future__ import annotations

import io
import math
import pathlib
import pickle
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import filesystem as _torch_fs
from torch.distributed.checkpoint import metadata as _torch_md

from ..base.allowlist_pickle import AllowlistUnpickler
from ..base.errors import CheckpointError, CorruptCheckpointError, MetadataError, UnsupportedValueError
from ..base.limits import MAX_NDIM, MAX_VALUE_DEPTH, MAX_VALUE_ITEMS
from .metadata import METADATA_FILE
from .validation import check_shape, validate_file_name

__all__ = ["ALLOWED_GLOBALS", "is_pickle", "read_torch_metadata", "check_torch_metadata", "check_chunks_in_files",
           "load_tensor_item", "load_bytes_item"]

_MD = "torch.distributed.checkpoint.metadata"
_TORCH_NAMES = sorted(n for n in dir(torch) if isinstance(getattr(torch, n, None),
                                                          (torch.dtype, torch.layout, torch.memory_format)))

# (module, name) -> object: every global a torch DCP ``.metadata`` may name, and nothing else.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    **{(_MD, n): getattr(_torch_md, n) for n in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _torch_fs._StorageInfo,
    ("torch", "Size"): torch.Size,
    **{("torch", n): getattr(torch, n) for n in _TORCH_NAMES},  # dtypes, layouts, memory formats
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a layout by its name
    ("collections", "OrderedDict"): __import__("collections").OrderedDict,
    **{("pathlib", n): getattr(pathlib, n) for n in ("Path", "PosixPath", "WindowsPath", "PurePath",
                                                      "PurePosixPath", "PureWindowsPath")},
    **{("builtins", n): getattr(__import__("builtins"), n) for n in (
        "set", "frozenset", "list", "tuple", "dict", "int", "float", "str", "bytes", "bool", "complex")},
}

_PICKLE_PROTO = b"\x80"  # a pickle of protocol 2 or later starts with its PROTO opcode


def is_pickle(raw: bytes) -> bool:
    """Whether ``raw`` (a ``.metadata``'s bytes) is a pickle, as torch DCP writes it (ours is JSON)."""
    return raw[:1] == _PICKLE_PROTO


class _MetadataUnpickler(AllowlistUnpickler):
    """Resolves only :data:`ALLOWED_GLOBALS`; persistent ids (which call a loader) are refused too."""

    def admit(self, module: str, name: str) -> Any | None:
        return ALLOWED_GLOBALS.get((module, name))

    def refusal(self, what: str) -> Exception:
        if what.startswith("a persistent id"):
            return MetadataError(f"{self.where}: the pickle holds {what}; torch DCP's metadata has none. Refused")
        return MetadataError(
            f"{self.where}: the pickle names {what}, which is not one of torch.distributed.checkpoint's "
            "metadata records or the types they hold; refused without running it. A checkpoint of "
            "HyperParallel's DCP or a tampered file names such globals: convert it once with "
            "import_hyper_parallel(src, dst, trust=True) or import_torch_dcp(src, dst, trust=True) only if you "
            "trust where it came from")


def read_torch_metadata(raw: bytes, where: str = METADATA_FILE) -> _torch_md.Metadata:
    """torch DCP's ``Metadata`` from the bytes of its pickled ``.metadata``, checked.

    Raises:
        MetadataError: naming ``where``: a global outside :data:`ALLOWED_GLOBALS` (never
            resolved, so never called), a pickle that is not torch's metadata as this library
            reads it (the message names the conversion for a trusted one), or a record that
            fails :func:`check_torch_metadata`.
    """
    try:
        meta = _MetadataUnpickler(raw, where).load()
    except CheckpointError:
        raise
    except Exception as exc:  # truncated, damaged, or a call an allowed record refused
        raise MetadataError(
            f"{where} is a Python pickle that is not torch.distributed.checkpoint's metadata as this library reads "
            f"it without running it ({type(exc).__name__}: {exc!s:.200}). Convert a trusted one once with "
            "import_torch_dcp(src, dst, trust=True) or import_hyper_parallel(src, dst, trust=True)") from None
    check_torch_metadata(meta, where)
    return meta


def _fail(where: str, key: Any, msg: str) -> MetadataError:
    at = f"{where}, key {key!r}" if key is not None else where
    return MetadataError(f"{at}: {msg}")


def _size(v: Any, where: str, key: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (torch.Size, tuple, list)) or len(v) > MAX_NDIM or not all(
            type(d) is int and d >= 0 for d in v):
        raise _fail(where, key, f"{what} must be at most {MAX_NDIM} integers >= 0, found {v!r:.120}")
    return tuple(v)


def check_torch_metadata(meta: Any, where: str = METADATA_FILE) -> None:
    """Check what an allowed unpickling produced before anything reads it: record types of every
    field (an allowed pickle may still put a list where a dict belongs), each tensor's shape and
    chunk boxes (inside the shape, covering it), storage records with plain file names and
    byte ranges >= 0, and ``planner_data`` paths of str/int parts. Cost: one pass over the chunks.

    Raises MetadataError naming ``where`` and the key.
    """
    if type(meta) is not _torch_md.Metadata:
        raise _fail(where, None, f"holds a {type(meta).__name__}, not torch DCP's Metadata record")
    sdm = getattr(meta, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        raise _fail(where, None, f"state_dict_metadata must be a dict, found {type(sdm).__name__}")
    for key, m in sdm.items():
        if type(key) is not str:
            raise _fail(where, None, f"state_dict_metadata key {key!r:.80} is not a string")
        if type(m) is _torch_md.BytesStorageMetadata:
            continue
        if type(m) is not _torch_md.TensorStorageMetadata:
            raise _fail(where, key, f"is a {type(m).__name__}, neither TensorStorageMetadata nor BytesStorageMetadata")
        _check_tensor(key, m, where)
    storage = getattr(meta, "storage_data", None)
    if not isinstance(storage, dict):
        raise _fail(where, None, f"storage_data must be a dict, found {type(storage).__name__}")
    for index, info in storage.items():
        if type(index) is not _torch_md.MetadataIndex or type(index.fqn) is not str:
            raise _fail(where, None, f"storage_data key {index!r:.80} is not a MetadataIndex")
        if index.fqn not in sdm:
            raise _fail(where, index.fqn, "has a storage record but no state_dict_metadata entry")
        if type(info) is not _torch_fs._StorageInfo:
            raise _fail(where, index.fqn, f"storage record is a {type(info).__name__}, not torch's _StorageInfo")
        validate_file_name(getattr(info, "relative_path", None), f"{where}, key {index.fqn!r}")
        for what in ("offset", "length"):
            v = getattr(info, what, None)
            if type(v) is not int or v < 0:
                raise _fail(where, index.fqn, f"storage {what} must be an integer >= 0, found {v!r:.40}")
        descriptors = getattr(info, "transform_descriptors", None)
        if descriptors is not None and (not isinstance(descriptors, (list, tuple))
                                        or not all(type(d) is str for d in descriptors)):
            raise _fail(where, index.fqn, f"transform_descriptors must be strings, found {descriptors!r:.80}")
    for key, m in sdm.items():  # every stored item has its record
        if type(m) is _torch_md.BytesStorageMetadata and _torch_md.MetadataIndex(key) not in storage:
            raise _fail(where, key, "is a byte item without a storage record")
        if type(m) is _torch_md.TensorStorageMetadata:
            for c in m.chunks:
                if math.prod(c.sizes) and _torch_md.MetadataIndex(key, c.offsets) not in storage:
                    raise _fail(where, key, f"chunk at {list(c.offsets)} has no storage record")
    planner_data = getattr(meta, "planner_data", None)
    if planner_data is not None:
        if not isinstance(planner_data, dict):
            raise _fail(where, None, f"planner_data must be a dict or None, found {type(planner_data).__name__}")
        for key, path in planner_data.items():
            if type(key) is not str or not isinstance(path, (tuple, list)) or not 0 < len(path) <= MAX_VALUE_DEPTH \
                    or not all(type(p) is str or (type(p) is int and 0 <= p < MAX_VALUE_ITEMS) for p in path):
                raise _fail(where, key, f"planner_data path must be 1 to {MAX_VALUE_DEPTH} parts, each a str or a list "
                                        f"index in [0, {MAX_VALUE_ITEMS}), found {path!r:.80}")


def _check_tensor(key: str, m: Any, where: str) -> None:
    props = getattr(m, "properties", None)
    if type(props) is not _torch_md.TensorProperties or not isinstance(getattr(props, "dtype", None), torch.dtype):
        raise _fail(where, key, "properties must be torch's TensorProperties with a torch dtype")
    shape = check_shape(_size(getattr(m, "size", None), where, key, "size"), where, key)
    chunks = getattr(m, "chunks", None)
    if not isinstance(chunks, list):
        raise _fail(where, key, f"chunks must be a list, found {type(chunks).__name__}")
    held = 0
    for c in chunks:
        if type(c) is not _torch_md.ChunkStorageMetadata:
            raise _fail(where, key, f"chunk is a {type(c).__name__}, not a ChunkStorageMetadata")
        offsets = _size(getattr(c, "offsets", None), where, key, "chunk offsets")
        sizes = _size(getattr(c, "sizes", None), where, key, "chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            raise _fail(where, key, f"chunk at {list(offsets)} of sizes {list(sizes)} lies outside its shape "
                                    f"{list(shape)}")
        held += math.prod(sizes)
    if held < math.prod(shape):
        raise _fail(where, key, f"its chunks hold {held} of the {math.prod(shape)} elements of shape {list(shape)}; "
                                "the checkpoint is incomplete or its metadata damaged")


def check_chunks_in_files(meta: Any, file_size: Callable[[str], int], where: str,
                          keys: Any = None) -> None:
    """Each stored chunk of ``keys`` (default: every tensor) lies inside its file and holds at least its
    elements' bytes (unless a stream transform, such as compression, wrote it), so a forged
    shape fails here, naming the key, instead of allocating what it says. ``file_size(name)``
    is asked once per file. ``meta`` passed :func:`check_torch_metadata` (or came from torch).

    Raises CorruptCheckpointError naming the key and file.
    """
    sizes: dict[str, int] = {}
    sdm: Mapping[str, Any] = meta.state_dict_metadata
    for key in (sdm if keys is None else keys):
        m = sdm.get(key)
        if not isinstance(m, _torch_md.TensorStorageMetadata):
            continue
        itemsize = m.properties.dtype.itemsize
        for c in m.chunks:
            numel = math.prod(c.sizes)
            if not numel:
                continue
            info = meta.storage_data.get(_torch_md.MetadataIndex(key, c.offsets))
            if info is None:
                raise CorruptCheckpointError(f"{where}: {key!r}: chunk at {list(c.offsets)} has no storage record")
            name = validate_file_name(info.relative_path, where)
            if name not in sizes:
                sizes[name] = file_size(name)
            nbytes = numel * itemsize
            if (info.offset + info.length > sizes[name]
                    or (not getattr(info, "transform_descriptors", None) and info.length < nbytes)):
                raise CorruptCheckpointError(
                    f"{where}: {key!r}: chunk at {list(c.offsets)} ({nbytes} bytes) is stored at bytes {info.offset}.."
                    f"{info.offset + info.length} of {name}, which has {sizes[name]}; the metadata is damaged or "
                    "does not belong to these files")


def load_tensor_item(raw: Any, key: str, where: str) -> torch.Tensor:
    """The tensor a torch DCP data file holds at one chunk's bytes (a ``torch.save`` archive),
    loaded with ``weights_only=True`` on the CPU. ``raw``: the bytes, or a seekable file of them.

    Raises CorruptCheckpointError naming ``key`` and ``where`` (the file) when the bytes are
    not such an archive of a tensor.
    """
    try:
        source = raw if hasattr(raw, "read") else io.BytesIO(raw)
        value = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CorruptCheckpointError(
            f"{where}: {key!r}: its bytes are not a tensor torch loads with weights_only=True "
            f"({type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(value, torch.Tensor):
        raise CorruptCheckpointError(f"{where}: {key!r}: a tensor item holds a {type(value).__name__}, not a tensor")
    return value


def _numpy_globals() -> list[Any]:
    """numpy's array and scalar records: rebuilding one allocates data, it calls nothing else."""
    core = getattr(np, "_core", None) or np.core
    found = [np.ndarray, np.dtype, core.multiarray._reconstruct, core.multiarray.scalar]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        found += [v for v in vars(dtypes).values() if isinstance(v, type) and issubclass(v, np.dtype)]
    return found


_NUMPY_GLOBALS = _numpy_globals()


def load_bytes_item(raw: bytes | bytearray | memoryview, key: str, where: str, allow_pickle: bool = False) -> Any:
    """The value of one of torch DCP's byte items (``torch.save`` of a non-tensor value), loaded with
    ``weights_only=True`` (numpy arrays and scalars admitted too); with ``allow_pickle`` (the
    caller's opt-in) by plain unpickling, as torch's own ``DefaultLoadPlanner`` does.

    Raises:
        UnsupportedValueError: the pickle needs a global weights-only loading refuses (named
            in the message), never resolved; ``allow_pickle=True`` loads it.
        CorruptCheckpointError: the bytes are not a ``torch.save`` archive.
    """
    try:
        if allow_pickle:
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals(_NUMPY_GLOBALS):
            return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if "weights_only" in str(exc) or "Weights only" in str(exc):
            raise UnsupportedValueError(
                f"{where}: {key!r}: this byte item's pickle needs a global that weights-only loading refuses "
                f"({_refused_global(exc)}); it was not run. Pass allow_pickle=True to load it only if you trust "
                "where the checkpoint came from") from None
        raise CorruptCheckpointError(f"{where}: {key!r}: its bytes are not a torch.save archive "
                                     f"({_first_line(exc)})") from None
    except Exception as exc:
        raise CorruptCheckpointError(f"{where}: {key!r}: its bytes are not a torch.save archive "
                                     f"({type(exc).__name__}: {_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines() or [""])[0][:200]


def _refused_global(exc: BaseException) -> str:
    for line in str(exc).splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip()[:200]
    return _first_line(exc)
