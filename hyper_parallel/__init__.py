"""hyper-parallel: parallel training building blocks on PyTorch.

The entry points below are torch's own DeviceMesh, FSDP2 and DTensor, re-exported so that
HyperParallel code reads the same on every device ("cpu", "cuda", "npu" pass through).
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
    """Create a torch ``DeviceMesh`` over the initialised process group.

    Args:
        device_type: "cpu", "cuda", "npu" (Ascend, needs torch_npu) or any torch device type.
        mesh_shape: ranks per mesh dimension, e.g. ``(dp_size,)`` or ``(dp, tp)``.
        mesh_dim_names: a name per dimension, e.g. ``("dp", "tp")``.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    """
    return _torch_init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names, **kwargs)
