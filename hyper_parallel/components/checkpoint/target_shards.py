"""A whole converted tensor put into a model tensor that may hold only a shard of it.

The legacy loader, and :class:`HFLoadPlanner` for the conversions it runs on real tensors,
produce whole tensors; a model tensor is a plain tensor (takes it whole) or a DTensor (takes the
part its placements give this rank, exactly as ``distribute_tensor`` cuts it, without any
communication). The value is cast to the model tensor's dtype and copied in place.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, distribute_tensor

__all__ = ["local_part", "check_target", "copy_into_target"]


def local_part(target: torch.Tensor) -> torch.Tensor:
    """The values of ``target`` this rank holds."""
    return target.to_local() if isinstance(target, DTensor) else target


def check_target(name: str, target: Any, shape: tuple[int, ...]) -> None:
    """Refuse a model tensor that cannot take a value of ``shape``: still on the meta device, a
    ``Partial`` placement (a sum of values, not a value), or another global shape."""
    if local_part(target).is_meta:
        raise ValueError(f"model tensor {name!r} is on the meta device; materialize the model (e.g. to_empty) "
                         "before loading weights into it")
    if isinstance(target, DTensor) and any(isinstance(p, Partial) for p in target.placements):
        raise ValueError(f"model tensor {name!r} has a Partial placement {target.placements}; pretrained weights load "
                         "into Shard or Replicate placements only")
    if tuple(target.shape) != tuple(shape):
        raise ValueError(f"shape mismatch for model tensor {name!r}: the checkpoint gives {tuple(shape)}, the model "
                         f"has {tuple(target.shape)}")


def copy_into_target(name: str, whole: torch.Tensor, target: torch.Tensor) -> None:
    """Copy this rank's part of ``whole`` into ``target`` (cast to its dtype)."""
    check_target(name, target, tuple(whole.shape))
    if isinstance(target, DTensor):
        part = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None).to_local()
    else:
        part = whole
    destination = local_part(target)
    with torch.no_grad():
        destination.copy_(part.to(device=destination.device, dtype=destination.dtype))
