"""``distributed_checkpoint.utils``: torch DCP's ``utils`` names and HyperParallel's helpers.

One import path, two callers, no name shared between them:

- torch's (``torch.distributed.checkpoint.utils``): ``find_tensor_shard`` and
  ``find_state_dict_object``, from :mod:`._src.sharding.shard_lookup`;
- HyperParallel's (its newer ``utils``): ``all_gather_object`` (:mod:`._src.coordination.coordinator`),
  the area helpers ``infer_intersection``/``chunk_to_area``/``narrow_tensor_by_index``
  (:mod:`._src.base.areas`), the object-path helpers ``traverse_state_dict``/``flatten_state_dict``/
  ``set_element`` (:mod:`._src.state.nested_paths`), ``create_chunk_list_for_tensor``
  (:mod:`._src.planning.chunk_lists`) and ``plan_ownership_masks`` (:mod:`._src.planning.ownership`).

torch's ``utils`` also re-exports ``CheckpointException`` (the one the package exports), and
torch's own tests and some user code import its private helpers ``_DistWrapper`` and
``_create_file_view``: torch's objects, here under their torch names.

``dist`` is ``torch.distributed`` itself, here because HyperParallel's tests patch
``utils.dist.get_rank``. (``util``, without the s, is HyperParallel's older path.)
"""

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.utils import _create_file_view as _create_file_view  # torch's private helpers
from torch.distributed.checkpoint.utils import _DistWrapper as _DistWrapper

from ._src.base.areas import chunk_to_area, infer_intersection, narrow_tensor_by_index
from ._src.coordination.coordinator import all_gather_object
from ._src.planning.chunk_lists import create_chunk_list_for_tensor
from ._src.planning.ownership import plan_ownership_masks
from ._src.sharding.shard_lookup import find_state_dict_object, find_tensor_shard
from ._src.state.nested_paths import flatten_state_dict, set_element, traverse_state_dict

__all__ = [
    "find_tensor_shard", "find_state_dict_object",
    "all_gather_object", "chunk_to_area", "create_chunk_list_for_tensor", "flatten_state_dict",
    "infer_intersection", "narrow_tensor_by_index", "plan_ownership_masks", "set_element", "traverse_state_dict",
    "dist", "CheckpointException",
]
