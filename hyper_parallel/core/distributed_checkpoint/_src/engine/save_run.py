"""A save of several ranks together, as its phases.

1. :func:`plan_locally` (exchange "save (planning)"): this rank's writer set up, its state
   flattened and planned; each rank tells the others a :class:`~.plan_exchange.Summary`.
2. :func:`agree_on_place`: one place, one save id; then the global plan
   (:func:`~.plan_exchange.agree_on_plan`, cached where every rank may reuse it).
3. :func:`write_and_commit`: each rank writes its share (exchange "save (writing data)"), the
   coordinator commits ``.metadata`` (:mod:`.commit`).

Each phase returns what it made; what stays on a rank travels beside what the exchange
carries (:class:`~.phase_result.PhaseResult`). A save by one rank alone without collectives
is :mod:`.rank_local_save`; a save on torch's protocol is :mod:`.protocol_run`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from ..backends.locations import location
from ..backends.protocol import StorageWriter
from ..backends.resolve import writer_for
from ..base.options import Coordination, WriteOptions
from ..coordination.coordinator import Coordinator
from ..format import metadata as md
from ..format.metadata_build import build_metadata
from ..format.values import check_user_metadata
from ..planning.per_call import planner_for_call
from ..planning.plan_cache import CachedSaveResult, announce_plan, cache_scope, cached_plans, plan_digest, remember_plan
from ..planning.planner import SavePlan
from ..planning.standard_planner import StandardPlanner
from ..state.flatten import FlatStateDict
from ..transfer.plan_writer import PlanWriter
from ..transfer.saver import data_file_names, write_plan
from .commit import commit_and_agree, remove_own_files, write_and_report
from .flattened import Flattened, flatten_once
from .incremental import IncrementalState
from .phase_result import PhaseResult
from .plan_exchange import (
    PLAIN_DETAIL_RANKS,
    Summary,
    agree_on_plan,
    check_complete_alone,
    plain_digests,
    warn_divergent_plain,
)
from .scope import bound_calls, check_one_location, mesh_group, part_guard

__all__ = ["SaveCall", "Planned", "save_together", "plan_locally", "agree_on_place", "write_and_commit"]


@dataclass(frozen=True)
class SaveCall:
    """One save of ranks together, as the public call resolved it.

    ``writer``: the one given, or None (one for ``where`` is made while planning); ``planner``:
    this call's own copy; ``scoped``: the group is a mesh's over some ranks, so a commit must
    not replace another part's checkpoint (:func:`~.scope.part_guard`); ``flattened``: the
    state dict flattened once (None: it came flat, a :class:`FlatStateDict`).
    """

    state_dict: Any
    flattened: Flattened | None
    where: str | None
    writer: StorageWriter | None
    planner: Any
    coord: Coordinator
    options: WriteOptions
    incremental: IncrementalState | None
    scoped: bool


@dataclass(frozen=True)
class Planned:
    """What planning leaves on this rank: its writer (set up), its local plan, and its cached plans."""

    writer: StorageWriter
    local: SavePlan
    cached: dict[str, CachedSaveResult]


def save_together(state_dict: Any, where: str | None, writer: StorageWriter | None, planner: Any,
                  coordination: Coordination, options: WriteOptions, incremental: IncrementalState | None,
                  mesh_scoped: bool) -> md.Metadata:
    """``save`` with collectives (or in one process): plan, agree, write, commit; the committed
    Metadata on every rank."""
    call = _save_call(state_dict, where, writer, planner, coordination, options, incremental, mesh_scoped)
    scope = cache_scope(call.planner, call.coord)
    planning: PhaseResult[Planned, Summary] = PhaseResult(lambda: plan_locally(call, scope))
    summaries = call.coord.exchange("save (planning)", planning.shared)
    planned = planning.kept
    save_id = agree_on_place(call, planned.writer, summaries)
    fingerprint, mine, used = agree_on_plan(call.coord, call.planner, planned.local, summaries, scope, planned.cached)
    meta, written = write_and_commit(call, planned.writer, mine, save_id,
                                     lambda: announce_plan(call.planner, scope, fingerprint, used))
    if used is None:
        remember_plan(call.planner, scope, fingerprint, mine, meta, where)
    if incremental is not None:
        incremental.committed(mine.entries, written.digests, written.known_reused, meta, written.verdicts,
                              written.stats)
    return meta


def _save_call(state_dict: Any, where: str | None, writer: StorageWriter | None, planner: Any,
               coordination: Coordination, options: WriteOptions, incremental: IncrementalState | None,
               mesh_scoped: bool) -> SaveCall:
    """The state flattened once, the group (a mesh over some ranks may choose it), its
    coordinator and this call's planner."""
    c = coordination
    flattened = None if isinstance(state_dict, FlatStateDict) else flatten_once(state_dict)
    scoped = c.process_group is None and not c.no_dist
    group = (c.process_group if c.process_group is not None or c.no_dist
             else mesh_group(state_dict, flattened.flat if flattened is not None else None))
    scoped = (scoped and group is not None) or (mesh_scoped and not c.no_dist)
    coord = Coordinator(group, c.no_dist or not c.use_collectives, c.coordinator_rank, c.timeout)
    planner = planner_for_call(planner if planner is not None else StandardPlanner(), options.allow_pickle)
    return SaveCall(state_dict, flattened, where, writer, planner, coord, options, incremental, scoped)


def plan_locally(call: SaveCall, scope: tuple | None) -> tuple[Planned, Summary]:
    """Phase 1, on each rank: set the writer up, flatten and plan this rank's state; returns
    what stays here and the :class:`Summary` the other ranks learn."""
    coord, planner, options = call.coord, call.planner, call.options
    if options.user_metadata is not None:  # inside the exchange: a bad value on one rank fails every rank
        check_user_metadata(options.user_metadata)
    writer = call.writer if call.writer is not None else writer_for(call.where, options.sync_files)
    writer.set_up(coord.rank, coord.is_coordinator)
    bound_calls(writer, coord)
    flat = call.state_dict if call.flattened is None else FlatStateDict.of(call.flattened.leaves())
    if hasattr(planner, "group_ranks"):  # mesh ranks are recorded as ranks of the saving group
        planner.group_ranks = coord.group_ranks if coord.world_size > 1 else None
    planner.set_up_save(flat, coord.is_coordinator)
    local = planner.create_local_save_plan()
    if coord.world_size == 1:
        check_complete_alone(local)
    writer.prepare()
    cached = cached_plans(scope)
    digest = planner.structure_digest(local) if hasattr(planner, "structure_digest") else plan_digest(local)
    plain = plain_digests(planner, local, coord.world_size <= PLAIN_DETAIL_RANKS) if coord.world_size > 1 else None
    summary = Summary(digest, uuid.uuid4().hex[:16], list(cached) if scope is not None else None,
                      location(call.where) if call.where is not None else None, plain)
    return Planned(writer, local, cached), summary


def agree_on_place(call: SaveCall, writer: StorageWriter, summaries: list[Summary]) -> str:
    """Phase 2: every rank saves to one place (else all fail); the coordinator warns about
    plain values that differ between ranks; the save id is the coordinator's."""
    coord = call.coord
    check_one_location([s.place for s in summaries], coord)
    if coord.is_coordinator and coord.world_size > 1:
        warn_divergent_plain([s.plain for s in summaries], coord)
    save_id = summaries[coord.coordinator_rank].save_id
    writer.save_id = save_id  # torch's StorageWriter.save_id: what storage_meta() reports for this save
    return save_id


def write_and_commit(call: SaveCall, writer: StorageWriter, mine: SavePlan, save_id: str,
                     announce: Any) -> tuple[md.Metadata, Any]:
    """Phase 3: each rank writes its share of ``mine``, the coordinator commits; returns the
    committed Metadata and this rank's write result. A save that fails here (or whose commit
    is not known) makes an incremental save's next step write everything."""
    coord, options, incremental = call.coord, call.options, call.incremental
    own_files = data_file_names(coord.rank, save_id, options.thread_count, hashes=incremental is not None)
    what = f"save to {call.where or 'storage'}"
    writing: PhaseResult[Any, Any] = PhaseResult(lambda: write_share(call, writer, mine, save_id, announce))
    try:
        if isinstance(writer, PlanWriter):  # its collective part first (every rank, or none, fails)
            try:
                writer.write_together(coord, mine, call.planner, save_id, options.thread_count)
            except BaseException:
                remove_own_files(writer, own_files)
                raise
        results = write_and_report(coord, writer, "save (writing data)", writing.shared, own_files, what, save_id)
        guard = part_guard(coord, set(mine.entries), call.where) if call.scoped else None
        meta = commit_and_agree(
            coord, writer, "save (commit)",
            lambda: build_metadata(mine.entries, results, save_id, coord.world_size, options.user_metadata or {}),
            own_files, what, save_id, guard=guard)
    except BaseException:
        if incremental is not None:
            incremental.reset()  # not committed, or not known to be: the next save writes everything
        raise
    return meta, writing.kept


def write_share(call: SaveCall, writer: StorageWriter, mine: SavePlan, save_id: str, announce: Any) -> tuple[Any, Any]:
    """This rank's writes: its full result (kept) and what the coordinator needs of it."""
    announce()  # in the exchange: a plan-cache hook that raises fails every rank
    coord, planner, incremental = call.coord, call.planner, call.incremental
    thread_count = call.options.thread_count
    reuse = incremental.reusable(mine.entries) if incremental is not None else None
    if isinstance(writer, PlanWriter):  # it lays out its own files (Hugging Face safetensors)
        result = writer.write_plan(mine, planner, coord.rank, save_id, thread_count)
    else:
        result = write_plan(mine, planner, writer, coord.rank, save_id, thread_count,
                            hashes=incremental is not None, reuse=reuse)
    return result, result.for_coordinator()
