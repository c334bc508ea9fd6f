"""The checkpoint's ``.metadata``: schema, JSON (de)serialization, validation, versions.

``.metadata`` is one JSON object, written last and atomically; its presence is the commit.
Its last member, ``"crc32c"``, is the checksum of every byte before it, so any flipped byte
of ``.metadata`` is detected. Nothing here ever unpickles: values are plain JSON plus type
tags. ``docs/format.md`` is the full description; in short:

Version 2 (written) grows with tensors and files, not chunks::

    {"format": "hyper-parallel-dcp", "version": 2, "save_id": "...", "world_size": 4,
     "user": {...}, "dirs": [""], "rank_lists": [],
     "files": [[name, dir, rank, index_offset, index_length, index_crc32c, size], ...],
     "entries": {
       "<key>": {"kind": "tensor", "path": [...], "dtype": "float32", "shape": [8, 5],
                 "layout": {"mesh_shape": [4], "mesh_dim_names": ["dp"], "placements": ["S(0)"]},
                 "store": {"grid": {"tiles": 1, "offset": 0, "copies": "one"}}},
       "<key>": {"kind": "tensor", ..., "store": {"grid": {"writer": 0, "tiles": 1}}},
       "<key>": {"kind": "tensor", ..., "store": {"table": {"n": 3, "offsets": <b64>, "sizes": <b64>,
                                                            "file": <b64>}}},
       "<key>": {"kind": "object", "path": [...], "value": <typed JSON>}}}

A *grid* store's chunks are the boxes of a layout (the entry's, or the store's own
``"layout"``), computed by :mod:`.grid`; each box is written by one of its holders (the
writer rule ``(offset + box) % replicas``) or by all of them (``"copies": "all"``); without a
layout it is one box written by rank ``"writer"``. ``"where"`` (incremental checkpoints) says,
in runs over box ids, which of ``"dirs"`` holds each box: ``""`` is this checkpoint, other
names are earlier steps in the same parent directory. A *table* store lists irregular chunks
(imports, hand-made layouts) as binary columns. Where a chunk's bytes and checksums are
inside its data file is in that file's own index (:mod:`.data_file`).

Version 1 (still read) listed every chunk with its file, byte range and checksums.

Kinds: ``tensor``, ``ndarray`` (numpy, returned as numpy), ``bytes``, ``pickle`` (opt-in
only), ``object`` (a JSON-representable value kept with its type: int stays int, tuple stays
tuple). ``path`` says where the key sits in the nested state dict: a string is a dict key,
``{"i": n}`` a list index, ``{"t": n}`` a tuple index, ``{"k": n}`` an int dict key.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import gc
import json
import math
import re
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import crc32c
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (  # noqa: F401 - also HyperParallel's names (CHUNK_INFO)
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ..base.box import Box, first_overlap
from ..base.errors import MetadataError, UnsupportedValueError

FORMAT_NAME = "hyper-parallel-dcp"
FORMAT_VERSION = 2
METADATA_FILE = ".metadata"

KINDS = ("tensor", "ndarray", "bytes", "pickle", "object")
MAX_NDIM = 64
_MAX_ELEMENTS = 1 << 56  # far beyond any real tensor; stops overflow games early
MAX_WORLD = 1 << 20  # ranks; beyond any job, small enough that a mesh of it can be walked
MAX_MESH_NDIM = 8
_MAX_TILES = 4096
_PLACEMENT_NAME = re.compile(r"^(?:R|S\((-?\d{1,3})\)|_S\((-?\d{1,3}),(\d{1,7})\))$")

# dtype name -> (torch dtype, safetensors dtype name or None when it has none)
_DTYPES: dict[str, tuple[torch.dtype, str | None]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "float8_e4m3fnuz": (torch.float8_e4m3fnuz, "F8_E4M3FNUZ"),
    "float8_e5m2fnuz": (torch.float8_e5m2fnuz, "F8_E5M2FNUZ"),
    "float8_e8m0fnu": (torch.float8_e8m0fnu, None),
    "complex64": (torch.complex64, "C64"),
    "complex128": (torch.complex128, None),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "uint16": (torch.uint16, "U16"),
    "uint32": (torch.uint32, "U32"),
    "uint64": (torch.uint64, "U64"),
    "bool": (torch.bool, "BOOL"),
}
_NAME_OF = {dt: name for name, (dt, _) in _DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The metadata name of a torch dtype; raises for dtypes the format cannot hold."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise MetadataError(f"dtype {dtype} is not supported by the checkpoint format") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name][0]
    except (KeyError, TypeError):
        raise MetadataError(f"unknown dtype {name!r} in metadata") from None


def safetensors_dtype(name: str) -> str | None:
    """Safetensors' name for the dtype, or None (then the entry is stored as raw U8)."""
    return _DTYPES[name][1]


# Safetensors' dtype names -> ours. F8_E8M0 is a safetensors dtype too, but data files of
# this library store float8_e8m0fnu as raw U8 (safetensors' torch binding cannot read it).
_FROM_SAFETENSORS = {st: name for name, (_, st) in _DTYPES.items() if st} | {"F8_E8M0": "float8_e8m0fnu"}


def dtype_from_safetensors(st: str) -> str | None:
    """Our dtype name for a safetensors dtype name (``"BF16"`` -> ``"bfloat16"``), or None."""
    return _FROM_SAFETENSORS.get(st) if isinstance(st, str) else None


def itemsize(name: str) -> int:
    return torch_dtype(name).itemsize


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic GC while building or parsing millions of small objects.

    Plans and metadata of large jobs are millions of tuples and records that hold no
    cycles; the collector re-scanning them made planning grow faster than linearly.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---------------------------------------------------------------------------- records


@dataclass(frozen=True)
class ChunkRecord:
    """Where one box of a tensor lives on disk, and how to check it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int
    block_rows: int
    crc32c: tuple[int, ...]

    @property
    def rows(self) -> int:
        return self.sizes[0] if self.sizes else 1


@dataclass(frozen=True)
class FileRecord:
    """A data file: where it is, who wrote it, and where its index is (format v2).

    ``dir`` is "" for this checkpoint's directory, else the name of an earlier step's
    directory beside it (incremental checkpoints). v1 files have no index (offsets 0).
    """

    name: str
    dir: str = ""
    rank: int = -1
    index_offset: int = 0
    index_length: int = 0
    index_crc: int = 0
    size: int = 0

    @property
    def path(self) -> str:
        """The name storage readers open: a plain name, or ``../<dir>/<name>``."""
        return self.name if not self.dir else f"../{self.dir}/{self.name}"


@dataclass
class GridStore:
    """Chunks = the boxes of a layout (see :mod:`.grid`); locations follow from the writer rule.

    ``layout`` is the storage layout when it differs from the entry's; ``writer`` is the
    rank that wrote a layout-less (whole) tensor; ``where`` are runs ``(count, dir index)``
    over box ids (None: every box is in this checkpoint).
    """

    tiles: int = 1
    offset: int = 0
    copies: str = "one"
    writer: int | None = None
    layout: dict[str, Any] | None = None
    where: list[tuple[int, int]] | None = None


@dataclass
class TableStore:
    """Irregular chunks listed one by one: box offsets and sizes, and the file of each.

    Chunk ``i`` has sub id ``i`` in its file's index (or ``subs[i]``). ``records`` are the
    v1 chunk records (byte ranges and checksums known from ``.metadata`` itself).
    """

    offsets: np.ndarray  # (n, ndim) int64
    sizes: np.ndarray  # (n, ndim) int64
    file: np.ndarray  # (n,) int32, index into Metadata.files
    records: list[ChunkRecord] | None = None
    subs: np.ndarray | None = None  # (n,) chunk ids in file indexes, when not 0..n-1 (merged fragments)

    def sub(self, i: int) -> int:
        return int(self.subs[i]) if self.subs is not None else i

    def __len__(self) -> int:
        return len(self.file)


@dataclass
class Entry:
    """One flattened key of the saved state dict."""

    key: str
    kind: str
    path: tuple[Any, ...]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    layout: dict[str, Any] | None = None
    value: Any = None  # the decoded value, for kind "object"
    store: GridStore | TableStore | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor's data (each element once, replicas not counted)."""
        if self.kind == "object" or self.shape is None:
            return 0
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def metadata(self) -> Metadata | None:
        """The checkpoint metadata this entry was read or built with (None if detached)."""
        ref = self.__dict__.get("_meta")
        return ref() if ref is not None else None

    @property
    def chunks(self) -> list[ChunkRecord]:
        """The v1 chunk records (format v1 only; v2 readers use :mod:`.chunks`)."""
        if isinstance(self.store, TableStore) and self.store.records is not None:
            return self.store.records
        return []


@dataclass
class Metadata:
    """Everything a reader needs to find, check and reassemble every key."""

    entries: dict[str, Entry]
    save_id: str
    world_size: int
    version: int = FORMAT_VERSION
    user: dict[str, Any] = field(default_factory=dict)
    files: list[FileRecord] = field(default_factory=list)
    dirs: list[str] = field(default_factory=lambda: [""])
    rank_lists: list[list[int]] = field(default_factory=list)
    fragment: tuple[int, int] | None = None  # (rank, world size) of a rank-local checkpoint's fragment

    def attach(self) -> Metadata:
        """Let every entry know the metadata it belongs to (``Entry.metadata``); returns self."""
        for entry in self.entries.values():
            entry.__dict__["_meta"] = weakref.ref(self)
        return self

    @property
    def state_dict_metadata(self) -> dict[str, Any]:
        """Every saved key's metadata shaped like torch DCP's (and HyperParallel's).

        A tensor key maps to a ``TensorStorageMetadata`` (``.size``, ``.properties.dtype``,
        ``.chunks`` with each saved chunk's ``.offsets`` and ``.sizes``); any other value to
        a ``BytesStorageMetadata``. Built on first access (it lists every chunk).
        """
        view = self.__dict__.get("_sdm")
        if view is None:
            view = self.__dict__["_sdm"] = _state_dict_metadata(self)
        return view

    def file_names(self) -> list[str]:
        """The data files in this checkpoint's own directory (what retention may delete)."""
        return sorted({f.name for f in self.files if not f.dir})

    def referenced_dirs(self) -> list[str]:
        """Earlier steps' directories whose files this checkpoint reads (incremental)."""
        return sorted({f.dir for f in self.files if f.dir})

    def to_json(self) -> bytes:
        """Serialise as format v2 (a checkpoint read from v1 cannot be written back)."""
        with paused_gc():
            return self._to_json()

    def _to_json(self) -> bytes:
        rank_lists: list[list[int]] = []
        interned: dict[tuple[int, ...], int] = {}

        def layout_json(rec: dict[str, Any] | None) -> dict[str, Any] | None:
            if rec is None or rec.get("rank_list") is None:
                return rec
            ranks = tuple(rec["rank_list"])
            if ranks == tuple(range(len(ranks))):
                return {k: v for k, v in rec.items() if k != "rank_list"}
            if ranks not in interned:
                interned[ranks] = len(rank_lists)
                rank_lists.append(list(ranks))
            return {**rec, "rank_list": interned[ranks]}

        entries = {}
        for key, e in self.entries.items():
            d: dict[str, Any] = {"kind": e.kind, "path": [_encode_path_part(p) for p in e.path]}
            if e.kind == "object":
                d["value"] = encode_value(e.value)
            else:
                d["dtype"] = e.dtype
                d["shape"] = list(e.shape or ())
                if e.layout is not None:
                    d["layout"] = layout_json(e.layout)
                d["store"] = _encode_store(e.store, key, layout_json)
            entries[key] = d
        doc = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "user": self.user,
            "dirs": self.dirs,
            "rank_lists": rank_lists,
            "files": [[f.name, self.dirs.index(f.dir), f.rank, f.index_offset, f.index_length, f.index_crc, f.size]
                      for f in self.files],
            "entries": entries,
        }
        if self.fragment is not None:
            doc["fragment"] = list(self.fragment)
        return seal_json(doc)

    @classmethod
    def from_json(cls, raw: bytes, where: str = METADATA_FILE) -> Metadata:
        """Parse and validate; every problem raises MetadataError naming ``where``."""
        if not raw:
            raise MetadataError(f"{where} is empty: the checkpoint is incomplete or corrupt")
        try:
            with paused_gc():
                doc = json.loads(raw)
        except RecursionError:  # hostile nesting ("[" * 100_000): refused, never a raw RecursionError
            raise _too_deep(where) from None
        except (ValueError, UnicodeDecodeError) as exc:
            if raw[:1] == b"\x80":  # a pickle's PROTO opcode
                raise MetadataError(
                    f"{where} is a Python pickle, not our JSON: a checkpoint of torch.distributed.checkpoint or "
                    "of HyperParallel's DCP. Convert it once with import_torch_dcp(src, dst, trust=True) or "
                    "import_hyper_parallel(src, dst, trust=True) (hyper-dcp import-torch-dcp / "
                    "import-hyper-parallel --trust); a pickle is never loaded directly") from None
            raise MetadataError(
                f"{where} is not valid JSON ({exc}); it is corrupt or not written by "
                "hyper-parallel (checkpoints of torch.distributed.checkpoint must be imported)"
            ) from None
        if isinstance(doc, dict) and doc.get("format") == FORMAT_NAME:
            _check_own_crc(raw, doc, where)
        try:
            with paused_gc():
                return _parse(doc, where).attach()
        except RecursionError:  # nesting json.loads still took, deeper than the parser's decoding goes
            raise _too_deep(where) from None


def _too_deep(where: str) -> MetadataError:
    return MetadataError(f"{where} is nested too deeply to parse (more levels of [ and {{ than Python's recursion "
                         "limit); it is corrupt or hostile, not written by hyper-parallel")


def _state_dict_metadata(meta: Metadata) -> dict[str, Any]:
    from .chunks import all_chunks

    out: dict[str, Any] = {}
    for key, e in meta.entries.items():
        if e.kind not in ("tensor", "ndarray"):
            out[key] = BytesStorageMetadata()
            continue
        chunks = [ChunkStorageMetadata(torch.Size(r.box.offsets), torch.Size(r.box.sizes))
                  for r in all_chunks(meta, e)]
        chunks.sort(key=lambda c: tuple(c.offsets))
        out[key] = TensorStorageMetadata(TensorProperties(dtype=torch_dtype(e.dtype)), torch.Size(e.shape or ()),
                                         chunks)
    return out


def _b64(a: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode()


def _encode_store(store: Any, key: str, layout_json: Any) -> dict[str, Any]:
    if isinstance(store, GridStore):
        g: dict[str, Any] = {"tiles": store.tiles}
        if store.writer is not None:
            g["writer"] = store.writer
        else:
            g["offset"] = store.offset
            g["copies"] = store.copies
        if store.layout is not None:
            g["layout"] = layout_json(store.layout)
        if store.where is not None:
            g["where"] = [list(r) for r in store.where]
        return {"grid": g}
    if isinstance(store, TableStore):
        if store.records is not None:
            raise ValueError(f"{key!r} was read from a format-v1 checkpoint; it cannot be written as v2")
        t = {"n": len(store), "offsets": _b64(store.offsets, "<i8"), "sizes": _b64(store.sizes, "<i8"),
             "file": _b64(store.file, "<i4")}
        if store.subs is not None:
            t["sub"] = _b64(store.subs, "<i4")
        return {"table": t}
    raise ValueError(f"{key!r} has no store")


_CRC_MEMBER = b',"crc32c":'


def seal_json(doc: dict[str, Any]) -> bytes:
    """Serialise ``doc`` with its own checksum as the last member (``crc32c``)."""
    doc = {k: v for k, v in doc.items() if k != "crc32c"}
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return body[:-1] + _CRC_MEMBER + b"%d}" % crc32c.crc32c(body)


def _check_own_crc(raw: bytes, doc: dict, where: str) -> None:
    cut = raw.rfind(_CRC_MEMBER)
    expected = doc.get("crc32c")
    if cut < 0 or type(expected) is not int:
        raise MetadataError(f"{where} has no checksum member 'crc32c'; it is corrupt or truncated")
    got = crc32c.crc32c(raw[:cut] + b"}")
    if got != expected:
        raise MetadataError(
            f"{where} is corrupt: its checksum is {expected:#010x} but its bytes give {got:#010x}"
        )


# ---------------------------------------------------------------------------- validation


_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")


def validate_file_name(name: Any, where: str = METADATA_FILE) -> str:
    """A data-file name must be a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or not _FILE_NAME.match(name) or ".." in name:
        raise MetadataError(
            f"{where}: data file name {name!r} is not a plain file name inside the checkpoint "
            "(absolute paths, '..' and separators are refused)"
        )
    return name


def _fail(where: str, key: str | None, msg: str) -> MetadataError:
    at = f"{where}, key {key!r}" if key is not None else where
    return MetadataError(f"{at}: {msg}")


def _int(v: Any, where: str, key: str | None, what: str, lo: int = 0, hi: int | None = None) -> int:
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        bound = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}"
        raise _fail(where, key, f"{what} must be an integer{bound}, found {v!r}")
    return v


def _int_list(v: Any, where: str, key: str, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise _fail(where, key, f"{what} must be a list of at most {MAX_NDIM} integers, found {v!r}")
    return tuple(_int(x, where, key, what) for x in v)


def check_shape(shape: Any, where: str, key: str | None = None) -> tuple[int, ...]:
    """A tensor shape this format holds: at most 64 integers >= 0, at most 2**56 elements.

    Every entry read from ``.metadata`` and every entry a save builds goes through it, so a
    shape the reader would refuse (``[-1, 0]`` from a foreign file) is never written.
    Raises MetadataError naming ``where`` and ``key``.
    """
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise _fail(where, key, f"shape must be a list of at most {MAX_NDIM} integers >= 0, found {shape!r:.200}")
    dims = tuple(shape)
    if math.prod(dims) > _MAX_ELEMENTS:
        raise _fail(where, key, f"shape {list(dims)} is absurdly large")
    return dims


def _parse(doc: Any, where: str) -> Metadata:
    if not isinstance(doc, dict):
        raise MetadataError(f"{where}: expected a JSON object, found {type(doc).__name__}")
    if doc.get("format") != FORMAT_NAME:
        raise MetadataError(
            f"{where}: format is {doc.get('format')!r}, expected {FORMAT_NAME!r}; "
            "this is not a hyper-parallel checkpoint"
        )
    version = doc.get("version")
    if type(version) is not int or version < 1:
        raise MetadataError(f"{where}: version must be a positive integer, found {version!r}")
    if version > FORMAT_VERSION:
        raise MetadataError(
            f"{where}: format version {version} is newer than this hyper-parallel reads "
            f"(up to {FORMAT_VERSION}); upgrade hyper-parallel to load it"
        )
    entries_raw = doc.get("entries")
    if not isinstance(entries_raw, dict):
        raise MetadataError(f"{where}: 'entries' must be an object")
    save_id = doc.get("save_id")
    if not isinstance(save_id, str):
        raise MetadataError(f"{where}: 'save_id' must be a string")
    world_size = _int(doc.get("world_size"), where, None, "world_size", lo=1, hi=MAX_WORLD)
    user = doc.get("user", {})
    if not isinstance(user, dict):
        raise MetadataError(f"{where}: 'user' must be an object")
    meta = Metadata({}, save_id, world_size, version, user)
    if version == 1:
        files_raw = doc.get("files")
        if not isinstance(files_raw, list):
            raise MetadataError(f"{where}: 'files' must be a list of file names")
        names = [validate_file_name(f, where) for f in files_raw]
        meta.files = [FileRecord(n) for n in names]
        meta.entries = {key: _parse_entry_v1(key, e, names, where) for key, e in entries_raw.items()}
        return meta
    if doc.get("fragment") is not None:
        frag = doc["fragment"]
        if not isinstance(frag, list) or len(frag) != 2:
            raise MetadataError(f"{where}: 'fragment' must be [rank, world size]")
        size = _int(frag[1], where, None, "fragment world size", lo=1, hi=MAX_WORLD)
        meta.fragment = (_int(frag[0], where, None, "fragment rank", hi=size - 1), size)
    meta.dirs = _parse_dirs(doc.get("dirs"), where)
    meta.rank_lists = _parse_rank_lists(doc.get("rank_lists"), where)
    meta.files = _parse_files(doc.get("files"), meta.dirs, where)
    meta.entries = {key: _parse_entry_v2(key, e, meta, where) for key, e in entries_raw.items()}
    return meta


_STEP_NAME = re.compile(r"^step_(\d{8,})$")


def step_dir_name(step: int) -> str:
    """The directory name of ``step`` in a CheckpointManager's directory: ``step_`` + the number
    zero-padded to 8 digits. The only names ``dirs`` may hold besides ``""``."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a (canonical) step name."""
    m = _STEP_NAME.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if name == step_dir_name(step) else None


def _parse_dirs(raw: Any, where: str) -> list[str]:
    if not isinstance(raw, list) or not raw or raw[0] != "" or len(raw) > 1 << 16:
        raise MetadataError(f"{where}: 'dirs' must be a list starting with \"\" (this checkpoint)")
    for d in raw[1:]:  # sibling step directories of a CheckpointManager (incremental checkpoints), nothing else
        if not isinstance(d, str) or step_of(d) is None:
            raise MetadataError(f"{where}: 'dirs' names {d!r:.80}, which is not a step directory of a "
                                f"CheckpointManager ({step_dir_name(1)!r}, ...); a checkpoint reads files only "
                                "from itself and its sibling steps")
    dirs = list(raw)
    if len(set(dirs)) != len(dirs):
        raise MetadataError(f"{where}: 'dirs' repeats a directory")
    return dirs


def _parse_rank_lists(raw: Any, where: str) -> list[list[int]]:
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > 1 << 12:
        raise MetadataError(f"{where}: 'rank_lists' must be a list of rank lists")
    out = []
    for ranks in raw:
        if not isinstance(ranks, list) or not 0 < len(ranks) <= MAX_WORLD or any(
                type(r) is not int or not 0 <= r < MAX_WORLD for r in ranks) or len(set(ranks)) != len(ranks):
            raise MetadataError(f"{where}: a rank list must hold distinct ranks in [0, {MAX_WORLD}), "
                                f"found {ranks!r:.100}")
        out.append(ranks)
    return out


def _parse_files(raw: Any, dirs: list[str], where: str) -> list[FileRecord]:
    if not isinstance(raw, list):
        raise MetadataError(f"{where}: 'files' must be a list of file records")
    out = []
    for f in raw:
        if not isinstance(f, list) or len(f) != 7:
            raise MetadataError(f"{where}: a file record must be a list of 7 fields, found {f!r:.200}")
        name = validate_file_name(f[0], where)
        d = _int(f[1], where, None, f"file {name!r}: dir index", hi=len(dirs) - 1)
        rank = _int(f[2], where, None, f"file {name!r}: rank", lo=-1, hi=MAX_WORLD)
        size = _int(f[6], where, None, f"file {name!r}: size", hi=1 << 62)
        off = _int(f[3], where, None, f"file {name!r}: index offset", hi=size)
        length = _int(f[4], where, None, f"file {name!r}: index length", hi=size - off)
        crc = _int(f[5], where, None, f"file {name!r}: index crc32c", hi=0xFFFFFFFF)
        out.append(FileRecord(name, dirs[d], rank, off, length, crc, size))
    if len({(f.dir, f.name) for f in out}) != len(out):
        raise MetadataError(f"{where}: 'files' lists a file twice")
    return out


def _parse_common(key: str, e: Any, where: str) -> Entry:
    """Kind, path and (objects) value, or dtype and shape: the part v1 and v2 share."""
    if not isinstance(e, dict):
        raise _fail(where, key, "entry must be an object")
    kind = e.get("kind")
    if kind not in KINDS:
        raise _fail(where, key, f"kind must be one of {KINDS}, found {kind!r}")
    path_raw = e.get("path")
    if not isinstance(path_raw, list) or not path_raw:
        raise _fail(where, key, "path must be a non-empty list")
    path = tuple(_decode_path_part(p, where, key) for p in path_raw)
    if kind == "object":
        if "value" not in e:
            raise _fail(where, key, "object entry has no 'value'")
        try:
            value = decode_value(e["value"])
        except (ValueError, TypeError) as exc:
            raise _fail(where, key, f"bad value encoding: {exc}") from None
        return Entry(key, kind, path, value=value)
    dtype = e.get("dtype")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise _fail(where, key, f"dtype must be one of {sorted(_DTYPES)}, found {dtype!r}")
    shape = check_shape(e.get("shape"), where, key)
    if kind == "bytes" and len(shape) != 1:
        raise _fail(where, key, "bytes entries must be 1-d")
    return Entry(key, kind, path, dtype, shape)


def _parse_entry_v2(key: str, e: Any, meta: Metadata, where: str) -> Entry:
    entry = _parse_common(key, e, where)
    if entry.kind == "object":
        return entry
    shape = entry.shape or ()
    if e.get("layout") is not None:
        entry.layout = validate_layout_record(e["layout"], len(shape), where, key, meta.rank_lists)
    store = e.get("store")
    if not isinstance(store, dict) or len(store) != 1:
        raise _fail(where, key, f"store must be {{'grid': ...}} or {{'table': ...}}, found {store!r:.100}")
    (kind, body), = store.items()
    if not isinstance(body, dict):
        raise _fail(where, key, f"store {kind!r} must be an object")
    if kind == "grid":
        entry.store = _parse_grid(key, body, entry, meta, where)
    elif kind == "table":
        entry.store = _parse_table(key, body, shape, len(meta.files), where)
    else:
        raise _fail(where, key, f"unknown store {kind!r}")
    return entry


def _parse_grid(key: str, g: dict, entry: Entry, meta: Metadata, where: str) -> GridStore:
    shape = entry.shape or ()
    tiles = _int(g.get("tiles", 1), where, key, "grid tiles", lo=1, hi=_MAX_TILES)
    layout = g.get("layout")
    if layout is not None:
        layout = validate_layout_record(layout, len(shape), where, key, meta.rank_lists)
    elif "writer" not in g:
        layout = entry.layout
    store = GridStore(tiles=tiles, layout=layout if "layout" in g else None)
    if "writer" in g:
        store.writer = _int(g["writer"], where, key, "grid writer", hi=MAX_WORLD)
    else:
        if layout is None:
            raise _fail(where, key, "a grid store needs a layout or a writer")
        store.offset = _int(g.get("offset", 0), where, key, "grid offset", hi=1 << 31)
        store.copies = g.get("copies", "one")
        if store.copies not in ("one", "all"):
            raise _fail(where, key, f"grid copies must be 'one' or 'all', found {store.copies!r:.20}")
    if g.get("where") is not None:
        runs = g["where"]
        if not isinstance(runs, list) or len(runs) > MAX_WORLD:
            raise _fail(where, key, "grid where must be a list of [count, dir] runs")
        store.where = []
        for run in runs:
            if not isinstance(run, list) or len(run) != 2:
                raise _fail(where, key, f"a where run must be [count, dir], found {run!r:.50}")
            store.where.append((_int(run[0], where, key, "where count", lo=1, hi=_MAX_ELEMENTS),
                                _int(run[1], where, key, "where dir", hi=len(meta.dirs) - 1)))
    return store


def _column(raw: Any, dtype: str, count: int, where: str, key: str, what: str) -> np.ndarray:
    if not isinstance(raw, str) or len(raw) > 4 * (count * np.dtype(dtype).itemsize + 3) // 3 + 4:
        raise _fail(where, key, f"table {what} must be base64 of {count} values")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise _fail(where, key, f"table {what} is not valid base64") from None
    if len(data) != count * np.dtype(dtype).itemsize:
        raise _fail(where, key, f"table {what} holds {len(data)} bytes, expected {count} values")
    return np.frombuffer(data, dtype=dtype).astype(np.int64)


def _parse_table(key: str, t: dict, shape: tuple[int, ...], n_files: int, where: str) -> TableStore:
    n = _int(t.get("n"), where, key, "table n", hi=1 << 24)
    ndim = len(shape)
    offsets = _column(t.get("offsets"), "<i8", n * ndim, where, key, "offsets").reshape(n, ndim)
    sizes = _column(t.get("sizes"), "<i8", n * ndim, where, key, "sizes").reshape(n, ndim)
    files = _column(t.get("file"), "<i4", n, where, key, "file")
    dims = np.array(shape, dtype=np.int64).reshape(1, ndim)
    if n and ((offsets < 0).any() or (sizes < 1).any() or (offsets + sizes > dims).any()):
        raise _fail(where, key, f"a table chunk is empty or lies outside shape {list(shape)}")
    if n and ((files < 0).any() or (files >= n_files).any()):
        raise _fail(where, key, "a table chunk names a file that is not in 'files'")
    boxes = {(tuple(o), tuple(s)) for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)}
    if sum(math.prod(s) for _, s in boxes) > math.prod(shape):
        raise _fail(where, key, "table chunks hold more elements than the tensor: they overlap")
    _check_disjoint(boxes, where, key)
    subs = None
    if t.get("sub") is not None:
        subs = _column(t["sub"], "<i4", n, where, key, "sub")
        if n and (subs < 0).any():
            raise _fail(where, key, "table chunk ids must not be negative")
        subs = subs.astype(np.int32)
    return TableStore(offsets, sizes, files.astype(np.int32), subs=subs)


def _parse_entry_v1(key: str, e: Any, files: list[str], where: str) -> Entry:
    entry = _parse_common(key, e, where)
    if entry.kind == "object":
        return entry
    shape = entry.shape or ()
    size = itemsize(entry.dtype)
    numel = math.prod(shape)
    chunks_raw = e.get("chunks")
    if not isinstance(chunks_raw, list):
        raise _fail(where, key, "chunks must be a list")
    if e.get("layout") is not None:
        entry.layout = validate_layout_record(e["layout"], len(shape), where, key)
    chunks = []
    volume = 0
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for c in chunks_raw:
        if not isinstance(c, list) or len(c) != 7:
            raise _fail(where, key, f"a chunk must be a list of 7 fields, found {c!r:.200}")
        offsets = _int_list(c[0], where, key, "chunk offsets")
        sizes = _int_list(c[1], where, key, "chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise _fail(where, key, f"chunk box {offsets}+{sizes} does not match shape {shape}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=False)):
            raise _fail(where, key, f"chunk box {list(offsets)}+{list(sizes)} lies outside shape {list(shape)}")
        n = math.prod(sizes)
        if n == 0:
            raise _fail(where, key, "empty chunks are never saved")
        fidx = _int(c[2], where, key, "chunk file index", hi=len(files) - 1)
        start = _int(c[3], where, key, "chunk start")
        length = _int(c[4], where, key, "chunk length")
        if length != n * size:
            raise _fail(where, key, f"chunk length {length} != {n} elements x {size} bytes")
        block_rows = _int(c[5], where, key, "chunk block_rows", lo=1)
        rows = sizes[0] if sizes else 1
        crcs = c[6]
        if not isinstance(crcs, list) or len(crcs) != -(-rows // block_rows):
            raise _fail(where, key, f"chunk needs {-(-rows // block_rows)} checksums, found {crcs!r:.100}")
        crcs = tuple(_int(x, where, key, "crc32c", hi=0xFFFFFFFF) for x in crcs)
        chunks.append(ChunkRecord(offsets, sizes, files[fidx], start, length, block_rows, crcs))
        if (offsets, sizes) not in seen:  # a repeated box is a replica, stored in another file
            seen.add((offsets, sizes))
            volume += n
    if volume > numel:
        raise _fail(where, key, f"chunks hold {volume} elements but the tensor has {numel}: they overlap")
    _check_disjoint(seen, where, key)
    ndim = len(shape)
    index = {f: i for i, f in enumerate(files)}
    entry.store = TableStore(
        np.array([c.offsets for c in chunks], dtype=np.int64).reshape(len(chunks), ndim),
        np.array([c.sizes for c in chunks], dtype=np.int64).reshape(len(chunks), ndim),
        np.array([index[c.file] for c in chunks], dtype=np.int32), chunks)
    return entry


def validate_layout_record(rec: Any, ndim: int, where: str = METADATA_FILE, key: str | None = None,
                           rank_lists: list[list[int]] | None = None) -> dict[str, Any]:
    """Check a saved layout (mesh shape, dim names, placements) before anything uses it.

    The mesh may hold at most ``MAX_WORLD`` positions, and nothing that reads a saved layout
    allocates or walks per mesh position (a layout is read in O(mesh dims)); returns the
    record with only its known members.
    """
    if not isinstance(rec, dict):
        raise _fail(where, key, f"layout must be an object, found {type(rec).__name__}")
    mesh = rec.get("mesh_shape")
    if not isinstance(mesh, list) or not 1 <= len(mesh) <= MAX_MESH_NDIM:
        raise _fail(where, key, f"layout mesh_shape must be a list of 1 to {MAX_MESH_NDIM} sizes, found {mesh!r:.100}")
    mesh = [_int(m, where, key, "layout mesh size", lo=1, hi=MAX_WORLD) for m in mesh]
    ranks = math.prod(mesh)
    if ranks > MAX_WORLD:
        raise _fail(where, key, f"layout mesh {mesh} has {ranks} positions, more than any job ({MAX_WORLD})")
    names = rec.get("mesh_dim_names")
    if names is not None and (not isinstance(names, list) or len(names) != len(mesh) or len(set(map(str, names)))
                              != len(names) or any(type(n) is not str or not 0 < len(n) <= 256 or n == "None"
                                                   for n in names)):
        raise _fail(where, key, f"layout mesh_dim_names must be {len(mesh)} distinct non-empty names, "
                                f"found {names!r:.200}")
    placements = rec.get("placements")
    if not isinstance(placements, list) or len(placements) != len(mesh):
        raise _fail(where, key, f"layout needs one placement per mesh dim ({len(mesh)}), found {placements!r:.200}")
    for p in placements:
        match = _PLACEMENT_NAME.match(p) if isinstance(p, str) else None
        if match is None:
            raise _fail(where, key, f"layout placement {p!r:.50} is not 'R', 'S(d)' or '_S(d,k)'")
        if p == "R":
            continue
        d = int(match.group(1) if match.group(1) is not None else match.group(2))
        if not -ndim <= d < ndim:
            raise _fail(where, key, f"layout placement {p} shards dim {d} of a {ndim}-d tensor")
        if match.group(3) is not None and not 1 <= int(match.group(3)) <= ranks:
            raise _fail(where, key, f"layout placement {p}: split factor must be in [1, {ranks}]")
    out = {"mesh_shape": mesh, "mesh_dim_names": names, "placements": placements}
    if rec.get("rank_list") is not None:
        i = rec["rank_list"]
        if rank_lists is None or type(i) is not int or not 0 <= i < len(rank_lists) or len(rank_lists[i]) != ranks:
            raise _fail(where, key, f"layout rank_list {i!r:.20} names no rank list of {ranks} ranks")
        out["rank_list"] = rank_lists[i]
    return out


def replicas(chunks: list[ChunkRecord]) -> list[list[ChunkRecord]]:
    """Chunks grouped by box: each group holds one box's replicas (usually just one)."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[ChunkRecord]] = {}
    for c in chunks:
        groups.setdefault((c.offsets, c.sizes), []).append(c)
    return list(groups.values())


def _check_disjoint(boxes: set[tuple[tuple[int, ...], tuple[int, ...]]], where: str, key: str) -> None:
    # Distinct boxes must not overlap (equal boxes are replicas, and the set holds each once).
    distinct = [Box(o, s) for o, s in boxes]
    pair = first_overlap(distinct)
    if pair is not None:
        raise _fail(where, key, f"chunks {distinct[pair[0]]} and {distinct[pair[1]]} overlap")


# ---------------------------------------------------------------------------- paths


def _encode_path_part(p: Any) -> Any:
    if isinstance(p, str):
        return p
    tag, n = p
    return {tag: n}


def _decode_path_part(p: Any, where: str, key: str) -> Any:
    if isinstance(p, str):
        return p
    if isinstance(p, dict) and len(p) == 1:
        (tag, n), = p.items()
        if tag in ("i", "t", "k") and type(n) is int:
            return (tag, n)
    raise _fail(where, key, f"bad path component {p!r}")


# ---------------------------------------------------------------------------- typed values


# A plain value is written into .metadata as JSON, each shared list or dict once per use, so
# its size is bounded by what JSON writes, not by its objects: 45 levels of ``[x, x]`` are 91
# objects and 2**45 JSON items. Both bounds are far beyond real values (a step, a config).
MAX_VALUE_DEPTH = 64  # containers inside containers; encoded, at most 3 JSON levels each
MAX_VALUE_ITEMS = 1 << 20  # items as JSON writes them (a shared container counts at each use)
_LEAVES = (bool, int, float, str)


class ValueFault(NamedTuple):
    """Why a value is not plain data: ``kind`` is ``"type"`` (``culprit`` is a value of a type
    JSON cannot hold), ``"key"`` (``culprit`` is a dict key other than str or int) or ``"shape"``
    (``culprit`` is a container that holds itself, nests too deep or holds too many items);
    ``path`` holds the keys/indices leading to it."""

    kind: str
    path: tuple[Any, ...]
    culprit: Any
    why: str


class _Fault(Exception):
    def __init__(self, kind: str, culprit: Any, why: str):
        super().__init__(why)
        self.fault = ValueFault(kind, (), culprit, why)
        self.path: list[Any] = []  # keys from the culprit up, added as the walk unwinds


def plain_value_problem(v: Any) -> ValueFault | None:
    """None when ``v`` round-trips exactly through :func:`encode_value`; else its first fault.

    The walk stops at the first fault (a reference cycle, nesting deeper than MAX_VALUE_DEPTH,
    more than MAX_VALUE_ITEMS items, a type or key JSON cannot hold), so any value, hostile or
    not, costs at most MAX_VALUE_ITEMS steps and MAX_VALUE_DEPTH frames.
    """
    items = 1
    on_path: set[int] = set()  # ids of the containers being walked: one met again is a cycle

    def walk(x: Any, depth: int) -> None:
        nonlocal items
        t = type(x)
        if t is dict:
            for k in x:
                if type(k) is not str and type(k) is not int:
                    raise _Fault("key", k, f"its dict key {k!r:.80} is a {type(k).__name__}, not a str or int")
            members: Any = x.items()
        elif t is list or t is tuple:
            members = enumerate(x)
        elif x is None or t in _LEAVES:
            return
        else:
            raise _Fault("type", x, f"a {t.__module__}.{t.__qualname__} is not plain data")
        if id(x) in on_path:
            raise _Fault("shape", x, "it contains itself (a reference cycle)")
        if depth >= MAX_VALUE_DEPTH:
            raise _Fault("shape", x, f"it nests lists, tuples or dicts more than {MAX_VALUE_DEPTH} deep")
        items += len(x)
        if items > MAX_VALUE_ITEMS:
            raise _Fault("shape", x, f"it holds more than {MAX_VALUE_ITEMS} items as JSON writes them (a list or "
                                     "dict used in several places counts at each use)")
        on_path.add(id(x))
        for k, m in members:
            if m is not None and type(m) not in _LEAVES:
                try:
                    walk(m, depth + 1)
                except _Fault as fault:
                    fault.path.append(k)
                    raise
        on_path.discard(id(x))

    try:
        walk(v, 0)
    except _Fault as fault:
        return fault.fault._replace(path=tuple(reversed(fault.path)))
    return None


def is_json_value(v: Any) -> bool:
    """True when ``v`` round-trips exactly through :func:`encode_value` (within the bounds of
    :func:`plain_value_problem`: no cycles, nesting and size bounded)."""
    if v is None or type(v) in _LEAVES:
        return True
    return plain_value_problem(v) is None


# HyperParallel's names, for code written for it: its metadata classes are torch DCP's (which
# Metadata.state_dict_metadata returns too), and a plain tensor may carry a ChunkInfo under
# CHUNK_INFO. Only the whole, replicated case means what it means there (a plain tensor is
# saved whole and loaded whole); a part of a bigger tensor is refused (use a DTensor).
CHUNK_INFO = "chunk_info"


@dataclass(frozen=True)
class ChunkInfo:
    """Where a plain tensor sits in a global tensor, and which ranks hold it (HyperParallel)."""

    chunk: ChunkStorageMetadata
    global_shape: tuple[int, ...]
    replica_rank_list: tuple[int, ...] = ()


def check_chunk_info(key: str, tensor: Any) -> None:
    """Refuse a plain tensor whose ``chunk_info`` makes it a part of a bigger tensor."""
    info = getattr(tensor, CHUNK_INFO, None)
    if info is None:
        return
    shape = tuple(tensor.shape)
    offsets = tuple(getattr(info.chunk, "offsets", ()))
    sizes = tuple(getattr(info.chunk, "sizes", ()))
    if tuple(info.global_shape) != shape or sizes != shape or any(offsets):
        raise UnsupportedValueError(
            f"{key!r}: its chunk_info places it at {list(offsets)} (sizes {list(sizes)}) of a global "
            f"{list(info.global_shape)}; only a whole tensor's chunk_info is supported (a plain tensor is saved and "
            "loaded whole). Save a part of a bigger tensor as a DTensor")


def json_culprit(value: Any, where: str, item: Callable[[str, Any], str] | None = None) -> tuple[str, Any] | None:
    """The first value inside ``value`` that :func:`is_json_value` refuses, and where it sits
    (``item(where, key)`` names a member; default ``where.key``), so that an error names it
    rather than its container; a dict key of another type than str or int counts. None when
    everything is plain."""
    item = item or (lambda w, k: f"{w}.{k}")
    found = plain_value_problem(value)
    if found is None:
        return None
    for k in found.path:
        where = item(where, k)
    if found.kind == "key":
        return f"{where} (its key {found.culprit!r})", found.culprit
    if found.kind == "type":  # the culprit's type says what is wrong
        return where, found.culprit
    return f"{where} ({found.why})", found.culprit


def check_user_metadata(value: Any) -> None:
    """Raise ValueError naming the first value of ``user_metadata`` that is not plain JSON-able
    data (:func:`is_json_value`), e.g. ``user_metadata['loss'] is a numpy.float32``."""
    found = (json_culprit(value, "user_metadata", lambda w, k: f"{w}[{k!r}]") if type(value) is dict
             else ("user_metadata", value))
    if found is not None:
        where, bad = found
        raise ValueError(f"{where} is a {type(bad).__module__}.{type(bad).__qualname__}: user_metadata must be a dict "
                         "of plain JSON-able values (None, bool, int, float, str, lists, tuples, dicts with str or "
                         "int keys); convert it first (e.g. float(x) for a numpy scalar)")


def encode_value(v: Any) -> Any:
    """Python value -> JSON with type tags; only call when :func:`is_json_value` holds."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return v
    if t is float:
        return v if math.isfinite(v) else {"$float": repr(v)}
    if t is list:
        return [encode_value(x) for x in v]
    if t is tuple:
        return {"$tuple": [encode_value(x) for x in v]}
    if t is dict:
        return {"$dict": [[k, encode_value(x)] for k, x in v.items()]}
    raise TypeError(f"cannot encode {t.__name__}")


def decode_value(v: Any) -> Any:
    if v is None or type(v) in (bool, int, float, str):
        return v
    if type(v) is list:
        return [decode_value(x) for x in v]
    if type(v) is dict and len(v) == 1:
        (tag, inner), = v.items()
        if tag == "$tuple" and type(inner) is list:
            return tuple(decode_value(x) for x in inner)
        if tag == "$dict" and type(inner) is list:
            out = {}
            for pair in inner:
                if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in (str, int):
                    raise ValueError(f"bad dict item {pair!r:.80}")
                out[pair[0]] = decode_value(pair[1])
            return out
        if tag == "$float" and inner in ("nan", "inf", "-inf"):
            return float(inner)
    raise ValueError(f"unrecognised value {v!r:.80}")
