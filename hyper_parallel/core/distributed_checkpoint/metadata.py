"""Checkpoint metadata (seed path ``distributed_checkpoint.metadata``).

A face over :mod:`.format.metadata` and :mod:`.format.chunk_info`. It also carries HyperParallel's names: torch DCP's
metadata classes (what ``Metadata.state_dict_metadata`` holds), ``CHUNK_INFO`` and ``ChunkInfo``.
"""

from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from .format.chunk_info import CHUNK_INFO, ChunkInfo
from .format.metadata import FORMAT_NAME, FORMAT_VERSION, METADATA_FILE, Metadata

__all__ = [
    "Metadata",
    "METADATA_FILE",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "CHUNK_INFO",
    "ChunkInfo",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
]
