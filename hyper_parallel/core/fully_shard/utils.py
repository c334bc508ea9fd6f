"""``hyper_parallel.core.fully_shard.utils``: torch's FSDP2 policy classes.

``MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)`` has
the same fields in both.
"""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]
