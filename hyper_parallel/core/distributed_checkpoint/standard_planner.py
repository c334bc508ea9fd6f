"""The standard planner (seed path ``distributed_checkpoint.standard_planner``).

A face over :mod:`.planning.standard_planner`.
"""

from .planning.standard_planner import StandardLoadPlanner, StandardPlanner, StandardSavePlanner

__all__ = ["StandardPlanner", "StandardSavePlanner", "StandardLoadPlanner"]
