"""Checkpoint metadata records (torch DCP's and HyperParallel's path ``distributed_checkpoint.metadata``).

A face. ``Metadata``, ``MetadataIndex``, ``TensorProperties``, ``TensorStorageMetadata`` accept
torch's form and HyperParallel's (:mod:`._src.format.records` tabulates the differences), and
``isinstance`` against them holds for the records torch's own functions build;
``ChunkStorageMetadata``, ``BytesStorageMetadata``, ``StorageMeta`` are torch's own. ``CHUNK_INFO``
and ``ChunkInfo`` are HyperParallel's marks on a plain tensor saying which part of a global tensor
it holds. Our own on-disk document is not this ``Metadata``: it is
``format.metadata.Metadata`` (``METADATA_FILE``, ``FORMAT_NAME``, ``FORMAT_VERSION`` describe it),
and ``read_metadata()`` of our readers gives the torch-shaped view of it.
"""

from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE

from ._src.format.chunk_info import CHUNK_INFO, ChunkInfo
from ._src.format.metadata import FORMAT_NAME, FORMAT_VERSION, METADATA_FILE
from ._src.format.records import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
    dtype_element_size,
)

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
    "dtype_element_size",
    "STATE_DICT_TYPE",
]
