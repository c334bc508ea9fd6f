"""Whole checkpoint tensors read for a function, for what no :class:`~.remap_blocks.RemapBlock` describes.

A conversion that is not an index map with elementwise steps (a matrix product, a reduction
over experts, anything data-dependent) cannot be cut into regions. :class:`DeferredRead`
names the checkpoint tensors it needs; each rank that plans it reads them whole into host
memory itself (never through a broadcast) and calls ``complete`` once, with
``{name: tensor}`` in the checkpoint's dtype, when the last of them has landed. The function
puts its results in place itself.

:class:`DeferredGathering` is the per-load state: it collects the tensors of one read as
they land, from any thread, and calls ``complete`` exactly once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DeferredRead", "DeferredGathering"]


@dataclass(frozen=True)
class DeferredRead:
    """Checkpoint tensors read whole, and the function called once with all of them.

    Args:
        sources: the checkpoint tensors' names, each once.
        complete: called with ``{name: tensor}`` once every source has been read.
        targets: the state-dict entries ``complete`` writes, when known. A load that broadcasts
            replicated shards sends a whole shard from the rank that read it, which would overwrite
            what ``complete`` wrote on the receiving ranks, so the entries named here are never
            broadcast, and while any deferred read leaves ``targets`` as None (unknown) nothing is.
            Default None.

    Raises:
        ValueError: no sources, a source that is not a non-empty string, or one named twice.

    Example::

        DeferredRead(("w1", "w3"), lambda t: merged.copy_(torch.cat([t["w1"], t["w3"]])), targets=("mlp.w13",))
    """

    sources: tuple[str, ...]
    complete: Callable[[dict[str, torch.Tensor]], Any]
    targets: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        sources = (self.sources,) if isinstance(self.sources, str) else tuple(self.sources)
        if not sources or not all(isinstance(s, str) and s for s in sources) or len(set(sources)) != len(sources):
            raise ValueError(f"DeferredRead needs distinct checkpoint tensor names as sources, got {self.sources!r}")
        if not callable(self.complete):
            raise ValueError(f"DeferredRead of {sources}: complete must be callable, got {self.complete!r}")
        object.__setattr__(self, "sources", sources)
        if self.targets is not None:
            object.__setattr__(self, "targets", (self.targets,) if isinstance(self.targets, str)
                               else tuple(self.targets))


class DeferredGathering:
    """The tensors of one :class:`DeferredRead` as they land in one load; calls ``complete``
    once the last one has (on that read's thread)."""

    def __init__(self, read: DeferredRead) -> None:
        self.read = read
        self._lock = threading.Lock()
        self._tensors: dict[str, torch.Tensor] = {}
        self._done = False

    def arrived(self, source: str, tensor: torch.Tensor) -> None:
        """``source`` has been read whole."""
        with self._lock:
            if self._done:
                return
            self._tensors[source] = tensor
            if len(self._tensors) < len(self.read.sources):
                return
            self._done = True
            tensors, self._tensors = self._tensors, {}
        self.read.complete(tensors)
