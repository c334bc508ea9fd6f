"""A staged tensor kept as the column bands the data file will hold.

A save cuts a large 2-D (or higher) chunk into column bands (format v2 ``tiles``, see
:attr:`.StandardPlanner.max_tiles`), each stored row-major on its own. From an ordinary
row-major tensor every band is strided, so the saver gathers it into a contiguous buffer:
a second copy of the tensor, made by the background thread of an async save while the
training loop wants the CPU. An async save instead lays each band out contiguously in its
staging buffer while it takes the snapshot (the one copy it makes anyway), and the saver
writes the bands straight from there.

The staged state dict then holds, for such a tensor, a tensor on the meta device with the
tensor's shape and dtype (a DTensor around one for a DTensor), and this module's
:class:`BandedSnapshot` beside it (the snapshot's ``bands``): the planner hands out the bands
as write data. If the save's plan asks for a region that is not one band (a planner that
decided otherwise), that region is put together from the bands, so the data is right either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..sharding.grid import band_columns

__all__ = ["BandedSnapshot", "band_columns"]


class BandedSnapshot:
    """A staged tensor stored as contiguous column bands.

    ``logical`` is the meta tensor that stands for it in the staged state dict (a DTensor's
    local tensor); ``bands[k]`` holds columns ``cols[k]`` of every row, contiguously.
    """

    def __init__(self, logical: torch.Tensor, bands: Sequence[torch.Tensor], cols: Sequence[tuple[int, int]]):
        self.logical = logical
        self.bands = list(bands)
        self.cols = list(cols)

    def region(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The data at ``index`` (slices of the logical tensor): a band when it is one, else
        the parts of the bands it covers put together (a copy of that region only)."""
        shape = self.logical.shape
        lo, hi = index[1].start, index[1].stop
        rest = (index[0], *index[2:])
        rows_whole = all((s.start, s.stop) == (0, n) for s, n in zip(rest, (shape[0], *shape[2:]), strict=True))
        pieces = []
        for band, (start, size) in zip(self.bands, self.cols, strict=True):
            a, b = max(lo, start), min(hi, start + size)
            if rows_whole and (a, b) == (start, start + size) == (lo, hi):
                return band
            if a < b:
                pieces.append(band[(index[0], slice(a - start, b - start), *index[2:])])
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return self.bands[0][(index[0], slice(0, 0), *index[2:])]
        return torch.cat(pieces, dim=1)
