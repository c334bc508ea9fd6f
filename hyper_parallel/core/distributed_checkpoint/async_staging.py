"""Asynchronous saves (HyperParallel's path ``distributed_checkpoint.async_staging``).

A face over :mod:`._src.asynchronous`. ``build_staged_state_dict`` is HyperParallel's host copy of a
state dict (:mod:`._src.asynchronous.persist_process`), which its child-process save persists.
"""

from ._src.asynchronous.api import async_save, default_checkpointer, register_optimizer_hook
from ._src.asynchronous.buffers import StagingStats
from ._src.asynchronous.checkpointer import AsyncCheckpointer
from ._src.asynchronous.persist_process import build_staged_state_dict
from ._src.asynchronous.response import AsyncSaveError, AsyncSaveFuture, AsyncSaveResponse, AsyncStagingError

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
