"""torch DCP's ``planner_helpers`` import path: the reads that fill local chunks from saved ones.

A face over :mod:`._src.planning.chunk_reads`. The private helpers torch's tests and planners import
from here (``_create_write_item_for_tensor``, ``_compare_save_plans``, ``_merge_delta_local_plans``,
...) are torch's own: they build and compare torch's plan records (no I/O).
"""

from torch.distributed.checkpoint.planner_helpers import _compare_save_plans as _compare_save_plans
from torch.distributed.checkpoint.planner_helpers import _contains_usable_plan as _contains_usable_plan
from torch.distributed.checkpoint.planner_helpers import _create_read_items as _create_read_items
from torch.distributed.checkpoint.planner_helpers import _create_write_item_for_tensor as _create_write_item_for_tensor
from torch.distributed.checkpoint.planner_helpers import _create_write_items as _create_write_items
from torch.distributed.checkpoint.planner_helpers import _merge_delta_local_plans as _merge_delta_local_plans

from ._src.planning.chunk_reads import create_read_items_for_chunk_list

__all__ = ["create_read_items_for_chunk_list"]
