"""``hyper_parallel.core.fully_shard``: torch's FSDP2 under HyperParallel's import paths."""

from .api import fully_shard
from .utils import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["fully_shard", "MixedPrecisionPolicy", "OffloadPolicy"]
