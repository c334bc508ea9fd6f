"""hyper-parallel: parallel training building blocks on PyTorch.

The entry points below are torch's own DeviceMesh, FSDP2 and DTensor, so HyperParallel code
reads the same on every device: the device type string ("cpu", "cuda", or "npu" for Ascend
with ``torch_npu`` installed) is passed to torch unchanged.

- :func:`init_device_mesh`: a thin wrapper of ``torch.distributed.device_mesh.init_device_mesh``.
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
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__version__ = "0.1.0"

__all__ = [
    "init_device_mesh",
    "fully_shard",
    "DeviceMesh",
    "DTensor",
    "Shard",
    "Replicate",
    "Partial",
]


def init_device_mesh(
    device_type: str,
    mesh_shape: tuple[int, ...],
    *,
    mesh_dim_names: tuple[str, ...] | None = None,
    **kwargs: Any,
) -> DeviceMesh:
    """Create a torch ``DeviceMesh``: the ranks of the job arranged as an N-d grid.

    A thin wrapper of ``torch.distributed.device_mesh.init_device_mesh``; arguments go to
    torch unchanged. If no default process group exists yet, torch initialises one from the
    environment (``env://``: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) with the backend
    for ``device_type``.

    Args:
        device_type: "cpu", "cuda", "npu" (Ascend; needs ``torch_npu``), or any torch
            device type; passed through as it is.
        mesh_shape: ranks per mesh dimension, e.g. ``(dp_size,)`` or ``(dp, tp)``; the
            product must equal the world size.
        mesh_dim_names: a name per dimension, e.g. ``("dp", "tp")``; ``mesh["tp"]`` then
            gives the 1-D sub-mesh.
        **kwargs: further keyword arguments of torch's ``init_device_mesh``.

    Returns:
        The ``DeviceMesh``; every rank of the world must call this together.

    Raises:
        RuntimeError: (from torch) the mesh size does not match the world size, or the
            device type's backend is unavailable.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        fully_shard(model, mesh=mesh["dp"])
    """
    return _torch_init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names, **kwargs)
