"""Format v2 data files: where each chunk sits, and the index that lets readers find it.

A data file is a valid safetensors file::

    [8-byte header length][JSON header, space-padded][payloads ...][__index__]

- Payloads of at least ``ALIGNED_PAYLOAD_MIN`` bytes start on ``DIRECT_IO_ALIGN`` (4 KiB) boundaries, so they
  can be written and read with O_DIRECT; smaller ones are packed densely (aligned only to
  their element size), so thousands of tiny shards do not grow the file. Every gap is a
  ``__pad<n>`` entry of raw bytes, because safetensors allows no holes.
- The JSON header names every chunk ``<key>@<offsets>`` with its dtype and shape, so any
  standard tool opens it; readers of this library never parse it (``verify`` checks it).
- ``__index__`` is a binary blob this library reads instead of the JSON header: one row per
  chunk ``(key id, sub id, crc position, start)`` sorted by ``(key id, sub id)``, the crc32c
  table (one checksum per block of whole rows of dim 0, at most ``block_bytes`` bytes
  each), and optionally a 128-bit content hash per chunk (incremental checkpoints compare
  them). ``.metadata`` records each file's index offset, length and crc32c, so a reader
  reads only the index of the files it reads, and a damaged index is detected.

A chunk is identified by its key's 64-bit *key id* (a hash of the key, so ids stay valid in
files of earlier steps) and a *sub id* (which box of the key: see :mod:`.grid`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import struct
from dataclasses import dataclass

import crc32c
import numpy as np
import torch

from ..base.alignment import DIRECT_IO_ALIGN
from ..base.box import Box
from ..base.dtypes import itemsize, safetensors_dtype
from ..base.errors import CorruptCheckpointError
from . import metadata as md
from .safetensors import frame_header

ALIGNED_PAYLOAD_MIN = 64 << 10  # payloads at least this large start on a DIRECT_IO_ALIGN boundary
BLOCK_BYTES = 1 << 20
INDEX_NAME = "__index__"
_MAGIC = b"HPDCIDX2"
_HEAD = struct.Struct("<8sIIII")  # magic, items, crcs, block_bytes, flags
_HASHES = 1
_ROW = 24  # key id u64, sub u32, crc position u32, start u64
LAYOUT_VERSION = 2  # the data files' own layout (their "__metadata__" says it): unchanged since format v2


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a tensor's data, row-major, as a flat memoryview (copies only if it must)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():  # lazy conjugate/negative views: their values, not their bits
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # one element whose size-1 dims had other strides: contiguous, but not stride 1
        flat = flat.as_strided((1,), (1,))
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


@functools.lru_cache(maxsize=1 << 16)
def key_id(key: str) -> int:
    """The 64-bit id of a key in data-file indexes (cached: every file of a save repeats keys)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def block_rows(sizes: tuple[int, ...], nbytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """Rows of dim 0 per checksum block (the whole chunk for 0-d tensors)."""
    rows = sizes[0] if sizes else 1
    row_bytes = max(1, nbytes // max(rows, 1))
    return max(1, min(rows, block_bytes // row_bytes))


def n_blocks(sizes: tuple[int, ...], nbytes: int, block_bytes: int = BLOCK_BYTES) -> int:
    rows = sizes[0] if sizes else 1
    return -(-rows // block_rows(sizes, nbytes, block_bytes)) if nbytes else 0


@dataclass(frozen=True)
class Item:
    """One chunk (or sub-chunk) a data file stores."""

    key: str
    sub: int
    box: Box
    dtype: str
    nbytes: int


@dataclass
class FileLayout:
    """Where everything of one data file goes, decided before a byte is written."""

    header: bytes
    starts: list[int]  # absolute offset of each item's payload
    crc_first: list[int]  # position of each item's first checksum in the crc table
    n_crcs: int
    index_offset: int
    index_length: int  # the index itself (what readers read)
    index_span: int  # the index with the padding that ends the file on a block boundary
    size: int
    aligned: bool  # some payloads are DIRECT_IO_ALIGN-aligned (worth writing with O_DIRECT)

    @property
    def base(self) -> int:
        return len(self.header)


def _align(pos: int, a: int) -> int:
    return -(-pos // a) * a


@functools.lru_cache(maxsize=1 << 16)
def _json_key(key: str) -> str:
    """``key`` as a JSON string without its closing quote (cached: every file repeats keys)."""
    return json.dumps(key)[:-1]


def plan_file(items: list[Item], save_id: str, hashes: bool = False, block_bytes: int = BLOCK_BYTES) -> FileLayout:
    """Place ``items`` (in this order) in a data file; see the module docstring.

    One pass, a few operations per item, the JSON header written as text directly:
    offline tools plan thousands of files of thousands of tiny chunks each.
    """
    names: set[str] = set()
    for item in items:
        name = (item.key, item.box.offsets)
        if name in names:
            raise ValueError(f"{item.key!r}: two chunks at offsets {item.box.offsets} in one data file")
        names.add(name)
    t = _plan(items, save_id, hashes, block_bytes, None)
    return t.layout(t.text)


@dataclass
class FileTemplate:
    """The layout of data files that hold chunks of the same keys, sizes and dtypes in the
    same order, with each chunk's box offsets left open: ``text`` is the JSON header as a
    ``str.format`` template whose field ``{s}`` is the offsets text (``"0,128"``) of slot
    ``s``. Offline tools that write thousands of files alike (every rank of a reshard holds
    one box of each key) plan the file once and fill in each rank's offsets."""

    text: str
    rel: list[int]  # each item's payload start, relative to the end of the header
    crc_first: list[int]
    n_crcs: int
    index_rel: int
    index_length: int
    index_span: int
    aligned: bool

    def header(self, text: str) -> bytes:
        """The framed header bytes of a filled-in ``text``."""
        return frame_header(text.encode(), DIRECT_IO_ALIGN if self.aligned else 8)

    def layout(self, text: str) -> FileLayout:
        blob = self.header(text)
        base = len(blob)
        return FileLayout(blob, [base + r for r in self.rel], self.crc_first, self.n_crcs, base + self.index_rel,
                          self.index_length, self.index_span, base + self.index_rel + self.index_span, self.aligned)


def plan_template(items: list[Item], slots: list[int], save_id: str, block_bytes: int = BLOCK_BYTES) -> FileTemplate:
    """A :class:`FileTemplate` of ``items`` (their box sizes count, their offsets do not):
    item ``i``'s name is ``<key>@{slots[i]}``. Keys must be distinct (one chunk per key)."""
    if len(set(i.key for i in items)) != len(items):
        raise ValueError("plan_template: one chunk per key (two items share a key)")
    return _plan(items, save_id, False, block_bytes, slots)


def _plan(items: list[Item], save_id: str, hashes: bool, block_bytes: int, slots: list[int] | None) -> FileTemplate:
    """The one implementation of the file layout: with ``slots`` None the header text is
    final (offsets written in), else a ``str.format`` template (braces doubled)."""
    aligned = any(i.nbytes >= ALIGNED_PAYLOAD_MIN for i in items)
    lb, rb = ("{{", "}}") if slots is not None else ("{", "}")
    meta = json.dumps({"format": md.FORMAT_NAME, "version": str(LAYOUT_VERSION), "save_id": save_id},
                      separators=(",", ":"))
    out: list[str] = [lb + '"__metadata__":', meta.replace("{", lb).replace("}", rb)]
    rel: list[int] = []
    crc_first: list[int] = []
    pos = pads = n_crcs = 0
    kinds: dict[str, tuple[str, int]] = {}  # dtype -> (safetensors name or "", itemsize)
    for n_item, item in enumerate(items):
        kind = kinds.get(item.dtype)
        if kind is None:
            kind = kinds[item.dtype] = (safetensors_dtype(item.dtype) or "", max(1, itemsize(item.dtype)))
        st, size = kind
        nbytes = item.nbytes
        a = DIRECT_IO_ALIGN if nbytes >= ALIGNED_PAYLOAD_MIN else size
        start = -(-pos // a) * a
        if start > pos:
            out.append(f',"__pad{pads}":{lb}"dtype":"U8","shape":[{start - pos}],"data_offsets":[{pos},{start}]{rb}')
            pads += 1
        box = item.box
        if slots is None:
            name = f'{_json_key(item.key)}@{",".join(map(str, box.offsets))}"'
        else:
            name = f'{_json_key(item.key).replace("{", "{{").replace("}", "}}")}@{{{slots[n_item]}}}"'
        shape = ",".join(map(str, box.sizes)) if st else str(nbytes)
        end = start + nbytes
        out.append(f',{name}:{lb}"dtype":"{st or "U8"}","shape":[{shape}],"data_offsets":[{start},{end}]{rb}')
        rel.append(start)
        pos = start + nbytes
        crc_first.append(n_crcs)
        n_crcs += (1 if nbytes else 0) if nbytes <= block_bytes else n_blocks(box.sizes, nbytes, block_bytes)
    index_rel = _align(pos, DIRECT_IO_ALIGN if aligned else 8)
    if index_rel > pos:
        gap = index_rel - pos
        out.append(f',"__pad{pads}":{lb}"dtype":"U8","shape":[{gap}],"data_offsets":[{pos},{index_rel}]{rb}')
    index_length = _HEAD.size + _ROW * len(items) + 4 * n_crcs + (16 * len(items) if hashes else 0)
    span = _align(index_length, DIRECT_IO_ALIGN) if aligned else index_length  # the file ends on a block boundary
    last = index_rel + span
    out.append(f',"{INDEX_NAME}":{lb}"dtype":"U8","shape":[{span}],"data_offsets":[{index_rel},{last}]{rb}{rb}')
    return FileTemplate("".join(out), rel, crc_first, n_crcs, index_rel, index_length, span, aligned)


def encode_index(layout: FileLayout, items: list[Item], crcs: list[int], digests: list[bytes] | None,
                 block_bytes: int = BLOCK_BYTES) -> bytes:
    """The ``__index__`` blob of a file, padded to ``layout.index_span``."""
    ids = np.array([key_id(i.key) for i in items], dtype=np.uint64)
    subs = np.array([i.sub for i in items], dtype=np.uint32)
    order = np.lexsort((subs, ids))
    blob = index_columns(ids[order], subs[order], np.array(layout.crc_first, dtype=np.uint32)[order],
                         np.array(layout.starts, dtype=np.uint64)[order], np.array(crcs, dtype=np.uint32),
                         b"".join(digests[i] for i in order) if digests is not None else None, block_bytes)
    if len(blob) != layout.index_length:
        raise AssertionError("index size differs from its plan")
    return blob + bytes(layout.index_span - len(blob))


def index_columns(ids: np.ndarray, subs: np.ndarray, crc_first: np.ndarray, starts: np.ndarray, crcs: np.ndarray,
                  digests: bytes | None = None, block_bytes: int = BLOCK_BYTES) -> bytes:
    """The ``__index__`` blob (unpadded) from its columns, rows already sorted by (key id, sub id):
    ``ids`` u64, ``subs`` u32, ``crc_first`` u32, ``starts`` u64 (absolute), ``crcs`` u32 in
    the table's order (any integer arrays of those values)."""
    parts = [_HEAD.pack(_MAGIC, len(ids), len(crcs), block_bytes, _HASHES if digests is not None else 0),
             np.asarray(ids, dtype="<u8").tobytes(), np.asarray(subs, dtype="<u4").tobytes(),
             np.asarray(crc_first, dtype="<u4").tobytes(), np.asarray(starts, dtype="<u8").tobytes(),
             np.asarray(crcs, dtype="<u4").tobytes()]
    if digests is not None:
        parts.append(digests)
    return b"".join(parts)


@dataclass(frozen=True)
class ChunkBytes:
    """Where one chunk's payload is, and its checksums (what the loader needs to read it)."""

    start: int
    block_rows: int
    crc32c: tuple[int, ...]
    digest: bytes | None = None


TABLE_AFTER = 8  # lookups in one index before it builds a (key id, sub) -> row table


class FileIndex:
    """A data file's decoded ``__index__``: look up chunks by (key, sub id)."""

    def __init__(self, raw: bytes | memoryview, where: str, index_offset: int):
        raw = memoryview(raw)
        if raw.nbytes < _HEAD.size:
            raise CorruptCheckpointError(f"{where}: its index is truncated ({raw.nbytes} bytes)")
        magic, n, n_crcs, block_bytes, flags = _HEAD.unpack_from(raw)
        need = _HEAD.size + _ROW * n + 4 * n_crcs + (16 * n if flags & _HASHES else 0)
        if magic != _MAGIC or need > raw.nbytes or block_bytes < 1:
            raise CorruptCheckpointError(f"{where}: its index is not a format-v2 index (or is damaged)")
        pos = _HEAD.size
        self.ids = np.frombuffer(raw, np.uint64, n, pos)
        self.subs = np.frombuffer(raw, np.uint32, n, pos + 8 * n)
        self.crc_first = np.frombuffer(raw, np.uint32, n, pos + 12 * n)
        self.starts = np.frombuffer(raw, np.uint64, n, pos + 16 * n)
        self.crcs = np.frombuffer(raw, np.uint32, n_crcs, pos + _ROW * n)
        self.digests = (np.frombuffer(raw, np.uint8, 16 * n, pos + _ROW * n + 4 * n_crcs).reshape(n, 16)
                        if flags & _HASHES else None)
        self.block_bytes = block_bytes
        self.where = where
        self.limit = index_offset  # payloads lie before the index
        self._lookups = 0
        self._rows: dict[tuple[int, int], int] | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def _row(self, key: str, sub: int) -> int | None:
        rows = self._rows
        if rows is None and self._lookups >= TABLE_AFTER:
            # Many lookups in this file (a load of most of its chunks): one dict, built once,
            # beats a binary search per chunk (numpy's searchsorted on scalars: ~3 us each).
            # A few lookups (one tensor out of thousands of files) keep the searches.
            pairs = list(zip(self.ids.tolist(), self.subs.tolist(), strict=True))
            rows = self._rows = {pairs[j]: j for j in range(len(pairs) - 1, -1, -1)}  # the first row wins
        if rows is not None:
            return rows.get((key_id(key), sub))
        self._lookups += 1
        kid = np.uint64(key_id(key))
        lo = int(np.searchsorted(self.ids, kid, "left"))
        hi = int(np.searchsorted(self.ids, kid, "right"))
        if lo == hi:
            return None
        j = lo + int(np.searchsorted(self.subs[lo:hi], np.uint32(sub)))
        return j if j < hi and int(self.subs[j]) == sub else None

    def find(self, key: str, sub: int, sizes: tuple[int, ...], nbytes: int) -> ChunkBytes | None:
        """The payload of chunk (key, sub) of ``nbytes`` bytes and box sizes ``sizes``, or None.

        Raises CorruptCheckpointError when the index points outside the payload area.
        """
        j = self._row(key, sub)
        if j is None:
            return None
        start, first = int(self.starts[j]), int(self.crc_first[j])
        count = n_blocks(sizes, nbytes, self.block_bytes)
        if start + nbytes > self.limit or first + count > len(self.crcs):
            raise CorruptCheckpointError(f"{self.where}: index entry of {key!r} (chunk {sub}) points outside "
                                         "the file's payloads; the file is damaged")
        digest = bytes(self.digests[j]) if self.digests is not None else None
        return ChunkBytes(start, block_rows(sizes, nbytes, self.block_bytes),
                          tuple(self.crcs[first:first + count].tolist()), digest)


class UncheckedIndex:
    """The index of a data file this library did not write (e.g. a Hugging Face safetensors
    file, see :mod:`.hf_storage`): where each chunk's payload starts, and no checksums.

    A storage reader builds it from the file's own header (``StorageReader.file_index``).
    Chunks found here carry an empty checksum tuple; the loader then reads only the bytes a
    target needs and verifies nothing, since the file holds nothing to verify against.
    """

    def __init__(self, chunks: dict[tuple[str, int], tuple[int, tuple[int, ...], int]], where: str):
        self.chunks = chunks  # (key, sub id) -> (payload start, box sizes, payload bytes)
        self.where = where

    def __len__(self) -> int:
        return len(self.chunks)

    def find(self, key: str, sub: int, sizes: tuple[int, ...], nbytes: int) -> ChunkBytes | None:
        """The payload of chunk (key, sub), or None when the file has no such chunk.

        Raises CorruptCheckpointError when the file holds it with another shape or size than
        the checkpoint's metadata says (the file changed since the metadata was built).
        """
        found = self.chunks.get((key, sub))
        if found is None:
            return None
        start, have_sizes, have_nbytes = found
        if tuple(have_sizes) != tuple(sizes) or have_nbytes != nbytes:
            raise CorruptCheckpointError(
                f"{self.where}: {key!r} holds shape {list(have_sizes)} in {have_nbytes} bytes, the checkpoint's "
                f"metadata says shape {list(sizes)} in {nbytes} bytes; the file changed while it was being loaded")
        return ChunkBytes(start, max(1, sizes[0]) if sizes else 1, ())


def check_index(raw: bytes | memoryview, expected_crc: int, where: str) -> None:
    if crc32c.crc32c(raw) != expected_crc:
        raise CorruptCheckpointError(f"{where}: its index fails its checksum (expected {expected_crc:#010x}); "
                                     "the file is damaged")


class ContentHash:
    """The 128-bit content hash of a chunk, fed in pieces (xxh3-128): what incremental
    checkpoints compare to tell a changed chunk from an unchanged one."""

    def __init__(self) -> None:
        import xxhash

        self._h = xxhash.xxh3_128()

    def feed(self, data: memoryview) -> None:
        self._h.update(data)

    def digest(self) -> bytes:
        return self._h.digest()
