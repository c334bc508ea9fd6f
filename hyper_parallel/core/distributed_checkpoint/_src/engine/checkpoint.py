"""save / load: the orchestration of a checkpoint, and nothing else.

Save: flatten -> local plan -> (cached) global plan -> each rank writes its share ->
write results to the coordinator -> coordinator commits ``.metadata``. Load: coordinator
reads ``.metadata`` -> broadcast -> each rank plans and reads its overlaps. Each phase ends
in a status exchange, so a failure anywhere fails every rank with the same message.

The steps of the phases live beside this module, in engine/: where and with which ranks
(:mod:`.scope`), the save's planning exchange (:mod:`.plan_exchange`), the commit
(:mod:`.commit`), the load target's checks and filling (:mod:`.targets`), the rank-local save
(:mod:`.rank_local_save`), the metadata read (:mod:`.metadata_reader`); the plan cache's
hooks are called as :mod:`..planning.plan_cache` describes.
"""

from __future__ import annotations

import functools
import inspect
import os
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

from ..backends.locations import location
from ..backends.protocol import StorageReader, StorageWriter
from ..backends.resolve import reader_for, writer_for
from ..backends.torch_format import TorchFormatReader, is_pickle
from ..backends.torch_storage import as_our_reader, as_our_writer, as_torch_writer, is_torch_reader, is_torch_writer
from ..base.errors import CheckpointError, UnsupportedValueError, storage_error
from ..base.gc_pause import paused_gc
from ..coordination.coordinator import Coordinator, as_timeout
from ..format import metadata as md
from ..format.torch_view import TorchView
from ..format.values import check_user_metadata
from ..planning.hyper_parallel_protocol import is_seed_planner, is_seed_reader
from ..planning.per_call import planner_for_call
from ..planning.plan_cache import CachedSaveResult, announce_plan, cache_scope, cached_plans, plan_digest, remember_plan
from ..planning.planner import LoadPlanner, SavePlan, SavePlanner
from ..planning.standard_planner import StandardPlanner
from ..planning.torch_planners import as_our_planner, leave_set_up
from ..planning.torch_protocol import is_torch_planner, torch_load_planner
from ..state.flatten import FlatStateDict, flatten, unflatten
from ..transfer.loader import read_plan
from ..transfer.plan_writer import PlanWriter
from ..transfer.saver import build_metadata, data_file_names, write_plan
from ..transfer.shared_reads import DEFAULT_BATCH_BYTES, Needs, needs_of, read_shared, sharing_wanted, worth_sharing
from ..transfer.torch_reads import OwnFormatReader
from . import in_flight
from .commit import commit_and_agree, remove_own_files, write_and_report
from .incremental import IncrementalState
from .metadata_reader import metadata_bytes, own_metadata_bytes
from .plan_exchange import (
    PLAIN_DETAIL_RANKS,
    Summary,
    agree_on_plan,
    check_complete_alone,
    plain_digests,
    warn_divergent_plain,
)
from .protocol_run import run_load, run_save
from .rank_local_save import save_rank_local
from .scope import (
    PathLike,
    bound_calls,
    check_one_location,
    distributed,
    mesh_group,
    part_guard,
    resolve_path,
    storage_in_path_slot,
)
from .targets import apply_loaded, asked_for, assign_back, check_all_asked_for, check_keys, materialize_meta

__all__ = ["save", "load"]


def _storage_errors_as_ours(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (save) raising every storage ``OSError`` as a :class:`~..base.errors.StorageError`
    naming the checkpoint, cause chained: a save in one process otherwise let the OS's error
    out as it was, where a save of several ranks raises RankFailedError; both must be the
    library's (torch's) ``CheckpointException``. The error stays an OSError of its kind."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            if isinstance(exc, CheckpointError):  # ours already (NotACheckpointError, StorageTimeoutError)
                raise
            given = signature.bind_partial(*args, **kwargs).arguments
            where = (given.get("path") or given.get("checkpoint_id")
                     or getattr(given.get("storage_writer"), "path", None))
            what = f"checkpoint save to {os.fspath(where)!r}" if where else "checkpoint save"
            raise storage_error(exc, what) from exc

    return wrapper


@_storage_errors_as_ours
def save(
    state_dict: dict[str, Any] | None = None,
    path: PathLike | None = None,
    *,
    checkpoint_id: PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    coordinator_rank: int = 0,
    allow_pickle: bool = False,
    thread_count: int = 1,
    sync_files: bool = True,
    timeout: timedelta | float | None = None,
    user_metadata: dict[str, Any] | None = None,
    incremental: IncrementalState | None = None,
    _mesh_scoped: bool = False,
) -> md.Metadata | None:
    """Save a (sharded) state dict; every rank of the group calls it with its own shards.

    Each rank writes only the chunks the global plan gives it (replicated data is written
    once in total, spread evenly over its holders); then the coordinator commits
    ``.metadata`` atomically (see :mod:`.commit` for the protocol). Until that commit, an
    older checkpoint at ``path`` stays intact and loadable; once it is in place, nothing
    deletes the new data.

    Args:
        state_dict: nested dict of tensors, DTensors, numpy arrays, bytes, plain values,
            and objects with ``state_dict()``/``load_state_dict()``.
        path / checkpoint_id: the checkpoint directory (the two names are synonyms), or an
            fsspec URL such as ``s3://bucket/ckpt`` (credentials from the environment; pass
            an ``FsspecWriter`` to set storage options).
        storage_writer: a :class:`StorageWriter`; default: :class:`FileSystemWriter`. torch DCP's
            ``FileSystemWriter``/``FsspecWriter`` are taken as configuration (their options mapped:
            :mod:`..backends.torch_storage`).
        planner: a :class:`SavePlanner`; default: :class:`StandardPlanner`. torch DCP's
            ``DefaultSavePlanner`` is taken as configuration (:mod:`..planning.torch_planners`).
        process_group: the ranks that save together. Default: the whole world, or, when every
            DTensor of the state dict lives on one mesh created over some ranks only
            (``init_device_mesh(..., rank_list=...)``), that mesh's ranks; ranks outside it
            need not call save.
        no_dist: this process saves alone, as a whole checkpoint (it must hold every element).
        use_collectives: False makes a rank-local checkpoint (see :mod:`.fragments`): every
            rank writes its own shards and metadata fragment, with no collective.
        allow_pickle: permit values that only pickle can store (refused by default); it
            applies to this call only.
        thread_count: data files (and writer threads) per rank.
        sync_files: fsync data and metadata before committing (default True).
        timeout: bound on every cross-rank exchange and on every call to an object store
            (seconds > 0 or a timedelta; default 30 min): a rank that crashed, hung or never
            called save, or a store that stopped answering, becomes an error on all ranks.
        user_metadata: a JSON-able dict stored in ``.metadata`` (``Metadata.user``).
        incremental: the checkpoint manager's memory of the previous step (see
            :mod:`.incremental`): chunks whose bytes did not change are referenced in that
            step's files instead of written. ``CheckpointManager(incremental=True)`` passes it.
        _mesh_scoped: internal (async save): ``process_group`` is the group a mesh over some
            ranks chose, not the caller's, so the partial-world guard applies.

    Returns:
        The committed :class:`Metadata`, on every rank (a rank-local save: this rank's fragment).

    Raises:
        RankFailedError: on every rank, when any rank failed before the commit; it names
            each rank and cause. The previous checkpoint at ``path`` is untouched.
        CommitError: a peer was lost around the commit, or the store did not answer the
            ``.metadata`` write in time; ``committed`` says whether the new checkpoint is in
            place (True), or that only ``load`` can tell (None).
        StorageTimeoutError: (inside RankFailedError when ranks save together) a call to an
            object store got no answer within ``timeout``.
        UnsupportedValueError: a value cannot be saved safely (e.g. needs pickle).
        StorageError: (a save in one process; ranks saving together raise RankFailedError)
            the storage failed with an OSError (read-only or full disk, a path through a
            file): an OSError of the same kind and errno, the original chained as its cause.
        ValueError / TypeError: a bad argument (``timeout``, ``user_metadata``), named.

    Example::

        save(model.state_dict(), "/ckpt/step100")
    """
    path, storage_writer = storage_in_path_slot(path, storage_writer, "storage_writer")  # torch's save(sd, writer)
    # torch DCP's unmodified planner and storage objects stand for ours with their options; those
    # with code of their own run on torch's protocol
    storage_writer = as_our_writer(storage_writer, foreign_ok=True)
    planner = as_our_planner(planner, "save", foreign_ok=True)
    if is_torch_writer(storage_writer) or is_torch_planner(planner, "save") or is_seed_planner(planner):
        if state_dict is None:
            raise ValueError("save() needs a state_dict")
        return _save_on_torch_protocol(state_dict, path, checkpoint_id, storage_writer, planner, process_group,
                                       no_dist, use_collectives, coordinator_rank, timeout, sync_files, thread_count,
                                       user_metadata, incremental)
    where = resolve_path(path, checkpoint_id, storage_writer)
    if state_dict is None:
        raise ValueError("save() needs a state_dict")
    if thread_count == 1 and getattr(storage_writer, "thread_count", 1) > 1:  # torch's FileSystemWriter(thread_count=)
        thread_count = storage_writer.thread_count
    # an earlier async save to this place must not commit over this one
    in_flight.wait_for_saves_to(in_flight.place_of(where, storage_writer))
    if not use_collectives and not no_dist and distributed():
        as_timeout(timeout)  # checked as everywhere, though this rank saves alone
        if user_metadata is not None:
            check_user_metadata(user_metadata)  # no collective here: this rank alone
        return _torch_shaped(save_rank_local(state_dict, where, storage_writer, planner, process_group, allow_pickle,
                               thread_count, sync_files, user_metadata))
    scoped = process_group is None and not no_dist  # a mesh over some ranks may choose the group
    process_group = process_group if process_group is not None or no_dist else mesh_group(state_dict)
    scoped = (scoped and process_group is not None) or (_mesh_scoped and not no_dist)
    coord = Coordinator(process_group, no_dist or not use_collectives, coordinator_rank, timeout)
    planner = planner_for_call(planner if planner is not None else StandardPlanner(), allow_pickle)
    scope = cache_scope(planner, coord)
    writer: StorageWriter = storage_writer  # type: ignore[assignment]
    local: list[SavePlan] = []
    cached: dict[str, CachedSaveResult] = {}

    def plan_locally() -> Summary:
        nonlocal writer
        if user_metadata is not None:  # inside the exchange: a bad value on one rank fails every rank
            check_user_metadata(user_metadata)
        if writer is None:
            writer = writer_for(where, sync_files)
        writer.set_up(coord.rank, coord.is_coordinator)
        bound_calls(writer, coord)
        flat = state_dict if isinstance(state_dict, FlatStateDict) else FlatStateDict.of(flatten(state_dict))
        if hasattr(planner, "group_ranks"):  # mesh ranks are recorded as ranks of the saving group
            planner.group_ranks = coord.group_ranks if coord.world_size > 1 else None
        planner.set_up_save(flat, coord.is_coordinator)
        local.append(planner.create_local_save_plan())
        if coord.world_size == 1:
            check_complete_alone(local[0])
        writer.prepare()
        cached.update(cached_plans(scope))
        digest = planner.structure_digest(local[0]) if hasattr(planner, "structure_digest") else plan_digest(local[0])
        plain = (plain_digests(planner, local[0], coord.world_size <= PLAIN_DETAIL_RANKS)
                 if coord.world_size > 1 else None)
        return Summary(digest, uuid.uuid4().hex[:16], list(cached) if scope is not None else None,
                       location(where) if where is not None else None, plain)

    summaries = coord.exchange("save (planning)", plan_locally)
    check_one_location([s.place for s in summaries], coord)
    if coord.is_coordinator and coord.world_size > 1:
        warn_divergent_plain([s.plain for s in summaries], coord)
    save_id = summaries[coord.coordinator_rank].save_id
    writer.save_id = save_id  # torch's StorageWriter.save_id: what storage_meta() reports for this save
    fingerprint, mine, used = agree_on_plan(coord, planner, local[0], summaries, scope, cached)
    own_files = data_file_names(coord.rank, save_id, thread_count, hashes=incremental is not None)
    what = f"save to {where or 'storage'}"
    mine_written: list[Any] = []

    def write() -> Any:
        announce_plan(planner, scope, fingerprint, used)  # in the exchange: a hook that raises fails every rank
        reuse = incremental.reusable(mine.entries) if incremental is not None else None
        if isinstance(writer, PlanWriter):  # it lays out its own files (Hugging Face safetensors)
            result = writer.write_plan(mine, planner, coord.rank, save_id, thread_count)
        else:
            result = write_plan(mine, planner, writer, coord.rank, save_id, thread_count,
                                hashes=incremental is not None, reuse=reuse)
        mine_written.append(result)
        return result.for_coordinator()

    try:
        if isinstance(writer, PlanWriter):  # its collective part first (every rank, or none, fails)
            try:
                writer.write_together(coord, mine, planner, save_id, thread_count)
            except BaseException:
                remove_own_files(writer, own_files)
                raise
        results = write_and_report(coord, writer, "save (writing data)", write, own_files, what, save_id)
        meta = commit_and_agree(
            coord, writer, "save (commit)",
            lambda: build_metadata(mine.entries, results, save_id, coord.world_size, user_metadata or {}),
            own_files, what, save_id, guard=part_guard(coord, set(mine.entries), where) if scoped else None)
    except BaseException:
        if incremental is not None:
            incremental.reset()  # not committed, or not known to be: the next save writes everything
        raise
    if used is None:
        remember_plan(planner, scope, fingerprint, mine, meta, where)
    if incremental is not None:
        done = mine_written[0]
        incremental.committed(mine.entries, done.digests, done.known_reused, meta, done.verdicts, done.stats)
    return _torch_shaped(meta)


def _torch_shaped(meta: Any) -> Any:
    """What save returns: torch's ``Metadata`` (and HyperParallel's), a view of the committed
    document built per key on access, with the document's own fields on it (``.entries``...)."""
    return TorchView(meta) if isinstance(meta, md.Metadata) else meta


def _save_on_torch_protocol(state_dict: dict[str, Any], path: PathLike | None, checkpoint_id: PathLike | None,
                            writer: Any, planner: Any, process_group: Any, no_dist: bool, use_collectives: bool,
                            coordinator_rank: int, timeout: Any, sync_files: bool, thread_count: int,
                            user_metadata: Any, incremental: Any) -> Any:
    """save() of a planner or writer with code of its own: torch's procedure (:mod:`.protocol_run`).
    A writer of ours (or none) under a torch-protocol planner becomes torch's writer for the same
    place, so the checkpoint is in torch's format (which load reads in place)."""
    for name, value in (("user_metadata", user_metadata), ("incremental", incremental)):
        if value is not None:
            raise UnsupportedValueError(f"save({name}=...) is this library's format's; a save on torch's protocol "
                                        f"(planner {type(planner).__name__}, writer {type(writer).__name__}) has "
                                        "nowhere to keep it")
    if path is not None and checkpoint_id is not None and os.fspath(path) != os.fspath(checkpoint_id):
        raise ValueError(f"path={path!r} and checkpoint_id={checkpoint_id!r} disagree; pass one")
    chosen = path if path is not None else checkpoint_id
    if not is_torch_writer(writer):  # ours or none: torch's writer of the same place and options
        chosen = resolve_path(path, checkpoint_id, writer)
        writer = as_torch_writer(writer, chosen)
        writer.sync_files = getattr(writer, "sync_files", True) and sync_files
        writer.thread_count = max(getattr(writer, "thread_count", 1), thread_count)
    in_flight.wait_for_saves_to(in_flight.place_of(chosen, writer))
    rank_local = not use_collectives and not no_dist and distributed()
    if rank_local:
        rank = dist.get_rank(process_group) if process_group is not None else dist.get_rank()
        coord = Coordinator(None, True, coordinator_rank, timeout)
    else:
        process_group = process_group if process_group is not None or no_dist else mesh_group(state_dict)
        coord = Coordinator(process_group, no_dist, coordinator_rank, timeout)
        rank = coord.rank
    return run_save(state_dict, writer, planner, coord, checkpoint_id=chosen, use_collectives=not rank_local,
                    rank=rank)


def _load_on_torch_protocol(state_dict: Any, reader: Any, planner: Any, coord: Coordinator, rank: int,
                            strict: bool | str, allow_pickle: bool, checkpoint_id: Any = None) -> dict[str, Any]:
    """load() through torch's procedure (:mod:`.protocol_run`): ``planner`` as given when it is on
    torch's protocol (or HyperParallel's newer one), else torch's default planner with this
    library's ``strict`` (no target: everything, nested as saved)."""
    whole = state_dict is None
    if not (is_torch_planner(planner, "load") or is_seed_planner(planner)):
        planner = torch_load_planner(planner, whole=whole, strict=strict)
    target = {} if whole else state_dict
    return run_load(target, reader, planner, coord, checkpoint_id=checkpoint_id, rank=rank,
                    allow_pickle=allow_pickle)


def _load_with_protocol_reader(state_dict: Any, path: PathLike | None, checkpoint_id: PathLike | None, reader: Any,
                               planner: Any, process_group: Any, no_dist: bool, strict: bool | str,
                               coordinator_rank: int, allow_pickle: bool, timeout: Any) -> dict[str, Any]:
    """load() with a reader on torch's protocol (or HyperParallel's newer one): torch's procedure
    with that reader; ``checkpoint_id`` given is passed to its ``reset`` as torch does."""
    if path is not None and checkpoint_id is not None and os.fspath(path) != os.fspath(checkpoint_id):
        raise ValueError(f"path={path!r} and checkpoint_id={checkpoint_id!r} disagree; pass one")
    chosen = path if path is not None else checkpoint_id
    in_flight.wait_for_saves_to(in_flight.place_of(chosen, reader))
    if isinstance(state_dict, dict) and not state_dict and process_group is None and not (
            is_torch_planner(planner, "load") or is_seed_planner(planner)):
        return state_dict
    process_group = process_group if process_group is not None or no_dist else mesh_group(state_dict)
    coord = Coordinator(process_group, no_dist, coordinator_rank, timeout)
    try:
        return _load_on_torch_protocol(state_dict, reader, planner, coord, coord.rank, strict, allow_pickle,
                                       checkpoint_id=None if chosen is None else os.fspath(chosen))
    finally:
        close = getattr(reader, "close", None)
        if callable(close):
            close()


def load(
    state_dict: dict[str, Any] | PathLike | None = None,
    path: PathLike | None = None,
    *,
    checkpoint_id: PathLike | None = None,
    storage_reader: StorageReader | None = None,
    planner: LoadPlanner | None = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    strict: bool | str = True,
    coordinator_rank: int = 0,
    allow_pickle: bool = False,
    thread_count: int = 4,
    verify: bool = True,
    timeout: timedelta | float | None = None,
    broadcast_replicated_tensors: bool | None = None,
    broadcast_groups: dict[tuple[int, ...], Any] | None = None,
    broadcast_batch_bytes: int | None = None,
    broadcast_from_minimum_rank: bool | None = None,
) -> dict[str, Any]:
    """Load a checkpoint, resharding from the saved layout into the target's.

    ``load(sd, path)`` fills ``sd`` in place: each DTensor gets its local shard under its
    own placements (whatever layout was saved), each plain tensor the whole tensor (a
    target of another dtype is converted), plain values are replaced, Stateful objects get
    ``load_state_dict`` with their filled state. ``load(path=p)`` with no target returns
    the full state as CPU tensors and plain values, nested as it was saved.

    Args:
        state_dict: the target (filled in place), or None to return everything.
        path / checkpoint_id: the checkpoint directory (synonyms).
        storage_reader: a :class:`StorageReader`; default: :class:`FileSystemReader`. torch DCP's
            ``FileSystemReader``/``FsspecReader`` are taken as configuration.
        planner: a :class:`LoadPlanner`; default: :class:`StandardPlanner`. torch DCP's
            ``DefaultLoadPlanner`` is taken as configuration (``allow_partial_load=True``: keys
            missing from the checkpoint are left as they are, as ``strict=False``).
        process_group: as for :func:`save` (default: the world, or the one mesh over some
            ranks that every target DTensor lives on; ranks outside that mesh need not call
            load). A call with an empty target returns at once without any collective, as
            HyperParallel's system tests need (ranks outside a ``rank_list`` mesh call
            ``load({})``); so where the others load on the world group, every rank must ask for
            something, or they wait for it until ``timeout`` and then fail saying so.
        use_collectives: False: no collective; this rank reads the whole checkpoint's
            metadata where there is one (``.metadata``, or a foreign reader's such as
            Hugging Face files), else only its own fragment of a rank-local checkpoint.
        strict: ``True`` (default): every key this rank asks for must be in the checkpoint
            (keys the checkpoint holds and no target asks for are fine: pipeline stages,
            model-only loads). ``False``: load what exists and warn about the rest.
            ``"all"``: also require that every checkpoint key is asked for by some rank.
        allow_pickle: permit unpickling values saved with ``allow_pickle=True``.
        thread_count: reader threads per rank (files are read in parallel, each front to back).
        timeout: bound on every cross-rank exchange and on every call to an object store
            (seconds > 0 or a timedelta; default 30 min); a store that stops answering raises
            StorageTimeoutError.
        verify: check the crc32c of every byte read (default). A chunk is checked in blocks
            of whole rows, so a load that needs part of each row (e.g. ``Shard(0)`` saved,
            ``Shard(1)`` loaded) reads whole rows. ``verify=False`` reads only the bytes the
            target needs and checks sizes but no checksums.
        broadcast_replicated_tensors: True: read each part of a target that several ranks
            need (replicas: HSDP, DDP, ``Replicate``, plain tensors) from storage once, by one
            of them, and send it to the others over the group, straight into their targets
            (see :mod:`.shared_reads`). False: every rank reads what it needs itself. None
            (default): True, except where the files live in memory (tmpfs, ramfs,
            ``memory://``: the reader's ``memory_backed``), where reading again is as cheap as
            receiving. The coordinator's reader decides for all. Changes how bytes are
            fetched, never what is loaded.
        broadcast_batch_bytes: bytes of buffers a rank holds at once for shared parts that
            cannot land in their targets directly (non-contiguous or accelerator targets;
            default 256 MiB).
        broadcast_groups: HyperParallel's explicit replica groups; accepted and not needed
            (the ranks that share a chunk are found from the plans).
        broadcast_from_minimum_rank: HyperParallel's newer name for
            ``broadcast_replicated_tensors`` (one rank of a group holding the same shard reads
            it, the others receive it); giving both with different values is a ValueError.

    Returns:
        The filled ``state_dict`` (the same object), or the loaded nested state dict.

    Raises:
        NotACheckpointError: ``path`` holds no committed checkpoint.
        MetadataError: ``.metadata`` is corrupt or of a newer format version, or fragments of
            a rank-local checkpoint are missing (names the ranks).
        StateDictMismatchError: a key the target asks for is missing (strict), or a shape or
            kind mismatch.
        CorruptCheckpointError: a checksum, size or file check failed; names key and file.
        RankFailedError: on every rank in a group when any rank failed.

    Example::

        sd = {"model": model.state_dict()}
        load(sd, checkpoint_id="/ckpt/step100")
    """
    if isinstance(state_dict, (str, os.PathLike)) and path is None and checkpoint_id is None:
        state_dict, path = None, state_dict
    path, storage_reader = storage_in_path_slot(path, storage_reader, "storage_reader")  # torch's load(sd, reader)
    if strict not in (True, False, "all"):
        raise ValueError(f"strict must be True, False or 'all', found {strict!r}")
    if broadcast_from_minimum_rank is not None:  # HyperParallel's name for the same switch
        if broadcast_replicated_tensors is not None and broadcast_replicated_tensors != broadcast_from_minimum_rank:
            raise ValueError(f"broadcast_from_minimum_rank={broadcast_from_minimum_rank} and "
                             f"broadcast_replicated_tensors={broadcast_replicated_tensors} disagree: they are one "
                             "switch (HyperParallel's name and ours); pass one")
        broadcast_replicated_tensors = broadcast_from_minimum_rank
    if broadcast_groups is not None and broadcast_replicated_tensors is False:
        raise ValueError("broadcast_groups needs broadcast_replicated_tensors=True (broadcast_from_minimum_rank=True)")
    storage_reader = as_our_reader(storage_reader, foreign_ok=True)
    planner = as_our_planner(planner, "load", foreign_ok=True)
    # a reader with code of its own: torch's procedure (ours answer the seed's names too, and load as ours)
    if is_torch_reader(storage_reader) or (is_seed_reader(storage_reader)
                                           and not isinstance(storage_reader, StorageReader)):
        return _load_with_protocol_reader(state_dict, path, checkpoint_id, storage_reader, planner, process_group,
                                          no_dist, strict, coordinator_rank, allow_pickle, timeout)
    foreign_planner = is_torch_planner(planner, "load") or is_seed_planner(planner)
    where = resolve_path(path, checkpoint_id, storage_reader)
    # an async save in flight to this place would commit under the reader (and remove the old files)
    in_flight.wait_for_saves_to(in_flight.place_of(where, storage_reader))
    if isinstance(state_dict, dict) and not state_dict and process_group is None and not foreign_planner:
        return state_dict  # nothing to load: no collective (HyperParallel's ranks outside a rank_list mesh)
    rank_local = not use_collectives and not no_dist and distributed()
    if rank_local:
        my_rank = dist.get_rank(process_group) if process_group is not None else dist.get_rank()
        coord = Coordinator(None, True, 0, timeout)
    else:
        process_group = process_group if process_group is not None or no_dist else mesh_group(state_dict)
        coord = Coordinator(process_group, no_dist or not use_collectives, coordinator_rank, timeout)
        my_rank = coord.rank
    given = planner  # a checkpoint in torch's format, or a torch-protocol planner: torch's procedure
    if not foreign_planner:
        planner = planner_for_call(planner if planner is not None else StandardPlanner(), allow_pickle)
        if getattr(planner, "allow_partial_load", False) and strict is True:
            strict = False  # StandardLoadPlanner(allow_partial_load=True): HyperParallel's strict=False
    reader: StorageReader = storage_reader  # type: ignore[assignment]
    flat: Any = None
    materialized: list[Any] = []  # leaves whose meta-device targets were replaced
    raw: list[bytes] = []
    auto_share: list[bool] = []
    label = f"{where or 'checkpoint'}/{md.METADATA_FILE}"

    def read_and_share_metadata() -> None:
        # Everything that can fail on one rank happens inside an exchange, so the others
        # learn of it at once instead of waiting out the timeout.
        nonlocal reader, flat
        if reader is None:
            reader = reader_for(where)
        reader.set_up(coord.rank, coord.is_coordinator)
        bound_calls(reader, coord)
        flat = flatten(state_dict) if state_dict is not None else None
        if flat is not None:
            materialized.extend(materialize_meta(flat))
        if rank_local:
            raw.append(own_metadata_bytes(reader, my_rank, where or "checkpoint"))
        elif coord.is_coordinator:
            raw.append(metadata_bytes(reader, where or "checkpoint"))
            if broadcast_replicated_tensors is None:  # decided once, for every rank
                auto_share.append(not getattr(reader, "memory_backed", False))
        if raw and is_pickle(raw[0]):  # torch's format: checked here (files too), before any rank plans from it
            TorchFormatReader(reader, raw[0], allow_pickle).read_metadata()

    loaded: list[Any] = []
    # Planning and reading make thousands of small acyclic objects (boxes, chunk references,
    # read items); the full collections they trigger over a trained model's heap measured
    # 50-200 ms on the critical path, so the cyclic GC waits until the data is in place.
    with paused_gc():
        try:
            coord.exchange("load (reading metadata)", read_and_share_metadata)
            if rank_local:
                meta_bytes, enabled = raw[0], False
            else:
                mine = (raw[0], auto_share[0] if auto_share else False) if raw else None
                meta_bytes, enabled = coord.broadcast(mine, "load (metadata broadcast)")
            if broadcast_replicated_tensors is not None:
                enabled = broadcast_replicated_tensors
            if is_pickle(meta_bytes) or foreign_planner:  # torch's format, or a planner on torch's protocol
                on_protocol = (TorchFormatReader(reader, meta_bytes, allow_pickle, files_checked=True)
                               if is_pickle(meta_bytes) else
                               OwnFormatReader(reader, md.Metadata.from_json(meta_bytes, where=label).attach(),
                                               where=where or "checkpoint", allow_pickle=allow_pickle,
                                               thread_count=thread_count, verify=verify))
                out = _load_on_torch_protocol(state_dict, on_protocol, given, coord, my_rank, strict, allow_pickle)
                leave_set_up(given, out, on_protocol.read_metadata, coord.is_coordinator)
                return out

            share = sharing_wanted(coord, enabled, rank_local)
            planned: dict[str, Any] = {}

            def plan_and_read() -> tuple[Needs | None, bytes]:
                meta = md.Metadata.from_json(meta_bytes, where=label)
                planner.set_up_load(FlatStateDict.of(flat) if flat else None, meta, coord.is_coordinator,
                                    rank=my_rank)
                plan = planner.create_local_load_plan()
                check_keys(planner, strict)
                asked = asked_for(meta, planner) if strict == "all" else b""
                planned.update(meta=meta, plan=plan)
                if share:  # read after learning what the other ranks need
                    return needs_of(plan, meta), asked
                read_plan(plan, planner, reader, thread_count, verify=verify)
                loaded.extend((planner.finish_load(), meta))
                return None, asked

            outcomes = coord.exchange("load", plan_and_read)
            if share:
                everyone = [needs for needs, _ in outcomes]
                if worth_sharing(everyone):
                    read_shared(coord, planned["plan"], planner, reader, planned["meta"], everyone,
                                thread_count=thread_count, verify=verify,
                                batch_bytes=broadcast_batch_bytes or DEFAULT_BATCH_BYTES)
                else:
                    coord.exchange("load (reading)", lambda: read_plan(planned["plan"], planner, reader, thread_count,
                                                                       verify=verify))
                coord.exchange("load (finishing)", lambda: loaded.extend((planner.finish_load(), planned["meta"])))
        finally:
            if reader is not None:
                reader.close()
    values, meta = loaded
    if strict == "all":
        check_all_asked_for(meta, [asked for _, asked in outcomes])
    if flat is None:
        order = {k: i for i, k in enumerate(meta.entries)}  # as saved
        return unflatten({meta.entries[k].path: values[k] for k in sorted(values, key=order.__getitem__)})
    # Putting values back can raise too (a Stateful's load_state_dict): in an exchange of its
    # own, after every rank has read, so no rank is left waiting and none applies half-read data.
    def apply() -> None:
        apply_loaded(flat, values, planner, materialized)
        assign_back(state_dict)

    coord.exchange("load (applying)", apply)
    leave_set_up(planner, state_dict, lambda: TorchView(meta, where, version=CURRENT_DCP_VERSION),
                 coord.is_coordinator)
    return state_dict
