"""HyperParallel's ``ChunkInfo``: where a plain tensor claims to sit in a global tensor.

Code written for HyperParallel may put a :class:`ChunkInfo` on a plain tensor under the
attribute :data:`CHUNK_INFO`. Only the whole, replicated case means here what it means
there (a plain tensor is saved whole and loaded whole); :func:`check_chunk_info` refuses a
part of a bigger tensor (save it as a DTensor). Not part of ``.metadata``: nothing of it
is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

from ..base.errors import UnsupportedValueError

CHUNK_INFO = "chunk_info"


@dataclass(frozen=True)
class ChunkInfo:
    """Where a plain tensor sits in a global tensor, and which ranks hold it (HyperParallel)."""

    chunk: ChunkStorageMetadata
    global_shape: tuple[int, ...]
    replica_rank_list: tuple[int, ...] = ()


def check_chunk_info(key: str, tensor: Any) -> None:
    """Refuse a plain tensor whose ``chunk_info`` makes it a part of a bigger tensor."""
    info = getattr(tensor, CHUNK_INFO, None)
    if info is None:
        return
    shape = tuple(tensor.shape)
    offsets = tuple(getattr(info.chunk, "offsets", ()))
    sizes = tuple(getattr(info.chunk, "sizes", ()))
    if tuple(info.global_shape) != shape or sizes != shape or any(offsets):
        raise UnsupportedValueError(
            f"{key!r}: its chunk_info places it at {list(offsets)} (sizes {list(sizes)}) of a global "
            f"{list(info.global_shape)}; only a whole tensor's chunk_info is supported (a plain tensor is saved and "
            "loaded whole). Save a part of a bigger tensor as a DTensor")
