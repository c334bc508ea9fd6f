"""Which rank reads a shard that several ranks load the same, for the others: the global step of
a load plan whose replicated shards are read once and broadcast.

Ranks whose plans name the same destination shard (``dest_index``: a tensor and the offsets of
the part a rank holds, e.g. every rank of a ``Replicate`` placement) need the same bytes. One of
them reads them from storage and broadcasts the shard to the rest: :func:`shard_sources` picks
that rank for every such shard from the gathered local plans, and :func:`mark_sources` puts the
decision on a plan's items as a :class:`~.records.BroadcastSource`. A driver that carries out
broadcasts (:mod:`..transfer.broadcasts`) then has the source read every item of the shard and
send it whole; the others skip those reads and receive it. A driver that does not (torch's
``load``) reads every item anyway, and the marks change nothing.

The choice is a pure function of the gathered plans in rank order, so every rank can compute it
for itself and they agree without another exchange. It reads only what survives
:meth:`~.records.LoadPlan.identity`: an item's type, ``dest_index``, ``lengths`` and
``broadcastable``. A shard is shared only when every rank naming it reads as many elements for
it and none marked an item of it not ``broadcastable``. Shards are weighed in bytes and handed
out heaviest first, each to the member of its group that has been given the fewest bytes so
far (ties to the lowest rank), so the reads spread over the ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from .records import BroadcastSource, LoadItemType

__all__ = ["ShardKey", "shard_key", "shard_sources", "mark_sources"]

ShardKey = tuple[str, tuple[int, ...]]
"""A destination shard: the tensor's name and the offsets of the part a rank holds."""


def shard_key(index: Any) -> ShardKey:
    """The shard a ``MetadataIndex`` names (its ``index`` hint is not part of it)."""
    return index.fqn, tuple(int(o) for o in (index.offset or ()))


def shard_sources(plans: Sequence[Any], element_size: Callable[[Any], int]) -> dict[ShardKey, BroadcastSource]:
    """For every shard more than one rank loads the same: who reads it, for which group.

    Args:
        plans: every rank's local load plan, in rank order (``plans[r]`` is rank ``r``'s).
        element_size: bytes per element of the shard a ``dest_index`` names.

    Returns:
        ``{shard: BroadcastSource(group_ranks, src_rank)}``; shards one rank loads are absent.

    Example::

        shard_sources([plan_rank0, plan_rank1], lambda index: 4)
        # {("w", (0, 0)): BroadcastSource(group_ranks=(0, 1), src_rank=0)}
    """
    ranks: dict[ShardKey, dict[int, int]] = {}  # shard -> {rank: elements it reads for it}
    index_of: dict[ShardKey, Any] = {}
    unsendable: set[ShardKey] = set()
    for rank, plan in enumerate(plans):
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                continue
            key = shard_key(item.dest_index)
            index_of.setdefault(key, item.dest_index)
            per_rank = ranks.setdefault(key, {})
            per_rank[rank] = per_rank.get(rank, 0) + math.prod(int(n) for n in item.lengths)
            if not getattr(item, "broadcastable", True):
                unsendable.add(key)
    shards = []
    for key, per_rank in ranks.items():  # first-seen order: the same on every rank
        if len(per_rank) < 2 or key in unsendable or len(set(per_rank.values())) != 1:
            continue
        elements = next(iter(per_rank.values()))
        shards.append((elements * element_size(index_of[key]), key, tuple(sorted(per_rank))))
    shards.sort(key=lambda shard: -shard[0])  # stable: equal weights keep first-seen order
    given = [0] * len(plans)
    sources: dict[ShardKey, BroadcastSource] = {}
    for nbytes, key, group in shards:
        src = min(group, key=lambda r: (given[r], r))
        given[src] += nbytes
        sources[key] = BroadcastSource(group_ranks=group, src_rank=src)
    return sources


def mark_sources(plan: Any, sources: dict[ShardKey, BroadcastSource]) -> Any:
    """``plan`` with every item of a shared shard carrying its ``source`` (a new plan; items of
    other shards are kept as they are)."""
    if not sources:
        return plan
    items = [replace(item, source=sources[shard_key(item.dest_index)])
             if item.type == LoadItemType.TENSOR and shard_key(item.dest_index) in sources else item
             for item in plan.items]
    return replace(plan, items=items)
