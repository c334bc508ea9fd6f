"""Checkpoint loader (seed path ``distributed_checkpoint.loader``).

A face: plans are executed by :mod:`.transfer.loader`; ``load_checkpoint`` is HyperParallel's
single-file loader (:mod:`.interop.single_file`).
"""

from .interop.single_file import load_checkpoint
from .transfer.loader import read_plan

__all__ = ["load_checkpoint", "read_plan"]
