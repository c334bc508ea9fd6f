"""Plans and the planner protocols (torch DCP's and HyperParallel's path ``distributed_checkpoint.planner``).

A face. The plan records (``WriteItem``, ``ReadItem``, ``SavePlan``, ``LoadPlan``, ``WriteItemType``,
``LoadItemType``, ``TensorWriteData``, ``BytesIOWriteData``, ``BroadcastSource``) are the ones torch
DCP code and HyperParallel code build, one class for both forms (:mod:`.planning.records` says
where the forms differ and what each caller gets). ``SavePlanner``/``LoadPlanner`` are this
library's planner protocols (:mod:`.planning.planner`), which plan in boxes; a planner written
on torch's protocol runs too (see ``save``/``load``).
"""

from .planning.planner import EntrySpec, LoadPlanner, SavePlanner
from .planning.records import (
    BroadcastSource,
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

__all__ = ["EntrySpec", "WriteItem", "SavePlan", "ReadItem", "LoadPlan", "BroadcastSource", "SavePlanner",
           "LoadPlanner", "WriteItemType", "LoadItemType", "TensorWriteData", "BytesIOWriteData"]
