"""Layout records: how a DTensor's placement is written into metadata, and read back.

A layout record is the JSON-able dict an entry of ``.metadata`` keeps for a DTensor:
``mesh_shape``, ``mesh_dim_names``, ``placements`` (by name) and, only when the mesh is not
simply ranks 0..N-1 of the saving group, ``rank_list`` (row-major). This module makes a
record from a DTensor (:func:`layout_record`), finds the box this rank holds
(:func:`dtensor_box`; for a RaggedShard DTensor, the boxes of its flat run: :func:`ragged_piece`),
says which records may be written to metadata (:func:`storable_layout`), and answers the two
questions the save's global plan asks of a record: which ranks it spans and where a rank sits
in it.

What it is not: the metadata schema that validates records (:mod:`..format.metadata`),
nor the chunk grid derived from them (:mod:`.grid`).
"""

from __future__ import annotations

import math
from typing import Any

from torch.distributed.tensor import DTensor

from ..base.box import Box
from ..base.errors import UnsupportedValueError
from .grid import shared_grid
from .placements import placement_to_name
from .ragged import RaggedPiece, flat_range_boxes, is_ragged, ragged_from_name, ragged_mesh_dim, rank_flat_range
from .sharded_tensor import is_shard_table

__all__ = ["mesh_ranks", "layout_record", "dtensor_box", "ragged_piece", "is_ragged_dtensor", "storable_layout",
           "record_ranks", "record_position"]


_MESH_RANKS: dict[int, tuple[Any, list[int]]] = {}


def mesh_ranks(mesh: Any) -> list[int]:
    """The global ranks of a mesh, row-major (cached per mesh object: a model's DTensors share a few)."""
    cached = _MESH_RANKS.get(id(mesh))
    if cached is None or cached[0] is not mesh:
        if len(_MESH_RANKS) > 256:
            _MESH_RANKS.clear()
        cached = _MESH_RANKS[id(mesh)] = (mesh, [int(r) for r in mesh.mesh.flatten().tolist()])
    return cached[1]


def layout_record(t: DTensor, group_rank: dict[int, int] | None = None) -> dict[str, Any]:
    """A DTensor's layout as metadata records it; ``rank_list`` (ranks in the saving group,
    row-major) only when the mesh is not simply ranks 0..N-1."""
    mesh = t.device_mesh
    rec: dict[str, Any] = {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": [placement_to_name(p) for p in t.placements],
    }
    ranks = mesh_ranks(mesh)
    if group_rank is not None:
        missing = [r for r in ranks if r not in group_rank]
        if missing:
            raise UnsupportedValueError(
                f"a DTensor's mesh holds rank(s) {missing[:8]} outside the process group that saves it; "
                "save with a process_group that contains the whole mesh")
        ranks = [group_rank[r] for r in ranks]
    if ranks[0] != 0 or ranks[-1] != len(ranks) - 1 or ranks != list(range(len(ranks))):
        rec["rank_list"] = ranks
    return rec


def is_ragged_dtensor(t: object) -> bool:
    """True for a DTensor with a RaggedShard placement."""
    return isinstance(t, DTensor) and any(is_ragged(p) for p in t.placements)


def storable_layout(layout: dict[str, Any] | None) -> dict[str, Any] | None:
    """``layout`` as ``.metadata`` may record it: None for a RaggedShard layout and a
    ShardedTensor's shard table (such a tensor is stored as a table of ordinary boxes, and the
    format has no name for the placement)."""
    if is_shard_table(layout):
        return None
    if layout is None or not any(ragged_from_name(p) is not None for p in layout.get("placements", ())):
        return layout
    return None


def ragged_piece(t: DTensor, key: str) -> RaggedPiece | None:
    """This rank's part of a RaggedShard DTensor: its flat local tensor and the global boxes
    that hold the same elements, in order; None if the rank holds nothing.

    Raises:
        UnsupportedValueError: the placements are not one RaggedShard plus Replicate, the
            shape does not divide into the units, or the local tensor's size is not the run's.
    """
    try:
        m = ragged_mesh_dim(t.placements, key)
    except ValueError as exc:
        raise UnsupportedValueError(str(exc)) from None
    if m is None:
        raise UnsupportedValueError(f"{key!r}: not a RaggedShard DTensor (placements {list(t.placements)})")
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    p = t.placements[m]
    if len(p.local_units) != t.device_mesh.shape[m]:
        raise UnsupportedValueError(f"{key!r}: RaggedShard local_units {p.local_units} needs one entry per rank of "
                                    f"mesh dim {m} ({t.device_mesh.shape[m]} ranks)")
    shape = tuple(t.shape)
    try:
        start, end = rank_flat_range(shape, p, coord[m], key)
    except ValueError as exc:
        raise UnsupportedValueError(str(exc)) from None
    local = t._local_tensor
    if local.numel() != end - start:
        raise UnsupportedValueError(
            f"{key!r}: local tensor of {local.numel()} elements, but RaggedShard {p} gives rank {coord[m]} of mesh "
            f"dim {m} the flat range [{start}, {end}) ({end - start} elements) of shape {list(shape)}")
    return RaggedPiece(local, flat_range_boxes(shape, start, end)) if end > start else None


def dtensor_box(t: DTensor, key: str) -> Box | None:
    """The global box of this rank's local shard, or None if the rank holds nothing.

    Raises:
        UnsupportedValueError: a Partial placement; a RaggedShard (its run is several boxes:
            use :func:`ragged_piece`); a strided shard that is no box.
    """
    if is_ragged_dtensor(t):
        raise UnsupportedValueError(
            f"{key!r}: a RaggedShard DTensor's local run is several boxes, not one; this path supports only "
            "Shard/Replicate layouts (save and load it with save()/load(), which store it as ordinary boxes)")
    if any(p.is_partial() for p in t.placements):
        raise UnsupportedValueError(
            f"{key!r}: DTensor has Partial placement {list(t.placements)}; its local values are "
            "not the tensor's values. Reduce it first, e.g. "
            "t.redistribute(placements=[Replicate() if p.is_partial() else p for p in t.placements])"
        )
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        return None
    # The box by arithmetic (grid.py, checked against torch's own shard math), not torch's
    # index lists, which cost O(rows) per strided DTensor.
    mesh_shape = tuple(t.device_mesh.shape)
    try:  # uneven strided shards are not contiguous boxes: refuse rather than save wrong data
        grid = shared_grid(tuple(t.shape), mesh_shape, [placement_to_name(p) for p in t.placements])
    except ValueError as exc:
        raise UnsupportedValueError(f"{key!r}: {exc}") from None
    position = 0
    for c, size in zip(coord, mesh_shape, strict=True):
        position = position * size + c
    box = grid.box(grid.locate(position)[0])
    local = t._local_tensor
    if tuple(local.shape) != box.sizes:
        if not local.numel() and not box.numel:  # FSDP2 gives a rank with none of a TP shard (0, 0)
            return None
        raise UnsupportedValueError(
            f"{key!r}: local tensor shape {tuple(local.shape)} differs from its chunk {box}"
        )
    return box if box.numel else None


def record_ranks(layout: dict[str, Any]) -> tuple[int, ...]:
    """The ranks a layout record's mesh spans, row-major."""
    ranks = layout.get("rank_list")
    return tuple(ranks) if ranks is not None else tuple(range(math.prod(layout["mesh_shape"])))


_POSITIONS: dict[tuple[int, ...], dict[int, int]] = {}


def record_position(layout: dict[str, Any], rank: int) -> int | None:
    """The mesh position of ``rank`` in a layout record (None if the mesh does not hold it)."""
    ranks = layout.get("rank_list")
    if ranks is None:
        return rank if rank < math.prod(layout["mesh_shape"]) else None
    key = tuple(ranks)
    pos = _POSITIONS.get(key)
    if pos is None:
        if len(_POSITIONS) > 64:
            _POSITIONS.clear()
        pos = _POSITIONS[key] = {r: i for i, r in enumerate(ranks)}
    return pos.get(rank)
