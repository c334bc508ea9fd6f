"""Asynchronous saves (seed path ``distributed_checkpoint.async_staging``).

A face over :mod:`.asynchronous`.
"""

from .asynchronous.api import async_save, default_checkpointer, register_optimizer_hook
from .asynchronous.buffers import StagingStats
from .asynchronous.checkpointer import AsyncCheckpointer
from .asynchronous.response import AsyncSaveError, AsyncSaveResponse, AsyncStagingError

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
