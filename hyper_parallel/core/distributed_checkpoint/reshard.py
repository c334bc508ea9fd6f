"""reshard: rewrite a checkpoint for a new mesh (HyperParallel's path ``distributed_checkpoint.reshard``).

A face over :mod:`._src.resharding.reshard`; ``Box`` is the N-d box its intersection math uses.
It also holds HyperParallel's in-memory helpers of the same path: ``ReshardHandler`` and
``check_layout`` (:mod:`._src.resharding.handler`), ``rank_id_to_dev_id_list`` and
``infer_slice_area_by_rank`` (:mod:`._src.sharding.tensor_map_areas`), ``infer_intersection``
(:mod:`._src.base.areas`).
"""

from ._src.base.areas import infer_intersection
from ._src.base.box import Box
from ._src.resharding.handler import ReshardHandler, check_layout
from ._src.resharding.reshard import reshard
from ._src.sharding.tensor_map_areas import infer_slice_area_by_rank, rank_id_to_dev_id_list

__all__ = ["reshard", "Box", "ReshardHandler", "check_layout", "infer_intersection", "infer_slice_area_by_rank",
           "rank_id_to_dev_id_list"]
