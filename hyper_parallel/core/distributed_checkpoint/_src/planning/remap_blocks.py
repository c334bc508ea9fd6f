"""A box of a destination tensor read from a checkpoint tensor through an affine index map.

A :class:`RemapBlock` says: the destination elements ``x`` with ``offsets <= x < offsets +
lengths`` come from the checkpoint tensor ``source`` at index ``base + coeff @ (x - offsets)``.
``coeff`` has one row per checkpoint dimension and one column per destination dimension, all
entries non-negative, so the elements a box reads always form a box of the checkpoint tensor
(its *region*: the first element at ``base``, the last at ``base + coeff @ (lengths - 1)``).
Examples, for a destination of shape ``(m, n)``:

- ``coeff=((1, 0), (0, 1))``: rows and columns one to one (a plain copy of a region);
- ``coeff=((0, 1), (1, 0))``: a transpose;
- ``coeff=((2, 0), (0, 1))``: every other row (de-interleaving a fused tensor);
- ``coeff=((0, 0), (0, 1))``: one checkpoint row repeated down the box.

``post`` holds elementwise operations (``tensor -> tensor``) run, in order, on the values read,
in the checkpoint's dtype, before they are cast to the destination's.

This module is the geometry: where a part of a block reads from (:meth:`RemapBlock.cut`), and
how the values land in the destination, straight (:func:`direct_view`, when every walked
destination dimension steps one checkpoint dimension of its own by one and there is no
``post``) or gathered out of a buffer holding the region (:func:`gather`). What to read per
rank and when is the planner's (:mod:`.remap`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from ..base.box import Box

__all__ = ["RemapBlock", "BlockPiece", "direct_view", "gather"]


def _ints(values: Any, what: str, source: str) -> tuple[int, ...]:
    """``values`` as a tuple of ints (torch.Size and numpy integers welcome; floats and bools not)."""
    try:
        items = list(values)
        if any(isinstance(v, (bool, float)) for v in items):
            raise TypeError
        return tuple(int(v) for v in items)
    except (TypeError, ValueError):
        raise ValueError(f"RemapBlock of {source!r}: {what} must be a sequence of integers, got {values!r}") from None


@dataclass(frozen=True)
class RemapBlock:
    """A box of a destination tensor and the checkpoint elements it is read from.

    Args:
        offsets: where the box starts in the whole destination tensor (non-negative).
        lengths: the box's size, one positive length per offset.
        source: the checkpoint tensor's name.
        base: the checkpoint index the box's first element comes from (non-negative).
        coeff: non-negative steps, one row per checkpoint dimension (as many as ``base``) and one
            column per destination dimension.
        post: elementwise operations applied in order to the values read, in the checkpoint's
            dtype, before the cast to the destination's dtype. Default ().

    Raises:
        ValueError: the parts disagree on a number of dimensions, a length is not positive, an
            offset or ``base`` is negative, a step is negative (the map would walk backwards), or a
            post operation is not callable. The message names ``source``.

    Example::

        # rows 4..5 of a fused (6, 3) tensor are the (2, 3) checkpoint tensor "k"
        RemapBlock(offsets=(4, 0), lengths=(2, 3), source="k", base=(0, 0), coeff=((1, 0), (0, 1)))
    """

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    source: str
    base: tuple[int, ...]
    coeff: tuple[tuple[int, ...], ...]
    post: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = ()

    def __post_init__(self) -> None:
        source = self.source
        if not isinstance(source, str) or not source:
            raise ValueError(f"RemapBlock needs the checkpoint tensor's name as source, got {source!r}")
        offsets = _ints(self.offsets, "offsets", source)
        lengths = _ints(self.lengths, "lengths", source)
        base = _ints(self.base, "base", source)
        if not isinstance(self.coeff, Sequence):
            raise ValueError(f"RemapBlock of {source!r}: coeff must be rows of integers, got {self.coeff!r}")
        rows = tuple(_ints(row, "each row of coeff", source) for row in self.coeff)
        post = tuple(self.post) if isinstance(self.post, (tuple, list)) else (self.post,)
        if len(lengths) != len(offsets) or any(n <= 0 for n in lengths) or any(o < 0 for o in offsets):
            raise ValueError(f"RemapBlock of {source!r} needs one positive length per non-negative offset, "
                             f"got offsets={offsets} lengths={lengths}")
        if len(rows) != len(base) or any(len(row) != len(offsets) for row in rows):
            raise ValueError(f"RemapBlock of {source!r} needs one row of coeff per entry of base (a checkpoint "
                             f"dimension), each with {len(offsets)} steps (one per destination dimension), "
                             f"got base={base} coeff={rows}")
        if any(step < 0 for row in rows for step in row):
            raise ValueError(f"RemapBlock of {source!r}: coeff={rows} has a negative step, which would read the "
                             "checkpoint backwards; describe the block from its other end instead")
        if any(b < 0 for b in base):
            raise ValueError(f"RemapBlock of {source!r}: base={base} has a negative index")
        if not all(callable(op) for op in post):
            raise ValueError(f"RemapBlock of {source!r}: every post operation must be callable, got {post!r}")
        for name, value in (("offsets", offsets), ("lengths", lengths), ("base", base), ("coeff", rows),
                            ("post", post)):
            object.__setattr__(self, name, value)

    def with_source(self, source: str) -> RemapBlock:
        """This block reading ``source`` instead: the same geometry, already checked, so only the
        name is (a planner reusing one layer's blocks for the next builds thousands of these).

        Raises:
            ValueError: ``source`` is not a non-empty string.
        """
        if not isinstance(source, str) or not source:
            raise ValueError(f"RemapBlock needs the checkpoint tensor's name as source, got {source!r}")
        copy = object.__new__(RemapBlock)
        copy.__dict__.update(self.__dict__)
        object.__setattr__(copy, "source", source)
        return copy

    @cached_property
    def box(self) -> Box:
        """The destination box the block fills (global coordinates); made once, planning asks often."""
        return Box(self.offsets, self.lengths)

    @cached_property
    def whole_region(self) -> Box:
        """The checkpoint region the whole block reads (:meth:`region` of :attr:`box`), made once."""
        return self.region(self.box)

    def region(self, part: Box) -> Box:
        """The checkpoint region the destination box ``part`` (inside :attr:`box`) reads, gaps
        included: from the index of ``part``'s first element to that of its last."""
        steps = [o - b for o, b in zip(part.offsets, self.offsets, strict=True)]
        start = tuple(b + sum(c * s for c, s in zip(row, steps, strict=True)) for b, row in zip(
            self.base, self.coeff, strict=True))
        extent = tuple(1 + sum(c * (n - 1) for c, n in zip(row, part.sizes, strict=True)) for row in self.coeff)
        return Box(start, extent)

    def cut(self, within: Box) -> BlockPiece | None:
        """The part of this block inside the destination box ``within`` (e.g. a rank's shard),
        or None when they do not overlap."""
        part = self.box.intersect(within)
        return None if part is None else BlockPiece(self, part, self.region(part), self._direct_axes(part.sizes))

    def _direct_axes(self, sizes: Sequence[int]) -> tuple[int, ...] | None:
        """For a box of ``sizes``: the destination axis each checkpoint dimension walks (-1 for
        none), when the values can be copied straight into place; None when they must be gathered."""
        if self.post:
            return None
        walker = [-1] * len(self.coeff)
        for axis, n in enumerate(sizes):
            if n == 1:
                continue  # a dimension the box does not walk reads one element whatever its steps
            walked = [d for d, row in enumerate(self.coeff) if row[axis]]
            if len(walked) != 1 or self.coeff[walked[0]][axis] != 1 or walker[walked[0]] != -1:
                return None
            walker[walked[0]] = axis
        return tuple(walker)


@dataclass(frozen=True)
class BlockPiece:
    """The part of a block inside one destination box: ``dest`` (global destination
    coordinates), the checkpoint ``region`` it reads, and ``walker`` (for a piece copied straight
    into place, the destination axis each checkpoint dimension walks, -1 for none; None for a
    piece gathered from a buffer)."""

    block: RemapBlock
    dest: Box
    region: Box
    walker: tuple[int, ...] | None

    @property
    def direct(self) -> bool:
        return self.walker is not None

    def dest_part(self, region_part: Box) -> Box:
        """For a direct piece: the destination box a sub-box of its region lands in."""
        offsets, sizes = list(self.dest.offsets), list(self.dest.sizes)
        for d, axis in enumerate(self.walker or ()):
            if axis >= 0:
                offsets[axis] += region_part.offsets[d] - self.region.offsets[d]
                sizes[axis] = region_part.sizes[d]
        return Box(tuple(offsets), tuple(sizes))


def direct_view(dest: torch.Tensor, walker: tuple[int, ...], region_sizes: tuple[int, ...]) -> torch.Tensor:
    """A view of the destination box ``dest`` in the shape and dimension order of the checkpoint
    region it is read from (``walker`` from :class:`BlockPiece`), so a copy into it writes the
    destination.

    Only the order of the dimensions changes and dimensions of size one come or go, so the result
    is always a view (``view`` raises rather than copy, should that ever not hold).
    """
    walked = [axis for axis in walker if axis >= 0]
    order = walked + [axis for axis in range(dest.dim()) if axis not in walked]
    if order != sorted(order):
        dest = dest.permute(order)
    return dest.view(region_sizes)


def gather(piece: BlockPiece, region: torch.Tensor) -> torch.Tensor:
    """The values of a piece's destination box, in destination order, picked out of ``region``
    (the piece's checkpoint region, any strides) with the block's ``post`` operations applied.

    Raises:
        ValueError: a post operation changed the shape (it must be elementwise); names the source.
    """
    block = piece.block
    strides = tuple(sum(row[axis] * step for row, step in zip(block.coeff, region.stride(), strict=True))
                    for axis in range(piece.dest.ndim))
    values = region.as_strided(piece.dest.sizes, strides, region.storage_offset())
    if block.post:
        values = values.contiguous()  # elements the map repeats share memory; give each op its own
        for op in block.post:
            values = op(values)
            if not isinstance(values, torch.Tensor) or tuple(values.shape) != piece.dest.sizes:
                got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
                raise ValueError(f"a post operation of the block reading {block.source!r} returned {got}, expected "
                                 f"a tensor of shape {piece.dest.sizes}: post operations must be elementwise")
    return values
