"""A snapshot whose tensors are copied into bounded memory while the save writes them.

An async save under a host-memory budget (``AsyncCheckpointer(max_host_bytes=...)``) cannot
copy the whole state before it writes: it copies a piece, the saver writes it, and the
memory takes the next piece. The staged state dict then holds, for each tensor, a tensor on
the meta device with its shape and dtype (a DTensor around one for a DTensor), as
:mod:`.staged_bands` does, and beside it (the snapshot's ``stream``) a :class:`SnapshotStream`
that hands out the bytes of any region of it on demand.

Protocol (the saver calls it through the planner, on the thread(s) that write the files):

1. :meth:`SnapshotStream.expect` once, before any region is read, with the regions this rank
   writes: per data file, in the order that file's writer reads them (files are written in
   parallel). The stream may copy ahead, in that order, as far as its memory allows.
2. :meth:`StreamedTensor.region`, for each expected region, iterated once: host byte arrays
   (the region's row-major bytes, in order), each valid until the caller drops it. Memory is
   reused only once nothing refers to an array any more, so a storage writer that keeps a
   part queued keeps it intact.

A region never expected (a saver that did not announce it) is copied when it is read, in the
same bounded memory. This module defines the protocol; the asynchronous layer implements it.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["SnapshotStream", "StreamedTensor", "Region"]

Region = tuple["StreamedTensor", tuple[slice, ...]]  # a tensor of the stream and the part of it


class StreamedTensor:
    """One tensor of a streamed snapshot: ``logical`` is the meta tensor standing for it in the
    staged state dict (a DTensor's local tensor), ``source`` the live tensor it is read from."""

    def __init__(self, stream: SnapshotStream, logical: torch.Tensor, source: Any):
        self.stream = stream
        self.logical = logical
        self.source = source

    def region(self, index: tuple[slice, ...]) -> Iterator[Any]:
        """The bytes of ``source[index]``, in bounded pieces (see the module docstring)."""
        return self.stream.region(self, index)


class SnapshotStream(abc.ABC):
    """Produces the bytes of a snapshot's tensors on demand, in bounded memory."""

    @abc.abstractmethod
    def tensor_for(self, logical: torch.Tensor) -> StreamedTensor | None:
        """The streamed tensor that meta tensor ``logical`` stands for, or None."""

    @abc.abstractmethod
    def expect(self, files: Sequence[Sequence[Region]]) -> None:
        """The regions that will be read, per data file, in the order each file reads them."""

    @abc.abstractmethod
    def region(self, tensor: StreamedTensor, index: tuple[slice, ...]) -> Iterator[Any]:
        """Iterate the bytes of ``tensor.source[index]`` as host arrays (see the module docstring)."""
