"""A collective save's planning exchange: what each rank tells the others, and the global
plan they agree on.

Each rank sends a :class:`Summary` (a digest of its structure, the save id it proposes, the
plans it has cached, where it saves, digests of its plain values); from these every rank
decides alike whether a cached plan is used (:func:`agree_on_plan`: only when every rank
has it) or computes the same new global plan, numbering table-stored chunks the same
everywhere. Plain values that differ between ranks are warned of
(:func:`warn_divergent_plain`); a process saving alone must hold every element
(:func:`check_complete_alone`).

What it is not: the planner that makes the plans (:mod:`..planning`) nor the cache that keeps
them (:mod:`..planning.plan_cache`).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any, NamedTuple

import crc32c

from ..base.box import Box
from ..base.errors import UnsupportedValueError
from ..coordination.coordinator import Coordinator
from ..format import metadata as md
from ..format.values import is_json_value
from ..planning.plan_cache import CachedSaveResult
from ..planning.planner import SavePlan, SavePlanner, WriteItem

__all__ = ["Summary", "PLAIN_DETAIL_RANKS", "plain_digests", "warn_divergent_plain", "agree_on_plan",
           "check_complete_alone"]


class Summary(NamedTuple):
    """What a rank tells the others in a save's planning exchange."""

    digest: str  # of its structure (StandardPlanner) or its whole local plan
    save_id: str  # the coordinator's is used
    cached: list[str] | None  # fingerprints of the plans it has cached (None: caching off)
    place: str | None  # where it saves (:func:`..backends.locations.location`)
    plain: tuple[int, dict[str, int] | None] | None  # :func:`plain_digests`


PLAIN_DETAIL_RANKS = 64  # up to this many ranks, the divergence warning names the keys


def _canonical(v: Any) -> Any:
    """A plain value with its dicts in a fixed order (equal dicts built in another order match)."""
    if isinstance(v, dict):
        return ["$dict", sorted(([repr(k), _canonical(x)] for k, x in v.items()), key=lambda kv: kv[0])]
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [_canonical(x) for x in v]]
    return repr(v)


def plain_digests(planner: SavePlanner, plan: SavePlan, per_key: bool) -> tuple[int, dict[str, int] | None]:
    """A crc32c of this rank's plain (JSON) values, and, for small groups, one per key: the
    checkpoint keeps one rank's value per key, so ranks holding different ones are worth a
    warning. Large groups send one number per rank (the exchange reaches every rank)."""
    each = {}
    for key in plan.objects:
        value = planner.resolve_data(WriteItem(key, Box((), ()), 0))
        if is_json_value(value):
            each[key] = crc32c.crc32c(repr(_canonical(value)).encode())
    total = crc32c.crc32c(repr(sorted(each.items())).encode())
    return total, each if per_key else None


def warn_divergent_plain(digests: list[tuple[int, dict[str, int] | None]], coord: Coordinator) -> None:
    """Warn (once, on the coordinator) of plain values that differ between ranks."""
    if len({total for total, _ in digests}) <= 1:
        return
    seen: dict[str, dict[int, list[int]]] = {}
    for r, (_, mine) in enumerate(digests):
        for key, d in (mine or {}).items():
            seen.setdefault(key, {}).setdefault(d, []).append(coord._name(r))
    differ = {k: v for k, v in seen.items() if len(v) > 1}
    if differ:
        shown = "; ".join(f"{k!r}: {' vs '.join(str(rs[:4]) for rs in v.values())}"
                          for k, v in list(differ.items())[:5]) + "; ranks grouped by value"
    else:  # a large group sent one digest per rank; or the ranks hold different keys
        groups: dict[int, list[int]] = {}
        for r, (total, _) in enumerate(digests):
            groups.setdefault(total, []).append(coord._name(r))
        shown = "ranks " + " vs ".join(str(rs[:4]) for rs in list(groups.values())[:4])
    warnings.warn(
        f"save: ranks hold different plain values under the same key(s) ({shown}); the checkpoint "
        "keeps one rank's value per key, and every rank loads that one. Give per-rank values keys of "
        "their own (e.g. f'dataloader.rank{rank}')", stacklevel=3)


def agree_on_plan(coord: Coordinator, planner: SavePlanner, local: SavePlan,
                   summaries: list[Summary], scope: tuple | None,
                   cached: dict[str, CachedSaveResult]) -> tuple[str, SavePlan, CachedSaveResult | None]:
    """This rank's part of the save's global plan: ``(fingerprint of every rank's local plan,
    this rank's plan, the cache entry used or None)``. A cached plan is used only when EVERY
    rank has it for this exact set of local plans; a miss anywhere is a miss everywhere (else
    ranks would run different collectives). A new plan is cached after the commit
    (:func:`~..planning.plan_cache.remember_plan`), so only plans that made a checkpoint are kept.

    A planner with ``structure_digest`` (StandardPlanner) needs only every rank's entries:
    each distinct structure travels once, from the first rank that has it, so the exchange
    grows with tensors and distinct structures, not with ranks x chunks. Other planners
    get every rank's full local plan, as the SavePlanner protocol says.
    """
    digests = [s.digest for s in summaries]
    fingerprint = hashlib.sha256("|".join(digests).encode()).hexdigest()
    if all(s.cached is not None and fingerprint in s.cached for s in summaries):
        return fingerprint, cached[fingerprint].final_plan, cached[fingerprint]
    if hasattr(planner, "structure_digest"):
        first: dict[str, int] = {}
        for rank, d in enumerate(digests):
            first.setdefault(d, rank)
        shared: dict[str, SavePlan] = {}
        for d, rank in first.items():
            entries = coord.broadcast_from(rank, local.entries if coord.rank == rank else None,
                                           "save (structure exchange)")
            shared[d] = SavePlan(entries, [], [])
        plans = [shared[d] for d in digests]
    else:
        with md.paused_gc():  # unpickling every rank's plan: many small objects at scale
            plans = coord.exchange("save (plan exchange)", lambda: local)
    computed: list[list[SavePlan]] = []
    # Every rank computes the same global plan; only the statuses are exchanged.
    coord.exchange("save (global plan)", lambda: computed.append(_numbered(planner.create_global_save_plan(plans))))
    return fingerprint, computed[0][coord.rank], None


def _numbered(plans: list[SavePlan]) -> list[SavePlan]:
    """Give the chunks of table-stored keys (a planner that sets no store) ids 0..n-1, the
    same on every rank: sorted by box over all ranks' plans. Grid-stored keys keep theirs."""
    if not plans or all(spec.store is not None or spec.kind == "object" for spec in plans[0].entries.values()):
        return plans
    boxes: dict[str, list[Box]] = {}
    for plan in plans:
        for item in plan.items:
            if plan.entries[item.key].store is None:
                boxes.setdefault(item.key, []).append(item.box)
    ids = {key: {b: i for i, b in enumerate(sorted(set(bs), key=lambda b: (b.offsets, b.sizes)))}
           for key, bs in boxes.items()}
    return [SavePlan(plan.entries, [WriteItem(i.key, i.box, i.nbytes, ids[i.key][i.box]) if i.key in ids else i
                                    for i in plan.items], plan.objects) for plan in plans]


def check_complete_alone(plan: SavePlan) -> None:
    """A process saving alone must hold every element, or the checkpoint would be incomplete."""
    held: dict[str, int] = {}
    for item in plan.items:
        held[item.key] = held.get(item.key, 0) + item.box.numel
    for key, spec in plan.entries.items():
        if spec.kind == "object" or spec.shape is None:
            continue
        numel = math.prod(spec.shape)
        if held.get(key, 0) != numel:
            raise UnsupportedValueError(
                f"{key!r}: this process holds {held.get(key, 0)} of its {numel} elements (a DTensor "
                f"shard on mesh {spec.layout and spec.layout.get('mesh_shape')}), but it saves alone "
                "(no_dist=True / use_collectives=False), so the checkpoint would miss the other "
                "ranks' shards. Save from every rank with collectives, or gather the tensor first")
