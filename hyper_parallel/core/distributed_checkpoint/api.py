"""``save`` / ``load``: the checkpoint's two calls (seed path ``distributed_checkpoint.api``).

A face: the procedures live in :mod:`.engine.checkpoint`; this module only re-exports them.
It is also torch DCP's ``api`` path, for ``CheckpointException``: torch's class, which every
error of ours (:class:`~.base.errors.CheckpointError`) is, so ``except CheckpointException``
catches them.
"""

from torch.distributed.checkpoint.api import CheckpointException

from .engine.checkpoint import load, save

__all__ = ["save", "load", "CheckpointException"]
