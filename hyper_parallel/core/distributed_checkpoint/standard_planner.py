"""The standard planner (HyperParallel's path ``distributed_checkpoint.standard_planner``).

A face over :mod:`._src.planning.standard_planner`; ``StandardSavePlanner`` and
``StandardLoadPlanner`` are ``StandardPlanner``, which also answers HyperParallel's planner
calls (:mod:`._src.planning.hyper_parallel_plans`). ``create_read_items_for_chunk_list`` and ``_is_on_host``
are HyperParallel's helpers; the planner reads ``_is_on_host`` from this module at call time,
so patching it here (as HyperParallel's tests do) decides which destinations count as host memory.
``CachedSaveResult`` is what ``get_cached()`` returns. ``BoxSavePlanner`` and ``BoxLoadPlanner``
are its two halves (save planning, load planning), for code that wants one side only.
"""

import sys

from ._src.planning import hyper_parallel_plans as _planner_calls
from ._src.planning.hyper_parallel_plans import create_read_items_for_chunk_list
from ._src.planning.hyper_parallel_plans import is_on_host as _is_on_host
from ._src.planning.load_planner import BoxLoadPlanner
from ._src.planning.plan_cache import CachedSaveResult
from ._src.planning.save_planner import BoxSavePlanner
from ._src.planning.standard_planner import StandardLoadPlanner, StandardPlanner, StandardSavePlanner

__all__ = ["StandardPlanner", "StandardSavePlanner", "StandardLoadPlanner", "CachedSaveResult",
           "BoxSavePlanner", "BoxLoadPlanner", "create_read_items_for_chunk_list", "_is_on_host"]

_planner_calls.use_patch_points(sys.modules[__name__])
