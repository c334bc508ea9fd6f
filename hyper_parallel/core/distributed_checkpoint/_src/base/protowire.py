"""The protobuf wire format, as much as MindSpore's files need: read and write, no dependency.

A protobuf message is a sequence of fields; each starts with a varint key
``field_number << 3 | wire_type``. Wire type 0 is a varint, 1 eight bytes, 5 four bytes, 2 a
varint length and that many bytes (a string, a nested message, or a packed run of varints).
Repeated fields simply repeat; concatenating two messages merges them. That is all.

Reading works on any buffer (``bytes``, ``memoryview``, ``mmap``) by offsets, so a caller can
walk the headers of a many-GiB file and remember where each payload lies without copying it.
Every length is checked against the end of its enclosing message before it is used.

Not here: schemas, groups (wire types 3/4, unused since proto2), unknown-field preservation.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

VARINT, I64, LEN, I32 = 0, 1, 2, 5
_MAX_VARINT_BYTES = 10


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message (truncated, or not protobuf at all)."""

    def __init__(self, msg: str, pos: int):
        super().__init__(msg)
        self.pos = pos


def read_varint(buf: Any, pos: int, end: int) -> tuple[int, int]:
    """The unsigned varint at ``pos`` and the position after it; raises WireError if cut at ``end``."""
    result = shift = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos + i >= end:
            raise WireError(f"varint at byte {pos} runs past the end of its message (byte {end})", pos)
        b = buf[pos + i]
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos + i + 1
        shift += 7
    raise WireError(f"varint at byte {pos} is longer than {_MAX_VARINT_BYTES} bytes", pos)


def as_signed(v: int, bits: int = 64) -> int:
    """A varint read back as the two's complement int protobuf's int32/int64 encode."""
    v &= (1 << 64) - 1
    if v >= 1 << 63:
        v -= 1 << 64
    if bits == 32 and not -(1 << 31) <= v < 1 << 31:
        raise ValueError(f"{v} does not fit an int32")
    return v


def fields(buf: Any, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Each field of the message in ``buf[start:end]`` as ``(number, wire_type, a, b)``.

    For VARINT ``a`` is the value (``b`` unused); for LEN, I64 and I32 the payload is
    ``buf[a:b]``. Raises WireError on a truncated field or an unknown wire type.
    """
    pos = start
    while pos < end:
        key_pos = pos
        key, pos = read_varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError(f"field number 0 at byte {key_pos}", key_pos)
        if wire == VARINT:
            value, pos = read_varint(buf, pos, end)
            yield number, wire, value, 0
        elif wire == LEN:
            n, pos = read_varint(buf, pos, end)
            if n > end - pos:
                raise WireError(f"field {number} at byte {key_pos} says {n} bytes, only {end - pos} remain "
                                f"in its message", key_pos)
            yield number, wire, pos, pos + n
            pos += n
        elif wire in (I64, I32):
            n = 8 if wire == I64 else 4
            if n > end - pos:
                raise WireError(f"field {number} at byte {key_pos} is cut short", key_pos)
            yield number, wire, pos, pos + n
            pos += n
        else:
            raise WireError(f"wire type {wire} (field {number}) at byte {key_pos} is not one protobuf uses "
                            "for this data", key_pos)


def repeated_varints(buf: Any, wire: int, a: int, b: int) -> list[int]:
    """The values of one occurrence of a repeated integer field: unpacked (one) or packed (a run)."""
    if wire == VARINT:
        return [a]
    if wire != LEN:
        raise WireError(f"an integer field has wire type {wire}", a)
    out, pos = [], a
    while pos < b:
        v, pos = read_varint(buf, pos, b)
        out.append(v)
    return out


def text(buf: Any, a: int, b: int) -> str:
    """A string field's payload, decoded as UTF-8 (raises WireError when it is not)."""
    try:
        return bytes(buf[a:b]).decode("utf-8")
    except UnicodeDecodeError:
        raise WireError(f"string at byte {a} is not UTF-8", a) from None


# ---------------------------------------------------------------------------- writing


def varint(v: int) -> bytes:
    """The varint bytes of ``v``; negative ints become their 64-bit two's complement (10 bytes)."""
    if v < 0:
        v += 1 << 64
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def key(number: int, wire: int) -> bytes:
    return varint(number << 3 | wire)


def int_field(number: int, v: int) -> bytes:
    return key(number, VARINT) + varint(v)


def len_header(number: int, n: int) -> bytes:
    """Key and length of a LEN field whose ``n`` payload bytes the caller writes next."""
    return key(number, LEN) + varint(n)


def len_field(number: int, payload: bytes) -> bytes:
    return len_header(number, len(payload)) + payload


def str_field(number: int, s: str) -> bytes:
    return len_field(number, s.encode("utf-8"))


def repeated_ints(number: int, values: list[int]) -> bytes:
    """A repeated integer field, unpacked (one key per value), as proto2 writes it by default."""
    return b"".join(int_field(number, v) for v in values)
