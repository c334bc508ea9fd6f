"""Integrity check of a whole checkpoint, without a process group or a target model.

``verify_checkpoint`` re-reads every byte the metadata points at and checks, in order:
``.metadata`` parses and validates (including its own checksum); every data file exists,
is a plain file, its index passes its checksum, and its safetensors header parses and
agrees with the index and the metadata (entry names, dtypes, byte ranges, padding, no
holes); every chunk's crc32c blocks match; every tensor's chunks cover it exactly, and
every chunk is found where the metadata says (in each replica's file, and in earlier
steps' files for incremental checkpoints). Problems are collected, not raised, so one run
reports them all.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import crc32c

from ..backends.protocol import StorageReader
from ..backends.resolve import reader_for
from ..base.box import Box
from ..base.dtypes import itemsize, safetensors_dtype
from ..base.errors import CheckpointError, CorruptCheckpointError
from ..engine.commit import unreferenced_files
from ..engine.metadata_reader import metadata_bytes
from ..format import metadata as md
from ..format.chunks import all_chunks, covered
from ..format.data_file import INDEX_NAME, FileIndex, check_index, key_id
from ..format.safetensors import HEAD, METADATA_KEY, read_header_bytes, split_header


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
    header = _read_header(reader, name, size, problems)
    if header is None:
        return
    base = header.pop("__base__")
    header.pop(METADATA_KEY, None)
    for entry_name, rec in expected.items():
        info = header.get(entry_name)
        st_dtype = safetensors_dtype(dtypes[entry_name]) or "U8"
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
    reader = storage_reader or reader_for(path)
    report = VerifyReport(str(path or getattr(reader, "path", getattr(reader, "url", ""))))
    try:
        meta = md.Metadata.from_json(metadata_bytes(reader, report.path))
    except CheckpointError as exc:
        report.problems.append(str(exc))
        return report
    report.keys = len(meta.entries)
    if meta.version >= 2:
        try:
            _verify_v2(meta, reader, report, progress)
        finally:
            reader.close()
        return report
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
    report.unreferenced = unreferenced_files(reader, meta.file_names())
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


def _verify_v2(meta: md.Metadata, reader: StorageReader, report: VerifyReport,
               progress: Callable[[int], None] | None) -> None:
    size_of = {k: itemsize(e.dtype) for k, e in meta.entries.items() if e.kind != "object"}
    key_of = {key_id(k): k for k in size_of}
    expected: dict[str, dict[tuple[str, int], Box]] = {}  # file path -> chunks it may hold
    # each chunk, and the (file, chunk id) pairs of which one must hold it: a writer rank with
    # several files (thread_count > 1) holds a chunk in one of them, which the index tells
    needs: list[tuple[str, Box, list[tuple[str, int]]]] = []
    for key, entry in meta.entries.items():
        if entry.kind == "object":
            continue
        numel = math.prod(entry.shape or ())
        try:
            if covered(meta, entry) != numel:
                report.problems.append(f"{key!r}: chunks cover {covered(meta, entry)} of {numel} elements")
            refs = list(all_chunks(meta, entry))
        except CheckpointError as exc:
            report.problems.append(str(exc))
            continue
        if isinstance(entry.store, md.TableStore):  # every row is a chunk in its own file
            store = entry.store
            for i in range(len(store)):
                box = Box(tuple(store.offsets[i].tolist()), tuple(store.sizes[i].tolist()))
                path, sub = meta.files[int(store.file[i])].path, store.sub(i)
                expected.setdefault(path, {})[(key, sub)] = box
                needs.append((key, box, [(path, sub)]))
            continue
        for ref in refs:
            ranks: dict[tuple[str, int], list[tuple[str, int]]] = {}  # a holder rank's files, in order
            for f, sub in ref.candidates():
                ranks.setdefault((f.dir, f.rank), []).append((f.path, sub))
            if not ranks:
                report.problems.append(f"{key!r}: chunk {ref.box} has no data file listed for its writer")
            for group in list(ranks.values())[:None if _all_copies(entry) else 1]:
                for path, sub in group:
                    expected.setdefault(path, {})[(key, sub)] = ref.box
                needs.append((key, ref.box, group))
    report.unreferenced = unreferenced_files(reader, meta.file_names())
    report.files = len(meta.files)
    found_in: set[tuple[str, str, int]] = set()  # (file, key, chunk id) found in the file's index
    unreadable: set[str] = set()  # files already reported, whose chunks are not reported again
    for f in meta.files:
        unreadable.add(f.path)
        try:
            size = reader.file_size(f.path)
            if size != f.size:
                report.problems.append(f"{f.path}: {size} bytes, the metadata says {f.size}")
                continue
            raw = bytearray(f.index_length)
            reader.read_into(f.path, f.index_offset, memoryview(raw))
            check_index(raw, f.index_crc, f.path)
            index = FileIndex(raw, f.path, f.index_offset)
            header = _read_header(reader, f.path, size, report.problems)
        except (CheckpointError, OSError) as exc:
            report.problems.append(str(exc))
            continue
        unreadable.discard(f.path)
        want = expected.get(f.path, {})
        named: set[str] = set()
        for j in range(len(index)):
            key = key_of.get(int(index.ids[j]))
            sub = int(index.subs[j])
            box = want.get((key, sub)) if key is not None else None
            if box is None:
                if not f.dir:  # an earlier step's file also holds chunks that changed since
                    report.problems.append(f"{f.path}: index row {j} (key id {int(index.ids[j]):#x}, chunk "
                                           f"{sub}) is no chunk the metadata places in this file")
                continue
            found_in.add((f.path, key, sub))
            nbytes = box.numel * size_of[key]
            report.chunks += 1
            try:
                chunk = index.find(key, sub, box.sizes, nbytes)
            except CheckpointError as exc:  # its bytes lie outside the file: reported, not read
                report.problems.append(str(exc))
                continue
            name = f"{key}@{','.join(map(str, box.offsets))}"
            if header is not None:
                info = header.get(name)
                base = header["__base__"]
                st = safetensors_dtype(meta.entries[key].dtype)
                want_info = {"dtype": st or "U8", "shape": list(box.sizes) if st else [nbytes],
                             "data_offsets": [chunk.start - base, chunk.start - base + nbytes]}
                named.add(name)
                if info != want_info:
                    report.problems.append(f"{f.path}: safetensors entry {name!r} is {info!r:.200}, "
                                           f"expected {want_info}")
            _check_crcs(reader, f.path, key, box, chunk.start, nbytes, chunk.block_rows, chunk.crc32c, report,
                        progress)
        if header is not None and not f.dir:
            extra = sorted(k for k in header if k not in named and k not in ("__base__", "__metadata__", INDEX_NAME)
                           and not _PAD.match(k))
            if extra:
                report.problems.append(f"{f.path}: safetensors header has entries the index does not know: "
                                       f"{extra[:5]}")
            info = header.get("__metadata__")
            if not isinstance(info, dict) or info.get("format") != md.FORMAT_NAME:
                report.problems.append(f"{f.path}: safetensors header's __metadata__ is {info!r:.100}")
            _check_coverage_of_buffer(f.path, header, f.index_offset - header["__base__"],
                                      f.size - f.index_offset, report.problems)
    for key, box, group in needs:
        if any((path, key, sub) in found_in for path, sub in group) or any(p in unreadable for p, _ in group):
            continue
        if len(group) == 1:
            report.problems.append(f"{group[0][0]}: chunk {box} of {key!r} is missing from the file")
        else:
            report.problems.append(f"chunk {box} of {key!r} is missing from every file of its writer "
                                   f"({', '.join(p for p, _ in group)})")


_PAD = re.compile(r"^__pad\d+$")


def _all_copies(entry: md.Entry) -> bool:
    return isinstance(entry.store, md.GridStore) and entry.store.copies == "all"


def _read_header(reader: StorageReader, name: str, size: int, problems: list[str]) -> dict | None:
    try:
        raw = read_header_bytes(reader, name, name, max_bytes=512 << 20, size=size)
        header = split_header(raw, name)
    except CorruptCheckpointError as exc:
        problems.append(str(exc))
        return None
    header["__base__"] = HEAD + len(raw)
    return header


def _check_coverage_of_buffer(name: str, header: dict, index_rel: int, index_len: int, problems: list[str]) -> None:
    """Safetensors allows no holes: the entries must tile the byte buffer exactly."""
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items()
                   if k != "__base__" and isinstance(v, dict) and isinstance(v.get("data_offsets"), list))
    pos = 0
    for lo, hi in spans:
        if lo != pos:
            problems.append(f"{name}: the safetensors byte buffer has a gap or overlap at {pos}..{lo}")
            return
        pos = hi
    if pos != index_rel + index_len:
        problems.append(f"{name}: the safetensors entries end at {pos}, the file's data at {index_rel + index_len}")


def _check_crcs(reader: StorageReader, name: str, key: str, box: Box, start: int, nbytes: int, rows_per_block: int,
                crcs: tuple[int, ...], report: VerifyReport, progress: Callable[[int], None] | None) -> None:
    rows = box.sizes[0] if box.sizes else 1
    step = nbytes // max(1, rows) * rows_per_block if nbytes else 1
    for b, off in enumerate(range(0, nbytes, step)):
        buf = bytearray(min(step, nbytes - off))
        reader.read_into(name, start + off, memoryview(buf))
        if crc32c.crc32c(buf) != crcs[b]:
            report.problems.append(f"{key!r} in {name}: checksum mismatch in block {b} "
                                   f"(bytes {start + off}..{start + off + len(buf)}, chunk {box})")
        report.bytes_checked += len(buf)
        if progress:
            progress(len(buf))
