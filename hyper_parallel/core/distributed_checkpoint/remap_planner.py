"""Loads into tensors named and laid out differently from the checkpoint's (HyperParallel's path
``distributed_checkpoint.remap_planner``).

A face over :mod:`.planning.remap` (the planner, and the two planner protocols it speaks),
:mod:`.planning.remap_blocks` (what a block means) and :mod:`.planning.deferred_reads`.
"""

from .planning.deferred_reads import DeferredRead
from .planning.remap import DEFERRED_FQN_PREFIX as _DEFERRED_FQN_PREFIX
from .planning.remap import RemapLoadPlanner
from .planning.remap_blocks import RemapBlock

__all__ = ["RemapLoadPlanner", "RemapBlock", "DeferredRead", "_DEFERRED_FQN_PREFIX"]
