"""``hyper_parallel.core.dtensor.placement_types``: torch's placement classes, and HyperParallel's
``RaggedShard``.

``Placement``, ``Shard``, ``Replicate`` and ``Partial`` are torch's own classes. ``RaggedShard``
(a flat, uneven shard of a tensor's leading dims) has no torch counterpart: it is defined in
:mod:`hyper_parallel.core.distributed_checkpoint._src.sharding.ragged` as a subclass of torch's
``Placement``, which torch's ``DTensor.from_local(local_flat, mesh, (RaggedShard(...),),
shape=..., stride=...)`` accepts as it is; the checkpoint saves and loads such DTensors as
ordinary boxes. Torch's own redistribution does not know it.
"""

from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ..distributed_checkpoint._src.sharding.ragged import RaggedShard

__all__ = ["Placement", "Shard", "Replicate", "Partial", "RaggedShard"]
