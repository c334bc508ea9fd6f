"""Asynchronous saves (seed path ``distributed_checkpoint.async_staging``).

A face over :mod:`.staging`.
"""

from .staging.api import async_save, default_checkpointer, register_optimizer_hook
from .staging.buffers import StagingStats
from .staging.checkpointer import AsyncCheckpointer
from .staging.response import AsyncSaveError, AsyncSaveResponse, AsyncStagingError

__all__ = [
    "async_save",
    "AsyncCheckpointer",
    "AsyncSaveResponse",
    "AsyncSaveError",
    "AsyncStagingError",
    "StagingStats",
    "default_checkpointer",
    "register_optimizer_hook",
]
