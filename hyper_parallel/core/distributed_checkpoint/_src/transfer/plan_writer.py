"""A storage writer that writes a rank's share of the save plan itself, in files of its own layout.

``save`` hands such a writer the plan instead of streaming this library's data files through
``write_file``: the writer decides where each chunk's bytes go (a foreign format, such as Hugging
Face safetensors, whose files are laid out by tensor, not by chunk). The rest of the protocol is
unchanged: ``set_up`` -> ``prepare`` -> ``write_together`` (every rank at once, over the
group; optional) -> ``write_plan`` (every rank, once) -> ``flush`` ->
``read_committed`` -> ``commit`` (the coordinator puts the result in place, atomically) ->
``remove`` (a rank whose save did not commit: its own new files).

Not here: this library's own data files (:mod:`.saver`), the writers of foreign formats
(:mod:`..interop`).
"""

from __future__ import annotations

import abc
from collections.abc import Iterable

from ..backends.protocol import Buffer, StorageWriter
from ..base.errors import UnsupportedValueError
from ..coordination.coordinator import Coordinator
from ..planning.planner import SavePlan, SavePlanner
from .saver import WriteResult

__all__ = ["PlanWriter"]


class PlanWriter(StorageWriter):
    """A :class:`StorageWriter` that lays out its own files: ``save`` calls :meth:`write_plan`
    on every rank instead of writing this library's data files through ``write_file``."""

    @abc.abstractmethod
    def write_plan(self, plan: SavePlan, planner: SavePlanner, rank: int, save_id: str,
                   thread_count: int) -> WriteResult:
        """Write this rank's share of the global plan (``plan.items``; ``plan.entries`` holds
        every key of the save, with its global shape and dtype, on every rank); values come
        from ``planner.resolve_data``. Called once per save on every rank, possibly with no
        items. Files need not be visible to readers before ``commit``. Returns what goes to
        the coordinator (the files written, if the metadata is to name them)."""

    def write_together(self, coord: Coordinator, plan: SavePlan, planner: SavePlanner, save_id: str,
                       thread_count: int) -> None:  # noqa: B027 (optional; default: nothing)
        """The part of the write that ranks do together over ``coord``'s group, before
        :meth:`write_plan`: called on every rank at once, with the same arguments as
        :meth:`write_plan`. It must fail on every rank or on none (``coord.exchange`` does
        that), and never leave a rank waiting. Default: nothing."""

    def write_file(self, name: str, parts: Iterable[Buffer]) -> int:
        raise UnsupportedValueError(
            f"{type(self).__name__} lays out its own files and cannot write this library's data file {name!r}; "
            "use it with save(..., storage_writer=...) on ranks that save together (use_collectives=True)")
