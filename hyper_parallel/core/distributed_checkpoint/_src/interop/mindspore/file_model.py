"""The MindSpore file model: dtype names, the index of a file's values, reading them.

:class:`MindSporeFile` is an open ``..ckpt`` or MindSpore safetensors file (the dialects:
:mod:`.ckpt`, :mod:`.safetensors_files`): each value's dtype, shape and the
byte ranges holding it, read with ``pread`` straight into a new tensor.

Not here: parsing either dialect, importing or exporting (:mod:`.checkpoints`).
"""

from __future__ import annotations

import math
import os
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ...base.errors import CorruptCheckpointError, MetadataError, UnsupportedValueError
from ...format import metadata as md

# MindSpore's tensor_type name -> our dtype name (metadata.py's names)
MS_DTYPES = {
    "Float64": "float64", "Float32": "float32", "Float16": "float16", "BFloat16": "bfloat16",
    "Int64": "int64", "Int32": "int32", "Int16": "int16", "Int8": "int8",
    "UInt64": "uint64", "UInt32": "uint32", "UInt16": "uint16", "UInt8": "uint8", "Bool": "bool",
}
_TO_MS = {v: k for k, v in MS_DTYPES.items()}
STR = "str"  # MindSpore's tensor_type for a string value
_CRC_CHUNK = 16 << 20


@dataclass
class TensorInfo:
    """One named value of a MindSpore file: our dtype name (or ``"str"``), shape, byte ranges."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[tuple[int, int]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.pieces)


class MindSporeFile:
    """An open MindSpore ``..ckpt`` or safetensors file: its index, and each value on demand.

    Use :func:`open_mindspore_file`. ``tensors`` keeps the file's order. Values are read with
    ``pread`` straight into the new tensor (one copy, no mapping kept). Close it (or use it as
    a context manager).
    """

    kind = "?"

    def __init__(self, path: str, fd: int):
        self.path = path
        self._fd = fd
        self.tensors: dict[str, TensorInfo] = {}

    def _pread_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < view.nbytes:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n <= 0:
                raise CorruptCheckpointError(f"{self.path}: the file ended at byte {offset + done} while reading; "
                                             "it was truncated after it was opened")
            done += n

    def read(self, name: str) -> torch.Tensor | str:
        """The value called ``name``: a new CPU tensor, or a ``str``."""
        info = self.tensors[name]
        if info.dtype == STR:
            raw = bytearray(info.nbytes)
            pos = 0
            for a, b in info.pieces:
                self._pread_into(memoryview(raw)[pos:pos + b - a], a)
                pos += b - a
            try:
                return raw.decode("utf-32-le").rstrip("\x00")
            except UnicodeDecodeError as exc:
                raise CorruptCheckpointError(
                    f"{self.path}: the string value {name!r} is not UTF-32 text ({exc.reason} at byte {exc.start} "
                    f"of its {len(raw)}); the file is damaged") from None
        out = torch.empty(info.shape, dtype=md.torch_dtype(info.dtype))
        if out.numel():
            view = memoryview(out.reshape(-1).view(torch.uint8).numpy()).cast("B")
            pos = 0
            for a, b in info.pieces:
                self._pread_into(view[pos:pos + b - a], a)
                pos += b - a
        return out

    def digest(self, name: str) -> int:
        """crc32 of the value's bytes (to compare copies of it across files)."""
        crc = 0
        for a, b in self.tensors[name].pieces:
            crc = _crc_range(self, a, b, crc)
        return crc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> MindSporeFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _crc_range(f: MindSporeFile, a: int, b: int, crc: int = 0) -> int:
    """crc32 of bytes ``[a, b)`` of the file, read in bounded chunks."""
    buf = memoryview(bytearray(min(_CRC_CHUNK, max(b - a, 0))))
    while a < b:
        n = min(b - a, buf.nbytes)
        f._pread_into(buf[:n], a)
        crc = zlib.crc32(buf[:n], crc)
        a += n
    return crc


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _check_dims(dims: Any, name: str, path: str) -> tuple[int, ...]:
    """The shape of a tensor of the file, refused unless our checkpoints can hold it (no
    negative dim, at most 64 dims and 2**56 elements), before anything allocates or imports it."""
    try:
        return md.check_shape(dims, f"{path}: tensor {name!r}")
    except MetadataError as exc:
        raise CorruptCheckpointError(f"{exc}; the file is damaged") from None


def _our_dtype(ms_type: str, name: str, path: str) -> str:
    if ms_type == STR:
        return STR
    try:
        return MS_DTYPES[ms_type]
    except KeyError:
        hint = " (MindSpore's packed 4-bit qint4x2 has no torch dtype)" if ms_type == "Int4" else ""
        raise UnsupportedValueError(
            f"{path}: tensor {name!r} has MindSpore dtype {ms_type!r}{hint}; this importer reads "
            f"{sorted(MS_DTYPES) + [STR]}") from None
