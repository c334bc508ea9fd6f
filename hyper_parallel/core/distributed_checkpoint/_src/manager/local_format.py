"""The local tier's shard file: one rank's own shards of one step, in one file.

A local save writes, for each rank and step, one file (names in :func:`shard_file_name`)::

    local_dir/tier-<16 hex digits>/r<rank:05d>/step_<step:08d>-<timeline>.safetensors

``tier-...`` is derived from the manager's durable directory (:func:`tier_dir_name`), so two
jobs sharing ``/dev/shm`` never see or delete each other's files; ``r<rank>`` holds the files
of one rank's shards, whether written by that rank or received as a copy from it.

It is a valid safetensors file (``safetensors.safe_open`` reads it): an 8-byte header
length, a JSON header, then the payloads, each at a 64-byte aligned offset with every gap
covered by a ``__pad<n>`` entry (safetensors allows no holes). Payload entries are named
``<key>@<global offsets>`` like the chunks of a checkpoint's data files. The header's
``__metadata__`` holds ``"hp_local"``: the *manifest* (JSON text), which this library reads
instead of the safetensors entries, and ``"hp_local_crc32c"``: the header's checksum (below)::

    {"format": "hyper-parallel-local", "version": 2, "step": 42, "rank": 1, "world_size": 4,
     "timeline": "0189c3...", "directory": "/ckpt/run1", "fingerprint": "<sha256 hex>",
     "durable_base": {"step": 40, "timeline": "0189a7..."},
     "entries": {"model.w": {"kind": "dtensor", "dtype": "float32", "shape": [8, 16],
                             "start": 0, "nbytes": 512, "crc32c": 1234,
                             "global_shape": [32, 16], "offsets": [8, 0]},
                 "step": {"kind": "object", "value": 42}, ...}}

- ``kind``: ``dtensor`` (this rank's local shard of a DTensor), ``tensor`` (a plain tensor,
  this rank's copy), ``ndarray`` (``dtype`` is numpy's ``dtype.str``), ``bytes``, or
  ``object`` (a JSON value with the type tags of :func:`values.encode_value`).
- ``start``/``nbytes``: where the payload lies, relative to the first byte after the header;
  ``crc32c``: its checksum, verified on every read.
- ``fingerprint``: the structure of the rank's state dict (keys, kinds, dtypes, local shapes,
  global boxes and layouts, see :func:`describe`); a file loads into a target only when the
  target's fingerprint is the same (same keys and the same sharding on the same rank).
- ``directory`` ties the file to one checkpoint manager (its durable directory), ``timeline``
  to one run of it (a restart starts a new timeline, so steps of an abandoned run never mix
  with a new run's), ``world_size`` to the job's size.
- ``durable_base``: the newest durable step (and the timeline that committed it; null for a
  step saved before timelines were recorded) when the file's timeline began; ``{"step":
  null, "timeline": null}`` when there was none. Recovery uses a local step only while the
  newest durable step is that one or was written by the file's own timeline: otherwise a
  later run committed a durable step, and the local step belongs to an abandoned run. Files
  written before this field existed have none (recovery then only refuses them when a later
  run of this version has committed a durable step).

**Integrity**: every byte this library reads is checksummed before it is trusted. The
header (the 8-byte length, the JSON text and its padding: the manifest with every non-tensor
value, and the safetensors entries) is covered by ``"hp_local_crc32c"``, the crc32c of those
bytes with the field's own 8 hex digits written as ``00000000``, verified before the JSON is
parsed (:func:`parse_manifest`); the payloads by the manifest's per-entry ``crc32c``, verified
as they are read (:func:`read_into`). A copy that fails either check is never loaded:
recovery takes another copy, an older step, or the durable tier, with a warning naming the
file and the step. Version 1 files (before the header checksum) cannot be verified and are
refused the same way: the local tier is a cache, the durable tier still holds the state.

**Commit**: the file is written under a temporary name (``.tmp-...``) in the same directory
and renamed into place; a file with its final name is whole (a partial save is only ever a
``.tmp-`` file, swept at the next start). The rename is not fsynced by default: the local
tier survives a process restart (the page cache does), not a machine crash, and after a
crash the checksums reject a file whose data never reached the disk.

This module knows files and bytes; the tier's protocol is in :mod:`.local_tier`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import crc32c
import numpy as np
import torch
from torch.distributed.tensor import DTensor

from ..base.alignment import TENSOR_ALIGN
from ..base.atomic_file import atomic_file
from ..base.dtypes import dtype_name, itemsize, safetensors_dtype
from ..base.errors import CorruptCheckpointError, UnsupportedValueError
from ..base.limits import MAX_NDIM
from ..format.safetensors import METADATA_KEY, PAD_PREFIX, encode_header, header_length, pad_entry, tensor_entry
from ..format.values import decode_value, encode_value, is_json_value, json_culprit
from ..sharding.records import dtensor_box, layout_record
from ..sharding.sharded_tensor import is_sharded_tensor
from ..state.flatten import FlatLeaves
from ..state.version_stamp import mark_written

FORMAT_NAME = "hyper-parallel-local"
FORMAT_VERSION = 2  # 2: the header's checksum (version 1 files are refused: unverifiable)
MANIFEST_KEY = "hp_local"
CHECK_KEY = "hp_local_crc32c"  # __metadata__'s checksum of the whole header (see the module docstring)
_UNSEALED = "0" * 8  # the checksum field's value while the checksum is computed
# The field as it lies in the header text. Inside a JSON string every quote is escaped, so an
# unescaped `crc32c":"` only occurs where __metadata__ holds the field (entry names end in
# "@<offsets>", and the manifest is one string): exactly once in a sealed header.
_CHECK_FIELD = re.compile(rb'"' + CHECK_KEY.encode() + rb'":"([0-9a-f]{8})"')
BODY_ALIGN = TENSOR_ALIGN  # the header is padded so the body starts at a multiple of this: the
# staging buffer's aligned payloads stay aligned in the file (and in a mapping of it)
MAX_HEADER = 256 << 20  # a manifest larger than this is not ours
TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"^step_(\d{8,})-([0-9a-f]{8,64})\.safetensors$")
_RANK_DIR = re.compile(r"^r(\d{5,})$")
_KINDS = ("dtensor", "tensor", "ndarray", "bytes", "object")


def tier_dir_name(directory: str) -> str:
    """The subdirectory of ``local_dir`` that holds the local tier of the manager of ``directory``."""
    return "tier-" + hashlib.sha256(directory.encode()).hexdigest()[:16]


def rank_dir_name(rank: int) -> str:
    return f"r{rank:05d}"


def rank_of_dir(name: str) -> int | None:
    m = _RANK_DIR.match(name)
    return int(m.group(1)) if m and name == rank_dir_name(int(m.group(1))) else None


def shard_file_name(step: int, timeline: str) -> str:
    """The committed name of a rank's file of ``step`` in run ``timeline``."""
    return f"step_{step:08d}-{timeline}.safetensors"


def parse_shard_file_name(name: str) -> tuple[int, str] | None:
    """``(step, timeline)`` of a committed shard file name, or None (temporary or foreign)."""
    m = _NAME.match(name)
    if m is None or name != shard_file_name(int(m.group(1)), m.group(2)):
        return None
    return int(m.group(1)), m.group(2)


def new_timeline() -> str:
    """A new timeline id (a run's, recorded in its files' names and manifests and in the
    durable steps it commits): creation time (hex ns) and 8 random hex digits."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}"


# ----------------------------------------------------------------------------- what a rank holds


@dataclass
class LocalEntry:
    """One leaf of a rank's state dict as the local tier stores it (no data)."""

    key: str
    kind: str
    dtype: str | None = None  # md dtype name (tensors) or numpy dtype.str (ndarray)
    shape: tuple[int, ...] | None = None  # the local shape
    global_shape: tuple[int, ...] | None = None  # DTensors
    offsets: tuple[int, ...] | None = None  # DTensors: the local shard's global offsets (None: holds nothing)
    layout: dict[str, Any] | None = None  # DTensors: mesh shape, dim names, placements

    def structure(self) -> tuple:
        """What must match between the saved entry and a target for an exact, in-place load."""
        if self.kind in ("dtensor", "tensor"):
            return (self.key, self.kind, self.dtype, self.shape, self.global_shape, self.offsets,
                    json.dumps(self.layout, sort_keys=True) if self.layout is not None else None)
        return (self.key, self.kind)


def describe(flat: FlatLeaves, cache: dict | None = None) -> tuple[list[LocalEntry], list[Any], str]:
    """The entries of a flattened state dict, the value of each (local tensors for DTensors),
    and its fingerprint. Raises UnsupportedValueError for values the tier cannot store.

    ``cache`` (a dict the caller keeps across calls) remembers each DTensor layout's box and
    record: torch recomputes a mesh's rank tensor on every access, which made this the
    largest part of a local save's pause.
    """
    entries, values = [], []
    for key, leaf in flat.leaves.items():
        value = leaf.value
        if is_sharded_tensor(value):
            raise UnsupportedValueError(
                f"{key!r}: a ShardedTensor cannot be kept in the local tier (it stores one tensor or DTensor shard "
                "per key); keep the local tier off for this state, or convert it to a DTensor first")
        if isinstance(value, DTensor):
            offsets, layout = _dtensor_facts(value, key, cache)
            local = value._local_tensor
            entry = LocalEntry(key, "dtensor", dtype_name(value.dtype), tuple(local.shape), tuple(value.shape),
                               offsets, layout)
            value = local
        elif isinstance(value, torch.Tensor):
            entry = LocalEntry(key, "tensor", dtype_name(value.dtype), tuple(value.shape))
        elif isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise UnsupportedValueError(f"{key!r}: a numpy array of Python objects cannot be saved; "
                                            "convert it to a numeric array or to plain values")
            entry = LocalEntry(key, "ndarray", value.dtype.str, tuple(value.shape))
        elif isinstance(value, (bytes, bytearray)):
            entry = LocalEntry(key, "bytes", shape=(len(value),))
            value = np.frombuffer(value, dtype=np.uint8)  # staged like an array
        elif is_json_value(value):
            entry = LocalEntry(key, "object")
        else:
            where, bad = json_culprit(value, key) or (key, value)  # the innermost value at fault
            raise UnsupportedValueError(
                f"{where!r}: a {type(bad).__module__}.{type(bad).__qualname__} can only be saved with pickle, "
                "which the local tier never uses; convert it to tensors/plain values (e.g. int(x) or float(x) "
                "for a numpy scalar)")
        entries.append(entry)
        values.append(value)
    return entries, values, fingerprint(entries)


def _dtensor_facts(value: DTensor, key: str, cache: dict | None) -> tuple[tuple[int, ...] | None, dict[str, Any]]:
    """The global offsets of this rank's shard (None: it holds nothing) and the layout record."""
    mesh = value.device_mesh
    ck = (id(mesh), tuple(value.placements), tuple(value.shape))
    hit = cache.get(ck) if cache is not None else None
    if hit is None or hit[0] is not mesh:
        box = dtensor_box(value, key)  # refuses Partial placements and odd strided shards
        hit = (mesh, None if box is None else box.offsets, layout_record(value))
        if cache is not None:
            cache[ck] = hit
    return hit[1], hit[2]


def fingerprint(entries: Iterable[LocalEntry]) -> str:
    h = hashlib.sha256()
    for e in sorted(entries, key=lambda e: e.key):
        h.update(repr(e.structure()).encode())
    return h.hexdigest()


# ----------------------------------------------------------------------------- writing


def payload_bytes(value: Any) -> memoryview:
    """The bytes of a staged payload (a contiguous CPU tensor, numpy array, or bytes)."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("local tier payloads must be contiguous CPU tensors (staged)")
        if t.numel() == 0:
            return memoryview(b"")
        return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
    if isinstance(value, np.ndarray):
        return memoryview(np.ascontiguousarray(value).reshape(-1).view(np.uint8)).cast("B")
    return memoryview(value).cast("B")


@dataclass
class ShardFile:
    """A shard file ready to be written or sent: its header, then its body (the payloads as
    they lie in the staging buffer: at 64-byte aligned offsets, the gaps covered by pad
    entries)."""

    header: bytes
    body: memoryview

    @property
    def size(self) -> int:
        return len(self.header) + self.body.nbytes


def build_shard_file(manifest: dict[str, Any], entries: list[LocalEntry], spans: dict[str, int],
                     body: memoryview, objects: dict[str, Any]) -> ShardFile:
    """Lay out a shard file around ``body``: checksum each payload (one pass) and build the header.

    ``spans[key]`` is where each tensor/ndarray/bytes entry's payload starts in ``body``
    (payloads ascending and 64-byte aligned; ``body`` ends with the last one); ``objects``
    holds the value of every ``object`` entry.
    """
    header: dict[str, Any] = {}
    listed: dict[str, Any] = {}
    placed = []
    for e in entries:
        rec: dict[str, Any] = {"kind": e.kind}
        listed[e.key] = rec
        if e.kind == "object":
            rec["value"] = encode_value(objects[e.key])
            continue
        start = spans[e.key]
        nbytes = _nbytes(e)
        rec.update(start=start, nbytes=nbytes, crc32c=crc32c.crc32c(body[start:start + nbytes]))
        if e.kind in ("dtensor", "tensor", "ndarray"):
            rec.update(dtype=e.dtype, shape=list(e.shape or ()))
        if e.kind == "dtensor":
            rec.update(global_shape=list(e.global_shape or ()),
                       offsets=None if e.offsets is None else list(e.offsets), layout=e.layout)
        placed.append((start, nbytes, e))
    pos = pads = 0
    for start, nbytes, e in sorted(placed, key=lambda p: p[0]):
        if start > pos:
            header[f"{PAD_PREFIX}{pads}"] = pad_entry(pos, start)
            pads += 1
        st = safetensors_dtype(e.dtype) if e.kind in ("dtensor", "tensor") else None
        offsets = e.offsets if e.offsets is not None else (0,) * len(e.shape or ())
        header[f"{e.key}@{','.join(map(str, offsets))}"] = tensor_entry(
            st or "U8", list(e.shape or ()) if st else [nbytes], start, start + nbytes)
        pos = max(pos, start + nbytes)
    if pos != body.nbytes:
        raise ValueError(f"shard file body of {body.nbytes} bytes, payloads end at {pos}")
    header[METADATA_KEY] = {MANIFEST_KEY: json.dumps({**manifest, "entries": listed}, separators=(",", ":"))}
    return ShardFile(seal_header(header), body)


def seal_header(header: dict[str, Any]) -> bytes:
    """A shard file's header dict as its first bytes (length, JSON text, padding to
    ``BODY_ALIGN``), with ``__metadata__[CHECK_KEY]`` the crc32c of all of them (the field's
    own digits counted as ``00000000``): what :func:`parse_manifest` verifies."""
    header[METADATA_KEY] = {**header[METADATA_KEY], CHECK_KEY: _UNSEALED}
    raw = encode_header(header, BODY_ALIGN)
    fields = list(_CHECK_FIELD.finditer(raw))
    if len(fields) != 1:  # cannot happen (see _CHECK_FIELD); a header no reader could verify
        raise ValueError(f"local shard header holds its checksum field {len(fields)} times")
    start, end = fields[0].span(1)
    return raw[:start] + f"{crc32c.crc32c(raw):08x}".encode() + raw[end:]


def _verify_header(region: bytes, path: str) -> str:
    """Check a header's checksum (``region``: its length, JSON text and padding) before
    anything in it is parsed; return the checksum's hex digits.

    Raises CorruptCheckpointError naming the file: no checksum (a version 1 file, or the
    field damaged), or a mismatch (some byte of the header changed since it was written).
    """
    fields = list(_CHECK_FIELD.finditer(region))
    if len(fields) != 1:
        raise CorruptCheckpointError(f"{path}: {_unsealed(region, len(fields))}; the local copy cannot be "
                                     "trusted and is not loaded")
    start, end = fields[0].span(1)
    expected = int(region[start:end], 16)
    got = crc32c.crc32c(region[:start] + _UNSEALED.encode() + region[end:])
    if got != expected:
        raise CorruptCheckpointError(f"{path}: header checksum mismatch (expected crc32c {expected:#010x}, found "
                                     f"{got:#010x}): a byte of its header (manifest, values, entries or length) "
                                     "changed since it was written; the local copy is damaged")
    return region[start:end].decode()


def _unsealed(region: bytes, count: int) -> str:
    """Why a header holds no single checksum field (for the error: nothing here is trusted)."""
    if count > 1:
        return f"its header holds {count} checksum fields, expected one"
    try:  # only to name the version in the message
        version = json.loads(json.loads(region[8:])[METADATA_KEY][MANIFEST_KEY]).get("version")
    except (ValueError, KeyError, TypeError, AttributeError):
        version = None
    if version is not None and version != FORMAT_VERSION:
        return (f"local shard file version {version!r} has no header checksum (expected version "
                f"{FORMAT_VERSION}, whose header carries {CHECK_KEY!r})")
    return f"its header has no checksum {CHECK_KEY!r} (expected in a version {FORMAT_VERSION} local shard file)"


def _nbytes(e: LocalEntry) -> int:
    if e.kind == "ndarray":
        return int(np.prod(e.shape or (), dtype=np.int64)) * np.dtype(e.dtype).itemsize
    if e.kind == "bytes":
        return int((e.shape or (0,))[0])
    return int(np.prod(e.shape or (), dtype=np.int64)) * itemsize(e.dtype or "")


def tmp_path_for(final: str) -> str:
    d, name = os.path.split(final)
    return os.path.join(d, f"{TMP_PREFIX}{name}.{uuid.uuid4().hex[:12]}")


def write_shard_file(final: str, pieces: list[memoryview], sync: bool = False, spare: str | None = None) -> int:
    """Write ``pieces`` (a header and a body) under a temporary name, then rename it to
    ``final`` (the commit). ``spare``: a retired file of the same directory to overwrite
    instead of creating one (its pages are reused: on tmpfs that halves the cost)."""
    os.makedirs(os.path.dirname(final), exist_ok=True)
    size = sum(p.nbytes for p in pieces)
    with atomic_file(final, "r+b" if spare is not None else "wb", sync=sync,
                     tmp=spare if spare is not None else tmp_path_for(final)) as f:
        for piece in pieces:
            f.write(piece)
        if spare is not None:
            f.truncate(size)
    return size


# ----------------------------------------------------------------------------- reading


@dataclass
class Manifest:
    """A shard file's manifest, validated enough to be compared and indexed safely."""

    path: str
    size: int
    data_start: int
    step: int
    rank: int
    world_size: int
    timeline: str
    directory: str
    fingerprint: str
    entries: dict[str, dict[str, Any]] = field(repr=False, default_factory=dict)
    # (step, timeline) of the newest durable step when the file's timeline began; (None, None):
    # none; None: not recorded (a file written before the field existed)
    durable_base: tuple[int | None, str | None] | None = None


def _int(v: Any) -> bool:
    return type(v) is int and v >= 0


def parse_manifest(head: bytes | memoryview, size: int, path: str) -> Manifest:
    """The manifest of a shard file from its first bytes (header length + header).

    The header's checksum is verified first (see the module docstring), so no value of a
    damaged header is ever parsed, let alone loaded.

    Raises CorruptCheckpointError when it is not a valid local shard file of this version,
    or its header fails its checksum.
    """
    head = bytes(head)
    if len(head) < 8:
        raise CorruptCheckpointError(f"{path}: not a local shard file (truncated header)")
    n = header_length(head)
    if n > MAX_HEADER or 8 + n > size or len(head) < 8 + n:
        raise CorruptCheckpointError(f"{path}: not a local shard file or a damaged one (header length {n}, "
                                     f"expected at most {min(MAX_HEADER, size - 8)} in a file of {size} bytes)")
    check = _verify_header(head[:8 + n], path)
    try:
        header = json.loads(head[8:8 + n])
        if header[METADATA_KEY][CHECK_KEY] != check:
            raise ValueError("a second checksum field")
        man = json.loads(header[METADATA_KEY][MANIFEST_KEY])
    except (ValueError, KeyError, TypeError):
        raise CorruptCheckpointError(f"{path}: not a local shard file (its header has no manifest)") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{path}: not a local shard file (format {man.get('format')!r})"
                                     if isinstance(man, dict) else f"{path}: not a local shard file")
    if man.get("version") != FORMAT_VERSION:
        raise CorruptCheckpointError(f"{path}: local shard file version {man.get('version')!r}; this library "
                                     f"reads version {FORMAT_VERSION}")
    ok = (_int(man.get("step")) and _int(man.get("rank")) and _int(man.get("world_size"))
          and man["rank"] < man["world_size"] and isinstance(man.get("timeline"), str)
          and isinstance(man.get("directory"), str) and isinstance(man.get("fingerprint"), str)
          and isinstance(man.get("entries"), dict))
    if not ok:
        raise CorruptCheckpointError(f"{path}: its manifest is malformed")
    base = man.get("durable_base")
    if base is not None:
        if not (isinstance(base, dict) and (base.get("step") is None or _int(base.get("step")))
                and (base.get("timeline") is None or isinstance(base.get("timeline"), str))):
            raise CorruptCheckpointError(f"{path}: its manifest's durable_base is malformed")
        base = (base.get("step"), base.get("timeline"))
    data_start = 8 + n
    for key, rec in man["entries"].items():
        if not isinstance(rec, dict) or rec.get("kind") not in _KINDS:
            raise CorruptCheckpointError(f"{path}: manifest entry {key!r} is malformed")
        if rec["kind"] != "object" and not (_int(rec.get("start")) and _int(rec.get("nbytes"))
                                            and _int(rec.get("crc32c"))
                                            and data_start + rec["start"] + rec["nbytes"] <= size):
            raise CorruptCheckpointError(f"{path}: manifest entry {key!r} points outside the file")
    return Manifest(path, size, data_start, man["step"], man["rank"], man["world_size"], man["timeline"],
                    man["directory"], man["fingerprint"], man["entries"], base)


def read_manifest(path: str) -> Manifest:
    """Read and validate the manifest of the shard file at ``path`` (reads only its header)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        n = header_length(first) if len(first) == 8 else 0
        rest = f.read(n) if 0 < n <= min(MAX_HEADER, size) else b""
    return parse_manifest(first + rest, size, path)


def scan_rank_dir(path: str) -> Iterator[tuple[int, str, str]]:
    """``(step, timeline, file path)`` of every committed shard file in a rank directory."""
    try:
        names = os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:
        parsed = parse_shard_file_name(name)
        if parsed is not None:
            yield parsed[0], parsed[1], os.path.join(path, name)


@dataclass
class ReadStats:
    bytes_read: int = 0


def read_into(man: Manifest, entries: list[LocalEntry], targets: list[Any]) -> tuple[dict[str, Any], ReadStats]:
    """Fill ``targets`` (the local tensors of the state dict being loaded) from the file.

    Tensors are filled in place (straight into their memory when it is contiguous CPU
    memory); the values of the other kinds are returned by key. Every payload's crc32c is
    checked. The caller has checked that the file's fingerprint equals the targets'.

    Raises CorruptCheckpointError for a checksum or size mismatch.
    """
    stats = ReadStats()
    out: dict[str, Any] = {}
    with open(man.path, "rb", buffering=0) as f:
        def read_at(offset: int, buf: memoryview) -> None:
            got = os.preadv(f.fileno(), [buf], man.data_start + offset) if buf.nbytes else 0
            while got < buf.nbytes:
                more = os.preadv(f.fileno(), [buf[got:]], man.data_start + offset + got)
                if more <= 0:
                    raise CorruptCheckpointError(f"{man.path}: truncated at byte {man.data_start + offset + got}")
                got += more
            stats.bytes_read += buf.nbytes

        for e, target in zip(entries, targets, strict=True):
            rec = man.entries.get(e.key)
            if rec is None or rec.get("kind") != e.kind:
                raise CorruptCheckpointError(f"{man.path}: no {e.kind} entry {e.key!r} in the manifest")
            if e.kind == "object":
                out[e.key] = decode_value(rec.get("value"))
                continue
            nbytes = rec["nbytes"]
            if e.kind in ("dtensor", "tensor"):
                t = target.detach()
                if nbytes != t.numel() * t.element_size():
                    raise CorruptCheckpointError(f"{man.path}: {e.key!r} holds {nbytes} bytes, the target "
                                                 f"needs {t.numel() * t.element_size()}")
                if t.numel() == 0:
                    continue
                direct = t.device.type == "cpu" and t.is_contiguous()
                dest = t if direct else torch.empty(t.shape, dtype=t.dtype)
                buf = memoryview(dest.reshape(-1).view(torch.uint8).numpy()).cast("B")
                read_at(rec["start"], buf)
                _check(man, e.key, buf, rec["crc32c"])
                if not direct:
                    with torch.no_grad():
                        t.copy_(dest)
                else:  # written behind torch's back: an incremental save must not take it as unchanged
                    mark_written(t)
            elif e.kind == "ndarray":
                try:
                    dtype = np.dtype(rec.get("dtype"))
                except (TypeError, ValueError):
                    raise CorruptCheckpointError(f"{man.path}: ndarray entry {e.key!r} has dtype "
                                                 f"{rec.get('dtype')!r}") from None
                shape = rec.get("shape")
                # math.prod of Python ints: numpy's int64 product wraps, and a forged shape whose
                # product wraps to the recorded size would allocate whatever it says
                if dtype.hasobject or not isinstance(shape, list) or len(shape) > MAX_NDIM \
                        or not all(_int(s) for s in shape) or math.prod(shape) * dtype.itemsize != nbytes:
                    raise CorruptCheckpointError(f"{man.path}: ndarray entry {e.key!r} is malformed")
                arr = np.empty(shape, dtype=dtype)
                buf = memoryview(arr.reshape(-1).view(np.uint8)).cast("B")
                read_at(rec["start"], buf)
                _check(man, e.key, buf, rec["crc32c"])
                out[e.key] = arr
            else:  # bytes
                raw = bytearray(nbytes)
                buf = memoryview(raw)
                read_at(rec["start"], buf)
                _check(man, e.key, buf, rec["crc32c"])
                out[e.key] = bytes(raw)
    return out, stats


def _check(man: Manifest, key: str, data: memoryview, expected: int) -> None:
    got = crc32c.crc32c(data)
    if got != expected:
        raise CorruptCheckpointError(f"{man.path}: checksum mismatch in {key!r} (expected crc32c {expected:#010x}, "
                                     f"found {got:#010x}); the local copy is damaged")
