"""torch DCP's ``staging`` import path: the stager protocol and torch's stagers.

A face. These are torch's own classes, re-exported: ``StagingOptions`` is configuration and
``AsyncStager`` a protocol; ``async_save(..., async_stager=...)`` takes them. Our own staging
(snapshots into reused host buffers) lives in :mod:`._src.asynchronous`.
"""

from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager, DefaultStager, StagingOptions

__all__ = ["AsyncStager", "BlockingAsyncStager", "DefaultStager", "StagingOptions"]
