"""The chunks of a global tensor that a rank's state-dict value holds (HyperParallel's
``utils.create_chunk_list_for_tensor``), as torch's ``ChunkStorageMetadata`` records.

A load plans its reads from these: one chunk for a plain tensor (the whole tensor, or what
its ``chunk_info`` says), one box for a DTensor under Shard/Replicate (the same box our save
writes, :func:`..sharding.records.dtensor_box`; an empty shard keeps its offset at the dim's
end, as torch reports it), the boxes of its run for a RaggedShard DTensor, and none on a rank
outside the DTensor's mesh.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor

from ..base.box import Box
from ..format.chunk_info import CHUNK_INFO, ChunkInfo
from ..sharding.layout import TensorLayout
from ..sharding.records import dtensor_box, is_ragged_dtensor, ragged_piece

__all__ = ["create_chunk_list_for_tensor"]


def _chunk(box: Box) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes))


def create_chunk_list_for_tensor(obj: Any) -> list[ChunkStorageMetadata]:
    """The chunks of its global tensor that ``obj`` holds on this rank.

    Raises:
        ValueError: ``obj`` is not a tensor ("Not support type ..."), or its ``chunk_info``
            attribute is not a :class:`ChunkInfo`.
        UnsupportedValueError: a DTensor with a Partial placement (its local values are not the
            tensor's), or a strided shard that is no box.

    Example::

        create_chunk_list_for_tensor(torch.zeros(3, 5))
        # [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([3, 5]))]
    """
    if isinstance(obj, DTensor):
        if is_ragged_dtensor(obj):
            piece = ragged_piece(obj, "<tensor>")
            return [] if piece is None else [_chunk(b) for b in piece.boxes]
        box = dtensor_box(obj, "<tensor>")
        if box is not None:
            return [_chunk(box)]
        coord = obj.device_mesh.get_coordinate()
        if coord is None:  # this rank is outside the mesh
            return []
        # an empty shard: saved as nothing, but its place in the tensor is still its chunk
        rank = int(obj.device_mesh.mesh[tuple(coord)])
        box = TensorLayout.from_dtensor(obj).chunk_box(rank, tuple(obj.shape))
        return [_chunk(box)] if not box.numel else []
    if isinstance(obj, torch.Tensor):
        if hasattr(obj, CHUNK_INFO):
            info = getattr(obj, CHUNK_INFO)
            if not isinstance(info, ChunkInfo):
                raise ValueError(f"the tensor's {CHUNK_INFO!r} attribute must be a ChunkInfo "
                                 f"(distributed_checkpoint.metadata.ChunkInfo), found {type(info).__name__}")
            return [info.chunk]
        return [_chunk(Box.full(tuple(obj.shape)))]
    raise ValueError(f"Not support type {type(obj).__name__} for creating a chunk list: "
                     "expected a torch.Tensor or a DTensor")
