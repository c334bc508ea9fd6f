"""N-d boxes: the unit in which tensors are sharded, saved and resharded.

A box is a hyper-rectangle of a global tensor: ``offsets`` (its first index in every dim)
and ``sizes``. A saved chunk is a box; so is the part of a tensor a rank holds. Loading
under a new layout is intersecting target boxes with saved ones, then copying the overlap,
which the loader reads in whole rows of the saved chunk.
"""

from __future__ import annotations

import math
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
        lo = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets, strict=False))
        hi = tuple(min(a, b) for a, b in zip(self.ends, other.ends, strict=False))
        if any(h <= low for low, h in zip(lo, hi, strict=False)):
            return None
        return Box(lo, tuple(h - low for low, h in zip(lo, hi, strict=False)))

    def contains(self, other: Box) -> bool:
        return all(
            a <= b and b + s <= a + t
            for a, t, b, s in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=False)
        )

    def relative_to(self, outer: Box) -> tuple[slice, ...]:
        """Slices selecting this box inside a tensor that holds exactly ``outer``."""
        return tuple(slice(o - p, o - p + s) for o, s, p in zip(self.offsets, self.sizes, outer.offsets, strict=False))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes, strict=False)) + "]"

