"""``hyper_parallel.core.dtensor.dtensor``: torch's ``DTensor`` and its constructors.

``DTensor.from_local(local, mesh, placements)``, ``.to_local()``, ``.full_tensor()`` and
``.redistribute()`` are torch's. HyperParallel's ``DTensor.layout`` attribute does not exist
here (use ``.device_mesh`` and ``.placements``).
"""

from torch.distributed.tensor import DTensor, distribute_module, distribute_tensor

__all__ = ["DTensor", "distribute_tensor", "distribute_module"]
