"""Where one saved item's bytes lie: a file relative to the checkpoint, and a byte range in it.

The record torch DCP's file storage keeps per item (``filesystem._StorageInfo``) and HyperParallel's
storage layer keeps as ``storage.StorageInfo``, plus HyperParallel's ``tensor_key``: the item's name
inside a container file (a safetensors file names its tensors). Our own ``.metadata`` records
chunk places in :mod:`.chunks`; this record serves code written against HyperParallel's DCP or torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..base.public_path import publish

__all__ = ["StorageInfo"]



@dataclass
class StorageInfo:
    """One item's place in storage.

    Args:
        relative_path: the file, relative to the checkpoint directory.
        offset: the first byte of the item in that file.
        length: its byte count; -1 where it is not known (a tensor read by name).
        tensor_key: the item's name inside a container file (safetensors), or None.
        transform_descriptors: torch's per-item transforms (keyword only), or None.
    """

    relative_path: str
    offset: int
    length: int
    tensor_key: str | None = None
    transform_descriptors: Sequence[str] | None = field(default=None, kw_only=True)


publish("hyper_parallel.core.distributed_checkpoint.storage", StorageInfo)
