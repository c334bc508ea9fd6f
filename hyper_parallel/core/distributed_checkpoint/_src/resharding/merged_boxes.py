"""Storing a destination's tiny shards in fewer, larger chunks (``min_chunk_bytes``).

An offline rewrite for tens of thousands of ranks gives each rank a sliver of every tensor:
1,000 tensors of 65,536 rows over 65,536 ranks are 65 million chunks of 8 bytes in 65,536
files. Reading one tensor back then opens every file, and the per-file work of a load (an
open, the index read and searched, the chunk read and checked: about 175 us of Python a
file here) makes that 10 s whatever the disk.

A checkpoint's chunks need not be the ranks' shards: a load intersects each rank's box with
the saved chunks, whatever their cut. So a tensor whose shards would be smaller than
``min_chunk_bytes`` is stored as the boxes of ``G`` consecutive ranks merged into one: a grid
of its own (``GridStore.layout``, format v2 already) over every ``G``-th rank of the mesh,
whose files hold those merged chunks. Each rank of the destination job still finds its shard
in one file, reading only the checksum blocks that hold its rows; one tensor is read from
``1/G`` of the files. The entry keeps the destination layout as its ``layout``.

Only 1-d meshes whose one dim splits one tensor dim are merged, and only when the merged
boxes are exactly unions of ``G`` ranks' boxes (``G`` a power of two dividing the mesh):
other layouts keep a chunk per rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..sharding.layout import Layout, TensorLayout


def ranks_per_chunk(tl: TensorLayout, shape: Sequence[int], itemsize: int, min_chunk_bytes: int | None) -> int:
    """How many consecutive ranks' boxes of ``tl`` form one stored chunk (1: no merging)."""
    lay = tl.layout
    if min_chunk_bytes is None or lay.ndim != 1 or len(tl.splits) != 1 or tl.strided:
        return 1
    (dim, mesh_dims), = tl.splits.items()
    if len(mesh_dims) != 1 or not shape:
        return 1
    n, length = lay.mesh_shape[0], shape[dim]
    rows = -(-length // n)  # torch.chunk: every rank's box but the last ones has ``rows`` rows
    row_bytes = math.prod(s for d, s in enumerate(shape) if d != dim) * itemsize
    if not rows or not row_bytes or rows * row_bytes >= min_chunk_bytes:
        return 1
    g = 1
    while g * rows * row_bytes < min_chunk_bytes and n % (2 * g) == 0:
        g *= 2
    while g > 1 and -(-length // (n // g)) != g * rows:  # merged boxes must be unions of ranks' boxes
        g //= 2
    return g


def merged_layout(tl: TensorLayout, group: int, meshes: dict[tuple[int, int], Layout] | None = None) -> TensorLayout:
    """``tl``'s placements on every ``group``-th rank of its mesh: each box is the union of
    ``group`` consecutive ranks' boxes of ``tl`` (see :func:`ranks_per_chunk`). ``meshes``
    keeps one merged mesh per (mesh, group) across the keys of a plan, so their grids share
    one rank list (and the writer one group of keys)."""
    lay = tl.layout
    cache = meshes if meshes is not None else {}
    coarse = cache.get((id(lay), group))
    if coarse is None:
        coarse = cache[(id(lay), group)] = Layout((lay.mesh_shape[0] // group,), lay.alias_name,
                                                  list(lay.rank_list)[::group])
    return TensorLayout(coarse, tl.splits, tl.ndim)
