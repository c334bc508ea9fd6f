"""HyperParallel's ``hyper_parallel.core.dtensor`` import paths, as torch's own objects.

HyperParallel ships its own DTensor; this package has none. Its modules re-export
``torch.distributed.tensor``'s classes and functions under HyperParallel's names, so that
code written against ``hyper_parallel.core.dtensor.*`` runs on torch's DTensor unchanged.
``layout`` (HyperParallel's ``Layout``) is imported on demand: it builds on the checkpoint
package's layouts.
"""

from .device_mesh import DeviceMesh, init_device_mesh
from .dtensor import DTensor, SkipDTensorDispatch, distribute_module, distribute_tensor
from .placement_types import Partial, Placement, RaggedShard, Replicate, Shard

__all__ = ["DeviceMesh", "init_device_mesh", "DTensor", "SkipDTensorDispatch", "distribute_tensor", "distribute_module",
           "Placement", "Shard", "Replicate", "Partial", "RaggedShard"]
