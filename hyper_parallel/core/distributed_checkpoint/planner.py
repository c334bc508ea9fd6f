"""Plans and the planner protocols (seed path ``distributed_checkpoint.planner``).

A face over :mod:`.planning.planner`, where the save and load protocols are documented. Torch
DCP's plan-item enums and payload records (``WriteItemType``, ``LoadItemType``,
``TensorWriteData``, ``BytesIOWriteData``) are torch's own, re-exported as plain data: they
describe torch's plans (e.g. the read items of :func:`.planner_helpers.create_read_items_for_chunk_list`);
our plans carry boxes instead (:class:`WriteItem`, :class:`ReadItem`). :class:`BroadcastSource`
marks a replicated shard one rank reads and broadcasts (see :mod:`.broadcast`).
"""

from torch.distributed.checkpoint.planner import BytesIOWriteData, LoadItemType, TensorWriteData, WriteItemType

from .planning.planner import (
    BroadcastSource,
    EntrySpec,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)

__all__ = ["EntrySpec", "WriteItem", "SavePlan", "ReadItem", "LoadPlan", "BroadcastSource", "SavePlanner",
           "LoadPlanner", "WriteItemType", "LoadItemType", "TensorWriteData", "BytesIOWriteData"]
