"""Which area of a tensor a mesh position holds under a MindSpore-style tensor map.

HyperParallel's ``reshard`` module works on three plain values instead of a layout object:
``mesh_shape`` (ranks per mesh dim), ``tensor_map`` (per tensor dim: ``-1`` for whole, or the
mesh dim that splits it *counted from the last*, or a tuple of those, outermost first) and a
*position* in the mesh (``0 .. prod(mesh_shape) - 1``, row-major; HyperParallel's DCP calls it the inner
rank id). The split is even: a dim its splitting ranks do not divide is refused, as HyperParallel's DCP
refuses it. (:class:`.layout.TensorLayout` is the same geometry with torch's uneven
``torch.chunk`` rule; it is what our save and load use.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ..base.areas import Area

__all__ = ["rank_id_to_dev_id_list", "infer_slice_area_by_rank"]


def rank_id_to_dev_id_list(mesh_shape: Sequence[int], rank_id: int) -> list[int]:
    """The mesh coordinate (one index per mesh dim) of position ``rank_id``, row-major.

    Raises:
        ValueError: ``rank_id`` is not a position of the mesh.

    Example::

        rank_id_to_dev_id_list((2, 2), 1)   # [0, 1]
    """
    world = math.prod(mesh_shape)
    if not 0 <= rank_id < world:
        raise ValueError(f"rank id {rank_id} is outside the mesh {tuple(mesh_shape)} (positions 0..{world - 1})")
    coord = [0] * len(mesh_shape)
    for i in range(len(mesh_shape) - 1, -1, -1):
        rank_id, coord[i] = divmod(rank_id, mesh_shape[i])
    return coord


def _split_dims(entry: Any) -> tuple[int, ...]:
    """The splitting mesh dims of one tensor-map entry (counted from the last), -1s dropped."""
    dims = (entry,) if isinstance(entry, int) else tuple(entry)
    return tuple(d for d in dims if d != -1)


def infer_slice_area_by_rank(mesh_shape: Sequence[int], tensor_map: Sequence[Any], rank_id: int,
                             full_shape: Sequence[int]) -> Area:
    """The area of a ``full_shape`` tensor held at mesh position ``rank_id``.

    Args:
        mesh_shape: ranks per mesh dim.
        tensor_map: one entry per tensor dim (see the module docstring).
        rank_id: the mesh position (not a global rank: index it through the rank list first).
        full_shape: the global shape.

    Raises:
        ValueError: a tensor dim is not divisible by the ranks splitting it, the tensor map
            has fewer entries than dims, or an entry names a mesh dim the mesh does not have.

    Example::

        infer_slice_area_by_rank((1, 2), (0, -1), 1, (8, 4))   # ((4, 8), (0, 4))
    """
    if len(tensor_map) < len(full_shape):
        raise ValueError(f"tensor_map {tuple(tensor_map)} has {len(tensor_map)} entries for a "
                         f"{len(full_shape)}-d shape {tuple(full_shape)}; give one per tensor dim")
    coord = rank_id_to_dev_id_list(mesh_shape, rank_id)
    last = len(mesh_shape) - 1
    area: list[tuple[int, int]] = []
    for axis, size in enumerate(full_shape):
        dims = _split_dims(tensor_map[axis])
        if any(not 0 <= d <= last for d in dims):
            raise ValueError(f"tensor_map entry {tensor_map[axis]!r} (dim {axis}) names a mesh dim outside "
                             f"0..{last} (counted from the last) of mesh {tuple(mesh_shape)}")
        pieces, index = 1, 0
        for d in dims:  # outermost first: each further mesh dim splits the previous piece
            n = mesh_shape[last - d]
            pieces, index = pieces * n, index * n + coord[last - d]
        if size % pieces:
            raise ValueError(f"dim {axis} of shape {tuple(full_shape)} ({size}) cannot be split evenly over "
                             f"{pieces} ranks (tensor_map {tuple(tensor_map)}, mesh {tuple(mesh_shape)})")
        step = size // pieces
        area.append((index * step, index * step + step))
    return tuple(area)
