"""HyperParallel's older ``distributed_checkpoint.util`` path (its newer one is ``utils``).

What HyperParallel code imports from here, each from the layer that owns it:

- path checks of its single-file saver: ``check_path``, ``has_valid_filename``
  (:mod:`._src.base.file_names`);
- geometry and state-dict helpers, the same objects ``utils`` gives: ``chunk_to_area``,
  ``infer_intersection``, ``narrow_tensor_by_index`` (:mod:`._src.base.areas`),
  ``flatten_state_dict``, ``set_element``, ``traverse_state_dict`` (:mod:`._src.state.nested_paths`),
  ``create_chunk_list_for_tensor`` (:mod:`._src.planning.chunk_lists`), ``plan_ownership_masks``
  (:mod:`._src.planning.ownership`), ``all_gather_object`` (:mod:`._src.coordination.coordinator`);
- the load's broadcasts of replicated shards (:mod:`._src.transfer.broadcasts`):
  ``broadcast_groups_for_load``, ``ensure_broadcast_groups``, ``broadcast_shard``,
  ``wait_broadcasts``, ``BroadcastBatcher``, ``_MAX_BROADCASTS_IN_FLIGHT``,
  ``DEFAULT_BROADCAST_BATCH_BYTES``.

``platform`` is HyperParallel's platform object (``get_platform()`` when this module is
imported). As in HyperParallel's ``util``, the broadcast functions here make every collective
through it, read at call time: ``mock.patch.object(util, "platform", fake)`` or
``patch.object(util.platform, "get_rank", ...)`` changes what they do. The same pipeline at
``distributed_checkpoint.broadcast`` goes through ``torch.distributed`` instead.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from ...platform import get_platform
from ._src.base.areas import chunk_to_area, infer_intersection, narrow_tensor_by_index
from ._src.base.file_names import check_path, has_valid_filename
from ._src.coordination.coordinator import all_gather_object
from ._src.planning.chunk_lists import create_chunk_list_for_tensor
from ._src.planning.ownership import plan_ownership_masks
from ._src.state.nested_paths import flatten_state_dict, set_element, traverse_state_dict
from ._src.transfer import broadcasts as _impl
from ._src.transfer.broadcasts import DEFAULT_BROADCAST_BATCH_BYTES, BroadcastOps, platform_ops
from ._src.transfer.broadcasts import MAX_BROADCASTS_IN_FLIGHT as _MAX_BROADCASTS_IN_FLIGHT

__all__ = ["platform", "check_path", "has_valid_filename", "chunk_to_area", "infer_intersection",
           "narrow_tensor_by_index", "flatten_state_dict", "set_element", "traverse_state_dict",
           "create_chunk_list_for_tensor", "plan_ownership_masks", "all_gather_object",
           "broadcast_groups_for_load", "ensure_broadcast_groups", "broadcast_shard", "wait_broadcasts",
           "BroadcastBatcher", "DEFAULT_BROADCAST_BATCH_BYTES", "_MAX_BROADCASTS_IN_FLIGHT"]

platform = get_platform()


def _ops() -> BroadcastOps:
    """The backend calls as this module's ``platform`` and limit are now."""
    return platform_ops(platform, _MAX_BROADCASTS_IN_FLIGHT)


def ensure_broadcast_groups(items: Iterable[Any], groups: dict[tuple, Any] | None = None) -> dict[tuple, Any]:
    """Collective: a group for every rank tuple ``items`` broadcast through, the caller's
    ``groups`` kept and the missing ones created (see
    :func:`._src.transfer.broadcasts.build_broadcast_groups`). What it creates is the caller's to
    destroy; :func:`broadcast_groups_for_load` does that itself."""
    return _impl.build_broadcast_groups(list(items), dict(groups or {}), _ops())[0]


@contextmanager
def broadcast_groups_for_load(items: Iterable[Any], groups: dict[tuple, Any] | None = None) -> Iterator[dict]:
    """The groups one load broadcasts through, created where missing and destroyed (after
    draining the stream) on the way out; the caller's and those that existed before stay.

    Example::

        with broadcast_groups_for_load(plan.items) as groups:
            reader.execute_read(plan, planner, groups)
    """
    with _impl.broadcast_groups_for_load(items, groups, _ops()) as built:
        yield built


def broadcast_shard(in_flight: deque, state_dict: dict[str, Any], item: Any, groups: dict[tuple, Any]) -> None:
    """Start sending the whole shard ``item`` fills from the rank that read it, in place,
    without waiting. Raises KeyError when the shard's group is not in ``groups``."""
    _impl.broadcast_shard(in_flight, state_dict, item, groups, _ops())


def wait_broadcasts(in_flight: deque) -> None:
    """Wait on every broadcast still going, oldest first; ``in_flight`` is left empty."""
    _impl.wait_broadcasts(in_flight)


class BroadcastBatcher(_impl.BroadcastBatcher):
    """Small shards of one group, source rank and dtype sent in one broadcast (see
    :class:`._src.transfer.broadcasts.BroadcastBatcher`), through this module's ``platform``."""

    def __init__(self, batch_bytes: int, groups: dict[tuple, Any]) -> None:
        super().__init__(batch_bytes, groups)

    def current_ops(self) -> BroadcastOps:
        return _ops()
