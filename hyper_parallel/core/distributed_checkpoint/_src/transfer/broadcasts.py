"""Replicated shards read once and broadcast: the load's read-and-broadcast pipeline.

When several ranks hold the same whole shard (a ``Replicate`` placement, a data-parallel
copy), a planner marks each read of it with a :class:`~..planning.records.BroadcastSource`:
one rank of the group reads the shard from storage and broadcasts it to the others. This
module carries that out, in the shape HyperParallel's ``broadcast`` module has:

1. :func:`broadcast_groups_for_load` gives every group the load broadcasts through (reusing
   one that already exists, else creating it; every rank takes part, since creating a group
   is collective over the world) and destroys the ones it created when the load is done.
2. :func:`shard_order` puts the marked shards in one order every rank computes for itself
   from its own plan, so the members of a group meet its broadcasts in the same order
   without asking each other.
3. :func:`read_and_broadcast` walks that order: the source rank reads the next shards on a
   read-ahead thread while the main thread starts each broadcast as soon as its shard is
   read (:func:`broadcast_shard`, or :class:`BroadcastBatcher` for small shards); at most
   ``max_in_flight`` broadcasts are going at once, then :func:`wait_broadcasts`.

It is not :mod:`.shared_reads`, which is what our own ``load`` uses: that one shares any
replicated region (cut into slabs) with point-to-point messages planned from an exchange of
needs, and needs no marks in the plan. This one serves plans that carry the marks (the
HyperParallel's planners), with one broadcast per whole shard.

The backend calls go through a :class:`BroadcastOps` record rather than module globals, so a
face (``distributed_checkpoint.broadcast``) can hand in the names it exposes and a test can
stand a recording double in for any of them.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_group
from torch.distributed.tensor import DTensor

from .....platform import TorchPlatform
from ..planning.ragged_items import get_ragged_box_tensor
from ..planning.records import BroadcastSource
from ..sharding.ragged import is_ragged

__all__ = ["MAX_BROADCASTS_IN_FLIGHT", "DEFAULT_BROADCAST_BATCH_BYTES", "BroadcastOps", "MarkedRead",
           "copy_each", "get_created_group", "synchronize", "get_tensor_storage_size", "shard_buffer",
           "platform_ops", "existing_group", "build_broadcast_groups", "destroy_broadcast_groups",
           "broadcast_groups_for_load",
           "start_broadcast", "finish_broadcast", "broadcast_shard", "wait_broadcasts", "BroadcastBatcher",
           "shard_order", "read_and_broadcast"]

MAX_BROADCASTS_IN_FLIGHT = 8
"""Broadcasts one rank keeps going at once: enough that the next read overlaps the send
before it, few enough that the backend's per-operation resources stay bounded whatever the
number of shards."""

DEFAULT_BROADCAST_BATCH_BYTES = 6 << 20
"""Shards under this many bytes travel together (:class:`BroadcastBatcher`): a broadcast
costs about the same up to a few MiB, so small shards sent one by one spend the load on
starting broadcasts. A batch is held until it lands, so up to this times the in-flight limit
of memory is set aside."""


class MarkedRead(Protocol):
    """What this module needs of a read item: the shard it fills (``dest_index``: ``fqn`` and
    ``offset``) and who reads it for whom (``source``; ``None`` for a read nobody shares)."""

    dest_index: Any
    source: BroadcastSource | None


copy_each = TorchPlatform.copy_each
"""Copy ``srcs[i]`` into ``dests[i]`` for every ``i`` in one fused call (a small copy costs
mostly its launch, so one launch for many saves most of it): the platform's."""

get_created_group = TorchPlatform.get_created_group
"""The process group over a rank list that the process-wide registry
(``EXISTING_COMM_GROUPS``) already holds, or ``None``: the platform's."""

synchronize = TorchPlatform.synchronize
"""Wait for the work queued on the current accelerator stream: the platform's."""


def get_tensor_storage_size(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (what decides whether a shard is batched)."""
    return int(tensor.numel()) * int(tensor.element_size())


@dataclass(frozen=True)
class BroadcastOps:
    """The backend calls and the limit the pipeline uses, as one record to pass down.

    ``dist`` is :mod:`torch.distributed` (``get_rank``, ``get_world_size``,
    ``all_gather_object``, ``new_group``, ``broadcast``, ``destroy_process_group``);
    ``torch`` provides ``empty`` for batch buffers; ``world_group()`` is the group the job
    runs on; the rest are this module's functions of the same names.
    """

    dist: Any = dist
    torch: Any = torch
    get_created_group: Callable[[Sequence[int]], Any] = get_created_group
    world_group: Callable[[], Any] = _get_default_group
    synchronize: Callable[[], None] = synchronize
    copy_each: Callable[[list, list], None] = copy_each
    get_tensor_storage_size: Callable[[Any], int] = get_tensor_storage_size
    max_in_flight: int = MAX_BROADCASTS_IN_FLIGHT


DEFAULT_OPS = BroadcastOps()


class _PlatformDist:
    """The :mod:`torch.distributed` calls the pipeline makes, answered by a HyperParallel
    platform object (``get_platform()``: ``broadcast_async``, ``new_group``, ...)."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def get_rank(self) -> int:
        return self._platform.get_rank()

    def get_world_size(self) -> int:
        return self._platform.get_world_size()

    def all_gather_object(self, object_list: list, obj: Any) -> None:
        self._platform.all_gather_object(object_list, obj)

    def new_group(self, ranks: Sequence[int]) -> Any:
        return self._platform.new_group(tuple(ranks))

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = True) -> Any:
        return self._platform.broadcast_async(tensor, src, group)

    def destroy_process_group(self, group: Any = None) -> None:
        self._platform.destroy_process_group(group)


class _PlatformTensors:
    """``torch.empty`` for batch buffers, answered by a platform's ``new_tensor``."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def empty(self, size: Sequence[int], dtype: Any = None, device: Any = None) -> Any:
        return self._platform.new_tensor(size, dtype=dtype, device=device)


def platform_ops(platform: Any, max_in_flight: int = MAX_BROADCASTS_IN_FLIGHT) -> BroadcastOps:
    """The pipeline's backend calls made through a HyperParallel platform object (HyperParallel's
    ``util`` broadcasts through ``platform`` rather than :mod:`torch.distributed`), e.g.
    ``platform_ops(get_platform())``."""
    return BroadcastOps(dist=_PlatformDist(platform), torch=_PlatformTensors(platform),
                        get_created_group=platform.get_created_group, world_group=platform.get_world_group,
                        synchronize=platform.synchronize, copy_each=platform.copy_each,
                        get_tensor_storage_size=platform.get_tensor_storage_size, max_in_flight=max_in_flight)


def shard_buffer(obj: Any, index: Any) -> torch.Tensor:
    """The local tensor of the shard ``index`` names in state-dict entry ``obj``: what one
    broadcast carries, and a view (never a copy), so a broadcast received into it lands in
    the state dict. A RaggedShard DTensor's shard is the box of its run at ``index.offset``."""
    if isinstance(obj, DTensor):
        if any(is_ragged(p) for p in obj.placements):
            return get_ragged_box_tensor(obj, index).detach()
        return obj.to_local().detach()
    if not isinstance(obj, torch.Tensor):
        raise TypeError(f"{getattr(index, 'fqn', index)!r}: only tensors can be broadcast, "
                        f"found {type(obj).__name__}; load it without a BroadcastSource")
    return obj.detach()


def existing_group(group_ranks: tuple[int, ...], ops: BroadcastOps = DEFAULT_OPS) -> Any:
    """A group over ``group_ranks`` that exists already, or ``None``: the registry's first
    (the mesh's groups, which training keeps using), else the job's own group when the
    ranks are the whole world. Neither belongs to a load, so a load never destroys them."""
    found = ops.get_created_group(group_ranks)
    if found is not None:
        return found
    if tuple(group_ranks) == tuple(range(ops.dist.get_world_size())):
        return ops.world_group()
    return None


def build_broadcast_groups(items: Iterable[MarkedRead], supplied: dict[tuple, Any],
                           ops: BroadcastOps = DEFAULT_OPS) -> tuple[dict[tuple, Any], set[tuple]]:
    """A group for each rank tuple this rank's ``items`` broadcast through, and the tuples
    whose groups were created here (the caller destroys those: :func:`destroy_broadcast_groups`).

    Collective: every rank calls it, also one with nothing to broadcast. Each rank reports
    (every group it needs, the ones it finds missing); a group is created afresh, by every
    rank in the same sorted order, when any rank misses it, and reused only when none does,
    so all ranks take the same branch even where their registries differ. Groups in
    ``supplied`` (the caller's) are kept as given and never owned.
    """
    needed = sorted({tuple(item.source.group_ranks) for item in items
                     if item.source is not None and tuple(item.source.group_ranks) not in supplied})
    missing = tuple(ranks for ranks in needed if existing_group(ranks, ops) is None)
    reports: list[Any] = [None] * ops.dist.get_world_size()
    ops.dist.all_gather_object(reports, (tuple(needed), missing))
    wanted = sorted({tuple(r) for report in reports for r in report[0]})
    missing_anywhere = {tuple(r) for report in reports for r in report[1]}
    groups = dict(supplied)
    owned: set[tuple] = set()
    for ranks in wanted:
        fresh = ops.dist.new_group(ranks=list(ranks)) if ranks in missing_anywhere else None
        if ranks not in needed:
            continue  # took part in creating it; not one of ours
        if fresh is None:
            groups[ranks] = existing_group(ranks, ops)
        else:
            groups[ranks] = fresh
            owned.add(ranks)
    return groups, owned


def destroy_broadcast_groups(groups: dict[tuple, Any], owned: set[tuple], ops: BroadcastOps = DEFAULT_OPS,
                             warn: Callable[[str], None] | None = None) -> None:
    """Destroy the groups a load created, in sorted rank-tuple order (the same on every
    member). Drains the accelerator stream first: a waited broadcast may still be queued
    there, and destroying its group would drop it. Best effort: the data has arrived, so a
    group that will not go is reported through ``warn`` (default: :mod:`warnings`), not raised."""
    if not owned:
        return
    ops.synchronize()
    for ranks in sorted(owned):
        try:
            ops.dist.destroy_process_group(groups[ranks])
        except Exception as exc:  # noqa: BLE001 - the load already has its data
            message = f"could not destroy the broadcast group over ranks {ranks}: {exc}"
            if warn is not None:
                warn(message)
            else:
                import warnings

                warnings.warn(message, RuntimeWarning, stacklevel=2)


@contextmanager
def broadcast_groups_for_load(items: Iterable[MarkedRead], groups: dict[tuple, Any] | None = None,
                              ops: BroadcastOps = DEFAULT_OPS) -> Iterator[dict[tuple, Any]]:
    """The groups one load broadcasts through (:func:`build_broadcast_groups`), destroyed on
    the way out, also when the read fails; the caller's ``groups`` and groups that existed
    before are left standing."""
    built, owned = build_broadcast_groups(list(items), dict(groups or {}), ops)
    try:
        yield built
    finally:
        destroy_broadcast_groups(built, owned, ops)


def start_broadcast(in_flight: deque, buffer: torch.Tensor, source: BroadcastSource, groups: dict[tuple, Any],
                    after: Callable[[], None] | None = None, ops: BroadcastOps = DEFAULT_OPS) -> None:
    """Start one asynchronous broadcast of ``buffer`` from ``source.src_rank`` over its group,
    first waiting on the oldest ones while ``ops.max_in_flight`` are going. ``after`` runs once
    it has landed (a batch dealt back out to its shards).

    Raises:
        KeyError: ``groups`` has no group for ``source.group_ranks`` (creating one here would
            be a collective only some ranks enter: build them first with
            :func:`broadcast_groups_for_load`).
    """
    group = groups[tuple(source.group_ranks)]
    while len(in_flight) >= ops.max_in_flight:
        finish_broadcast(in_flight.popleft())
    work = ops.dist.broadcast(buffer, source.src_rank, group, async_op=True)
    if work is None:  # the backend finished it already
        if after is not None:
            after()
        return
    in_flight.append((work, after))


def finish_broadcast(pending: tuple[Any, Callable[[], None] | None]) -> None:
    """Wait on one started broadcast, then run what was left for when it landed."""
    work, after = pending
    work.wait()
    if after is not None:
        after()


def broadcast_shard(in_flight: deque, state_dict: dict[str, Any], item: MarkedRead, groups: dict[tuple, Any],
                    ops: BroadcastOps = DEFAULT_OPS) -> None:
    """Start broadcasting the whole shard ``item`` fills (its local buffer, in place) from
    the rank that read it; does not wait. Every member of the group must call it for the
    group's shards in the same order (:func:`shard_order`).

    Raises:
        KeyError: the shard's group is not in ``groups``.
    """
    buffer = shard_buffer(state_dict[item.dest_index.fqn], item.dest_index)
    start_broadcast(in_flight, buffer, item.source, groups, ops=ops)


def wait_broadcasts(in_flight: deque) -> None:
    """Wait on every broadcast still going, oldest first, leaving ``in_flight`` empty (the
    buffers are state-dict tensors: the load must not go on while they are being written)."""
    while in_flight:
        finish_broadcast(in_flight.popleft())


class BroadcastBatcher:
    """Small shards sent together: shards under ``batch_bytes`` that agree on group, source
    rank and dtype are gathered into one buffer, broadcast once, and copied back out to their
    shards on the receiving ranks after it lands; larger shards go on their own. A batch is
    sent before it would exceed ``batch_bytes``. ``batch_bytes=0`` sends every shard alone.

    The members of a group add its shards in the same order, so they fill and send the same
    batches at the same points. ``sent`` counts broadcasts started, ``batched`` the shards
    that travelled in a batch of two or more.
    """

    def __init__(self, batch_bytes: int, groups: dict[tuple, Any], ops: BroadcastOps = DEFAULT_OPS) -> None:
        self._batch_bytes = batch_bytes
        self._groups = groups
        self._ops = ops
        self._batches: dict[tuple, list[torch.Tensor]] = {}
        self._pending: dict[tuple, int] = {}
        self.batched = 0
        self.sent = 0

    def current_ops(self) -> BroadcastOps:
        """The backend calls to use now (a face overrides this to read its own names at call
        time, so what a caller patched there after building the batcher still applies)."""
        return self._ops

    def add(self, in_flight: deque, state_dict: dict[str, Any], item: MarkedRead) -> None:
        """Send ``item``'s shard now if it is large, else put it in its batch (sending that
        batch first if the shard would take it past ``batch_bytes``)."""
        ops = self.current_ops()
        buffer = shard_buffer(state_dict[item.dest_index.fqn], item.dest_index)
        nbytes = ops.get_tensor_storage_size(buffer)
        if nbytes >= self._batch_bytes:
            self.sent += 1
            start_broadcast(in_flight, buffer, item.source, self._groups, ops=ops)
            return
        key = (tuple(item.source.group_ranks), item.source.src_rank, buffer.dtype)
        if self._pending.get(key, 0) + nbytes > self._batch_bytes:
            self._send(in_flight, key)
        self._batches.setdefault(key, []).append(buffer)
        self._pending[key] = self._pending.get(key, 0) + nbytes

    def flush(self, in_flight: deque) -> None:
        """Send every batch still open, in the order each was first added to."""
        for key in list(self._batches):
            self._send(in_flight, key)

    def _send(self, in_flight: deque, key: tuple) -> None:
        buffers = self._batches.pop(key, [])
        self._pending.pop(key, None)
        if not buffers:
            return
        ops = self.current_ops()
        source = BroadcastSource(group_ranks=key[0], src_rank=key[1])
        self.sent += 1
        if len(buffers) == 1:  # nothing to gather it with
            start_broadcast(in_flight, buffers[0], source, self._groups, ops=ops)
            return
        self.batched += len(buffers)
        staging = ops.torch.empty((sum(b.numel() for b in buffers),), dtype=buffers[0].dtype,
                                  device=buffers[0].device)
        views, at = [], 0
        for b in buffers:
            views.append(staging[at:at + b.numel()].view(b.shape))
            at += b.numel()
        if source.src_rank == ops.dist.get_rank():  # the sender holds the data: gather, nothing comes back
            ops.copy_each(views, buffers)
            start_broadcast(in_flight, staging, source, self._groups, ops=ops)
        else:
            start_broadcast(in_flight, staging, source, self._groups,
                            after=lambda: ops.copy_each(buffers, views), ops=ops)


def _shard_key(item: MarkedRead) -> tuple:
    index = item.dest_index
    offset = tuple(getattr(index, "offset", None) or ())
    return (str(index.fqn), offset)


def shard_order(items: Iterable[MarkedRead]) -> list[list[MarkedRead]]:
    """The marked shards of a plan, each as the list of its items, in one order every rank
    derives from its own plan alone: by fqn, then shard offset. The members of a group hold
    the same shards of it, so they meet its broadcasts in the same order without exchanging
    anything; a group's shards are never reordered against each other.

    Raises:
        ValueError: two items of one shard name different sources (the shard would be sent
            twice, from two ranks).
    """
    shards: dict[tuple, list[MarkedRead]] = {}
    for item in items:
        if item.source is not None:
            shards.setdefault(_shard_key(item), []).append(item)
    for key, group in shards.items():
        sources = {(tuple(i.source.group_ranks), i.source.src_rank) for i in group}
        if len(sources) > 1:
            raise ValueError(f"{key[0]!r} at offset {key[1]}: its reads name {len(sources)} broadcast sources "
                             f"{sorted(sources)}; one shard is read by one rank for its whole group")
    return [shards[k] for k in sorted(shards)]


def read_and_broadcast(items: Sequence[MarkedRead], state_dict: dict[str, Any],
                       read: Callable[[list[MarkedRead]], None], groups: dict[tuple, Any], *,
                       batch_bytes: int = 0, read_ahead: int = 2, ops: BroadcastOps = DEFAULT_OPS) -> None:
    """Fill this rank's marked shards: read the ones it is the source of, broadcast every one.

    ``read(items)`` fills the state-dict targets of the given items from storage (the
    caller's reader); it runs on one read-ahead thread, at most ``read_ahead`` shards ahead
    of the broadcasts, so reading the next shard overlaps sending the last. The main thread
    walks :func:`shard_order`: each shard's broadcast starts as soon as its read is done (at
    once on a receiving rank), at most ``ops.max_in_flight`` at a time, small shards batched
    when ``batch_bytes`` > 0. Unmarked items are read last, on the same thread. Returns when
    every broadcast has landed.

    Every rank of every group in ``groups`` must call it with its own plan. A read that
    fails stops this rank: its peers then fail on the broken collective (or its timeout)
    rather than keeping bytes that never came.

    Raises:
        KeyError: a shard's group is missing from ``groups``.
        ValueError: a shard with two sources (:func:`shard_order`).
    """
    order = shard_order(items)
    me = ops.dist.get_rank()
    mine = [i for i, shard in enumerate(order) if shard[0].source.src_rank == me]
    plain = [item for item in items if item.source is None]
    in_flight: deque = deque()
    batcher = BroadcastBatcher(batch_bytes, groups, ops) if batch_bytes > 0 else None
    with cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dcp-read-ahead") as pool:
        reads: dict[int, cf.Future] = {}
        queued = 0  # how many of ``mine`` have been handed to the thread

        def top_up(done: int) -> None:
            nonlocal queued
            while queued < len(mine) and queued < done + max(1, read_ahead):
                reads[mine[queued]] = pool.submit(read, order[mine[queued]])
                queued += 1

        done = 0
        top_up(done)
        try:
            for i, shard in enumerate(order):
                if i in reads:
                    reads.pop(i).result()
                    done += 1
                    top_up(done)
                if batcher is not None:
                    batcher.add(in_flight, state_dict, shard[0])
                else:
                    broadcast_shard(in_flight, state_dict, shard[0], groups, ops)
            if batcher is not None:
                batcher.flush(in_flight)
            if plain:
                pool.submit(read, plain).result()
            wait_broadcasts(in_flight)
        finally:
            for future in reads.values():
                future.cancel()
