"""``distributed_checkpoint.utils``: torch DCP's ``utils`` names and HyperParallel's helpers.

One import path, two callers, no name shared between them:

- torch's (``torch.distributed.checkpoint.utils``): ``find_tensor_shard`` and
  ``find_state_dict_object``, from :mod:`.sharding.shard_lookup`;
- HyperParallel's (its newer ``utils``): ``all_gather_object`` (:mod:`.base.coordination`),
  the area helpers ``infer_intersection``/``chunk_to_area``/``narrow_tensor_by_index``
  (:mod:`.base.areas`), the object-path helpers ``traverse_state_dict``/``flatten_state_dict``/
  ``set_element`` (:mod:`.state.nested_paths`), ``create_chunk_list_for_tensor``
  (:mod:`.planning.chunk_lists`) and ``plan_ownership_masks`` (:mod:`.planning.ownership`).

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

from .base.areas import chunk_to_area, infer_intersection, narrow_tensor_by_index
from .base.coordination import all_gather_object
from .planning.chunk_lists import create_chunk_list_for_tensor
from .planning.ownership import plan_ownership_masks
from .sharding.shard_lookup import find_state_dict_object, find_tensor_shard
from .state.nested_paths import flatten_state_dict, set_element, traverse_state_dict

__all__ = [
    "find_tensor_shard", "find_state_dict_object",
    "all_gather_object", "chunk_to_area", "create_chunk_list_for_tensor", "flatten_state_dict",
    "infer_intersection", "narrow_tensor_by_index", "plan_ownership_masks", "set_element", "traverse_state_dict",
    "dist", "CheckpointException",
]
