"""Integrity check of a whole checkpoint, without a process group or a target model.

``verify_checkpoint`` re-reads every byte the metadata points at and checks, in order:
``.metadata`` parses and validates (including its own checksum); every data file exists,
is a plain file, and its safetensors header parses and agrees with the metadata (entry
names, dtypes, shapes, byte ranges); every chunk's crc32c blocks match; and every tensor's
chunks cover it exactly. Problems are collected, not raised, so one run reports them all.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c

from . import metadata as md
from .box import Box
from .commit import unreferenced_files
from .errors import CheckpointError
from .filesystem_storage import FileSystemReader
from .storage import StorageReader


@dataclass
class VerifyReport:
    """What ``verify_checkpoint`` found: problems (empty when the checkpoint is sound)."""

    path: str
    keys: int = 0
    files: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    unreferenced: list[str] = field(default_factory=list)  # debris of failed saves: `hyper-dcp gc` removes it

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"path": self.path, "ok": self.ok, "keys": self.keys, "files": self.files,
                "chunks": self.chunks, "bytes_checked": self.bytes_checked, "problems": self.problems,
                "unreferenced": self.unreferenced}


def _check_header(reader: StorageReader, name: str, size: int, expected: dict[str, md.ChunkRecord],
                  dtypes: dict[str, str], problems: list[str]) -> None:
    if size < 8:
        problems.append(f"{name}: {size} bytes is too short for a safetensors file")
        return
    head = bytearray(8)
    reader.read_into(name, 0, memoryview(head))
    (hlen,) = struct.unpack("<Q", head)
    if hlen > size - 8 or hlen > 512 << 20:
        problems.append(f"{name}: safetensors header length {hlen} exceeds the file ({size} bytes)")
        return
    raw = bytearray(hlen)
    reader.read_into(name, 8, memoryview(raw))
    try:
        header = json.loads(raw)
    except ValueError as exc:
        problems.append(f"{name}: safetensors header is not valid JSON ({exc})")
        return
    base = 8 + hlen
    header.pop("__metadata__", None)
    for entry_name, rec in expected.items():
        info = header.get(entry_name)
        st_dtype = md.safetensors_dtype(dtypes[entry_name]) or "U8"
        want = {"dtype": st_dtype, "data_offsets": [rec.start - base, rec.start - base + rec.length]}
        if not isinstance(info, dict) or any(info.get(k) != v for k, v in want.items()):
            problems.append(f"{name}: safetensors entry {entry_name!r} is {info!r:.200}, expected {want}")
    extra = set(header) - set(expected)
    if extra:
        problems.append(f"{name}: safetensors header has entries the metadata does not know: {sorted(extra)[:5]}")


def verify_checkpoint(
    path: str | os.PathLike | None = None,
    *,
    storage_reader: StorageReader | None = None,
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Check every byte of a checkpoint; return a report listing every problem found.

    Args:
        path: the checkpoint directory (or give ``storage_reader``).
        progress: called with the number of bytes checked after each block.

    Example::

        report = verify_checkpoint("/ckpt/step100")
        assert report.ok, report.problems
    """
    reader = storage_reader or FileSystemReader(path)
    report = VerifyReport(str(path or getattr(reader, "path", getattr(reader, "url", ""))))
    try:
        meta = md.Metadata.from_json(reader.read_metadata())
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    report.keys = len(meta.entries)
    by_file: dict[str, dict[str, md.ChunkRecord]] = {}
    dtypes: dict[str, str] = {}
    for key, entry in meta.entries.items():
        covered = sum(math.prod(g[0].sizes) for g in md.replicas(entry.chunks))
        for c in entry.chunks:
            name = f"{key}@{','.join(map(str, c.offsets))}"
            by_file.setdefault(c.file, {})[name] = c
            dtypes[name] = entry.dtype
        if entry.kind != "object" and covered != math.prod(entry.shape or ()):
            report.problems.append(
                f"{key!r}: chunks cover {covered} of {math.prod(entry.shape or ())} elements")
    report.files = len(by_file)
    report.unreferenced = unreferenced_files(reader, meta.files)
    try:
        for name, records in sorted(by_file.items()):
            try:
                size = reader.file_size(name)
                _check_header(reader, name, size, records, dtypes, report.problems)
            except (CheckpointError, OSError) as exc:
                report.problems.append(str(exc))
                continue
            for entry_name, c in records.items():
                report.chunks += 1
                if c.start + c.length > size:
                    report.problems.append(f"{entry_name!r} in {name}: bytes {c.start}..{c.start + c.length} "
                                           f"lie beyond the end of the file ({size} bytes)")
                    continue
                step = c.length // c.rows * c.block_rows
                for b, off in enumerate(range(0, c.length, step)):
                    buf = bytearray(min(step, c.length - off))
                    reader.read_into(name, c.start + off, memoryview(buf))
                    if crc32c.crc32c(buf) != c.crc32c[b]:
                        report.problems.append(
                            f"{entry_name!r} in {name}: checksum mismatch in block {b} "
                            f"(bytes {c.start + off}..{c.start + off + len(buf)}, chunk {Box(c.offsets, c.sizes)})")
                    report.bytes_checked += len(buf)
                    if progress:
                        progress(len(buf))
    finally:
        reader.close()
    return report
