"""Asynchronous saves (seed path ``distributed_checkpoint.async_staging``).

A face over :mod:`.asynchronous`. ``build_staged_state_dict`` is HyperParallel's host copy of a
state dict (:mod:`.asynchronous.persist_process`), which its child-process save persists.
"""

from .asynchronous.api import async_save, default_checkpointer, register_optimizer_hook
from .asynchronous.buffers import StagingStats
from .asynchronous.checkpointer import AsyncCheckpointer
from .asynchronous.persist_process import build_staged_state_dict
from .asynchronous.response import AsyncSaveError, AsyncSaveFuture, AsyncSaveResponse, AsyncStagingError

__all__ = [
    "async_save",
    "AsyncCheckpointer",
    "AsyncSaveFuture",
    "AsyncSaveResponse",
    "AsyncSaveError",
    "AsyncStagingError",
    "StagingStats",
    "default_checkpointer",
    "register_optimizer_hook",
    "build_staged_state_dict",
]
