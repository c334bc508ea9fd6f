"""Plans and the planner protocols (torch DCP's and HyperParallel's path ``distributed_checkpoint.planner``).

A face. The plan records (``WriteItem``, ``ReadItem``, ``SavePlan``, ``LoadPlan``, ``WriteItemType``,
``LoadItemType``, ``TensorWriteData``, ``BytesIOWriteData``, ``BroadcastSource``) are the ones torch
DCP code and HyperParallel code build, one class for both forms (:mod:`._src.planning.records` says
where the forms differ and what each caller gets). ``SavePlanner``/``LoadPlanner`` are torch's
ABCs, open to HyperParallel's method names (:mod:`._src.planning.protocols`): subclass them with
either, and ``save``/``load`` run the planner on its protocol. This library's own planners plan
in boxes on :mod:`._src.planning.planner`'s protocol (subclass ``StandardPlanner`` to customise them;
``EntrySpec`` is that protocol's record).
"""

from ._src.planning.planner import EntrySpec
from ._src.planning.protocols import LoadPlanner, SavePlanner
from ._src.planning.records import (
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
