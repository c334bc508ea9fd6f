"""torch DCP's older call forms, on our save and load: the deprecated spellings
``save_state_dict`` / ``load_state_dict`` and the private ``_save_state_dict`` /
``_load_state_dict`` they wrap in torch (clients import those: accelerate's
``merge_fsdp_weights`` and Lightning's consolidation call ``_load_state_dict`` with torch's
``_EmptyStateDictLoadPlanner`` to read a whole checkpoint into an empty dict).

They take torch's arguments in torch's order (the storage object is required, and carries the
checkpoint's path); the deprecated ones warn as torch does (a ``FutureWarning`` with torch's
text). Not here: the calls themselves (:mod:`...engine.checkpoint`).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from typing_extensions import deprecated

from ...backends.protocol import StorageReader, StorageWriter
from ...engine.checkpoint import load, save
from ...format.metadata import Metadata
from ...planning.planner import LoadPlanner, SavePlanner


def _save_state_dict(
    state_dict: dict[str, Any],
    storage_writer: StorageWriter,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: SavePlanner | None = None,
    use_collectives: bool = True,
) -> Metadata | None:
    """torch's private ``_save_state_dict``: ``save(state_dict, storage_writer=storage_writer, ...)``.

    Saves into the writer's own directory; returns the committed metadata (None on ranks other
    than the coordinator, as :func:`save`).
    """
    return save(state_dict, storage_writer=storage_writer, process_group=process_group,
                coordinator_rank=coordinator_rank, no_dist=no_dist, planner=planner, use_collectives=use_collectives)


def _load_state_dict(
    state_dict: dict[str, Any],
    storage_reader: StorageReader,
    process_group: Any = None,
    coordinator_rank: int = 0,
    no_dist: bool = False,
    planner: LoadPlanner | None = None,
) -> None:
    """torch's private ``_load_state_dict``: ``load(state_dict, storage_reader=storage_reader, ...)``.

    Fills ``state_dict`` in place from the reader's directory and returns None, as torch's does;
    with torch's ``_EmptyStateDictLoadPlanner``, an empty ``state_dict`` receives the whole
    checkpoint.

    Example::

        sd = {}
        _load_state_dict(sd, FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    """
    load(state_dict, storage_reader=storage_reader, process_group=process_group,
         coordinator_rank=coordinator_rank, no_dist=no_dist, planner=planner)


def _load_state_dict_from_keys(keys: set[str] | str | None = None, *, checkpoint_id: Any = None,
                               storage_reader: StorageReader | None = None,
                               process_group: Any = None) -> dict[str, Any]:
    """torch's private ``_load_state_dict_from_keys``: the checkpoint's values of ``keys`` (all when
    None; a str is one key), nested as they were saved, from this library's format or torch's.

    Example::

        step = _load_state_dict_from_keys("step", checkpoint_id=path)["step"]
    """
    no_dist = not (dist.is_available() and dist.is_initialized())
    state_dict: dict[str, Any] = {}
    load(state_dict, checkpoint_id=checkpoint_id, storage_reader=storage_reader, process_group=process_group,
         no_dist=no_dist, planner=_EmptyStateDictLoadPlanner(keys={keys} if isinstance(keys, str) else keys))
    return state_dict


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
    return _save_state_dict(state_dict, storage_writer, process_group, coordinator_rank, no_dist, planner)


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
    _load_state_dict(state_dict, storage_reader, process_group, coordinator_rank, no_dist, planner)
