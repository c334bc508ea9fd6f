"""RaggedShard: a flat, uneven shard of a tensor, and the ordinary boxes it is saved as.

HyperParallel's ``RaggedShard(dims, local_units)`` splits the row-major flattening of a
tensor's leading ``dims`` (a prefix ``0..k-1``) into contiguous runs, one per rank of one mesh
dim: rank ``i`` holds ``local_units[i]`` units, a unit being ``prod(shape[:k]) //
sum(local_units)`` prefix cells (each cell a whole ``shape[k:]`` slice). A rank may hold no
units. The local tensor is the rank's run as a flat 1-d tensor.

Such a run is no box of the tensor, but it is a union of at most ``2 * ndim - 1`` boxes
(:func:`flat_range_boxes`: a partial row, whole rows, a partial row, recursively), so a
checkpoint stores a RaggedShard tensor as ordinary chunks: the format, and every reader of
it, are unchanged. In memory, the save's layout record names the placement
``RS(<dims>;<local_units>)`` (:func:`ragged_name`); that name is never written to
``.metadata`` (its entries keep no layout, and a table store lists the boxes).

Representation: torch's ``DTensor`` takes a custom :class:`~torch.distributed.tensor.Placement`
as long as the global shape (and stride) are given: ``DTensor.from_local(flat, mesh,
(RaggedShard((0,), (1, 3)),), shape=(8, 16))`` keeps ``flat`` as its local tensor and
``(8, 16)`` as its shape. Torch's own sharding math does not know the placement
(``__create_chunk_list__`` would call it replicated), so this package computes the boxes
itself; DTensor operators that redistribute are not supported on such a tensor.

Supported layouts (as HyperParallel's first phase): one RaggedShard mesh dim, every other mesh
dim ``Replicate``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from ..base.box import Box

__all__ = ["RaggedShard", "is_ragged", "ragged_name", "ragged_from_name", "ragged_mesh_dim",
           "flat_range_boxes", "rank_flat_range", "RaggedPiece"]


class RaggedShard(Placement):
    """A flat, uneven shard over the leading ``dims`` of a tensor (HyperParallel's placement).

    Args:
        dims: the prefix of tensor dims whose row-major cells are split: ``(0,)``, ``(0, 1)``...
        local_units: the units each rank of the mesh dim holds, one per rank, ``>= 0``, with a
            positive sum; ``prod(shape[:len(dims)])`` must be a multiple of the sum.

    Raises:
        ValueError: ``dims`` is not a non-empty prefix ``(0, .., k-1)``, or ``local_units`` is
            not a non-empty tuple of non-negative ints with a positive sum.

    Example::

        # (8, 16) rows split 1:3 over two ranks: rank 0 holds rows 0-1, rank 1 rows 2-7,
        # each as a flat tensor (32 and 96 elements)
        p = RaggedShard(dims=(0,), local_units=(1, 3))
        t = DTensor.from_local(flat, mesh, (p,), shape=(8, 16), stride=(16, 1))
    """

    def __init__(self, dims: tuple[int, ...], local_units: tuple[int, ...]) -> None:
        super().__init__()
        dims = tuple(dims) if isinstance(dims, list) else dims
        local_units = tuple(local_units) if isinstance(local_units, list) else local_units
        if not isinstance(dims, tuple) or not dims or any(type(d) is not int for d in dims):
            raise ValueError(f"RaggedShard dims must be a non-empty tuple of ints, got {dims!r}")
        if dims != tuple(range(len(dims))):
            raise ValueError(f"RaggedShard dims must be the leading dims (0, 1, ..), got {dims!r}")
        if (not isinstance(local_units, tuple) or not local_units
                or any(type(u) is not int or u < 0 for u in local_units) or sum(local_units) <= 0):
            raise ValueError("RaggedShard local_units must be a non-empty tuple of non-negative ints with a "
                             f"positive sum (one per rank of the mesh dim), got {local_units!r}")
        self._dims = dims
        self._local_units = local_units

    @property
    def dims(self) -> tuple[int, ...]:
        """The leading tensor dims whose cells are split."""
        return self._dims

    @property
    def local_units(self) -> tuple[int, ...]:
        """Units held by each rank of the mesh dim."""
        return self._local_units

    def is_ragged_shard(self) -> bool:
        """True: this placement is a RaggedShard (HyperParallel's predicate)."""
        return True

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (self.dims, self.local_units) == (other.dims, other.local_units)

    def __hash__(self) -> int:
        return hash(("RaggedShard", self._dims, self._local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self._dims!r}, local_units={self._local_units!r})"

    def __str__(self) -> str:
        return ragged_name(self)


def is_ragged(p: Any) -> bool:
    """True for a :class:`RaggedShard` placement."""
    return isinstance(p, RaggedShard)


_NAME = re.compile(r"^RS\(([\d,]+);([\d,]+)\)$")


def ragged_name(p: RaggedShard) -> str:
    """The in-memory layout-record name: ``RS(0,1;1,3)`` (dims, then local units)."""
    return f"RS({','.join(map(str, p.dims))};{','.join(map(str, p.local_units))})"


def ragged_from_name(name: Any) -> RaggedShard | None:
    """The placement a :func:`ragged_name` names; None for any other name."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        return None
    return RaggedShard(tuple(int(x) for x in m.group(1).split(",")), tuple(int(x) for x in m.group(2).split(",")))


def ragged_mesh_dim(placements: Sequence[Any], key: str = "") -> int | None:
    """The mesh dim of the one RaggedShard among ``placements`` (objects or record names); None
    when there is none.

    Raises:
        ValueError: more than one RaggedShard, or another mesh dim that is not ``Replicate``.
    """
    found = [i for i, p in enumerate(placements) if is_ragged(p) or ragged_from_name(p) is not None]
    if not found:
        return None
    where = f"{key!r}: " if key else ""
    if len(found) > 1:
        raise ValueError(f"{where}at most one RaggedShard placement is supported, got {list(placements)}")
    others = [p for i, p in enumerate(placements) if i != found[0] and p not in ("R",) and
              not (hasattr(p, "is_replicate") and p.is_replicate())]
    if others:
        raise ValueError(f"{where}a RaggedShard DTensor may have only Replicate on its other mesh dims, got "
                         f"{list(placements)}")
    return found[0]


def rank_flat_range(shape: Sequence[int], p: RaggedShard, index: int, key: str = "") -> tuple[int, int]:
    """The flat element range ``[start, end)`` that rank ``index`` of the mesh dim holds.

    Raises:
        ValueError: ``dims`` exceeds the tensor, or the prefix cells are no multiple of the units.
    """
    shape = tuple(int(s) for s in shape)
    where = f"{key!r}: " if key else ""
    k = len(p.dims)
    if k > len(shape):
        raise ValueError(f"{where}RaggedShard dims {p.dims} exceed the {len(shape)}-d shape {list(shape)}")
    if not 0 <= index < len(p.local_units):
        raise ValueError(f"{where}RaggedShard rank {index} outside local_units {p.local_units}")
    cells, units = math.prod(shape[:k]), sum(p.local_units)
    if cells % units:
        raise ValueError(f"{where}RaggedShard over {cells} prefix cells of shape {list(shape)} needs a multiple "
                         f"of sum(local_units) = {units} (local_units {p.local_units})")
    per_unit = cells // units * math.prod(shape[k:])
    start = sum(p.local_units[:index]) * per_unit
    return start, start + p.local_units[index] * per_unit


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes whose union is the row-major flat range ``[start, end)`` of ``shape``, in order.

    Each box's elements, row-major, are the next run of the range, so the range's flat data
    is the boxes' data one after the other. At most ``2 * ndim - 1`` boxes: per dim, going
    down, a partial leading piece; then one box of whole slabs; then, going up, a partial
    trailing piece. An empty range has no boxes.

    Raises:
        ValueError: a 0-d shape, or a range outside ``[0, numel]``.
    """
    shape = tuple(int(s) for s in shape)
    if not shape:
        raise ValueError("a flat range needs a tensor of at least one dim")
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"flat range [{start}, {end}) is outside the {total} elements of shape {list(shape)}")
    if start == end:
        return []
    ndim = len(shape)
    strides = [math.prod(shape[d + 1:]) for d in range(ndim)]
    head: list[Box] = []
    pos = start
    # Going down: while pos is not aligned to the slab of dim d (and the range passes the end of
    # that slab), fill the rest of the slab of dim d+1 ... one dim at a time, finest first.
    # Work from the finest dim up to find where pos stops being aligned.
    for d in range(ndim - 1, 0, -1):
        slab = strides[d - 1]  # elements in one index of dim d-1 (a whole slab below it)
        rem = pos % slab
        if rem == 0:
            continue
        nxt = pos - rem + slab  # the next slab boundary
        if nxt > end:
            break
        # fill from pos to nxt with indices of dim d (pos is aligned to strides[d] by now)
        head.append(_run(shape, strides, pos, (nxt - pos) // strides[d], d))
        pos = nxt
    # Now pos is aligned to the largest slab that still fits; emit whole runs, coarsest first.
    tail: list[Box] = []
    for d in range(ndim):
        n = (end - pos) // strides[d]
        if n and pos % strides[d] == 0:
            tail.append(_run(shape, strides, pos, n, d))
            pos += n * strides[d]
        if pos == end:
            break
    if pos != end:  # pragma: no cover - the loops above always reach the end
        raise AssertionError(f"flat range [{start}, {end}) of {list(shape)} not decomposed (stopped at {pos})")
    return head + tail


def _run(shape: tuple[int, ...], strides: list[int], pos: int, count: int, d: int) -> Box:
    """The box of ``count`` consecutive indices of dim ``d`` starting at flat ``pos`` (aligned to dim d)."""
    offsets = []
    rest = pos
    for s in strides:
        q, rest = divmod(rest, s)
        offsets.append(q)
    sizes = [1] * d + [count] + list(shape[d + 1:])
    return Box(tuple(offsets), tuple(sizes))


class RaggedPiece:
    """A rank's flat local tensor with the global boxes it is saved as (or loaded into).

    ``boxes[i]`` holds the elements ``[starts[i], starts[i] + boxes[i].numel)`` of ``flat``.
    :meth:`view` gives a box's data as a tensor of the box's shape (a view of ``flat``).
    """

    def __init__(self, flat: Any, boxes: list[Box]):
        self.flat = flat
        self.boxes = boxes
        self.starts: dict[Box, int] = {}
        at = 0
        for b in boxes:
            self.starts[b] = at
            at += b.numel

    def view(self, box: Box) -> Any:
        """The local data of ``box`` (one of :attr:`boxes`), shaped as the box."""
        at = self.starts.get(box)
        if at is None:
            raise KeyError(f"box {box} is not one of this rank's ragged boxes {self.boxes}")
        return self.flat.reshape(-1)[at:at + box.numel].view(box.sizes)
