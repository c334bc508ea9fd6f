"""hyper-parallel: parallel training building blocks on PyTorch.

The entry points below are torch's own DeviceMesh, FSDP2 and DTensor, so HyperParallel code
reads the same on every device: the device type string ("cpu", "cuda", or "npu" for Ascend
with ``torch_npu`` installed) is passed to torch unchanged.

- :func:`init_device_mesh`: torch's ``init_device_mesh``, plus HyperParallel's ``rank_list=``
  for a mesh over some ranks of the job (see ``hyper_parallel.core.dtensor.device_mesh``).
- ``fully_shard``: torch's FSDP2 ``torch.distributed.fsdp.fully_shard`` itself (not a wrapper,
  so ``fully_shard.state(module)`` and torch's documentation apply). Call it on each
  submodule that should be its own all-gather unit, then on the root; parameters become
  ``DTensor``s sharded on dim 0 over ``mesh`` (a 1-D mesh: FSDP; a 2-D mesh
  ``(replicate, shard)``: HSDP)::

      mesh = init_device_mesh("npu", (dp_size,), mesh_dim_names=("dp",))
      for block in model.layers:
          fully_shard(block, mesh=mesh)
      fully_shard(model, mesh=mesh)

- ``DTensor``, ``Shard``, ``Replicate``, ``Partial``: ``torch.distributed.tensor``'s.
- :func:`get_platform`: HyperParallel's platform object (rank, world size, barrier, groups);
  ``hyper_parallel.platform.platform`` holds it (resettable) and ``EXISTING_COMM_GROUPS``.
- :class:`SkipDTensorDispatch`: a context manager in which DTensor operators run on the local
  shards (HyperParallel wraps optimizer steps in it).
- ``Layout``: HyperParallel's DTensor layout (``hyper_parallel.core.dtensor.layout``), loaded
  on first access.

Additive HyperParallel names on torch's classes (installed when this package is imported):
``DeviceMesh.rank_list``, ``DTensor.from_local_with_layout`` and
``FSDPModule.set_reduce_op_type`` (see the modules above for what each maps to in torch).
``DTensor.backward(gradient)`` also takes a plain tensor, read as this rank's local gradient
as HyperParallel's DTensor reads it (``hyper_parallel.core.dtensor.dtensor``).

HyperParallel's module paths exist as aliases of the same torch objects:
``hyper_parallel.core.dtensor.{device_mesh, placement_types, dtensor}``,
``hyper_parallel.core.fully_shard.{api, utils}`` and ``hyper_parallel.platform``.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .core.dtensor.device_mesh import init_device_mesh
from .core.dtensor.dtensor import SkipDTensorDispatch
from .core.fully_shard.api import fully_shard
from .platform import get_platform

__version__ = "0.1.0"

__all__ = [
    "init_device_mesh",
    "fully_shard",
    "DeviceMesh",
    "DTensor",
    "Shard",
    "Replicate",
    "Partial",
    "get_platform",
    "SkipDTensorDispatch",
    "Layout",
]


def __getattr__(name: str) -> Any:
    """``hyper_parallel.Layout`` on first access (it imports the checkpoint package)."""
    if name == "Layout":
        from .core.dtensor.layout import Layout

        return Layout
    raise AttributeError(f"module 'hyper_parallel' has no attribute {name!r}")
