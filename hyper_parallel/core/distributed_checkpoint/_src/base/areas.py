"""Areas: HyperParallel's spelling of a box, ``((start, end), ...)`` one half-open range per dim.

HyperParallel's helpers (``utils.infer_intersection``, ``chunk_to_area``, ``reshard.ReshardHandler``)
pass a tensor region as an area; inside this package the same region is a :class:`.box.Box`
(offsets and sizes). This module converts between the two and answers HyperParallel's area
questions with the box arithmetic, so there is one intersection rule, not two.
Not here: anything about ranks or layouts (:mod:`..sharding`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .box import Box

Area = tuple[tuple[int, int], ...]

__all__ = ["Area", "area_to_box", "box_to_area", "infer_intersection", "chunk_to_area", "narrow_tensor_by_index"]


def _check_area(area: Any, name: str) -> None:
    if not isinstance(area, (tuple, list)):
        raise TypeError(f"{name} must be a tuple of (start, end) ranges, one per dim; found {type(area).__name__}")
    for d, rng in enumerate(area):
        if not isinstance(rng, (tuple, list)) or len(rng) != 2:
            raise TypeError(f"{name}: dim {d} must be a 2-element (start, end) range, found {rng!r}")


def area_to_box(area: Sequence[Sequence[int]]) -> Box:
    """The box of ``area``; an inverted range (end before start) is an empty dim."""
    return Box(tuple(int(s) for s, _ in area), tuple(max(0, int(e) - int(s)) for s, e in area))


def box_to_area(box: Box) -> Area:
    """``box`` as half-open ``(start, end)`` ranges."""
    return tuple((o, o + s) for o, s in zip(box.offsets, box.sizes, strict=True))


def infer_intersection(area_a: Sequence[Sequence[int]], area_b: Sequence[Sequence[int]]) -> Area | None:
    """The area two areas share, or None when they share no element.

    Args:
        area_a: ``((start, end), ...)``, one half-open range per dim.
        area_b: the same, with as many dims.

    Raises:
        TypeError: an area is not a sequence of 2-element ranges.
        ValueError: the areas have different numbers of dims.

    Example::

        infer_intersection(((0, 4),), ((2, 6),))   # ((2, 4),)
    """
    _check_area(area_a, "area_a")
    _check_area(area_b, "area_b")
    if len(area_a) != len(area_b):
        raise ValueError(f"areas of different dims cannot intersect: area_a has {len(area_a)} dims "
                         f"{tuple(area_a)}, area_b has {len(area_b)} {tuple(area_b)}")
    cut = area_to_box(area_a).intersect(area_to_box(area_b))
    return None if cut is None else box_to_area(cut)


def chunk_to_area(chunk: Any) -> Area:
    """The area of a chunk record (anything with ``offsets`` and ``sizes``, e.g. torch's
    ``ChunkStorageMetadata``). Example: offsets (2, 0), sizes (4, 8) -> ((2, 6), (0, 8))."""
    return box_to_area(Box(tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)))


def narrow_tensor_by_index(tensor: Any, offsets: Sequence[int], lengths: Sequence[int]) -> Any:
    """The view of ``tensor`` at ``offsets`` with ``lengths`` per dim (basic slicing, so a
    torch tensor or a numpy array gives a view). Empty ``offsets`` or ``lengths`` mean the
    whole tensor, as in HyperParallel's DCP.

    Raises:
        ValueError: ``offsets`` and ``lengths`` differ in length, or name more dims than ``tensor`` has.
    """
    if not offsets or not lengths:
        return tensor
    if len(offsets) != len(lengths) or len(offsets) > len(tensor.shape):
        raise ValueError(f"offsets {tuple(offsets)} and lengths {tuple(lengths)} must have one entry per dim, "
                         f"at most the {len(tensor.shape)} dims of the tensor (shape {tuple(tensor.shape)})")
    return tensor[tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offsets, lengths, strict=True))]
