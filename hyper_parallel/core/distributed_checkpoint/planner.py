"""Plans and the planner protocols (seed path ``distributed_checkpoint.planner``).

A face over :mod:`.planning.planner`, where the save and load protocols are documented.
"""

from .planning.planner import EntrySpec, LoadPlan, LoadPlanner, ReadItem, SavePlan, SavePlanner, WriteItem

__all__ = ["EntrySpec", "WriteItem", "SavePlan", "ReadItem", "LoadPlan", "SavePlanner", "LoadPlanner"]
