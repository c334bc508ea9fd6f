"""Asynchronous saves (seed path ``distributed_checkpoint.async_staging``).

A face over :mod:`.staging`.
"""

from .staging.checkpointer import (
    AsyncCheckpointer,
    AsyncSaveError,
    AsyncSaveResponse,
    AsyncStagingError,
    StagingStats,
    async_save,
    default_checkpointer,
    register_optimizer_hook,
)

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
