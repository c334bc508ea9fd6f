"""save / load: the public entry of a checkpoint's save and load, and nothing else.

Save: flatten -> local plan -> (cached) global plan -> each rank writes its share ->
write results to the coordinator -> coordinator commits ``.metadata``. Load: coordinator
reads ``.metadata`` -> broadcast -> each rank plans and reads its overlaps. Each phase ends
in a status exchange, so a failure anywhere fails every rank with the same message.

Here the public keywords become option records (:mod:`..base.options`), built once, and the
call goes to the procedure that runs it: the phases of a save of ranks together
(:mod:`.save_run`) or of a load (:mod:`.load_run`), a rank-local save
(:mod:`.rank_local_save`), or torch's procedure for planners, readers and writers with code
of their own (:mod:`.protocol_run`). The steps of the phases live beside them, in engine/:
where and with which ranks (:mod:`.scope`), the save's planning exchange
(:mod:`.plan_exchange`), the commit (:mod:`.commit`), the load target's checks and filling
(:mod:`.targets`), the metadata read (:mod:`.metadata_reader`); the plan cache's hooks are
called as :mod:`..planning.plan_cache` describes.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..backends.protocol import StorageReader, StorageWriter
from ..backends.torch_storage import as_our_reader, as_our_writer, as_torch_writer, is_torch_reader, is_torch_writer
from ..base.errors import CheckpointError, UnsupportedValueError, storage_error
from ..base.options import BroadcastOptions, Coordination, ReadOptions, WriteOptions
from ..coordination.coordinator import Coordinator, as_timeout
from ..format import metadata as md
from ..format.torch_view import TorchView
from ..format.values import check_user_metadata
from ..planning.hyper_parallel_protocol import is_hyper_parallel_planner, is_hyper_parallel_reader
from ..planning.planner import LoadPlanner, SavePlanner
from ..planning.torch_planners import as_our_planner
from ..planning.torch_protocol import is_torch_planner
from . import in_flight
from .incremental import IncrementalState
from .load_run import load_on_torch_protocol, load_with, resolve_load
from .protocol_run import run_save
from .rank_local_save import save_rank_local
from .save_run import save_together
from .scope import PathLike, distributed, mesh_group, resolve_path, storage_in_path_slot

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
    coordination = Coordination(process_group, no_dist, use_collectives, coordinator_rank, timeout)
    options = WriteOptions(thread_count, sync_files, allow_pickle, user_metadata)
    path, storage_writer = storage_in_path_slot(path, storage_writer, "storage_writer")  # torch's save(sd, writer)
    # torch DCP's unmodified planner and storage objects stand for ours with their options; those
    # with code of their own run on torch's protocol
    storage_writer = as_our_writer(storage_writer, foreign_ok=True)
    planner = as_our_planner(planner, "save", foreign_ok=True)
    if is_torch_writer(storage_writer) or is_torch_planner(planner, "save") or is_hyper_parallel_planner(planner):
        if state_dict is None:
            raise ValueError("save() needs a state_dict")
        return _save_on_torch_protocol(state_dict, path, checkpoint_id, storage_writer, planner, coordination,
                                       options, incremental)
    where = resolve_path(path, checkpoint_id, storage_writer)
    if state_dict is None:
        raise ValueError("save() needs a state_dict")
    if thread_count == 1 and getattr(storage_writer, "thread_count", 1) > 1:  # torch's FileSystemWriter(thread_count=)
        options = replace(options, thread_count=storage_writer.thread_count)
    # an earlier async save to this place must not commit over this one
    in_flight.wait_for_saves_to(in_flight.place_of(where, storage_writer))
    if not use_collectives and not no_dist and distributed():
        as_timeout(timeout)  # checked as everywhere, though this rank saves alone
        if user_metadata is not None:
            check_user_metadata(user_metadata)  # no collective here: this rank alone
        return _torch_shaped(save_rank_local(state_dict, where, storage_writer, planner, process_group, allow_pickle,
                                             options.thread_count, sync_files, user_metadata))
    return _torch_shaped(save_together(state_dict, where, storage_writer, planner, coordination, options,
                                       incremental, _mesh_scoped))


def _torch_shaped(meta: Any) -> Any:
    """What save returns: torch's ``Metadata`` (and HyperParallel's), a view of the committed
    document built per key on access, with the document's own fields on it (``.entries``...)."""
    return TorchView(meta) if isinstance(meta, md.Metadata) else meta


def _save_on_torch_protocol(state_dict: dict[str, Any], path: PathLike | None, checkpoint_id: PathLike | None,
                            writer: Any, planner: Any, coordination: Coordination, options: WriteOptions,
                            incremental: Any) -> Any:
    """save() of a planner or writer with code of its own: torch's procedure (:mod:`.protocol_run`).
    A writer of ours (or none) under a torch-protocol planner becomes torch's writer for the same
    place, so the checkpoint is in torch's format (which load reads in place)."""
    for name, value in (("user_metadata", options.user_metadata), ("incremental", incremental)):
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
        writer.sync_files = getattr(writer, "sync_files", True) and options.sync_files
        writer.thread_count = max(getattr(writer, "thread_count", 1), options.thread_count)
    in_flight.wait_for_saves_to(in_flight.place_of(chosen, writer))
    c = coordination
    rank_local = not c.use_collectives and not c.no_dist and distributed()
    if rank_local:
        rank = dist.get_rank(c.process_group) if c.process_group is not None else dist.get_rank()
        coord = Coordinator(None, True, c.coordinator_rank, c.timeout)
    else:
        group = c.process_group if c.process_group is not None or c.no_dist else mesh_group(state_dict)
        coord = Coordinator(group, c.no_dist, c.coordinator_rank, c.timeout)
        rank = coord.rank
    return run_save(state_dict, writer, planner, coord, checkpoint_id=chosen, use_collectives=not rank_local,
                    rank=rank)


def _load_with_protocol_reader(state_dict: Any, path: PathLike | None, checkpoint_id: PathLike | None, reader: Any,
                               planner: Any, coordination: Coordination, read: ReadOptions) -> dict[str, Any]:
    """load() with a reader on torch's protocol (or HyperParallel's newer one): torch's procedure
    with that reader; ``checkpoint_id`` given is passed to its ``reset`` as torch does."""
    if path is not None and checkpoint_id is not None and os.fspath(path) != os.fspath(checkpoint_id):
        raise ValueError(f"path={path!r} and checkpoint_id={checkpoint_id!r} disagree; pass one")
    chosen = path if path is not None else checkpoint_id
    in_flight.wait_for_saves_to(in_flight.place_of(chosen, reader))
    c = coordination
    if isinstance(state_dict, dict) and not state_dict and c.process_group is None and not (
            is_torch_planner(planner, "load") or is_hyper_parallel_planner(planner)):
        return state_dict
    group = c.process_group if c.process_group is not None or c.no_dist else mesh_group(state_dict)
    coord = Coordinator(group, c.no_dist, c.coordinator_rank, c.timeout)
    try:
        return load_on_torch_protocol(state_dict, reader, planner, coord, coord.rank, read.strict, read.allow_pickle,
                                      checkpoint_id=None if chosen is None else os.fspath(chosen))
    finally:
        close = getattr(reader, "close", None)
        if callable(close):
            close()


def _broadcast_options(replicated_tensors: bool | None, groups: Any, batch_bytes: int | None,
                       from_minimum_rank: bool | None) -> BroadcastOptions:
    """load's broadcast keywords, checked, with HyperParallel's name for the switch folded into ours."""
    if from_minimum_rank is not None:  # HyperParallel's name for the same switch
        if replicated_tensors is not None and replicated_tensors != from_minimum_rank:
            raise ValueError(f"broadcast_from_minimum_rank={from_minimum_rank} and "
                             f"broadcast_replicated_tensors={replicated_tensors} disagree: they are one "
                             "switch (HyperParallel's name and ours); pass one")
        replicated_tensors = from_minimum_rank
    if groups is not None and replicated_tensors is False:
        raise ValueError("broadcast_groups needs broadcast_replicated_tensors=True (broadcast_from_minimum_rank=True)")
    return BroadcastOptions(replicated_tensors, groups, batch_bytes, from_minimum_rank)


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
    coordination = Coordination(process_group, no_dist, use_collectives, coordinator_rank, timeout)
    read = ReadOptions(thread_count, verify, allow_pickle, strict)
    broadcast = _broadcast_options(broadcast_replicated_tensors, broadcast_groups, broadcast_batch_bytes,
                                   broadcast_from_minimum_rank)
    storage_reader = as_our_reader(storage_reader, foreign_ok=True)
    planner = as_our_planner(planner, "load", foreign_ok=True)
    # a reader with code of its own: torch's procedure (ours answer HyperParallel's names too, and load as ours)
    if is_torch_reader(storage_reader) or (is_hyper_parallel_reader(storage_reader)
                                           and not isinstance(storage_reader, StorageReader)):
        return _load_with_protocol_reader(state_dict, path, checkpoint_id, storage_reader, planner, coordination,
                                          read)
    foreign_planner = is_torch_planner(planner, "load") or is_hyper_parallel_planner(planner)
    where = resolve_path(path, checkpoint_id, storage_reader)
    # an async save in flight to this place would commit under the reader (and remove the old files)
    in_flight.wait_for_saves_to(in_flight.place_of(where, storage_reader))
    if isinstance(state_dict, dict) and not state_dict and process_group is None and not foreign_planner:
        return state_dict  # nothing to load: no collective (HyperParallel's ranks outside a rank_list mesh)
    return load_with(resolve_load(state_dict, where, storage_reader, planner, foreign_planner, coordination, read,
                                broadcast))
