"""The rules for single fields of the format, each a check that raises MetadataError naming where.

What a shape may be (:func:`check_shape`), a data-file name (:func:`validate_file_name`), a
saved layout (:func:`validate_layout_record`), a step directory in ``dirs``
(:func:`step_dir_name`, :func:`step_of`), and that saved boxes do not overlap
(:func:`check_disjoint`); with the integer checks every parser of this package shares
(:func:`check_int`, :func:`check_ints`, :func:`field_error`). Used by the ``.metadata``
parser (:mod:`.metadata`), by writers that must not write what the reader refuses, and by
the readers of foreign files. The bounds are :mod:`..base.limits`; the document's structure
is :mod:`.metadata`.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..base.box import Box, first_overlap
from ..base.errors import MetadataError
from ..base.limits import MAX_ELEMENTS, MAX_MESH_NDIM, MAX_NDIM, MAX_WORLD

_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]{0,254}$")
_PLACEMENT_NAME = re.compile(r"^(?:R|S\((-?\d{1,3})\)|_S\((-?\d{1,3}),(\d{1,7})\))$")
_STEP_NAME = re.compile(r"^step_(\d{8,})$")


def validate_file_name(name: Any, where: str) -> str:
    """A data-file name must be a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or not _FILE_NAME.match(name) or ".." in name:
        raise MetadataError(
            f"{where}: data file name {name!r} is not a plain file name inside the checkpoint "
            "(absolute paths, '..' and separators are refused)"
        )
    return name


def plain_file_names(names: Any) -> bool:
    """Whether every name passes :func:`validate_file_name` (one pass; no error to build)."""
    match = _FILE_NAME.match
    return all(type(n) is str and match(n) is not None and ".." not in n for n in names)


def field_error(where: str, key: str | None, msg: str) -> MetadataError:
    """The error for a bad field of ``where`` (of entry ``key`` when given)."""
    at = f"{where}, key {key!r}" if key is not None else where
    return MetadataError(f"{at}: {msg}")


def check_int(v: Any, where: str, key: str | None, what: str, lo: int = 0, hi: int | None = None) -> int:
    """``v`` itself when it is an int in ``[lo, hi]``; else MetadataError naming ``what``."""
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        bound = f" in [{lo}, {hi}]" if hi is not None else f" >= {lo}"
        raise field_error(where, key, f"{what} must be an integer{bound}, found {v!r}")
    return v


def check_ints(v: Any, where: str, key: str, what: str) -> tuple[int, ...]:
    """A list of at most MAX_NDIM integers >= 0, as a tuple."""
    if not isinstance(v, list) or len(v) > MAX_NDIM:
        raise field_error(where, key, f"{what} must be a list of at most {MAX_NDIM} integers, found {v!r}")
    return tuple(check_int(x, where, key, what) for x in v)


def check_shape(shape: Any, where: str, key: str | None = None) -> tuple[int, ...]:
    """A tensor shape this format holds: at most 64 integers >= 0, at most 2**56 elements.

    Every entry read from ``.metadata`` and every entry a save builds goes through it, so a
    shape the reader would refuse (``[-1, 0]`` from a foreign file) is never written.
    Raises MetadataError naming ``where`` and ``key``.
    """
    if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM
            or not all(type(d) is int and d >= 0 for d in shape)):
        raise field_error(where, key, f"shape must be a list of at most {MAX_NDIM} integers >= 0, "
                                      f"found {shape!r:.200}")
    dims = tuple(shape)
    if math.prod(dims) > MAX_ELEMENTS:
        raise field_error(where, key, f"shape {list(dims)} is absurdly large")
    return dims


def step_dir_name(step: int) -> str:
    """The directory name of ``step`` in a CheckpointManager's directory: ``step_`` + the number
    zero-padded to 8 digits. The only names ``dirs`` may hold besides ``""``."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a directory name stands for, or None when it is not a (canonical) step name."""
    m = _STEP_NAME.match(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if name == step_dir_name(step) else None


def validate_layout_record(rec: Any, ndim: int, where: str, key: str | None = None,
                           rank_lists: list[list[int]] | None = None) -> dict[str, Any]:
    """Check a saved layout (mesh shape, dim names, placements) before anything uses it.

    The mesh may hold at most ``MAX_WORLD`` positions, and nothing that reads a saved layout
    allocates or walks per mesh position (a layout is read in O(mesh dims)); returns the
    record with only its known members.
    """
    if not isinstance(rec, dict):
        raise field_error(where, key, f"layout must be an object, found {type(rec).__name__}")
    mesh = rec.get("mesh_shape")
    if not isinstance(mesh, list) or not 1 <= len(mesh) <= MAX_MESH_NDIM:
        raise field_error(where, key, f"layout mesh_shape must be a list of 1 to {MAX_MESH_NDIM} sizes, "
                                      f"found {mesh!r:.100}")
    mesh = [check_int(m, where, key, "layout mesh size", lo=1, hi=MAX_WORLD) for m in mesh]
    ranks = math.prod(mesh)
    if ranks > MAX_WORLD:
        raise field_error(where, key, f"layout mesh {mesh} has {ranks} positions, more than any job ({MAX_WORLD})")
    names = rec.get("mesh_dim_names")
    if names is not None and (not isinstance(names, list) or len(names) != len(mesh) or len(set(map(str, names)))
                              != len(names) or any(type(n) is not str or not 0 < len(n) <= 256 or n == "None"
                                                   for n in names)):
        raise field_error(where, key, f"layout mesh_dim_names must be {len(mesh)} distinct non-empty names, "
                                f"found {names!r:.200}")
    placements = rec.get("placements")
    if not isinstance(placements, list) or len(placements) != len(mesh):
        raise field_error(where, key, f"layout needs one placement per mesh dim ({len(mesh)}), "
                                      f"found {placements!r:.200}")
    for p in placements:
        match = _PLACEMENT_NAME.match(p) if isinstance(p, str) else None
        if match is None:
            raise field_error(where, key, f"layout placement {p!r:.50} is not 'R', 'S(d)' or '_S(d,k)'")
        if p == "R":
            continue
        d = int(match.group(1) if match.group(1) is not None else match.group(2))
        if not -ndim <= d < ndim:
            raise field_error(where, key, f"layout placement {p} shards dim {d} of a {ndim}-d tensor")
        if match.group(3) is not None and not 1 <= int(match.group(3)) <= ranks:
            raise field_error(where, key, f"layout placement {p}: split factor must be in [1, {ranks}]")
    out = {"mesh_shape": mesh, "mesh_dim_names": names, "placements": placements}
    if rec.get("rank_list") is not None:
        i = rec["rank_list"]
        if rank_lists is None or type(i) is not int or not 0 <= i < len(rank_lists) or len(rank_lists[i]) != ranks:
            raise field_error(where, key, f"layout rank_list {i!r:.20} names no rank list of {ranks} ranks")
        out["rank_list"] = rank_lists[i]
    return out


def check_disjoint(boxes: set[tuple[tuple[int, ...], tuple[int, ...]]], where: str, key: str) -> None:
    """Distinct saved boxes (``(offsets, sizes)``) must not overlap; equal boxes are replicas,
    and the set holds each once."""
    distinct = [Box(o, s) for o, s in boxes]
    pair = first_overlap(distinct)
    if pair is not None:
        raise field_error(where, key, f"chunks {distinct[pair[0]]} and {distinct[pair[1]]} overlap")
