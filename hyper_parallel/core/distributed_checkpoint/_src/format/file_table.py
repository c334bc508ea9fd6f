"""The file table of ``.metadata``: every data file a checkpoint reads, as rows (v2) or columns (v3).

A row per file (version 2) costs about 85 bytes of JSON, most of it the name
(``data-r00042-0-<32 hex>.safetensors``): 5.5 MiB at 65,536 ranks. Version 3 writes the same
records as columns, and a name as the rule that made it: ``data-r<rank:05d>-<n>-<save id>``
from the file's rank, its ``n`` and one of a short list of save ids, with the names the rule
does not give listed apart. About 40 bytes a file::

    "files": {"count": 65536, "save_ids": ["3f2a..."],
              "n": {"all": 0}, "save_id": {"all": 0}, "names": {},
              "dir": {"all": 0}, "rank": [0, 1, ...], "index_offset": [...],
              "index_length": [...], "index_crc32c": [...], "size": [...]}

A column is a list of ``count`` integers, or ``{"all": v}`` when every file has ``v``. A
file's ``n`` is -1 when ``names`` (``{"<row>": name}``) gives its name. Tables of at least
:data:`COLUMNAR_FILES` files are written as columns (and the document says version 3); shorter
ones stay rows, which earlier releases read. Both are checked the same way: the columns are
turned into rows and checked column by column (:func:`parse_rows`).
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Any

from ..base.errors import MetadataError
from ..base.limits import MAX_WORLD
from .validation import check_int, plain_file_names, validate_file_name

__all__ = ["FileRecord", "data_file_name", "COLUMNAR_FILES", "encode_rows", "encode_columns", "parse_rows",
           "parse_columns"]

COLUMNAR_FILES = 1024
"""File tables this long are written as columns (format version 3)."""

MAX_FILES = 1 << 24  # a bound on "count", checked before any column is read
_RULE = re.compile(r"data-r(\d{5,})-(\d+)-([0-9a-f]{1,64})\.safetensors")
_COLUMNS = ("dir", "rank", "index_offset", "index_length", "index_crc32c", "size")


@dataclass(frozen=True)
class FileRecord:
    """A data file: where it is, who wrote it, and where its index is (format v2).

    ``dir`` is "" for this checkpoint's directory, else the name of an earlier step's
    directory beside it (incremental checkpoints). v1 files have no index (offsets 0).
    """

    name: str
    dir: str = ""
    rank: int = -1
    index_offset: int = 0
    index_length: int = 0
    index_crc: int = 0
    size: int = 0

    @property
    def path(self) -> str:
        """The name storage readers open: a plain name, or ``../<dir>/<name>``."""
        return self.name if not self.dir else f"../{self.dir}/{self.name}"


def data_file_name(rank: int, index: int, save_id: str) -> str:
    """What a writer calls the ``index``-th data file of ``rank`` in save ``save_id``."""
    return f"data-r{rank:05d}-{index}-{save_id}.safetensors"


# ---------------------------------------------------------------------------- writing


def encode_rows(files: list[FileRecord], dirs: list[str]) -> list[list]:
    """The version 2 table: ``[name, dir index, rank, index offset, index length, index crc32c, size]``."""
    index = {d: i for i, d in enumerate(dirs)}
    return [[f.name, index[f.dir], f.rank, f.index_offset, f.index_length, f.index_crc, f.size] for f in files]


def _column(values: list[int]) -> list[int] | dict[str, int]:
    return {"all": values[0]} if values and values.count(values[0]) == len(values) else values


def encode_columns(files: list[FileRecord], dirs: list[str]) -> dict[str, Any]:
    """The version 3 table (see the module docstring)."""
    save_ids: dict[str, int] = {}
    ns, sids, names = [], [], {}
    for row, f in enumerate(files):
        m = _RULE.fullmatch(f.name)
        if m is not None and f.rank >= 0 and data_file_name(f.rank, int(m[2]), m[3]) == f.name:
            ns.append(int(m[2]))
            sids.append(save_ids.setdefault(m[3], len(save_ids)))
        else:
            ns.append(-1)
            sids.append(0)
            names[str(row)] = f.name
    index = {d: i for i, d in enumerate(dirs)}
    cols = {"dir": [index[f.dir] for f in files], "rank": [f.rank for f in files],
            "index_offset": [f.index_offset for f in files], "index_length": [f.index_length for f in files],
            "index_crc32c": [f.index_crc for f in files], "size": [f.size for f in files]}
    return {"count": len(files), "save_ids": list(save_ids), "n": _column(ns), "save_id": _column(sids),
            "names": names, **{k: _column(v) for k, v in cols.items()}}


# ---------------------------------------------------------------------------- reading


def parse_rows(raw: Any, dirs: list[str], where: str) -> list[FileRecord]:
    """The version 2 table, every field checked; MetadataError names ``where`` and the file."""
    if not isinstance(raw, list):
        raise MetadataError(f"{where}: 'files' must be a list of file records")
    out = _rows_checked_at_once(raw, dirs)
    if out is None:  # something is wrong: the record by record checks say what
        out = [_parse_row(f, dirs, where) for f in raw]
    if len({(f.dir, f.name) for f in out}) != len(out):
        raise MetadataError(f"{where}: 'files' lists a file twice")
    return out


def parse_columns(raw: Any, dirs: list[str], where: str) -> list[FileRecord]:
    """The version 3 table, turned into rows and checked as :func:`parse_rows` checks them."""
    if not isinstance(raw, dict):
        raise MetadataError(f"{where}: 'files' must be an object of columns (format version 3)")
    count = check_int(raw.get("count"), where, None, "'files' count", hi=MAX_FILES)
    save_ids = raw.get("save_ids")
    if not isinstance(save_ids, list) or not all(isinstance(s, str) and re.fullmatch(r"[0-9a-f]{1,64}", s)
                                                 for s in save_ids):
        raise MetadataError(f"{where}: 'files' save_ids must be a list of hexadecimal save ids")
    given = raw.get("names")
    if not isinstance(given, dict):
        raise MetadataError(f"{where}: 'files' names must be an object of row -> file name")
    if count > 1 and len(given) < count and not any(isinstance(raw.get(k), list) for k in ("n", "save_id", "rank")):
        # (checked before a column is expanded: a forged count would otherwise cost memory, not bytes)
        raise MetadataError(f"{where}: 'files' gives all {count} files the same n, save id and rank, so the same "
                            "name; the table is damaged")
    cols = {k: _read_column(raw.get(k), count, f"'files' column {k!r}", where)
            for k in ("n", "save_id", *_COLUMNS)}
    names: list[Any] = [None] * count
    for row, name in given.items():
        i = int(row) if isinstance(row, str) and row.isdigit() else -1
        if not 0 <= i < count or cols["n"][i] != -1:
            raise MetadataError(f"{where}: 'files' names gives row {row!r:.40}, which is not a row whose n is -1")
        names[i] = name
    for i, (n, s, rank) in enumerate(zip(cols["n"], cols["save_id"], cols["rank"], strict=True)):
        if n == -1:
            if names[i] is None:
                raise MetadataError(f"{where}: 'files' row {i} has n -1 but 'names' does not name it")
            continue
        if n < 0 or not 0 <= s < len(save_ids) or rank < 0:
            raise MetadataError(f"{where}: 'files' row {i}: n {n!r}, save id {s!r} and rank {rank!r} name no file "
                                f"(n >= 0, a save id index below {len(save_ids)} and a rank >= 0 are needed)")
        names[i] = data_file_name(rank, n, save_ids[s])
    rows = [list(r) for r in zip(names, *(cols[k] for k in _COLUMNS), strict=True)]
    return parse_rows(rows, dirs, where)


def _read_column(col: Any, count: int, what: str, where: str) -> list[int]:
    if isinstance(col, dict) and set(col) == {"all"} and type(col["all"]) is int:
        return [col["all"]] * count
    if isinstance(col, list) and len(col) == count and all(type(v) is int for v in col):
        return col
    raise MetadataError(f"{where}: {what} must be {count} integers, or {{\"all\": integer}}")


def _rows_checked_at_once(raw: list, dirs: list[str]) -> list[FileRecord] | None:
    """The file records when every one passes :func:`_parse_row`'s checks, done column by
    column with C-level builtins (a checkpoint of 65,536 ranks lists 65,536 files: a few passes, not 400,000
    calls); None when any fails (the caller then finds it and names it)."""
    if not all(type(f) is list and len(f) == 7 for f in raw):
        return None
    if not raw:
        return []
    names, d, rank, off, length, crc, size = zip(*raw, strict=True)
    if not plain_file_names(names):
        return None
    if any(set(map(type, col)) != {int} for col in (d, rank, off, length, crc, size)):
        return None  # bools and floats too (as check_int)
    if not (min(d) >= 0 and max(d) <= len(dirs) - 1 and min(rank) >= -1 and max(rank) <= MAX_WORLD
            and min(size) >= 0 and max(size) <= 1 << 62 and min(off) >= 0 and min(length) >= 0
            and min(crc) >= 0 and max(crc) <= 0xFFFFFFFF and all(map(operator.le, off, size))
            and all(map(operator.le, map(operator.add, off, length), size))):
        return None
    return list(map(FileRecord, names, map(dirs.__getitem__, d), rank, off, length, crc, size))


def _parse_row(f: Any, dirs: list[str], where: str) -> FileRecord:
    if not isinstance(f, list) or len(f) != 7:
        raise MetadataError(f"{where}: a file record must be a list of 7 fields, found {f!r:.200}")
    name = validate_file_name(f[0], where)
    d = check_int(f[1], where, None, f"file {name!r}: dir index", hi=len(dirs) - 1)
    rank = check_int(f[2], where, None, f"file {name!r}: rank", lo=-1, hi=MAX_WORLD)
    size = check_int(f[6], where, None, f"file {name!r}: size", hi=1 << 62)
    off = check_int(f[3], where, None, f"file {name!r}: index offset", hi=size)
    length = check_int(f[4], where, None, f"file {name!r}: index length", hi=size - off)
    crc = check_int(f[5], where, None, f"file {name!r}: index crc32c", hi=0xFFFFFFFF)
    return FileRecord(name, dirs[d], rank, off, length, crc, size)
