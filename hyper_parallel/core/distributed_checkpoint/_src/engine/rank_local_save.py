"""The rank-local save: ``save(..., use_collectives=False)`` on one rank of a job.

This rank writes its own shards and its metadata fragment (:mod:`.fragments`, where the
format and its readers are described), with no collective: it plans alone, writes its data
files, commits its fragment atomically and reclaims what it replaced. A rank whose save
fails keeps its old fragment, marked failed, so it never loads beside newer fragments.

What it is not: the collective save (:mod:`.checkpoint`) nor the rank-local load's read of
its own fragment (:func:`.metadata_reader.own_metadata_bytes`).
"""

from __future__ import annotations

import uuid
from typing import Any

import torch.distributed as dist

from ..backends.protocol import StorageWriter
from ..backends.resolve import writer_for
from ..base.errors import CheckpointError, CommitError
from ..coordination.coordinator import Coordinator
from ..format import metadata as md
from ..format.metadata_build import build_metadata
from ..planning.per_call import planner_for_call
from ..planning.planner import EntrySpec, SavePlan
from ..planning.standard_planner import StandardPlanner
from ..state.flatten import FlatStateDict, flatten
from ..transfer.saver import data_file_names, write_plan
from .commit import (
    NotCommittedError,
    commit_metadata,
    drop_stale_fragments,
    reclaim_replaced,
    remove_own_files,
    write_and_report,
)
from .fragments import fragment_name, fragment_of, mark_failed, mark_in_progress, table_sub_ids, unmark_failed

__all__ = ["save_rank_local"]


def save_rank_local(state_dict: Any, where: str | None, writer: StorageWriter | None, planner: Any,
                     process_group: Any, allow_pickle: bool, thread_count: int, sync_files: bool,
                     user_metadata: dict[str, Any] | None) -> md.Metadata:
    """``save(..., use_collectives=False)``: this rank's shards and fragment, no collective."""
    rank = dist.get_rank(process_group) if process_group is not None else dist.get_rank()
    world = dist.get_world_size(process_group) if process_group is not None else dist.get_world_size()
    writer = writer if writer is not None else writer_for(where, sync_files)
    writer.set_up(rank, rank == 0)
    planner = planner_for_call(planner if planner is not None else StandardPlanner(), allow_pickle)
    flat = state_dict if isinstance(state_dict, FlatStateDict) else FlatStateDict.of(flatten(state_dict))
    planner.set_up_save(flat, rank == 0)
    local = planner.create_local_save_plan()
    writer.prepare()
    if writer.read_committed() is not None:
        raise CheckpointError(
            f"{where or 'storage'} holds a checkpoint saved with collectives; a rank-local save "
            "(use_collectives=False) would be shadowed by it. Save it to a directory of its own")
    entries = {k: EntrySpec(e.kind, e.path, e.dtype, e.shape, e.layout) for k, e in local.entries.items()}
    mine = SavePlan(entries, table_sub_ids(entries, local.items), list(local.objects))
    name = fragment_name(rank)
    if rank == 0 and where is not None:
        drop_stale_fragments(where, writer, world)
    save_id = uuid.uuid4().hex[:16]
    own = data_file_names(rank, save_id, thread_count)
    coord = Coordinator(None, no_dist=True)
    what = f"rank-local save of rank {rank} to {where or 'storage'}"

    def fragment() -> md.Metadata:
        return fragment_of(build_metadata(entries, results, save_id, world, user_metadata or {}), rank, world)

    previous_fragment = writer.read_committed(name)
    replacing = None
    if previous_fragment is not None:
        try:
            replacing = md.Metadata.from_json(previous_fragment).save_id
        except CheckpointError:  # a damaged fragment is overwritten all the same, marked as one being replaced
            replacing = "unreadable"
    if replacing is not None:
        mark_in_progress(writer, rank, replacing)  # a kill from here on leaves the old fragment marked
    try:
        results = write_and_report(coord, writer, "write", lambda: write_plan(mine, planner, writer, rank, save_id,
                                                                              thread_count), own, what, save_id)
        try:
            previous, _ = commit_metadata(writer, built := fragment(), name)
        except CommitError:
            raise
        except BaseException as exc:
            remove_own_files(writer, own)
            if isinstance(exc, NotCommittedError) and exc.__cause__ is not None:
                raise exc.__cause__ from None
            raise
    except CommitError:
        raise  # it may have committed: the files stay
    except BaseException as exc:
        # No rank knows whether the others committed: the old fragment stays (all ranks
        # failing keeps the old checkpoint whole), marked, so that it never loads beside
        # newer fragments of the others (see fragments.py).
        mark_failed(writer, rank, exc, replacing)
        raise
    unmark_failed(writer, rank)
    reclaim_replaced(writer, previous, built.file_names())
    return built
