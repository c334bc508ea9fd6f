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
:class:`BandedSnapshot` beside it (``FlatStateDict.bands``): the planner hands out the bands
as write data. If the save's plan asks for a region that is not one band (a planner that
decided otherwise), the bands are put back together first, so the data is right either way.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from .grid import band_columns

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
        self._whole: torch.Tensor | None = None
        self._lock = threading.Lock()

    def region(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The data at ``index`` (slices of the logical tensor): a band when it is one, else
        a slice of the bands put back together (made once, then kept)."""
        shape = self.logical.shape
        rows_whole = len(index) == len(shape) >= 2 and all(
            (s.start, s.stop) == (0, n) for s, n in zip(index[:1] + index[2:], shape[:1] + shape[2:], strict=True))
        if rows_whole:
            lo, hi = index[1].start, index[1].stop
            for band, (start, size) in zip(self.bands, self.cols, strict=True):
                if size and (lo, hi) == (start, start + size):
                    return band
        return self.whole()[index]

    def whole(self) -> torch.Tensor:
        """The tensor, put back together from its bands (a copy, kept for later calls)."""
        with self._lock:
            if self._whole is None:
                self._whole = torch.cat(self.bands, dim=1)
            return self._whole

    def release(self) -> None:
        """Forget the put-together copy (the staging buffer outlives this save)."""
        self._whole = None
