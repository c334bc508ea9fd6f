"""Checkpoint loader (HyperParallel's path ``distributed_checkpoint.loader``).

A face: plans are executed by :mod:`._src.transfer.loader`; ``load_checkpoint`` is HyperParallel's
single-file loader (:mod:`._src.interop.hyper_parallel.single_file`).
"""

from ._src.interop.hyper_parallel.single_file import load_checkpoint
from ._src.transfer.loader import read_plan

__all__ = ["load_checkpoint", "read_plan"]
