"""torch DCP's ``utils`` import path: find a state dict's object or shard by ``MetadataIndex``.

A face over :mod:`.sharding.shard_lookup`. (``util``, without the s, is HyperParallel's path.)
"""

from .sharding.shard_lookup import find_state_dict_object, find_tensor_shard

__all__ = ["find_tensor_shard", "find_state_dict_object"]
