"""Checkpoint saver (HyperParallel's path ``distributed_checkpoint.saver``).

A face: plans are executed by :mod:`._src.transfer.saver`; ``save_checkpoint`` is HyperParallel's
single-file saver (:mod:`._src.interop.hyper_parallel.single_file`).
"""

from ._src.interop.hyper_parallel.single_file import save_checkpoint
from ._src.transfer.saver import WriteResult, write_plan

__all__ = ["save_checkpoint", "write_plan", "WriteResult"]
