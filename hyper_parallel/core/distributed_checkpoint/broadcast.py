"""Replicated shards read once and broadcast (HyperParallel's path ``distributed_checkpoint.broadcast``).

A face over :mod:`._src.transfer.broadcasts`, where the pipeline is documented: groups for a load
(:func:`broadcast_groups_for_load`), one broadcast per shard started without waiting
(:func:`broadcast_shard`, at most ``_MAX_BROADCASTS_IN_FLIGHT`` going), small shards batched
(:class:`BroadcastBatcher`), :func:`wait_broadcasts`, and the whole read-and-broadcast walk
(:func:`read_and_broadcast`).

Like HyperParallel's module, this one holds the backend names its functions call —
``dist``, ``torch``, ``get_created_group``, ``_get_default_group``, ``synchronize``,
``copy_each``, ``get_tensor_storage_size`` and ``_MAX_BROADCASTS_IN_FLIGHT`` — and reads them
at call time, so replacing one here (``mock.patch.object(broadcast, "dist", ...)``) changes
what every function of this path does. The subpackage's own callers are not affected.
"""

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group

from ._src.planning.records import BroadcastSource
from ._src.transfer import broadcasts as _impl
from ._src.transfer.broadcasts import (
    DEFAULT_BROADCAST_BATCH_BYTES,
    BroadcastOps,
    copy_each,
    get_created_group,
    get_tensor_storage_size,
    shard_order,
    synchronize,
)
from ._src.transfer.broadcasts import MAX_BROADCASTS_IN_FLIGHT as _MAX_BROADCASTS_IN_FLIGHT
from ._src.transfer.broadcasts import shard_buffer as _shard_buffer

__all__ = ["BroadcastSource", "DEFAULT_BROADCAST_BATCH_BYTES", "BroadcastBatcher", "broadcast_groups_for_load",
           "broadcast_shard", "wait_broadcasts", "read_and_broadcast", "shard_order", "copy_each",
           "get_created_group", "synchronize", "get_tensor_storage_size", "_MAX_BROADCASTS_IN_FLIGHT",
           "_shard_buffer"]


def _ops() -> BroadcastOps:
    """The backend calls as this module's globals hold them now."""
    return BroadcastOps(dist=dist, torch=torch, get_created_group=get_created_group, world_group=_get_default_group,
                        synchronize=synchronize, copy_each=copy_each,
                        get_tensor_storage_size=get_tensor_storage_size, max_in_flight=_MAX_BROADCASTS_IN_FLIGHT)


def _existing_group(group_ranks: tuple) -> Any:
    """A group over ``group_ranks`` that exists already, or ``None``
    (see :func:`._src.transfer.broadcasts.existing_group`)."""
    return _impl.existing_group(group_ranks, _ops())


def _build_broadcast_groups(items: Iterable[Any], supplied: dict[tuple, Any]) -> tuple[dict[tuple, Any], set]:
    """Collective: the groups this rank's items broadcast through, and those created here
    (see :func:`._src.transfer.broadcasts.build_broadcast_groups`)."""
    return _impl.build_broadcast_groups(items, supplied, _ops())


def _destroy_broadcast_groups(groups: dict[tuple, Any], owned: set) -> None:
    """Destroy the groups a load created, after draining the stream (best effort)."""
    _impl.destroy_broadcast_groups(groups, owned, _ops())


@contextmanager
def broadcast_groups_for_load(items: Iterable[Any], groups: dict[tuple, Any] | None = None) -> Iterator[dict]:
    """The groups one load broadcasts through, created where missing and destroyed on the way
    out; the caller's ``groups`` and groups that existed before stay. Collective over the world.

    Example::

        with broadcast_groups_for_load(plan.items) as groups:
            read_and_broadcast(plan.items, state_dict, reader_fn, groups)
    """
    with _impl.broadcast_groups_for_load(items, groups, _ops()) as built:
        yield built


def _start_broadcast(in_flight: deque, buffer: Any, source: BroadcastSource, groups: dict[tuple, Any],
                     after: Callable[[], None] | None = None) -> None:
    """Start one asynchronous broadcast, first making room under the in-flight limit."""
    _impl.start_broadcast(in_flight, buffer, source, groups, after, _ops())


_finish_broadcast = _impl.finish_broadcast


def broadcast_shard(in_flight: deque, state_dict: dict[str, Any], item: Any, groups: dict[tuple, Any]) -> None:
    """Start sending the whole shard ``item`` fills from the rank that read it, in place, without
    waiting. Raises KeyError when the shard's group is not in ``groups``."""
    _impl.broadcast_shard(in_flight, state_dict, item, groups, _ops())


def wait_broadcasts(in_flight: deque) -> None:
    """Wait on every broadcast still going, oldest first; ``in_flight`` is left empty."""
    _impl.wait_broadcasts(in_flight)


class BroadcastBatcher(_impl.BroadcastBatcher):
    """Small shards of one group, source rank and dtype sent in one broadcast (see
    :class:`._src.transfer.broadcasts.BroadcastBatcher`); reads this module's names when it sends."""

    def __init__(self, batch_bytes: int, groups: dict[tuple, Any]) -> None:
        super().__init__(batch_bytes, groups)

    def current_ops(self) -> BroadcastOps:
        return _ops()


def read_and_broadcast(items: Sequence[Any], state_dict: dict[str, Any], read: Callable[[list], None],
                       groups: dict[tuple, Any], *, batch_bytes: int = 0, read_ahead: int = 2) -> None:
    """Read this rank's marked shards on a read-ahead thread and broadcast each as soon as it
    is read, in the order every rank computes (see :func:`._src.transfer.broadcasts.read_and_broadcast`)."""
    _impl.read_and_broadcast(items, state_dict, read, groups, batch_bytes=batch_bytes, read_ahead=read_ahead,
                             ops=_ops())

