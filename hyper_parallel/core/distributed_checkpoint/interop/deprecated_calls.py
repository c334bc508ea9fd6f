"""torch DCP's deprecated spellings ``save_state_dict`` / ``load_state_dict``, on our save and load.

They take torch's arguments in torch's order (the storage object is required, and carries the
checkpoint's path) and warn as torch does (a ``FutureWarning`` with torch's text). Not here: the
calls themselves (:mod:`..engine.checkpoint`).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import deprecated

from ..backends.protocol import StorageReader, StorageWriter
from ..engine.checkpoint import load, save
from ..format.metadata import Metadata
from ..planning.planner import LoadPlanner, SavePlanner


@deprecated(
    "`save_state_dict` is deprecated and will be removed in future versions."
    "Please use `save` instead.",
    category=FutureWarning,
)
def save_state_dict(
    state_dict: dict[str, Any],
    storage_writer: StorageWriter,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: SavePlanner | None = None,
) -> Metadata | None:
    """Deprecated (as in torch): ``save(state_dict, storage_writer=storage_writer, ...)``.

    Saves into the writer's own directory. Returns the committed metadata (None on ranks
    other than the coordinator, as :func:`save`).
    """
    return save(state_dict, storage_writer=storage_writer, process_group=process_group,
                coordinator_rank=coordinator_rank, no_dist=no_dist, planner=planner)


@deprecated(
    "`load_state_dict` is deprecated and will be removed in future versions. "
    "Please use `load` instead.",
    category=FutureWarning,
)
def load_state_dict(
    state_dict: dict[str, Any],
    storage_reader: StorageReader,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: LoadPlanner | None = None,
) -> None:
    """Deprecated (as in torch): ``load(state_dict, storage_reader=storage_reader, ...)``.

    Fills ``state_dict`` in place from the reader's directory and returns None, as torch's does.
    """
    load(state_dict, storage_reader=storage_reader, process_group=process_group,
         coordinator_rank=coordinator_rank, no_dist=no_dist, planner=planner)
