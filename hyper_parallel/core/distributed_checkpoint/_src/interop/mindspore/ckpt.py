"""MindSpore ``..ckpt`` files: the protobuf dialect, read (indexed without copying) and written.

A ``..ckpt`` is a run of ``Checkpoint`` messages, each holding one ``Value {tag: name,
tensor: TensorProto {dims, tensor_type, tensor_content}}``; a tensor above SLICE_BYTES is
several consecutive messages of one name. ``crc_check=True`` appends ``b"crc_num"`` and a
crc32. Encrypted files are refused. See :mod:`.checkpoints` for the whole picture.

Not here: the protobuf wire format (:mod:`...base.protowire`), the file model (:mod:`.file_model`).
"""

from __future__ import annotations

import mmap
import struct
import zlib
from collections.abc import Callable
from typing import Any

from ...base import protowire as pw
from ...base.errors import CorruptCheckpointError, UnsupportedValueError
from ...format import metadata as md
from .file_model import _TO_MS, STR, MindSporeFile, TensorInfo, _check_dims, _crc_range, _numel, _our_dtype

SLICE_BYTES = 512 * 1024 * 1024  # MindSpore's SLICE_SIZE (512 * 1024 KiB): bytes per message
CRC_TRAILER = b"crc_num"
_ENCRYPTED = {0x7F3A5ED8: "AES-GCM", 0x7F3A5ED9: "AES-CBC"}  # first 4 bytes, little-endian


def _name_in_cut_message(mm: Any, pos: int, end: int) -> str | None:
    """The tag of the Checkpoint.value message starting at ``pos`` when only its length is wrong."""
    try:
        _, p = pw.read_varint(mm, pos, end)
        _, p = pw.read_varint(mm, p, end)
        key, p = pw.read_varint(mm, p, end)
        n, p = pw.read_varint(mm, p, end)
        return pw.text(mm, p, p + n) if key == (1 << 3 | pw.LEN) and p + n <= end else None
    except ValueError:
        return None


class _Ckpt(MindSporeFile):
    kind = "ckpt"

    def __init__(self, path: str, fd: int, mm: mmap.mmap, verify: bool):
        super().__init__(path, fd)
        size = len(mm)
        end = size
        magic = struct.unpack("<I", mm[:4])[0] if size >= 4 else None
        if magic in _ENCRYPTED:
            raise UnsupportedValueError(
                f"{path} is an encrypted MindSpore checkpoint ({_ENCRYPTED[magic]}); decrypt it with MindSpore "
                "first: mindspore.save_checkpoint(mindspore.load_checkpoint(path, dec_key=KEY, "
                "dec_mode=MODE), 'plain.ckpt'), then import the plain file")
        if size >= 17 and mm[size - 17:size - 10] == CRC_TRAILER:
            end = size - 17
            if verify:
                stored = int.from_bytes(mm[size - 10:size], "big")
                actual = _crc_range(self, 0, end)
                if actual != stored:
                    raise CorruptCheckpointError(
                        f"{path}: crc32 of the data is {actual:#010x}, the file's crc_num trailer says "
                        f"{stored:#010x}; the file is damaged")
        if end and mm[0] != 0x0A:
            raise CorruptCheckpointError(f"{path}: not a MindSpore .ckpt (it starts with byte {mm[0]:#04x}, a "
                                         "checkpoint with 0x0a) and not a safetensors file")
        self._index(mm, end)

    def _index(self, mm: mmap.mmap, end: int) -> None:
        path = self.path
        last: str | None = None
        name: str | None = None  # of the message being read; None between messages
        try:
            for num, wire, a, b in pw.fields(mm, 0, end):
                if num != 1 or wire != pw.LEN:
                    raise pw.WireError(f"field {num} (wire type {wire}) where a Checkpoint.value is expected", a)
                name, tensor, is_map = None, None, False
                for n2, w2, x, y in pw.fields(mm, a, b):
                    if n2 == 1 and w2 == pw.LEN:
                        name = pw.text(mm, x, y)
                    elif n2 == 2 and w2 == pw.LEN:
                        tensor = (x, y)
                    elif n2 == 3:
                        is_map = True
                if name is None:
                    raise pw.WireError("a value without its tag (name)", a)
                if is_map:
                    raise UnsupportedValueError(
                        f"{path}: {name!r} is a MindSpore MapParameter (a key-value embedding table), which has "
                        "no torch counterpart; export it as tensors with MindSpore first")
                if tensor is None:
                    raise pw.WireError(f"value {name!r} holds no tensor", a)
                dims: list[int] = []
                ms_type, content = None, (b, b)  # no tensor_content: no bytes
                for n3, w3, x, y in pw.fields(mm, *tensor):
                    if n3 == 1:
                        dims.extend(pw.as_signed(v) for v in pw.repeated_varints(mm, w3, x, y))
                    elif n3 == 2 and w3 == pw.LEN:
                        ms_type = pw.text(mm, x, y)
                    elif n3 == 3 and w3 == pw.LEN:
                        content = (x, y)
                if ms_type is None:
                    raise pw.WireError(f"tensor {name!r} has no tensor_type", a)
                _check_dims(dims, name, path)
                if name == last:
                    info = self.tensors[name]
                    if (info.dtype != _our_dtype(ms_type, name, path)) or info.shape != tuple(dims):
                        raise CorruptCheckpointError(
                            f"{path}: the messages of tensor {name!r} disagree: {info.shape} vs {tuple(dims)}, "
                            f"dtype {info.dtype} vs {ms_type}")
                    info.pieces.append(content)
                    name = None
                    continue
                if name in self.tensors:
                    raise CorruptCheckpointError(
                        f"{path}: tensor {name!r} appears twice, apart (again at byte {a}); MindSpore keeps "
                        "only the last of such values: rewrite the file with unique names")
                if last is not None:
                    self._finish(last)
                self.tensors[name] = TensorInfo(name, _our_dtype(ms_type, name, path), tuple(dims), [content])
                last, name = name, None
        except pw.WireError as exc:
            # a message cut short fails on its length before its name is read: read the name anyway
            cut = name or _name_in_cut_message(mm, exc.pos, end)
            where = f" in tensor {cut!r}" if cut else f" after tensor {last!r}" if last else ""
            raise CorruptCheckpointError(
                f"{path}: truncated or not a MindSpore checkpoint{where}: {exc}") from None
        if last is not None:
            self._finish(last)

    def _finish(self, name: str) -> None:
        info = self.tensors[name]
        if info.dtype == STR:
            info.shape = ()
            return
        item = md.itemsize(info.dtype)
        have = info.nbytes
        if info.shape == (0,) and have == item:  # MindSpore reads dims [0] as a 0-d value
            info.shape = ()
        want = _numel(info.shape) * item
        if have != want:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {name!r} ({info.dtype} {list(info.shape)}) needs {want} bytes, its "
                f"{len(info.pieces)} message(s) hold {have}; the file is truncated or a slice message is missing")


def _ckpt_message(name: str, ms_type: str, dims: list[int], n: int) -> bytes:
    """The protobuf bytes of one ``Checkpoint`` message up to its ``n`` content bytes, which follow."""
    tensor = pw.repeated_ints(1, dims) + pw.str_field(2, ms_type) + pw.len_header(3, n)
    value = pw.str_field(1, name) + pw.len_header(2, len(tensor) + n)
    return pw.len_header(1, len(value) + len(tensor) + n) + value + tensor


def write_ckpt(out: Any, plan: list, data: Callable, crc_on: bool,
                wrote: Callable[[int], None]) -> None:
    crc = 0

    def write(b: Any) -> None:
        nonlocal crc
        out.write(b)
        if crc_on:
            crc = zlib.crc32(b, crc)

    for name, dtype, shape, entry, value in plan:
        raw = data(entry, value)
        ms_type = STR if dtype == STR else _TO_MS[dtype]
        dims = [0] if dtype == STR else list(shape)
        for off in range(0, max(raw.nbytes, 1), SLICE_BYTES):  # an empty tensor still gets its message
            piece = raw[off:off + SLICE_BYTES]
            write(_ckpt_message(name, ms_type, dims, piece.nbytes))
            write(piece)
        wrote(raw.nbytes)
        del raw, piece  # free this tensor before reading the next: one tensor in memory
    if crc_on:
        out.write(CRC_TRAILER + crc.to_bytes(10, "big"))
