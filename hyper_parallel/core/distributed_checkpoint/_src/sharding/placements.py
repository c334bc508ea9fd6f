"""Torch placements by name: ``R``, ``S(dim)``, ``_S(dim,split_factor)`` (and ``P(op)``, refused).

HyperParallel's ``RaggedShard`` has the in-memory name ``RS(dims;local_units)`` (:mod:`.ragged`);
metadata never records it (a RaggedShard tensor is saved as a table of ordinary boxes).

The one grammar of placement names, as checkpoint metadata records them: conversion to and
from torch's ``Shard``/``Replicate``/``_StridedShard`` objects, and the bare parse that the
chunk grid uses without torch objects. Not here: what a set of placements means for a
tensor's boxes (see ``layout.py`` and ``grid.py``).
"""

from __future__ import annotations

import re
from typing import Any

from torch.distributed.tensor import Partial, Replicate, Shard

from .ragged import RaggedShard, ragged_from_name, ragged_name

try:  # torch >= 2.5
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch has no strided shards
    _StridedShard = None

__all__ = ["placement_to_name", "placement_from_name", "split_placement_name", "is_placement", "is_strided",
           "StridedShard"]

StridedShard = _StridedShard  # torch's _StridedShard, or None on a torch without it

_PLACEMENT = re.compile(r"^\s*(?:(R)|S\((-?\d+)\)|_S\((-?\d+),\s*(\d+)\)|P\((\w*)\))\s*$")


def split_placement_name(name: str) -> tuple[Any, ...] | None:
    """``"R"`` -> ``("R",)``, ``"S(d)"`` -> ``("S", d)``, ``"_S(d,k)"`` -> ``("SS", d, k)``,
    ``"P(op)"`` -> ``("P", op)``; None when ``name`` is no placement name."""
    m = _PLACEMENT.match(name) if isinstance(name, str) else None
    if m is None:
        return None
    if m.group(1):
        return ("R",)
    if m.group(2) is not None:
        return ("S", int(m.group(2)))
    if m.group(3) is not None:
        return ("SS", int(m.group(3)), int(m.group(4)))
    return ("P", m.group(5))


def is_strided(p: Any) -> bool:
    """True for torch's ``_StridedShard``."""
    return _StridedShard is not None and isinstance(p, _StridedShard)


def is_placement(p: Any) -> bool:
    """True for a placement object (``Shard``, ``Replicate``, ``Partial``, ``_StridedShard``, ``RaggedShard``)."""
    return isinstance(p, (Shard, Replicate, Partial, RaggedShard)) or is_strided(p)


def placement_to_name(p: Any) -> str:
    """The short name of a placement, as checkpoint metadata records it: ``S(0)``, ``R``, ``_S(0,2)``
    (and ``RS(0;1,3)`` for a RaggedShard, in memory only)."""
    if isinstance(p, RaggedShard):
        return ragged_name(p)
    if is_strided(p):
        return f"_S({p.dim},{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({getattr(p, 'reduce_op', 'sum')})"
    raise ValueError(f"unknown placement {p!r}; expected Shard, Replicate, _StridedShard or RaggedShard")


def placement_from_name(name: str) -> Any:
    """Parse ``S(0)``, ``R``, ``_S(0,2)`` back into a torch placement.

    Raises:
        ValueError: the name is not one of those (``P(...)`` — a Partial — is refused: a
            checkpoint never holds partial values).
    """
    ragged = ragged_from_name(name)
    if ragged is not None:
        return ragged
    parts = split_placement_name(name)
    if parts is None:
        raise ValueError(f"placement {name!r} is not one of 'R', 'S(<dim>)', '_S(<dim>,<split_factor>)'")
    if parts[0] == "R":
        return Replicate()
    if parts[0] == "S":
        return Shard(parts[1])
    if parts[0] == "SS":
        if _StridedShard is None:  # pragma: no cover
            raise ValueError(f"placement {name!r} needs a torch with _StridedShard")
        return _StridedShard(parts[1], split_factor=parts[2])
    raise ValueError(f"placement {name!r} is Partial: its values are not the tensor's; reduce it first")
