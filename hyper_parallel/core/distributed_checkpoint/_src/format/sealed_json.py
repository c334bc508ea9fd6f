"""A JSON document that carries its own checksum as its last member, ``"crc32c"``.

``.metadata`` is written this way (:mod:`.metadata`): the checksum covers every byte before
it, so any flipped byte of the document is detected before anything in it is trusted.
Bytes and checksums only; what the document says is the caller's.
"""

from __future__ import annotations

import json
from typing import Any

import crc32c

from ..base.errors import MetadataError

_CRC_MEMBER = b',"crc32c":'


def seal_json(doc: dict[str, Any]) -> bytes:
    """Serialise ``doc`` with its own checksum as the last member (``crc32c``)."""
    doc = {k: v for k, v in doc.items() if k != "crc32c"}
    body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
    return body[:-1] + _CRC_MEMBER + b"%d}" % crc32c.crc32c(body)


def check_seal(raw: bytes, doc: dict, where: str) -> None:
    """Check that ``raw`` (which parsed as ``doc``) is sealed and its checksum matches; raises
    MetadataError naming ``where``."""
    cut = raw.rfind(_CRC_MEMBER)
    expected = doc.get("crc32c")
    if cut < 0 or type(expected) is not int:
        raise MetadataError(f"{where} has no checksum member 'crc32c'; it is corrupt or truncated")
    got = crc32c.crc32c(raw[:cut] + b"}")
    if got != expected:
        raise MetadataError(
            f"{where} is corrupt: its checksum is {expected:#010x} but its bytes give {got:#010x}"
        )
