"""Checkpoint saver (seed path ``distributed_checkpoint.saver``).

A face: plans are executed by :mod:`.transfer.saver`; ``save_checkpoint`` is HyperParallel's
single-file saver (:mod:`.interop.single_file`).
"""

from .interop.single_file import save_checkpoint
from .transfer.saver import WriteResult, write_plan

__all__ = ["save_checkpoint", "write_plan", "WriteResult"]
