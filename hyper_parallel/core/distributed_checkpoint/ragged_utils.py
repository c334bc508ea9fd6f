"""RaggedShard checkpoint geometry (seed path ``distributed_checkpoint.ragged_utils``).

A face over :mod:`.planning.ragged_items` (the seed's records) and :mod:`.sharding.ragged`
(the placement and the flat-range -> boxes decomposition).
"""

from .planning.ragged_items import (
    RaggedCheckpointBox,
    compute_ragged_boxes,
    create_ragged_write_items,
    get_ragged_box_tensor,
)
from .planning.ragged_items import decompose_flat_interval as _decompose_flat_interval
from .sharding.ragged import RaggedShard, flat_range_boxes

__all__ = ["RaggedShard", "RaggedCheckpointBox", "compute_ragged_boxes", "create_ragged_write_items",
           "get_ragged_box_tensor", "flat_range_boxes", "_decompose_flat_interval"]
