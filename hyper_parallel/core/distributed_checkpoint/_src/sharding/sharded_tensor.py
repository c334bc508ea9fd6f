"""ShardedTensor: torch's legacy sharded value (FSDP1 ``SHARDED_STATE_DICT``, torchrec), as boxes.

A ``torch.distributed._shard.sharded_tensor.ShardedTensor`` carries on every rank the metadata
of all its shards (global offsets, sizes, and the global rank that holds each: uneven shards,
and several per rank, are allowed), and on each rank the plain tensors of its own shards. A
checkpoint stores it as ordinary chunks, one per shard, so the format and every reader are
unchanged: a later load may reshard it into DTensors or plain tensors, and a ShardedTensor
target may be filled from any saved layout.

In memory, the save describes such a tensor with a *shard table* record (:func:`shard_table`):
``{"shards": [[group rank, offsets, sizes], ...]}`` in box order, the same on every rank. The
global plan makes each shard's holder its writer; the record is never written to
``.metadata`` (the entry keeps no layout and a table store lists the boxes). A rank's own
shards are a :class:`ShardPieces` (boxes and the tensors that hold them), which the planner
writes from and loads into in place.

What it is not: DTensor layouts (:mod:`.records`), the global plan (:mod:`..planning.global_plan`).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorBase, ShardedTensorMetadata

from ..base.box import Box
from ..base.errors import UnsupportedValueError

__all__ = ["is_sharded_tensor", "is_shard_table", "shard_table", "table_shards", "ShardPieces", "local_pieces",
           "local_tensors", "host_snapshot"]


def is_sharded_tensor(value: object) -> bool:
    """True for torch's ShardedTensor (and its base class)."""
    return isinstance(value, ShardedTensorBase)


def is_shard_table(layout: dict[str, Any] | None) -> bool:
    """True for a layout record made by :func:`shard_table`."""
    return layout is not None and "shards" in layout


def _global_shards(t: ShardedTensorBase, key: str) -> list[tuple[int, Box]]:
    """Every shard of ``t`` as (global rank, box), checked against the global shape."""
    shape = tuple(t.size())
    out = []
    for m in t.metadata().shards_metadata:
        offsets, sizes = tuple(int(o) for o in m.shard_offsets), tuple(int(s) for s in m.shard_sizes)
        rank = m.placement.rank() if m.placement is not None else None
        if rank is None:
            raise UnsupportedValueError(f"{key!r}: a ShardedTensor shard at {list(offsets)} has no rank in its "
                                        f"placement ({m.placement}); only rank placements ('rank:N/device') are "
                                        "supported")
        if (len(offsets) != len(shape) or len(sizes) != len(shape)
                or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True))):
            raise UnsupportedValueError(f"{key!r}: ShardedTensor shard at offsets {list(offsets)} sizes {list(sizes)} "
                                        f"does not lie inside its global shape {list(shape)}")
        out.append((int(rank), Box(offsets, sizes)))
    return out


def _check_tiling(key: str, shape: tuple[int, ...], boxes: list[Box]) -> None:
    """The shards must cover the tensor exactly once (no gap, no overlap), or the checkpoint
    would hold two values for an element, or none."""
    ordered = sorted((b for b in boxes if b.numel), key=lambda b: b.offsets)
    if shape:  # a sweep along dim 0: only boxes whose rows overlap can overlap
        active: list[Box] = []
        for b in ordered:
            active = [a for a in active if a.ends[0] > b.offsets[0]]
            for a in active:
                if a.intersect(b) is not None:
                    raise UnsupportedValueError(f"{key!r}: ShardedTensor shards {a} and {b} overlap; each element "
                                                "must belong to exactly one shard")
            active.append(b)
    elif len(ordered) > 1:
        raise UnsupportedValueError(f"{key!r}: a 0-d ShardedTensor has {len(ordered)} shards; it can have one")
    held = sum(b.numel for b in ordered)
    if held != math.prod(shape):
        raise UnsupportedValueError(f"{key!r}: ShardedTensor shards hold {held} of the {math.prod(shape)} elements "
                                    f"of shape {list(shape)}; its shards must cover the whole tensor")


def shard_table(t: ShardedTensorBase, key: str, group_rank: dict[int, int] | None = None) -> dict[str, Any]:
    """The shard table record of ``t``: every non-empty shard as ``[rank, offsets, sizes]``
    in box order, ranks in the saving group's numbering (``group_rank``: global -> group rank).

    Raises:
        UnsupportedValueError: a shard outside the tensor, shards that overlap or leave a gap,
            a shard placed by worker name, or one held by a rank outside the saving group.
    """
    shards = _global_shards(t, key)
    _check_tiling(key, tuple(t.size()), [b for _, b in shards])
    rows = []
    for rank, box in sorted(shards, key=lambda s: (s[1].offsets, s[1].sizes)):
        if not box.numel:
            continue
        if group_rank is not None:
            if rank not in group_rank:
                raise UnsupportedValueError(
                    f"{key!r}: a ShardedTensor shard {box} is held by global rank {rank}, outside the process group "
                    "that saves it; save with a process_group that holds every shard")
            rank = group_rank[rank]
        rows.append([rank, list(box.offsets), list(box.sizes)])
    return {"shards": rows}


def table_shards(layout: dict[str, Any]) -> list[tuple[int, Box]]:
    """The (group rank, box) of each shard of a shard table record, in its order (the table's rows)."""
    return [(r, Box(tuple(o), tuple(s))) for r, o, s in layout["shards"]]


class ShardPieces:
    """A rank's shards of a ShardedTensor: their global :attr:`boxes` and the tensors holding
    them. :meth:`view` gives the data of a box (a view of the shard's own tensor), to write
    from or to fill in place."""

    def __init__(self, boxes: list[Box], tensors: list[torch.Tensor]):
        self.boxes = boxes
        self.tensors = tensors
        self._at = {b: i for i, b in enumerate(boxes)}

    def view(self, box: Box) -> torch.Tensor:
        """The local data of ``box``: one of :attr:`boxes`, or a box inside one of them."""
        i = self._at.get(box)
        if i is not None:
            return self.tensors[i]
        for b, t in zip(self.boxes, self.tensors, strict=True):
            if b.contains(box):
                return t[box.relative_to(b)]
        raise KeyError(f"box {box} lies in none of this rank's ShardedTensor shards {self.boxes}")


def local_pieces(t: ShardedTensorBase, key: str) -> ShardPieces | None:
    """This rank's non-empty shards of ``t`` (None if it holds none).

    Raises:
        UnsupportedValueError: a local shard whose tensor's shape or dtype is not what its
            metadata says, or one that is not a dense tensor.
    """
    boxes, tensors = [], []
    dtype = t.dtype
    for shard in t.local_shards():
        m, local = shard.metadata, shard.tensor
        box = Box(tuple(int(o) for o in m.shard_offsets), tuple(int(s) for s in m.shard_sizes))
        if tuple(local.shape) != box.sizes or local.dtype != dtype:
            raise UnsupportedValueError(
                f"{key!r}: a local ShardedTensor shard at {list(box.offsets)} holds a {local.dtype} tensor of shape "
                f"{list(local.shape)}, but its metadata says {dtype} {list(box.sizes)}")
        if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.is_nested or local.layout != torch.strided:
            raise UnsupportedValueError(f"{key!r}: a local ShardedTensor shard at {list(box.offsets)} is a "
                                        f"{type(local).__name__} ({local.layout}); its shards must be dense tensors")
        if box.numel:
            boxes.append(box)
            tensors.append(local)
    return ShardPieces(boxes, tensors) if boxes else None


def local_tensors(value: Any) -> list[Any]:
    """The tensors a value's data lives in on this rank: a ShardedTensor's local shards, or
    the value itself."""
    if is_sharded_tensor(value):
        return [s.tensor for s in value.local_shards()]
    return [value]


def host_snapshot(value: ShardedTensorBase) -> ShardedTensorBase:
    """A copy of a ShardedTensor whose local shards are copies in host memory (an async save's
    snapshot: the caller may change or free the original as soon as it is taken); the same
    global shards, placed on the CPU of the same ranks."""
    meta = value.metadata()
    cpu = [ShardMetadata(m.shard_offsets, m.shard_sizes, f"rank:{m.placement.rank()}/cpu")
           if m.placement is not None and m.placement.rank() is not None else m for m in meta.shards_metadata]
    props = copy.copy(meta.tensor_properties)
    props.pin_memory = False
    global_meta = ShardedTensorMetadata(cpu, meta.size, props)
    shards = [Shard(s.tensor.detach().to("cpu", copy=True),
                    ShardMetadata(s.metadata.shard_offsets, s.metadata.shard_sizes,
                                  f"rank:{s.metadata.placement.rank()}/cpu"))
              for s in value.local_shards()]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, global_meta, process_group=getattr(value, "_process_group", None))
