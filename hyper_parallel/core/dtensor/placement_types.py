"""``hyper_parallel.core.dtensor.placement_types``: torch's placement classes.

HyperParallel's ``RaggedShard`` has no torch counterpart and is not provided.
"""

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["Placement", "Shard", "Replicate", "Partial"]
