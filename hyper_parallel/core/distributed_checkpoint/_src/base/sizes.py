"""Byte sizes written by people: ``"5GB"``, ``"512MiB"``, or a number of bytes.

Not here: the limits of the format (:mod:`.limits`) or any default size.
"""

from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(size: int | str) -> int:
    """``"5GB"`` -> 5_000_000_000; ``"512MiB"`` -> 536870912; ints pass through."""
    if isinstance(size, int):
        return size
    m = _SIZE.match(size)
    if not m:
        raise ValueError(f"cannot read size {size!r}; use e.g. 5GB, 512MiB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
