"""Find a state dict's object, or a rank's shard of it, by torch DCP's ``MetadataIndex``.

torch's ``utils.find_state_dict_object`` / ``find_tensor_shard``: an index names a key
(``fqn``) and, for a sharded tensor, the global offset of the chunk wanted. A DTensor answers
with its local tensor when this rank's chunk starts at that offset (its box from
:func:`.records.dtensor_box`); a plain tensor only at the origin. Not here: reading anything
from a checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..base.errors import StateDictMismatchError
from .records import dtensor_box

__all__ = ["find_tensor_shard", "find_state_dict_object"]


def find_tensor_shard(tensor: torch.Tensor, index: Any) -> torch.Tensor:
    """The part of ``tensor`` this rank holds at ``index.offset`` (torch's ``MetadataIndex``).

    A DTensor gives its local tensor if this rank's chunk starts at ``index.offset`` (or the
    index has no offset); a plain tensor gives itself, at the origin or with no offset.

    Raises:
        StateDictMismatchError: this rank holds no chunk of ``index.fqn`` at that offset.

    Example::

        local = find_tensor_shard(dtensor, MetadataIndex("w", torch.Size([4, 0])))
    """
    offset = None if index.offset is None else tuple(int(o) for o in index.offset)
    if isinstance(tensor, DTensor):
        box = dtensor_box(tensor, index.fqn)
        if offset is None or (box is not None and box.offsets == offset):
            return tensor.to_local()
        held = f"its chunk at offsets {box.offsets}" if box is not None else "no chunk of it"
        raise StateDictMismatchError(f"{index.fqn!r}: no shard at offsets {offset} on this rank, which holds {held}")
    if offset is None or offset == (0,) * tensor.dim():
        return tensor
    raise StateDictMismatchError(
        f"{index.fqn!r} is a plain tensor of shape {tuple(tensor.shape)}, whole on this rank; it has no chunk at "
        f"offsets {offset} (only at the origin)")


def find_state_dict_object(state_dict: dict[str, Any], index: Any) -> Any:
    """The value of ``state_dict[index.fqn]``, narrowed to this rank's shard for a tensor.

    Raises:
        StateDictMismatchError: ``index.fqn`` is not a key, or no chunk of it starts at ``index.offset``.
    """
    if index.fqn not in state_dict:
        raise StateDictMismatchError(f"{index.fqn!r} is not a key of the state dict (it has {len(state_dict)} keys)")
    obj = state_dict[index.fqn]
    if isinstance(obj, torch.Tensor):
        return find_tensor_shard(obj, index)
    if index.offset is not None:
        raise StateDictMismatchError(
            f"{index.fqn!r} is a {type(obj).__name__}, not a tensor; it has no chunk at offsets {tuple(index.offset)}")
    return obj
