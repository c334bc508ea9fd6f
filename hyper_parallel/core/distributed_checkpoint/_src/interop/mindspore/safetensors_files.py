"""MindSpore safetensors files: plain safetensors with ``{"format": "ms"}`` metadata and,
with ``crc_check=True``, a ``crc_num``: the crc32 over each tensor's name and bytes, in name
order. Read through the one safetensors parser; written in MindSpore's order, byte for byte.

Not here: the safetensors format itself (:mod:`...format.safetensors`).
"""

from __future__ import annotations

import mmap
import zlib
from collections.abc import Callable
from typing import Any

from ...base.errors import CorruptCheckpointError, UnsupportedValueError
from ...format.safetensors import HEAD, METADATA_KEY, contiguous_header, encode_header, header_length, parse_header
from .file_model import MindSporeFile, TensorInfo, _crc_range


class _Safetensors(MindSporeFile):
    kind = "safetensors"

    def __init__(self, path: str, fd: int, mm: mmap.mmap, verify: bool):
        super().__init__(path, fd)
        n = header_length(mm[:HEAD])
        if n > len(mm) - HEAD:
            raise CorruptCheckpointError(f"{path}: safetensors header of {n} bytes runs past the file "
                                         f"({len(mm)} bytes)")
        # MindSpore's crc_num may be any JSON value: it is compared as a number below
        header = parse_header(mm[HEAD:HEAD + n], len(mm), path, string_metadata=False)
        meta = header.extra
        for name, t in header.tensors.items():
            if meta.get(name) == "Int4":
                raise UnsupportedValueError(f"{path}: tensor {name!r} is MindSpore's packed 4-bit qint4x2, which has "
                                            "no torch dtype")
            self.tensors[name] = TensorInfo(name, t.dtype, t.shape, [(t.start, t.start + t.nbytes)])
        if verify and "crc_num" in meta:
            crc = 0
            for name in sorted(self.tensors):
                crc = zlib.crc32(name.encode(), crc)
                for a, b in self.tensors[name].pieces:
                    crc = _crc_range(self, a, b, crc)
            if crc != _int_or_none(meta["crc_num"]):
                raise CorruptCheckpointError(f"{path}: crc32 of the tensors is {crc}, the file's crc_num says "
                                             f"{meta['crc_num']}; the file is damaged")


def _int_or_none(v: Any) -> int | None:
    try:
        return int(v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(float("inf"))
        return None


def write_safetensors(out: Any, plan: list, data: Callable, crc_on: bool,
                wrote: Callable[[int], None]) -> None:
    # MindSpore writes names in sorted order and checksums them in that order; the crc is
    # only known at the end, so the header reserves ten digits (int() reads leading zeros).
    plan = sorted(plan, key=lambda p: p[0])
    header = contiguous_header([(name, dtype, shape) for name, dtype, shape, _, _ in plan],
                               {"format": "ms", **({"crc_num": "0" * 10} if crc_on else {})})
    head = encode_header(header)
    out.write(head)
    crc = 0
    for name, _, _, entry, value in plan:
        raw = data(entry, value)
        out.write(raw)
        if crc_on:
            crc = zlib.crc32(raw, zlib.crc32(name.encode(), crc))
        wrote(raw.nbytes)
        del raw
    if crc_on:
        header[METADATA_KEY]["crc_num"] = f"{crc:010d}"
        final = encode_header(header)
        assert len(final) == len(head)
        out.seek(0)
        out.write(final)
