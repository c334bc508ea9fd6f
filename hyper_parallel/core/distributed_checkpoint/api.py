"""``save`` / ``load``: the checkpoint's two calls (HyperParallel's path ``distributed_checkpoint.api``).

A face: the procedures live in :mod:`._src.engine.checkpoint`; this module only re-exports them.
It is also torch DCP's ``api`` path, for ``CheckpointException``: torch's class, which every
error of ours (:class:`~._src.base.errors.CheckpointError`) is, so ``except CheckpointException``
catches them.

HyperParallel's ``api`` internals are here under its names, for code and tests that reach for
them: ``_save_impl`` (one save as its persist child runs it), ``_create_persist_process`` and
the child entries ``execute_async_persist[_with_gloo]`` (:mod:`._src.asynchronous.persist_process`);
``dist`` and ``mp`` are :mod:`torch.distributed` and :mod:`multiprocessing` themselves, which
those call at call time (``patch("...api.dist.get_rank")`` reaches them).
"""

import multiprocessing as mp

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ._src.asynchronous.api import async_save
from ._src.asynchronous.persist_process import create_persist_process as _create_persist_process
from ._src.asynchronous.persist_process import execute_async_persist, execute_async_persist_with_gloo
from ._src.asynchronous.persist_process import save_impl as _save_impl
from ._src.engine.checkpoint import load, save

__all__ = ["save", "load", "async_save", "CheckpointException", "dist", "mp", "_save_impl",
           "_create_persist_process", "execute_async_persist", "execute_async_persist_with_gloo"]
