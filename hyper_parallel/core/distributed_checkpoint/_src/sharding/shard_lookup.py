"""Find a state dict's object, or a rank's shard of it, by torch DCP's ``MetadataIndex``.

torch's ``utils.find_state_dict_object`` / ``find_tensor_shard``: an index names a key
(``fqn``) and, for a sharded value, the global offset of the chunk wanted; no offset means the
whole value (for HyperParallel's index, whose offset defaults to ``()``, an empty offset of a
tensor with dimensions means the same). What answers, by the value's kind:

- a DTensor: its local tensor, when this rank's chunk starts at the offset (its box from
  :func:`.records.dtensor_box`) or no offset is given;
- a ShardedTensor: the tensor of its local shard that starts at the offset (the index's
  ``index`` hint is tried first, as torch does); an offset is required, a rank may hold several;
- a tensor that answers torch's ``__get_tensor_shard__`` (torch's ``_Checkpointable``, e.g.
  ``LocalShardsWrapper``): whatever it answers;
- a plain tensor: itself, at the origin or with no offset; any other value: itself, with no offset.

A miss raises :class:`.StateDictLookupError` (a ``ValueError``, as torch's are) naming the key,
the offset asked and what this rank holds. Not here: reading anything from a checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..base.errors import StateDictLookupError
from .records import dtensor_box
from .sharded_tensor import is_sharded_tensor

__all__ = ["find_tensor_shard", "find_state_dict_object"]


def _wanted_offset(index: Any, ndim: int) -> tuple[int, ...] | None:
    """The offset ``index`` asks for in a tensor of ``ndim`` dimensions, or None for "the whole
    value": torch's ``offset=None``, or HyperParallel's default ``()`` where ``()`` is not the
    origin (for a 0-d tensor ``()`` is the origin, and both readings give the same chunk)."""
    if index.offset is None:
        return None
    offset = tuple(int(o) for o in index.offset)
    return None if not offset and ndim else offset


def _sharded_tensor_shard(tensor: Any, index: Any, offset: tuple[int, ...] | None) -> torch.Tensor:
    """The tensor of the local shard of a ShardedTensor that starts at ``offset``."""
    shards = tensor.local_shards()
    held = [tuple(int(o) for o in s.metadata.shard_offsets) for s in shards]
    if offset is None:
        raise StateDictLookupError(
            f"{index.fqn!r} is a ShardedTensor and no offset was provided: say which of this rank's shards "
            f"(at offsets {held}) with MetadataIndex({index.fqn!r}, offset)")
    hint = index.index
    if hint is not None and 0 <= hint < len(shards) and held[hint] == offset:
        return shards[hint].tensor
    for at, shard in zip(held, shards, strict=True):
        if at == offset:
            return shard.tensor
    raise StateDictLookupError(
        f"Could not find shard at offsets {offset} for FQN {index.fqn!r}: this rank's local shards of the "
        f"ShardedTensor start at {held}")


def find_tensor_shard(tensor: torch.Tensor, index: Any) -> torch.Tensor:
    """The part of ``tensor`` this rank holds at ``index.offset`` (torch's ``MetadataIndex``).

    A DTensor gives its local tensor if this rank's chunk starts at ``index.offset`` (or the
    index has no offset); a ShardedTensor the tensor of its local shard starting there; a plain
    tensor itself, at the origin or with no offset.

    Raises:
        StateDictLookupError: this rank holds no chunk of ``index.fqn`` at that offset, or a
            ShardedTensor is asked for without one.

    Example::

        local = find_tensor_shard(dtensor, MetadataIndex("w", torch.Size([4, 0])))
    """
    offset = _wanted_offset(index, len(tensor.size()))
    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        if hasattr(local, "__get_tensor_shard__"):  # a DTensor over torch's LocalShardsWrapper
            return local.__get_tensor_shard__(index)
        box = dtensor_box(tensor, index.fqn)
        if offset is None or (box is not None and box.offsets == offset):
            return tensor.to_local()
        held = f"its chunk at offsets {box.offsets}" if box is not None else "no chunk of it"
        raise StateDictLookupError(f"{index.fqn!r}: no shard at offsets {offset} on this rank, which holds {held}")
    if is_sharded_tensor(tensor):
        return _sharded_tensor_shard(tensor, index, offset)
    if hasattr(tensor, "__get_tensor_shard__"):
        return tensor.__get_tensor_shard__(index)
    if offset is None or offset == (0,) * len(tensor.size()):
        return tensor
    raise StateDictLookupError(
        f"{index.fqn!r} is a plain tensor of shape {tuple(tensor.shape)}, whole on this rank (not a ShardedTensor "
        f"or DTensor); it has no chunk at offsets {offset} (only at the origin)")


def find_state_dict_object(state_dict: dict[str, Any], index: Any) -> Any:
    """The value of ``state_dict[index.fqn]``, narrowed to this rank's shard for a tensor.

    Raises:
        StateDictLookupError: ``index.fqn`` is not a key, or no chunk of it starts at ``index.offset``.

    Example::

        find_state_dict_object({"step": 7}, MetadataIndex("step"))  # 7
    """
    if index.fqn not in state_dict:
        raise StateDictLookupError(
            f"Could not find FQN {index.fqn!r}: it is not one of the state dict's {len(state_dict)} keys")
    obj = state_dict[index.fqn]
    if isinstance(obj, torch.Tensor):
        return find_tensor_shard(obj, index)
    if index.offset:
        raise StateDictLookupError(
            f"{index.fqn!r} is a {type(obj).__name__}, not a tensor (nor a ShardedTensor or DTensor); it has no chunk "
            f"at offsets {tuple(index.offset)}")
    return obj
