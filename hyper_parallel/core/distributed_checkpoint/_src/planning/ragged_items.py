"""HyperParallel's RaggedShard checkpoint helpers, as its planners and tests call them.

HyperParallel's ``distributed_checkpoint.ragged_utils`` turns a RaggedShard DTensor into the
ordinary N-D boxes its flat run is saved as, in HyperParallel's records: ``(offsets, sizes)``
pairs, :class:`RaggedCheckpointBox` (a box plus the slice of the local flat tensor that holds
it), and HyperParallel-form write items (torch's ``WriteItem`` with HyperParallel's ``tensor_data`` dict:
``chunk``, ``properties``, ``size``). Our own planner does not use these records (it plans
boxes directly, :mod:`.standard_planner`); the geometry is the same code
(:mod:`..sharding.ragged`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor

from ..base.errors import UnsupportedValueError
from ..format.records import ChunkStorageMetadata, MetadataIndex, TensorProperties
from ..sharding.ragged import flat_range_boxes
from ..sharding.records import is_ragged_dtensor, ragged_piece
from .records import WriteItem, WriteItemType

__all__ = ["RaggedCheckpointBox", "decompose_flat_interval", "compute_ragged_boxes", "create_ragged_write_items",
           "get_ragged_box_tensor"]


class RaggedCheckpointBox(NamedTuple):
    """One global box of a rank's RaggedShard run, and the local flat elements
    ``[local_flat_start, local_flat_end)`` that hold it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    local_flat_start: int
    local_flat_end: int


def decompose_flat_interval(shape: tuple[int, ...], flat_start: int,
                            flat_end: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The ordered ``(offsets, sizes)`` boxes whose union is the row-major flat range
    ``[flat_start, flat_end)`` of ``shape`` (empty range: no boxes).

    Raises:
        ValueError: a 0-d shape, or a range outside the tensor.
    """
    return tuple((b.offsets, b.sizes) for b in flat_range_boxes(tuple(shape), flat_start, flat_end))


def compute_ragged_boxes(tensor: DTensor) -> tuple[RaggedCheckpointBox, ...]:
    """The boxes of this rank's run of a RaggedShard DTensor, each with its local flat slice.

    Raises:
        ValueError: ``tensor`` is not a RaggedShard DTensor, or its layout or local size is
            not a valid RaggedShard (the message names what was expected).
    """
    if not is_ragged_dtensor(tensor):
        raise ValueError(f"compute_ragged_boxes needs a RaggedShard DTensor, got {type(tensor).__name__} "
                         f"with placements {list(getattr(tensor, 'placements', ()))}")
    try:
        piece = ragged_piece(tensor, "tensor")
    except UnsupportedValueError as exc:
        raise ValueError(str(exc)) from None
    if piece is None:
        return ()
    return tuple(RaggedCheckpointBox(b.offsets, b.sizes, at, at + b.numel)
                 for b, at in ((b, piece.starts[b]) for b in piece.boxes))


def create_ragged_write_items(fqn: str, tensor: DTensor) -> list[Any]:
    """One HyperParallel-form write item per box of this rank's run: ``index`` is
    ``MetadataIndex(fqn, box offsets)``, ``tensor_data`` HyperParallel's dict (``chunk``: the box,
    ``properties``: the dtype, ``size``: the global shape)."""
    properties = TensorProperties(dtype=tensor.dtype)
    size = torch.Size(tensor.shape)
    return [WriteItem(index=MetadataIndex(fqn=fqn, offset=torch.Size(box.offsets), index=None),
                      type=WriteItemType.TENSOR,
                      tensor_data={"chunk": ChunkStorageMetadata(offsets=torch.Size(box.offsets),
                                                                 sizes=torch.Size(box.sizes)),
                                   "properties": properties, "size": size})
            for box in compute_ragged_boxes(tensor)]


def get_ragged_box_tensor(tensor: DTensor, index: Any) -> torch.Tensor:
    """The local data of the run's box at ``index.offset``, shaped as the box (a view of the
    local flat tensor).

    Raises:
        ValueError: no box of this rank's run starts at that offset.
    """
    wanted = tuple(index.offset) if index.offset is not None else None
    for box in compute_ragged_boxes(tensor):
        if box.offsets == wanted:
            return tensor.to_local().reshape(-1)[box.local_flat_start:box.local_flat_end].view(box.sizes)
    raise ValueError(f"{index.fqn!r}: no box of this rank's RaggedShard run starts at offset {index.offset!r}; "
                     f"its boxes start at {[b.offsets for b in compute_ragged_boxes(tensor)]}")
