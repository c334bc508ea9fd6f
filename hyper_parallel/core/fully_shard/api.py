"""``hyper_parallel.core.fully_shard.api.fully_shard``: torch's FSDP2 ``fully_shard`` itself.

``fully_shard(module, mesh=, reshard_after_forward=, mp_policy=)`` is torch's. The module
it returns is torch's ``FSDPModule``; HyperParallel's extra module methods (such as
``set_reduce_op_type``) do not exist.
"""

from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["fully_shard", "FSDPModule"]
