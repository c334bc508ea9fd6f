"""reshard: rewrite a checkpoint for a new mesh (seed path ``distributed_checkpoint.reshard``).

A face over :mod:`.resharding.reshard`; ``Box`` is the N-d box its intersection math uses.
It also holds HyperParallel's in-memory helpers of the same path: ``ReshardHandler`` and
``check_layout`` (:mod:`.resharding.handler`), ``rank_id_to_dev_id_list`` and
``infer_slice_area_by_rank`` (:mod:`.sharding.tensor_map_areas`), ``infer_intersection``
(:mod:`.base.areas`).
"""

from .base.areas import infer_intersection
from .base.box import Box
from .resharding.handler import ReshardHandler, check_layout
from .resharding.reshard import reshard
from .sharding.tensor_map_areas import infer_slice_area_by_rank, rank_id_to_dev_id_list

__all__ = ["reshard", "Box", "ReshardHandler", "check_layout", "infer_intersection", "infer_slice_area_by_rank",
           "rank_id_to_dev_id_list"]
