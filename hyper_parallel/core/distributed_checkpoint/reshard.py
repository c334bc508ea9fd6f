"""reshard: rewrite a checkpoint for a new mesh (seed path ``distributed_checkpoint.reshard``).

A face over :mod:`.resharding.reshard`; ``Box`` is the N-d box its intersection math uses.
"""

from .base.box import Box
from .resharding.reshard import reshard

__all__ = ["reshard", "Box"]
