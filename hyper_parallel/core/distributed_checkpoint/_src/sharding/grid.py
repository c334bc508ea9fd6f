"""The chunk grid of a tensor saved with a layout: boxes, holders and overlaps, by arithmetic.

A DTensor saved under a layout (mesh shape, placements, the global rank at each mesh
position) has one box per *shard coordinate*: the coordinates of the mesh dims that shard
something. Ranks that differ only in the other mesh dims (the *replica* dims) hold the same
box. Format v2 stores such a tensor's layout once and derives every box from it, so
nothing here is ever a list as long as the job: a box, its holders, the boxes overlapping a
target region are all computed from per-tensor-dim split points.

Box ids are mixed-radix numbers over the sharded tensor dims (first dim most significant);
along one tensor dim the *dim coordinate* is a mixed-radix number over the mesh dims that
split it, in mesh order. Replica index ``q`` is a mixed-radix number over the replica mesh
dims, in mesh order. Boxes follow torch's own rules (``torch.chunk``-style uneven splits,
``_StridedShard``'s split-then-interleave), computed on intervals rather than index lists;
a layout whose strided shards are not contiguous boxes is refused.

Chunks may further be cut into ``tiles`` column bands (along tensor dim 1), so that a
reader that needs some columns reads only their bands; sub-chunk id ``s = box * tiles + t``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from ..base.box import Box
from .placements import split_placement_name

_R, _S, _SS = "R", "S", "SS"


def parse_placement(name: str, ndim: int) -> tuple:
    """``"R"`` -> ("R",); ``"S(d)"`` -> ("S", d); ``"_S(d,k)"`` -> ("SS", d, k); dims made non-negative."""
    parts = split_placement_name(name)
    if parts is None or parts[0] == "P":
        raise ValueError(f"placement {name!r} is not one of 'R', 'S(d)', '_S(d,k)'")
    if parts[0] == _R:
        return (_R,)
    return (parts[0], parts[1] % ndim) + parts[2:]


def chunk_piece(length: int, parts: int, index: int) -> tuple[int, int]:
    """``torch.chunk``'s piece ``index`` of ``length`` in ``parts``: (start, size).

    An empty piece past the end starts at ``length`` (as torch reports an empty shard).
    """
    full = -(-length // parts) if length else 0
    lo = min(length, full * index)
    return lo, max(0, min(length, lo + full) - lo)


def band_columns(cols: int, tiles: int) -> list[tuple[int, int]]:
    """(start, size) of each column band of a box ``cols`` wide, as :meth:`Grid.sub_box` cuts
    it (torch.chunk's pieces, empty ones included)."""
    return [chunk_piece(cols, tiles, k) for k in range(tiles)]


def _select(intervals: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The global intervals holding logical positions [lo, hi) of the concatenation ``intervals``."""
    out, pos = [], 0
    for start, size in intervals:
        a, b = max(lo, pos), min(hi, pos + size)
        if a < b:
            out.append((start + a - pos, b - a))
        pos += size
        if pos >= hi:
            break
    return out


@lru_cache(maxsize=4096)
def dim_intervals(length: int, steps: tuple[tuple, ...]) -> tuple[tuple[int, int], ...]:
    """Per dim coordinate (mixed radix over ``steps``, in order), the (start, size) it holds.

    ``steps`` are the placements splitting this tensor dim, in mesh order, as
    ``(kind, parts, split_factor)``. Raises ValueError when a coordinate's elements are not
    one contiguous range (torch's strided shards of some uneven sizes).
    """
    if len(steps) == 1 and steps[0][0] == _S:  # one plain shard (the common case): torch.chunk's pieces
        parts = steps[0][1]
        full = -(-length // parts) if length else 0
        lo = np.minimum(length, full * np.arange(parts, dtype=np.int64))
        size = np.maximum(0, np.minimum(length, lo + full) - lo)
        return tuple(zip(lo.tolist(), size.tolist(), strict=True))
    states: list[list[tuple[int, int]]] = [[(0, length)]]
    for kind, parts, split in steps:
        nxt = []
        for ivs in states:
            logical = sum(s for _, s in ivs)
            for c in range(parts):
                if kind == _S:
                    lo, size = chunk_piece(logical, parts, c)
                    nxt.append(_select(ivs, lo, lo + size))
                    continue
                picked: list[tuple[int, int]] = []
                for j in range(split):  # split into `split` pieces, take chunk c of each
                    p0, plen = chunk_piece(logical, split, j)
                    lo, size = chunk_piece(plen, parts, c)
                    picked.extend(_select(ivs, p0 + lo, p0 + lo + size))
                nxt.append(picked)
        states = nxt
    out = []
    for ivs in states:
        merged: list[tuple[int, int]] = []
        for start, size in sorted(i for i in ivs if i[1]):
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((start, size))
        if len(merged) > 1:
            raise ValueError(f"strided shards of a dim of size {length} ({steps}) are not contiguous boxes; "
                             "use sizes the mesh divides evenly, or split the dim in mesh order")
        out.append(merged[0] if merged else (length, 0))
    return tuple(out)


_SORTED: dict[int, tuple[tuple, list[int], list[int]]] = {}


def shared_grid(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str],
                rank_list: Sequence[int] | None = None, tiles: int = 1) -> Grid:
    """``Grid(...)``, one object per distinct layout (a model's tensors share a few shapes
    and layouts: planning a load then builds a handful of grids, not one per tensor).
    Grids are not changed once built (only their lookup caches fill), so sharing is safe."""
    if rank_list is not None and len(rank_list) > 64:  # hashing it would cost what sharing saves
        return Grid(shape, mesh_shape, placements, rank_list, tiles)
    ranks = tuple(rank_list) if rank_list is not None else None
    return _shared_grid(tuple(shape), tuple(mesh_shape), tuple(placements), ranks, tiles)


@lru_cache(maxsize=1024)
def _shared_grid(shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[str, ...],
                 rank_list: tuple[int, ...] | None, tiles: int) -> Grid:
    return Grid(shape, mesh_shape, placements, rank_list, tiles)


def _by_start(intervals: tuple[tuple[int, int], ...]) -> tuple[list[int], list[int]]:
    """Starts of the non-empty intervals in increasing order, and their dim coordinates.

    Cached per intervals object (``dim_intervals`` returns the same tuple for the same dim
    and placements), so the thousand tensors of one layout sort once.
    """
    found = _SORTED.get(id(intervals))
    if found is None or found[0] is not intervals:
        if len(_SORTED) > 4096:
            _SORTED.clear()
        nonempty = sorted((s, c) for c, (s, n) in enumerate(intervals) if n)
        found = _SORTED[id(intervals)] = (intervals, [s for s, _ in nonempty], [c for _, c in nonempty])
    return found[1], found[2]


class Grid:
    """The chunk grid of one tensor: its layout's boxes, holders, and overlap search.

    Args:
        shape: the global shape.
        mesh_shape: the saving mesh's shape.
        placements: placement names per mesh dim (``"S(0)"``, ``"R"``, ``"_S(0,2)"``).
        rank_list: the global rank at each mesh position, row-major (default: 0..N-1).
        tiles: column bands per box (1: none).

    Raises:
        ValueError: placements that do not fit the shape or are not contiguous boxes.
    """

    def __init__(self, shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[str],
                 rank_list: Sequence[int] | None = None, tiles: int = 1):
        self.shape = tuple(shape)
        self.mesh_shape = tuple(mesh_shape)
        ndim = len(self.shape)
        if len(placements) != len(self.mesh_shape):
            raise ValueError(f"{len(placements)} placements for a {len(self.mesh_shape)}-d mesh")
        parsed = [parse_placement(p, ndim) if ndim else (_R,) for p in placements]
        self.rank_list = range(math.prod(self.mesh_shape)) if rank_list is None else rank_list
        self.tiles = max(1, tiles) if ndim >= 2 else 1
        # tensor dim -> mesh dims splitting it, in mesh order
        self.split_by: dict[int, list[int]] = {}
        for m, p in enumerate(parsed):
            if p[0] != _R:
                self.split_by.setdefault(p[1], []).append(m)
        self.replica_dims = [m for m, p in enumerate(parsed) if p[0] == _R]
        self.dims = sorted(self.split_by)  # sharded tensor dims
        self.intervals: dict[int, tuple[tuple[int, int], ...]] = {}
        self._sorted: dict[int, tuple[list[int], list[int]]] = {}
        for d in self.dims:
            steps = tuple((p[0], self.mesh_shape[m], p[2] if p[0] == _SS else 1)
                          for m in self.split_by[d] for p in (parsed[m],))
            self.intervals[d] = dim_intervals(self.shape[d], steps)
        self.radix = [len(self.intervals[d]) for d in self.dims]
        self.num_boxes = math.prod(self.radix)
        self.replicas = math.prod(self.mesh_shape[m] for m in self.replica_dims)
        self._bands: dict[int, list[tuple[int, Box]]] = {}

    # ------------------------------------------------------------------ boxes

    def _dim_coords(self, box: int) -> list[int]:
        out = []
        for r in reversed(self.radix):
            out.append(box % r)
            box //= r
        return out[::-1]

    def box(self, box: int) -> Box:
        """The box with id ``box`` (size 0 in some dim when the split leaves it empty)."""
        offsets, sizes = [0] * len(self.shape), list(self.shape)
        for d, c in zip(self.dims, self._dim_coords(box), strict=True):
            offsets[d], sizes[d] = self.intervals[d][c]
        return Box(tuple(offsets), tuple(sizes))

    def sub_box(self, sub: int) -> Box:
        """Column band ``sub % tiles`` of box ``sub // tiles``."""
        box = self.box(sub // self.tiles)
        if self.tiles == 1:
            return box
        lo, size = chunk_piece(box.sizes[1], self.tiles, sub % self.tiles)
        return Box(box.offsets[:1] + (box.offsets[1] + lo,) + box.offsets[2:],
                   box.sizes[:1] + (size,) + box.sizes[2:])

    def band_subs(self, box: int) -> list[tuple[int, Box]]:
        """The non-empty sub-chunks (id, box) of a box (remembered: a shared grid serves the
        same boxes to every tensor of its shape). Do not modify the list."""
        out = self._bands.get(box)
        if out is None:
            out = []
            for t in range(self.tiles):
                sub = box * self.tiles + t
                b = self.sub_box(sub)
                if b.numel:
                    out.append((sub, b))
            if len(self._bands) < 4096:
                self._bands[box] = out
        return out

    # ------------------------------------------------------------------ mesh positions

    def _coord(self, position: int) -> list[int]:
        out = []
        for s in reversed(self.mesh_shape):
            out.append(position % s)
            position //= s
        return out[::-1]

    def locate(self, position: int) -> tuple[int, int]:
        """(box id, replica index) of a mesh position (row-major)."""
        coord = self._coord(position)
        box = 0
        for d, r in zip(self.dims, self.radix, strict=True):
            c = 0
            for m in self.split_by[d]:
                c = c * self.mesh_shape[m] + coord[m]
            box = box * r + c
        q = 0
        for m in self.replica_dims:
            q = q * self.mesh_shape[m] + coord[m]
        return box, q

    def position(self, rank: int) -> int | None:
        """The mesh position of global ``rank``, or None when the grid's mesh does not hold it."""
        rl = self.rank_list
        if isinstance(rl, range):
            return (rank - rl.start) // rl.step if rank in rl else None
        found = self.__dict__.get("_positions")
        if found is None:
            found = self.__dict__["_positions"] = {r: i for i, r in enumerate(rl)}
        return found.get(rank)

    def holder(self, box: int, q: int) -> int:
        """The global rank holding replica ``q`` of box ``box``."""
        coord = [0] * len(self.mesh_shape)
        for d, c in zip(reversed(self.dims), reversed(self._dim_coords(box)), strict=True):
            for m in reversed(self.split_by[d]):
                coord[m] = c % self.mesh_shape[m]
                c //= self.mesh_shape[m]
        for m in reversed(self.replica_dims):
            coord[m] = q % self.mesh_shape[m]
            q //= self.mesh_shape[m]
        position = 0
        for c, s in zip(coord, self.mesh_shape, strict=True):
            position = position * s + c
        return self.rank_list[position]

    def writer(self, box: int, offset: int) -> int:
        """The holder that writes ``box`` when it is saved once: replicas take turns by box id."""
        return self.holder(box, (offset + box) % self.replicas)

    # ------------------------------------------------------------------ search

    def overlapping(self, target: Box) -> list[int]:
        """Ids of the non-empty boxes that overlap ``target`` (none for an empty target)."""
        if not target.numel:
            return []
        per_dim = []
        for d in self.dims:
            starts, order = self._by_start(d)
            lo, hi = target.offsets[d], target.offsets[d] + target.sizes[d]
            i = max(0, bisect.bisect_right(starts, lo) - 1)
            picked = []
            while i < len(starts) and starts[i] < hi:
                c = order[i]
                s, n = self.intervals[d][c]
                if s + n > lo:
                    picked.append(c)
                i += 1
            per_dim.append(picked)
        out = [0]
        for picked, r in zip(per_dim, self.radix, strict=True):
            out = [b * r + c for b in out for c in picked]
        return out

    def _by_start(self, d: int) -> tuple[list[int], list[int]]:
        cached = self._sorted.get(d)
        if cached is None:
            cached = self._sorted[d] = _by_start(self.intervals[d])
        return cached

    def covered_volume(self) -> int:
        """Elements covered by the distinct boxes (equals the tensor's when they tile it)."""
        return math.prod(sum(n for _, n in self.intervals[d]) for d in self.dims) * math.prod(
            s for d, s in enumerate(self.shape) if d not in self.split_by)
