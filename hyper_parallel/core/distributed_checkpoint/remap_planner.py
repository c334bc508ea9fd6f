"""Loads into tensors named and laid out differently from the checkpoint's (HyperParallel's path
``distributed_checkpoint.remap_planner``).

A face over :mod:`._src.planning.remap` (the planner, and the two planner protocols it speaks),
:mod:`._src.planning.remap_blocks` (what a block means) and :mod:`._src.planning.deferred_reads`.
"""

from ._src.planning.deferred_reads import DeferredRead
from ._src.planning.remap import DEFERRED_FQN_PREFIX as _DEFERRED_FQN_PREFIX
from ._src.planning.remap import RemapLoadPlanner
from ._src.planning.remap_blocks import RemapBlock

__all__ = ["RemapLoadPlanner", "RemapBlock", "DeferredRead", "_DEFERRED_FQN_PREFIX"]
