"""The standard planner (seed path ``distributed_checkpoint.standard_planner``).

A face over :mod:`.planning.standard_planner`; ``StandardSavePlanner`` and
``StandardLoadPlanner`` are ``StandardPlanner``, which also answers HyperParallel's planner
calls (:mod:`.planning.seed_plans`). ``create_read_items_for_chunk_list`` and ``_is_on_host``
are HyperParallel's helpers; the planner reads ``_is_on_host`` from this module at call time,
so patching it here (as HyperParallel's tests do) decides which destinations count as host memory.
``CachedSaveResult`` is what ``get_cached()`` returns.
"""

import sys

from .planning import seed_plans as _seed_plans
from .planning.plan_cache import CachedSaveResult
from .planning.seed_plans import create_read_items_for_chunk_list
from .planning.seed_plans import is_on_host as _is_on_host
from .planning.standard_planner import StandardLoadPlanner, StandardPlanner, StandardSavePlanner

__all__ = ["StandardPlanner", "StandardSavePlanner", "StandardLoadPlanner", "CachedSaveResult",
           "create_read_items_for_chunk_list", "_is_on_host"]

_seed_plans.use_patch_points(sys.modules[__name__])
