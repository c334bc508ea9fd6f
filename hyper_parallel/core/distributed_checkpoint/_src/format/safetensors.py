"""The safetensors byte format: the one header builder and the one header parser.

A safetensors file is::

    [u64 little-endian header length][JSON header, space-padded][data area]

The JSON header maps each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}``
(offsets into the data area, which starts right after the header) and may hold
``"__metadata__"`` (a ``{name: string}`` object; no tensor may have that name). The data
area is tiled exactly by the tensors: no overlap, no hole, nothing after the last one.

- Building: :func:`frame_header` (length prefix and padding around JSON text),
  :func:`encode_header` (a header dict), :func:`contiguous_header` (tensors laid out one
  after the other, as ``safetensors.save_file`` does), :func:`tensor_entry` and
  :func:`pad_entry` (entries of headers that place payloads themselves).
- Parsing: :func:`split_header` (length prefix, bounds, JSON object; what every reader of
  a header does first), :func:`parse_header` (every check safetensors itself makes before
  trusting a byte), :func:`read_header` (through anything with ``file_size``/``read_into``),
  :func:`check_safetensors_file` (a local file, before the ``safetensors`` library opens it).

Not here: what a file means to its writer (data files: :mod:`.data_file`; the local tier's
shard files; the Hugging Face, torch and MindSpore dialects: :mod:`..interop`), and the
dtype names (:mod:`.metadata`).
"""

from __future__ import annotations

import errno
import json
import math
import os
import struct
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import crc32c

from ..base.dtypes import dtype_from_safetensors, safetensors_dtype
from ..base.errors import CorruptCheckpointError, UnsupportedValueError
from . import metadata as md

LENGTH = struct.Struct("<Q")  # the header length that opens every safetensors file
HEAD = LENGTH.size
METADATA_KEY = "__metadata__"  # the header's own member: no tensor may be named so
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
PAD_PREFIX = "__pad"  # "__pad<n>": raw bytes filling a gap between payloads (safetensors allows no holes)
_SUB_BYTE = ("F4", "F6_E2M3", "F6_E3M2")


# ---------------------------------------------------------------------------- building


def frame_header(raw: bytes, align: int = 8) -> bytes:
    """JSON header text -> the file's first bytes: the length, then the text space-padded so
    that the data area starts on a multiple of ``align`` (8 at least, as safetensors pads)."""
    raw += b" " * (-(HEAD + len(raw)) % align)
    return LENGTH.pack(len(raw)) + raw


def encode_header(header: Mapping[str, Any], align: int = 8) -> bytes:
    """A header dict (entries and ``__metadata__``) as the file's first bytes, compact JSON."""
    return frame_header(json.dumps(header, separators=(",", ":")).encode(), align)


def tensor_entry(st_dtype: str, shape: Sequence[int], begin: int, end: int) -> dict[str, Any]:
    """One header entry: safetensors dtype name, shape, data-area byte range."""
    return {"dtype": st_dtype, "shape": list(shape), "data_offsets": [begin, end]}


def pad_entry(begin: int, end: int) -> dict[str, Any]:
    """The entry of raw bytes ``[begin, end)`` that fills a gap between payloads."""
    return tensor_entry("U8", [end - begin], begin, end)


def nbytes_of(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of a tensor of our dtype name and ``shape``."""
    return math.prod(shape) * md.itemsize(dtype)


def contiguous_header(tensors: Sequence[tuple[str, str, Sequence[int]]],
                      metadata: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The header of ``(name, dtype, shape)`` tensors stored one after the other, in order.

    Raises UnsupportedValueError for a dtype safetensors has no name for, or a tensor named
    ``__metadata__``.
    """
    header: dict[str, Any] = {METADATA_KEY: dict(metadata)} if metadata else {}
    pos = 0
    for name, dtype, shape in tensors:
        if name == METADATA_KEY:
            raise UnsupportedValueError(f"tensor {name!r}: safetensors reserves the name {METADATA_KEY!r} for its "
                                        "header's metadata, so no tensor can have it; rename the tensor first")
        st = safetensors_dtype(dtype)
        if st is None:
            raise UnsupportedValueError(f"{name!r}: dtype {dtype} has no safetensors name; convert it first")
        n = nbytes_of(dtype, shape)
        header[name] = tensor_entry(st, shape, pos, pos + n)
        pos += n
    return header


# ---------------------------------------------------------------------------- parsing


class ByteSource(Protocol):
    """What :func:`read_header` reads through (a storage reader, or :class:`LocalFiles`)."""

    def file_size(self, name: str) -> int: ...

    def read_into(self, name: str, offset: int, buffer: Any) -> None: ...


@dataclass(frozen=True)
class SafetensorsTensor:
    """One tensor of a safetensors file: dtype (our name), shape, absolute byte range."""

    dtype: str
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed, validated safetensors header."""

    length: int  # bytes of JSON after the 8-byte length
    crc: int  # crc32c of those bytes
    tensors: dict[str, SafetensorsTensor]
    extra: dict[str, Any]  # the "__metadata__" values (strings unless parsed with string_metadata=False)


def header_length(head: bytes | bytearray | memoryview) -> int:
    """The JSON header's length from a file's first 8 bytes."""
    return LENGTH.unpack_from(head)[0]


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"name {k!r} appears twice")
        out[k] = v
    return out


def split_header(raw: bytes | bytearray | memoryview, where: str) -> dict[str, Any]:
    """The JSON object of a header (the bytes after the 8-byte length), names unique.

    Raises CorruptCheckpointError naming ``where``: not UTF-8 JSON, nested too deep, a name
    given twice, or not an object.
    """
    try:
        doc = json.loads(bytes(raw).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:  # RecursionError: nested deeper than any header
        why = exc if not isinstance(exc, RecursionError) else "nested too deep"
        raise CorruptCheckpointError(f"{where}: its safetensors header is not valid JSON ({why}); the file is "
                                     "damaged or not a safetensors file") from None
    if not isinstance(doc, dict):
        raise CorruptCheckpointError(f"{where}: its safetensors header is a JSON {type(doc).__name__}, not an object")
    return doc


def parse_header(raw: bytes | bytearray | memoryview, file_size: int, where: str, *,
                 string_metadata: bool = True) -> SafetensorsHeader:
    """Validate a safetensors header (the JSON after the 8-byte length) of a file of ``file_size`` bytes.

    Checks what safetensors itself checks before trusting a byte: JSON object, no repeated
    names, known dtypes, non-negative integer shapes, and ``data_offsets`` that match each
    tensor's size and tile the data area exactly. ``__metadata__`` must map names to strings
    (``string_metadata=False``: to any JSON values, as MindSpore's reader takes them).

    Raises CorruptCheckpointError (naming ``where`` and the tensor) for a damaged file,
    UnsupportedValueError for sub-byte dtypes.
    """
    doc = split_header(raw, where)
    data_start = HEAD + len(raw)
    data_len = file_size - data_start
    extra = doc.pop(METADATA_KEY, {})
    if not isinstance(extra, dict):
        raise CorruptCheckpointError(f"{where}: its safetensors header's {METADATA_KEY!r} is not an object")
    if string_metadata and not all(isinstance(v, str) for v in extra.values()):
        raise CorruptCheckpointError(f"{where}: its header's {METADATA_KEY!r} must map names to strings")
    tensors: dict[str, SafetensorsTensor] = {}
    spans: list[tuple[int, int, str]] = []
    for name, info in doc.items():
        at = f"{where}: tensor {name!r}"
        if not isinstance(info, dict):
            raise CorruptCheckpointError(f"{at}: its header entry must be an object, found {info!r:.80}")
        st = info.get("dtype")
        dtype = dtype_from_safetensors(st)
        if dtype is None:
            if st in _SUB_BYTE:
                raise UnsupportedValueError(f"{at} has the sub-byte dtype {st}, which cannot be loaded into a "
                                            "torch tensor; dequantize it with the tool that wrote it")
            raise CorruptCheckpointError(f"{at} has dtype {st!r:.40}, which is no safetensors dtype this reader "
                                         "knows")
        shape = info.get("shape")
        if (not isinstance(shape, list) or len(shape) > 64
                or not all(type(d) is int and d >= 0 for d in shape)):
            raise CorruptCheckpointError(f"{at}: shape must be a list of at most 64 sizes >= 0, found {shape!r:.80}")
        offs = info.get("data_offsets")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1]):
            raise CorruptCheckpointError(f"{at} has byte range {offs!r:.80}: data_offsets must be [begin, end] "
                                         "with 0 <= begin <= end")
        numel = math.prod(shape)
        if numel > 1 << 56:
            raise CorruptCheckpointError(f"{at}: shape {shape} is absurdly large")
        nbytes = numel * md.itemsize(dtype)
        if offs[1] - offs[0] != nbytes:
            raise CorruptCheckpointError(
                f"{at}: data_offsets {offs} span {offs[1] - offs[0]} bytes, but {st} shape {shape} needs "
                f"{nbytes}; the header lies about its data")
        tensors[name] = SafetensorsTensor(dtype, tuple(shape), data_start + offs[0], nbytes)
        spans.append((offs[0], offs[1], name))
    pos, prev = 0, None
    for begin, end, name in sorted(spans):
        if begin < pos:
            raise CorruptCheckpointError(f"{where}: tensor {name!r} (data bytes {begin}..{end}) overlaps tensor "
                                         f"{prev!r} (ends at {pos}); the header lies about its data")
        if begin > pos:
            raise CorruptCheckpointError(f"{where}: data bytes {pos}..{begin} before tensor {name!r} belong to no "
                                         "tensor; safetensors allows no holes, the header is damaged")
        pos, prev = end, name
    if pos > data_len:
        raise CorruptCheckpointError(
            f"{where} is truncated: its header places tensor data up to byte {data_start + pos}, the file has "
            f"{file_size} bytes")
    if pos < data_len:
        raise CorruptCheckpointError(
            f"{where}: {data_len - pos} bytes after the last tensor belong to no tensor (the header describes "
            f"{data_start + pos} bytes, the file has {file_size}); the file is damaged")
    return SafetensorsHeader(len(raw), crc32c.crc32c(raw), tensors, extra)


def read_header_bytes(source: ByteSource, name: str, where: str, max_bytes: int = MAX_HEADER_BYTES,
                      size: int | None = None) -> bytearray:
    """The JSON header of file ``name`` (two small reads), its length checked against the
    file's size (``size``, or asked of ``source``) and ``max_bytes``. Raises
    CorruptCheckpointError naming ``where``."""
    if size is None:
        size = source.file_size(name)
    if size < HEAD:
        raise CorruptCheckpointError(f"{where} is truncated: {size} bytes, too short for the 8 a safetensors file "
                                     "starts with")
    head = bytearray(HEAD)
    source.read_into(name, 0, memoryview(head))
    length = header_length(head)
    if length > max_bytes:
        raise CorruptCheckpointError(f"{where}: its header claims {length} bytes, more than safetensors allows "
                                     f"({max_bytes}); the file is damaged or not a safetensors file")
    if HEAD + length > size:
        raise CorruptCheckpointError(f"{where} is truncated: its header claims {length} bytes, the file has "
                                     f"{size} in all (too short for its header)")
    raw = bytearray(length)
    source.read_into(name, HEAD, memoryview(raw))
    return raw


def read_header(source: ByteSource, name: str, where: str, *, string_metadata: bool = True) -> SafetensorsHeader:
    """Read and validate file ``name``'s header through ``source`` (:func:`parse_header`)."""
    raw = read_header_bytes(source, name, where)
    return parse_header(raw, source.file_size(name), where, string_metadata=string_metadata)


class LocalFiles:
    """Byte ranges of files in a local directory, read with ``preadv`` from threads; symbolic
    links followed (the Hugging Face hub cache keeps every file of a snapshot as a link into
    its ``blobs`` directory). A missing file, or a directory where a file should be, is a
    CorruptCheckpointError naming it. ``bytes_read`` counts what was read.
    """

    def __init__(self, path: str):
        self.path = path
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                full = os.path.join(self.path, name)
                try:
                    fd = self._fds[name] = os.open(full, os.O_RDONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    raise CorruptCheckpointError(f"{full!r} is missing") from None
                except OSError as exc:
                    if exc.errno in (errno.EISDIR, errno.ENOTDIR):
                        raise CorruptCheckpointError(f"{full!r} is not a file") from None
                    raise
            return fd

    def file_size(self, name: str) -> int:
        return os.fstat(self._fd(name)).st_size

    def read_into(self, name: str, offset: int, buffer: Any) -> None:
        fd = self._fd(name)
        view = memoryview(buffer).cast("B")
        want = view.nbytes
        while view.nbytes:
            n = os.preadv(fd, [view], offset)
            if n == 0:
                raise CorruptCheckpointError(f"{os.path.join(self.path, name)!r} ends early: wanted {want} bytes "
                                             f"at offset {offset - (want - view.nbytes)}")
            view = view[n:]
            offset += n
        with self._lock:
            self.bytes_read += want

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def check_safetensors_file(path: str, *, string_metadata: bool = True) -> SafetensorsHeader:
    """Validate a local safetensors file's header (:func:`parse_header`) before the
    ``safetensors`` library opens it: its errors name neither the file nor the tensor."""
    files = LocalFiles(os.path.dirname(path) or ".")
    try:
        return read_header(files, os.path.basename(path), path, string_metadata=string_metadata)
    finally:
        files.close()
