"""torch DCP's ``resharding`` import path: the overlap of a saved shard and a wanted one.

torch keeps two private helpers here (``__all__`` is empty) that code resharding torch's
chunk records imports: whether two ``ChunkStorageMetadata`` overlap, and their overlap per
dimension as ``(dim, offset in the saved shard, offset in the current shard, length)``. They
are pure geometry on torch's own records, so this path serves torch's functions themselves.
This library's resharding of whole checkpoints is ``reshard`` (the ``reshard`` path).
"""

from torch.distributed.checkpoint.resharding import (
    _check_shard_metadata_pair_overlap as _check_shard_metadata_pair_overlap,
)
from torch.distributed.checkpoint.resharding import (
    _shards_get_overlap_region_wrt_saved_tensor as _shards_get_overlap_region_wrt_saved_tensor,
)

__all__: list[str] = []
