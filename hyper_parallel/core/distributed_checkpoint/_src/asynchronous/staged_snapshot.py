"""An async save's snapshot as the save receives it: the flat state plus what staging made beside it.

An async save copies the state (:mod:`.checkpointer`) and hands ``save`` the copy already
flat, with the keys and paths of the state dict it was taken from, as a
:class:`~..state.flatten.FlatStateDict`. Staging also makes things the save planner uses
while it writes that copy; they belong to the snapshot, not to a flat state dict in general,
so they live here, on this subclass:

- ``bands``: tensors staged as their column bands (:mod:`..planning.staged_bands`), by key;
- ``stamps``: the version stamp of the tensor each key was copied from
  (:mod:`..state.version_stamp`), so an incremental save compares the source's stamp, not the
  copy's;
- ``stream``: under a host-memory budget, the stream that copies tensors while they are
  written (:mod:`..planning.streamed_snapshot`), or None.

The planner reads them by name where present (``getattr``): it sits below this layer and
knows only the flat state dict; any other flat state dict has none, and is saved as itself.
"""

from __future__ import annotations

from typing import Any

from ..state.flatten import FlatStateDict, PathPart

__all__ = ["StagedSnapshot"]


class StagedSnapshot(FlatStateDict):
    """A flat snapshot of an async save, with its staging's ``bands``, ``stamps`` and ``stream``."""

    bands: dict[str, Any]
    stamps: dict[str, Any]
    stream: Any

    @classmethod
    def staged(cls, items: dict[str, tuple[tuple[PathPart, ...], Any]], bands: dict[str, Any],
               stamps: dict[str, Any], stream: Any) -> StagedSnapshot:
        """The snapshot of ``items`` (``{key: (path, staged value)}``) with its staging's side data."""
        out = cls.from_items(items)
        out.bands, out.stamps, out.stream = bands, stamps, stream
        return out
