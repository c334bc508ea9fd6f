"""The checkpoint's ``.metadata``: its records, and how the document is written and parsed.

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

Version 3 is version 2 with a long file table written as columns (:mod:`.file_table`);
writers use it only where the table has at least ``COLUMNAR_FILES`` files.

Version 1 (still read) listed every chunk with its file, byte range and checksums.

Kinds: ``tensor``, ``ndarray`` (numpy, returned as numpy), ``bytes``, ``pickle`` (opt-in
only), ``object`` (a JSON-representable value kept with its type: int stays int, tuple stays
tuple). ``path`` says where the key sits in the nested state dict: a string is a dict key,
``{"i": n}`` a list index, ``{"t": n}`` a tuple index, ``{"k": n}`` an int dict key.

Not here: the rules for single fields (shapes, file names, layouts, step names) are
:mod:`.validation`, plain values and paths :mod:`.values`, dtypes :mod:`..base.dtypes`,
bounds :mod:`..base.limits`; which files hold a key's chunks is :mod:`.chunks`.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..base.dtypes import DTYPE_NAMES, is_dtype_name, itemsize, torch_dtype
from ..base.errors import MetadataError
from ..base.gc_pause import paused_gc
from ..base.limits import MAX_ELEMENTS, MAX_TILES, MAX_WORLD
from ..sharding.grid import Grid, shared_grid
from .file_table import COLUMNAR_FILES, FileRecord, encode_columns, encode_rows, parse_columns, parse_rows
from .records import BytesStorageMetadata, ChunkStorageMetadata, TensorProperties, TensorStorageMetadata
from .sealed_json import check_seal, seal_json
from .validation import (
    check_disjoint,
    check_int,
    check_ints,
    check_shape,
    field_error,
    step_dir_name,
    step_of,
    validate_file_name,
    validate_layout_record,
)
from .values import decode_path_part, decode_value, encode_path_part, encode_value

FORMAT_NAME = "hyper-parallel-dcp"
FORMAT_VERSION = 3  # the newest version this reader reads; writers write 2 unless the file table is long
METADATA_FILE = ".metadata"

KINDS = ("tensor", "ndarray", "bytes", "pickle", "object")


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

    def distinct_boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Each saved box ``(offsets, sizes)`` once (replicas share one), in row order."""
        return list(dict.fromkeys(zip(map(tuple, self.offsets.tolist()), map(tuple, self.sizes.tolist()),
                                      strict=True)))

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
        """Serialise as format v2, or v3 when the file table has at least
        :data:`~.file_table.COLUMNAR_FILES` files (a checkpoint read from v1 cannot be written back)."""
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
            d: dict[str, Any] = {"kind": e.kind, "path": [encode_path_part(p) for p in e.path]}
            if e.kind == "object":
                d["value"] = encode_value(e.value)
            else:
                d["dtype"] = e.dtype
                d["shape"] = list(e.shape or ())
                if e.layout is not None:
                    d["layout"] = layout_json(e.layout)
                d["store"] = _encode_store(e.store, key, layout_json)
            entries[key] = d
        columns = len(self.files) >= COLUMNAR_FILES  # (version 3 only where it is needed: earlier releases read 2)
        doc = {
            "format": FORMAT_NAME,
            "version": 3 if columns else 2,
            "save_id": self.save_id,
            "world_size": self.world_size,
            "user": self.user,
            "dirs": self.dirs,
            "rank_lists": rank_lists,
            "files": encode_columns(self.files, self.dirs) if columns else encode_rows(self.files, self.dirs),
            "entries": entries,
        }
        if self.fragment is not None:
            doc["fragment"] = list(self.fragment)
        return seal_json(doc)

    @classmethod
    def from_json(cls, raw: bytes, where: str = METADATA_FILE, *, entries: bool = True) -> Metadata:
        """Parse and validate; every problem raises MetadataError naming ``where``.

        ``entries=False`` checks the document (its seal, format, version, files, user data) but
        leaves ``entries`` empty: what a checkpoint manager needs of each step to list, retain
        and sweep (the files a step names, its metrics), at a fraction of the cost per step.
        """
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
            check_seal(raw, doc, where)
        try:
            with paused_gc():
                return _parse(doc, where, entries).attach()
        except RecursionError:  # nesting json.loads still took, deeper than the parser's decoding goes
            raise _too_deep(where) from None


def _too_deep(where: str) -> MetadataError:
    return MetadataError(f"{where} is nested too deeply to parse (more levels of [ and {{ than Python's recursion "
                         "limit); it is corrupt or hostile, not written by hyper-parallel")


def entry_grid(entry: Entry) -> Grid | None:
    """The chunk grid of a grid-stored entry (None for tables): the boxes of its store's layout
    (or the entry's), or one box written by the store's writer; its ``where`` runs must cover
    every box. Raises MetadataError when the saved layout describes no grid."""
    store = entry.store
    if not isinstance(store, GridStore):
        return None
    shape = tuple(entry.shape or ())
    layout = store.layout if store.layout is not None else (entry.layout if store.writer is None else None)
    try:
        if layout is not None:
            grid = shared_grid(shape, layout["mesh_shape"], layout["placements"], layout.get("rank_list"),
                               store.tiles)
        else:
            grid = shared_grid(shape, (1,), ["R"], [store.writer], store.tiles)
    except ValueError as exc:
        raise MetadataError(f"key {entry.key!r}: its saved layout describes no chunk grid: {exc}") from None
    if store.where is not None:
        total = sum(count for count, _ in store.where)
        if total != grid.num_boxes:
            raise MetadataError(f"key {entry.key!r}: 'where' covers {total} boxes, its grid has {grid.num_boxes}")
    return grid


def saved_boxes(entry: Entry) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The distinct saved boxes ``(offsets, sizes)`` of an entry: a grid's non-empty boxes
    (each column band of one), or a table's boxes once each (replicas share one)."""
    grid = entry_grid(entry)
    if grid is not None:
        return [(box.offsets, box.sizes) for b in range(grid.num_boxes) for _, box in grid.band_subs(b)]
    return entry.store.distinct_boxes() if isinstance(entry.store, TableStore) else []


def storage_metadata_of(entry: Entry) -> TensorStorageMetadata | BytesStorageMetadata:
    """torch's record of one saved key: a tensor's size, dtype and distinct saved chunks (sorted
    by offsets), or a bytes record for any other value."""
    if entry.kind not in ("tensor", "ndarray"):
        return BytesStorageMetadata()
    grid = entry_grid(entry)
    chunks = _GRID_CHUNKS.get(grid) if grid is not None else None
    if chunks is None:
        chunks = [ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)) for offsets, sizes in saved_boxes(entry)]
        chunks.sort(key=lambda c: tuple(c.offsets))
        if grid is not None:  # a shared grid serves every key of its shape and layout: list its chunks once
            _GRID_CHUNKS[grid] = chunks
    return TensorStorageMetadata(TensorProperties(dtype=torch_dtype(entry.dtype)), torch.Size(entry.shape or ()),
                                 list(chunks))


# grid -> its chunks as torch records (the records are shared by the keys of one grid; each key
# gets its own list)
_GRID_CHUNKS: weakref.WeakKeyDictionary[Grid, list[ChunkStorageMetadata]] = weakref.WeakKeyDictionary()


def _state_dict_metadata(meta: Metadata) -> dict[str, Any]:
    return {key: storage_metadata_of(e) for key, e in meta.entries.items()}


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


def _parse(doc: Any, where: str, with_entries: bool = True) -> Metadata:
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
    world_size = check_int(doc.get("world_size"), where, None, "world_size", lo=1, hi=MAX_WORLD)
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
        if with_entries:
            meta.entries = {key: _parse_entry_v1(key, e, names, where) for key, e in entries_raw.items()}
        return meta
    if doc.get("fragment") is not None:
        frag = doc["fragment"]
        if not isinstance(frag, list) or len(frag) != 2:
            raise MetadataError(f"{where}: 'fragment' must be [rank, world size]")
        size = check_int(frag[1], where, None, "fragment world size", lo=1, hi=MAX_WORLD)
        meta.fragment = (check_int(frag[0], where, None, "fragment rank", hi=size - 1), size)
    meta.dirs = _parse_dirs(doc.get("dirs"), where)
    meta.rank_lists = _parse_rank_lists(doc.get("rank_lists"), where)
    files = doc.get("files")
    meta.files = parse_columns(files, meta.dirs, where) if version >= 3 else parse_rows(files, meta.dirs, where)
    if with_entries:
        meta.entries = {key: _parse_entry_v2(key, e, meta, where) for key, e in entries_raw.items()}
    return meta



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


def _parse_common(key: str, e: Any, where: str) -> Entry:
    """Kind, path and (objects) value, or dtype and shape: the part v1 and v2 share."""
    if not isinstance(e, dict):
        raise field_error(where, key, "entry must be an object")
    kind = e.get("kind")
    if kind not in KINDS:
        raise field_error(where, key, f"kind must be one of {KINDS}, found {kind!r}")
    path_raw = e.get("path")
    if not isinstance(path_raw, list) or not path_raw:
        raise field_error(where, key, "path must be a non-empty list")
    try:
        path = tuple(decode_path_part(p) for p in path_raw)
    except ValueError as exc:
        raise field_error(where, key, str(exc)) from None
    if kind == "object":
        if "value" not in e:
            raise field_error(where, key, "object entry has no 'value'")
        try:
            value = decode_value(e["value"])
        except (ValueError, TypeError) as exc:
            raise field_error(where, key, f"bad value encoding: {exc}") from None
        return Entry(key, kind, path, value=value)
    dtype = e.get("dtype")
    if not is_dtype_name(dtype):
        raise field_error(where, key, f"dtype must be one of {list(DTYPE_NAMES)}, found {dtype!r}")
    shape = check_shape(e.get("shape"), where, key)
    if kind == "bytes" and len(shape) != 1:
        raise field_error(where, key, "bytes entries must be 1-d")
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
        raise field_error(where, key, f"store must be {{'grid': ...}} or {{'table': ...}}, found {store!r:.100}")
    (kind, body), = store.items()
    if not isinstance(body, dict):
        raise field_error(where, key, f"store {kind!r} must be an object")
    if kind == "grid":
        entry.store = _parse_grid(key, body, entry, meta, where)
    elif kind == "table":
        entry.store = _parse_table(key, body, shape, len(meta.files), where)
    else:
        raise field_error(where, key, f"unknown store {kind!r}")
    return entry


def _parse_grid(key: str, g: dict, entry: Entry, meta: Metadata, where: str) -> GridStore:
    shape = entry.shape or ()
    tiles = check_int(g.get("tiles", 1), where, key, "grid tiles", lo=1, hi=MAX_TILES)
    layout = g.get("layout")
    if layout is not None:
        layout = validate_layout_record(layout, len(shape), where, key, meta.rank_lists)
    elif "writer" not in g:
        layout = entry.layout
    store = GridStore(tiles=tiles, layout=layout if "layout" in g else None)
    if "writer" in g:
        store.writer = check_int(g["writer"], where, key, "grid writer", hi=MAX_WORLD)
    else:
        if layout is None:
            raise field_error(where, key, "a grid store needs a layout or a writer")
        store.offset = check_int(g.get("offset", 0), where, key, "grid offset", hi=1 << 31)
        store.copies = g.get("copies", "one")
        if store.copies not in ("one", "all"):
            raise field_error(where, key, f"grid copies must be 'one' or 'all', found {store.copies!r:.20}")
    if g.get("where") is not None:
        runs = g["where"]
        if not isinstance(runs, list) or len(runs) > MAX_WORLD:
            raise field_error(where, key, "grid where must be a list of [count, dir] runs")
        store.where = []
        for run in runs:
            if not isinstance(run, list) or len(run) != 2:
                raise field_error(where, key, f"a where run must be [count, dir], found {run!r:.50}")
            store.where.append((check_int(run[0], where, key, "where count", lo=1, hi=MAX_ELEMENTS),
                                check_int(run[1], where, key, "where dir", hi=len(meta.dirs) - 1)))
    return store


def _column(raw: Any, dtype: str, count: int, where: str, key: str, what: str) -> np.ndarray:
    if not isinstance(raw, str) or len(raw) > 4 * (count * np.dtype(dtype).itemsize + 3) // 3 + 4:
        raise field_error(where, key, f"table {what} must be base64 of {count} values")
    try:
        data = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise field_error(where, key, f"table {what} is not valid base64") from None
    if len(data) != count * np.dtype(dtype).itemsize:
        raise field_error(where, key, f"table {what} holds {len(data)} bytes, expected {count} values")
    return np.frombuffer(data, dtype=dtype).astype(np.int64)


def _parse_table(key: str, t: dict, shape: tuple[int, ...], n_files: int, where: str) -> TableStore:
    n = check_int(t.get("n"), where, key, "table n", hi=1 << 24)
    ndim = len(shape)
    offsets = _column(t.get("offsets"), "<i8", n * ndim, where, key, "offsets").reshape(n, ndim)
    sizes = _column(t.get("sizes"), "<i8", n * ndim, where, key, "sizes").reshape(n, ndim)
    files = _column(t.get("file"), "<i4", n, where, key, "file")
    dims = np.array(shape, dtype=np.int64).reshape(1, ndim)
    if n and ((offsets < 0).any() or (sizes < 1).any() or (offsets + sizes > dims).any()):
        raise field_error(where, key, f"a table chunk is empty or lies outside shape {list(shape)}")
    if n and ((files < 0).any() or (files >= n_files).any()):
        raise field_error(where, key, "a table chunk names a file that is not in 'files'")
    boxes = {(tuple(o), tuple(s)) for o, s in zip(offsets.tolist(), sizes.tolist(), strict=True)}
    if sum(math.prod(s) for _, s in boxes) > math.prod(shape):
        raise field_error(where, key, "table chunks hold more elements than the tensor: they overlap")
    check_disjoint(boxes, where, key)
    subs = None
    if t.get("sub") is not None:
        subs = _column(t["sub"], "<i4", n, where, key, "sub")
        if n and (subs < 0).any():
            raise field_error(where, key, "table chunk ids must not be negative")
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
        raise field_error(where, key, "chunks must be a list")
    if e.get("layout") is not None:
        entry.layout = validate_layout_record(e["layout"], len(shape), where, key)
    chunks = []
    volume = 0
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for c in chunks_raw:
        if not isinstance(c, list) or len(c) != 7:
            raise field_error(where, key, f"a chunk must be a list of 7 fields, found {c!r:.200}")
        offsets = check_ints(c[0], where, key, "chunk offsets")
        sizes = check_ints(c[1], where, key, "chunk sizes")
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise field_error(where, key, f"chunk box {offsets}+{sizes} does not match shape {shape}")
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=False)):
            raise field_error(where, key, f"chunk box {list(offsets)}+{list(sizes)} lies outside shape {list(shape)}")
        n = math.prod(sizes)
        if n == 0:
            raise field_error(where, key, "empty chunks are never saved")
        fidx = check_int(c[2], where, key, "chunk file index", hi=len(files) - 1)
        start = check_int(c[3], where, key, "chunk start")
        length = check_int(c[4], where, key, "chunk length")
        if length != n * size:
            raise field_error(where, key, f"chunk length {length} != {n} elements x {size} bytes")
        block_rows = check_int(c[5], where, key, "chunk block_rows", lo=1)
        rows = sizes[0] if sizes else 1
        crcs = c[6]
        if not isinstance(crcs, list) or len(crcs) != -(-rows // block_rows):
            raise field_error(where, key, f"chunk needs {-(-rows // block_rows)} checksums, found {crcs!r:.100}")
        crcs = tuple(check_int(x, where, key, "crc32c", hi=0xFFFFFFFF) for x in crcs)
        chunks.append(ChunkRecord(offsets, sizes, files[fidx], start, length, block_rows, crcs))
        if (offsets, sizes) not in seen:  # a repeated box is a replica, stored in another file
            seen.add((offsets, sizes))
            volume += n
    if volume > numel:
        raise field_error(where, key, f"chunks hold {volume} elements but the tensor has {numel}: they overlap")
    check_disjoint(seen, where, key)
    ndim = len(shape)
    index = {f: i for i, f in enumerate(files)}
    entry.store = TableStore(
        np.array([c.offsets for c in chunks], dtype=np.int64).reshape(len(chunks), ndim),
        np.array([c.sizes for c in chunks], dtype=np.int64).reshape(len(chunks), ndim),
        np.array([index[c.file] for c in chunks], dtype=np.int32), chunks)
    return entry



def replicas(chunks: list[ChunkRecord]) -> list[list[ChunkRecord]]:
    """Chunks grouped by box: each group holds one box's replicas (usually just one)."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[ChunkRecord]] = {}
    for c in chunks:
        groups.setdefault((c.offsets, c.sizes), []).append(c)
    return list(groups.values())


