"""Plans and the planner protocols.

A plan says what each rank writes (save) or reads (load), in boxes and keys, never in
tensor data, so that plans are small enough to exchange between ranks.

Save protocol — the framework calls, on every rank, in this order:

0. ``set_up_save(state_dict, is_coordinator)`` with the flattened ``{key: value}`` map.
1. ``create_local_save_plan() -> SavePlan``: this rank's entries and the chunk boxes it holds.
2. ``create_global_save_plan(plans) -> list[SavePlan]``: given every rank's local plan (in rank
   order), decide who writes what. Called on EVERY rank with the same input; it must be
   deterministic, because there is no scatter: each rank takes ``result[rank]``.
3. ``prepare_writes(files)`` (optional; the default does nothing): the items this rank writes,
   per data file, in the order the saver resolves them, before it resolves any; a planner
   whose data is produced on demand (a streamed snapshot, :mod:`.streamed_snapshot`) can
   produce ahead in that order.
4. ``resolve_data(item) -> torch.Tensor | bytes``: the data of one write item, when the saver
   writes it (or an iterable of row slabs: tensors or host byte arrays, row-major, in order).
   Incremental saves also ask ``source_stamp(item)`` (optional; see
   :mod:`..state.version_stamp`).

Load protocol — on every rank, in this order:

0. ``set_up_load(state_dict, metadata, is_coordinator, rank)`` with the flattened target map,
   or ``None`` when the caller gave no target (load everything as full CPU tensors). ``rank``
   lets the planner prefer replicas stored in this rank's own data file.
1. ``create_local_load_plan() -> LoadPlan``: which saved chunks overlap which targets.
2. ``resolve_target(key) -> torch.Tensor``: the destination tensor (a rank's local shard) that
   the loader fills in place for a key; its global box is in the plan.
3. ``finish_load() -> dict[str, Any]``: the loaded flat values, after every read succeeded.

Subclass :class:`~.standard_planner.StandardPlanner` to customise; override
``transform_state_dict`` to rename or filter keys on both save and load.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.box import Box
from ..format.metadata import Metadata
from ..state.version_stamp import VersionStamp


@dataclass(frozen=True)
class EntrySpec:
    """What a key is, without its data: enough to write its metadata entry.

    ``layout`` is the saved layout record (mesh shape, dim names, placements, and the
    ranks of the mesh when they are not 0..N-1). ``store`` is filled by the global plan:
    how the key's chunks are stored (a :class:`~.metadata.GridStore`), or None for a table
    of whatever chunks the ranks write (imports, hand-made plans).
    """

    kind: str
    path: tuple[Any, ...]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    layout: dict[str, Any] | None = None
    store: Any = None


@dataclass(frozen=True)
class WriteItem:
    """One box of one key's data that one rank holds and may write.

    ``sub`` is the chunk's id within its key (the box id of a grid, or the row of a table).
    """

    key: str
    box: Box
    nbytes: int
    sub: int = 0


@dataclass
class SavePlan:
    """A rank's part of a save: entry specs of the keys it holds and the boxes it writes."""

    entries: dict[str, EntrySpec]
    items: list[WriteItem]
    objects: list[str] = field(default_factory=list)  # keys whose JSON value this rank records


@dataclass(frozen=True)
class ReadItem:
    """Copy ``region`` (global coordinates) from a saved ``chunk`` into key's target.

    ``chunk`` is a :class:`~.chunks.ChunkRef` (where to look) until the loader resolves it
    into a :class:`~.metadata.ChunkRecord` (byte range and checksums).
    """

    key: str
    chunk: Any
    region: Box


@dataclass
class LoadPlan:
    """A rank's reads, plus each target's global box (what its local tensor holds)."""

    items: list[ReadItem]
    targets: dict[str, Box]


class SavePlanner(abc.ABC):
    """Decides what every rank writes. See the module docstring for the call order."""

    @abc.abstractmethod
    def set_up_save(self, state_dict: dict[str, Any], is_coordinator: bool) -> None: ...

    @abc.abstractmethod
    def create_local_save_plan(self) -> SavePlan: ...

    @abc.abstractmethod
    def create_global_save_plan(self, plans: list[SavePlan]) -> list[SavePlan]: ...

    def prepare_writes(self, files: list[list[WriteItem]]) -> None:  # noqa: B027 (optional; default: nothing)
        """The items this rank writes, per data file, in the order they will be resolved
        (called before the first ``resolve_data`` of the writes; an incremental save calls it
        a second time for the files of the chunks it found changed only by hashing them,
        written after the first files). Optional."""

    @abc.abstractmethod
    def resolve_data(self, item: WriteItem) -> torch.Tensor | bytes: ...

    def source_stamp(self, item: WriteItem) -> VersionStamp | None:
        """The version stamp of the tensor the caller holds whose bytes ``resolve_data(item)``
        gives (an async save's snapshot: of the tensor it was copied from), or None (the
        default): an incremental save then hashes the chunk to tell whether it changed."""
        return None


class LoadPlanner(abc.ABC):
    """Decides what every rank reads and where it lands. See the module docstring."""

    @abc.abstractmethod
    def set_up_load(
        self, state_dict: dict[str, Any] | None, metadata: Metadata, is_coordinator: bool, rank: int = 0
    ) -> None: ...

    @abc.abstractmethod
    def create_local_load_plan(self) -> LoadPlan: ...

    @abc.abstractmethod
    def resolve_target(self, key: str) -> torch.Tensor: ...

    @abc.abstractmethod
    def finish_load(self) -> dict[str, Any]: ...
