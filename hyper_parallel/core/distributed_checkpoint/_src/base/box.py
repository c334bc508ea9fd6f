"""N-d boxes: the unit in which tensors are sharded, saved and resharded.

A box is a hyper-rectangle of a global tensor: ``offsets`` (its first index in every dim)
and ``sizes``. A saved chunk is a box; so is the part of a tensor a rank holds. Loading
under a new layout is intersecting target boxes with saved ones, then copying the overlap,
which the loader reads in whole rows of the saved chunk.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Box:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def full(cls, shape: tuple[int, ...]) -> Box:
        return cls((0,) * len(shape), tuple(shape))

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes, strict=False))

    def intersect(self, other: Box) -> Box | None:
        """The overlap of two boxes, or None when they do not overlap (or one is empty)."""
        # One pass, no generators: planning a load calls this once or twice per saved chunk.
        lo: list[int] = []
        sizes: list[int] = []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=False):
            start = a if a > b else b
            end = min(a + n, b + m)
            if end <= start:
                return None
            lo.append(start)
            sizes.append(end - start)
        return Box(tuple(lo), tuple(sizes))

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + s <= a + t
            for a, t, b, s in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=False)
        )

    def subtract(self, other: Box) -> list[Box]:
        """This box minus ``other``, as disjoint boxes (``[self]`` when they do not overlap)."""
        cut = self.intersect(other)
        if cut is None:
            return [self] if self.numel else []
        out: list[Box] = []
        lo, hi = list(self.offsets), list(self.ends)
        for d in range(self.ndim):  # peel the slabs before and after the cut, dim by dim
            if lo[d] < cut.offsets[d]:
                out.append(Box(tuple(lo[:d]) + (lo[d],) + tuple(lo[d + 1:]),
                               tuple(h - low for low, h in zip(lo[:d], hi[:d], strict=True))
                               + (cut.offsets[d] - lo[d],)
                               + tuple(h - low for low, h in zip(lo[d + 1:], hi[d + 1:], strict=True))))
            if cut.ends[d] < hi[d]:
                out.append(Box(tuple(lo[:d]) + (cut.ends[d],) + tuple(lo[d + 1:]),
                               tuple(h - low for low, h in zip(lo[:d], hi[:d], strict=True))
                               + (hi[d] - cut.ends[d],)
                               + tuple(h - low for low, h in zip(lo[d + 1:], hi[d + 1:], strict=True))))
            lo[d], hi[d] = cut.offsets[d], cut.ends[d]
        return out

    def split(self, max_numel: int) -> list[Box]:
        """Row-major pieces of at most ``max_numel`` elements (slabs of dim 0, then finer)."""
        if self.numel <= max_numel or not self.ndim:
            return [self]
        max_numel = max(1, max_numel)
        inner = math.prod(self.sizes[1:])
        o0, s0 = self.offsets[0], self.sizes[0]
        if inner <= max_numel:
            k = max_numel // inner
            return [Box((o0 + i,) + self.offsets[1:], (min(k, s0 - i),) + self.sizes[1:]) for i in range(0, s0, k)]
        pieces = Box(self.offsets[1:], self.sizes[1:]).split(max_numel)
        return [Box((o0 + i,) + p.offsets, (1,) + p.sizes) for i in range(s0) for p in pieces]

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Slices selecting this box inside a tensor that holds exactly ``outer``."""
        return tuple(slice(o - p, o - p + s) for o, s, p in zip(self.offsets, self.sizes, outer.offsets, strict=False))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=False)) + "]"



def uncovered(target: Box, boxes: list[Box]) -> list[Box]:
    """The parts of ``target`` that none of ``boxes`` covers, as disjoint boxes ([] if covered)."""
    left = [target] if target.numel else []
    for b in boxes:
        if not left:
            break
        left = [piece for p in left for piece in p.subtract(b)]
    return left


def first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Positions ``(i, j)`` of two of ``boxes`` (all of one ndim) that share an element, or None.

    Equal boxes overlap; empty ones overlap nothing. A sweep along the dim where the boxes
    start at the most distinct places compares only boxes whose ranges there overlap, so
    thousands of row- or column-sharded chunks cost little more than sorting them.
    """
    live = [i for i, b in enumerate(boxes) if b.numel]
    if len(live) < 2:
        return None
    ndim = boxes[live[0]].ndim
    if not ndim:
        return live[0], live[1]
    d = max(range(ndim), key=lambda k: len({boxes[i].offsets[k] for i in live}))
    active: list[int] = []
    for i in sorted(live, key=lambda i: boxes[i].offsets[d]):
        b = boxes[i]
        active = [a for a in active if boxes[a].ends[d] > b.offsets[d]]
        for a in active:
            if boxes[a].intersect(b) is not None:
                return a, i
        active.append(i)
    return None
