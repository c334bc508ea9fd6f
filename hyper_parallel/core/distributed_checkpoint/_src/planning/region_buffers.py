"""A checkpoint region read in parts into one buffer, handed on once every part has landed.

A load reads a checkpoint tensor one saved chunk at a time, so a region that straddles
several chunks arrives as several reads. When the values cannot go straight to their
destination (a gather, post operations, a whole tensor handed to a function), they are
collected here first: :meth:`RegionBuffer.part` gives the storage reader the view of the
buffer one read fills, :meth:`RegionBuffer.landed` counts the reads in, and the last one
calls ``on_full`` with the whole buffer, after which the buffer is let go.

The buffer is allocated when the first read asks for its part, not when the plan is made,
and freed once handed on, so a load holds only the regions it is reading at the time.
Reads may land from several threads (storage readers read files in parallel); the count is
kept under a lock, and ``on_full`` runs once, on the thread of the last read, outside it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable

import torch

from ..base.box import Box

__all__ = ["RegionBuffer"]


class RegionBuffer:
    """One checkpoint region (``region``, in the checkpoint tensor's global coordinates), filled
    by ``parts`` reads of sub-boxes of it, in ``dtype`` (the checkpoint's).

    Example::

        buf = RegionBuffer(Box((0, 0), (4, 3)), torch.bfloat16, parts=2, on_full=place)
        buf.part(Box((0, 0), (2, 3))).copy_(first_read); buf.landed("a")
        buf.landed("b", Box((2, 0), (2, 3)), second_read)   # copies it in, then calls place(buffer)
    """

    def __init__(self, region: Box, dtype: torch.dtype, parts: int,
                 on_full: Callable[[torch.Tensor], None]) -> None:
        self.region = region
        self.dtype = dtype
        self.parts = parts
        self._on_full = on_full
        self._lock = threading.Lock()
        self._tensor: torch.Tensor | None = None
        self._landed: set[Hashable] = set()
        self._handed_on = False

    def part(self, sub: Box) -> torch.Tensor:
        """The view of the buffer holding ``sub`` (a box inside :attr:`region`), allocating the
        buffer on first use."""
        with self._lock:
            if self._handed_on:
                raise RuntimeError(f"a read of {sub} arrived after region {self.region} was complete; "
                                   "each read of a plan must be resolved once")
            if self._tensor is None:
                self._tensor = torch.empty(self.region.sizes, dtype=self.dtype)
            tensor = self._tensor
        return tensor[sub.relative_to(self.region)]

    def landed(self, part_id: Hashable, sub: Box | None = None, values: torch.Tensor | None = None) -> None:
        """Count in the read ``part_id`` (a read landing twice counts once); the last one hands
        the buffer to ``on_full`` and lets it go. ``values`` (with its box ``sub``) is what the read
        produced, copied in unless it already is the buffer's view (what :meth:`part` gave)."""
        if values is not None and sub is not None:
            view = self.part(sub)
            if values.data_ptr() != view.data_ptr():
                view.copy_(values)
        with self._lock:
            self._landed.add(part_id)
            if self._handed_on or len(self._landed) < self.parts:
                return
            self._handed_on = True
            tensor, self._tensor = self._tensor, None
        if tensor is None:
            raise RuntimeError(f"region {self.region} was counted complete but no read was resolved into it")
        self._on_full(tensor)
