"""crc32c of many equal-length byte rows at once (the checksums of thousands of tiny chunks).

A reshard to tens of thousands of ranks writes millions of chunks of a few bytes each; one
``crc32c.crc32c`` call per chunk costs more in call overhead than in checksumming. For
short rows this computes every row's CRC-32C (Castagnoli, the ``crc32c`` package's value)
with numpy, two bytes of every row per step (a 64 Ki-entry table); longer rows go to the native
function one by one, where the call overhead is amortised.
"""

from __future__ import annotations

import crc32c
import numpy as np

VECTOR_MAX_ROW = 64  # rows up to this many bytes: numpy across rows beats a native call per row


def _table() -> np.ndarray:
    poly = 0x82F63B78  # CRC-32C, reflected
    t = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        t = np.where(t & 1, (t >> 1) ^ np.uint32(poly), t >> 1).astype(np.uint32)
    return t


_TABLE = _table()


def _table16() -> np.ndarray:
    """Two bytes per step: entry ``v`` is the register after feeding the 16 bits of ``v``
    (low byte first) to a zero register (two byte steps of ``_TABLE`` folded into one)."""
    v = np.arange(1 << 16, dtype=np.uint32)
    first = _TABLE[v & 0xFF]
    return (_TABLE[(first & 0xFF) ^ (v >> 8)] ^ (first >> 8)).astype(np.uint32)


_TABLE16 = _table16()


def row_crc32c(rows: np.ndarray) -> np.ndarray:
    """CRC-32C of each row of a 2-d ``uint8`` array, as ``uint32[len(rows)]``."""
    if rows.ndim != 2 or rows.dtype != np.uint8:
        raise ValueError(f"row_crc32c needs a 2-d uint8 array, found {rows.dtype} of {rows.ndim} dims")
    n, width = rows.shape
    if width > VECTOR_MAX_ROW:
        return np.fromiter((crc32c.crc32c(r) for r in np.ascontiguousarray(rows)), dtype=np.uint32, count=n)
    crc = np.full(n, 0xFFFFFFFF, dtype=np.uint32)
    j = 0
    if width % 2:  # an odd first byte, then two bytes at a time
        crc = _TABLE[(crc ^ rows[:, 0]) & 0xFF] ^ (crc >> 8)
        j = 1
    if width > j:
        words = np.ascontiguousarray(rows[:, j:]).view("<u2")
        for k in range(words.shape[1]):
            crc = _TABLE16[(crc ^ words[:, k]) & 0xFFFF] ^ (crc >> 16)
    return crc ^ np.uint32(0xFFFFFFFF)
