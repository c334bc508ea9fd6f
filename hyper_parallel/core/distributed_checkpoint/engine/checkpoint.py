"""save / load: the orchestration of a checkpoint, and nothing else.

Save: flatten -> local plan -> (cached) global plan -> each rank writes its share ->
write results to the coordinator -> coordinator commits ``.metadata``. Load: coordinator
reads ``.metadata`` -> broadcast -> each rank plans and reads its overlaps. Each phase ends
in a status exchange, so a failure anywhere fails every rank with the same message.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import math
import os
import threading
import uuid
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import crc32c
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..backends.locations import location
from ..backends.protocol import StorageReader, StorageWriter
from ..backends.resolve import reader_for, writer_for
from ..base.box import Box
from ..base.coordination import Coordinator, as_timeout
from ..base.errors import (
    CheckpointError,
    CommitError,
    NotACheckpointError,
    StateDictMismatchError,
    UnsupportedValueError,
)
from ..base.gc_pause import paused_gc
from ..format import metadata as md
from ..format.values import check_user_metadata, is_json_value
from ..planning.plan_cache import PLAN_CACHE, CachedSaveResult, entry_key, entry_prefix
from ..planning.planner import EntrySpec, LoadPlanner, SavePlan, SavePlanner, WriteItem
from ..planning.standard_planner import StandardPlanner, plan_digest
from ..state.flatten import FlatStateDict, flatten, unflatten, update_in_place
from ..transfer.loader import read_plan
from ..transfer.saver import build_metadata, data_file_names, write_plan
from ..transfer.shared_reads import DEFAULT_BATCH_BYTES, Needs, needs_of, read_shared, sharing_wanted, worth_sharing
from . import in_flight
from .commit import (
    NotCommittedError,
    commit_and_agree,
    commit_metadata,
    drop_stale_fragments,
    reclaim_replaced,
    remove_own_files,
    write_and_report,
)
from .fragments import (
    check_own_fragment,
    fragment_name,
    fragment_of,
    mark_failed,
    read_fragment,
    table_sub_ids,
    unmark_failed,
)
from .incremental import IncrementalState
from .metadata_reader import metadata_bytes

PathLike = str | os.PathLike

# Each rank's save plans by (planner scope, fingerprint of every rank's local plan): bounded and
# thread-safe (async_save's writer thread saves while the caller may too); see plan_cache.py.
# Whether a save uses a cached plan is decided by all ranks together (see _agree_on_plan).
_PLAN_CACHE = PLAN_CACHE
# Held from setting a planner's ``_cached_plans_key`` until its hook returns: an async save's
# copy of a planner calls the hooks of the caller's object, which a save of the caller's own
# may be using at the same time (reentrant: a hook may save).
_HOOKS_LOCK = threading.RLock()


def _resolve_path(path: PathLike | None, checkpoint_id: PathLike | None, storage: Any) -> str | None:
    """Where the checkpoint is. With a storage object too, ``checkpoint_id`` wins, as in torch
    DCP: the storage is pointed there (its ``reset``); one that cannot be and is elsewhere is
    an error, never a silent save or load at the storage's own place."""
    if path is not None and checkpoint_id is not None and os.fspath(path) != os.fspath(checkpoint_id):
        raise ValueError(f"path={path!r} and checkpoint_id={checkpoint_id!r} disagree; pass one")
    chosen = path if path is not None else checkpoint_id
    if chosen is None and storage is None:
        raise ValueError("say where the checkpoint is: path=/checkpoint_id= or a storage writer/reader")
    own = getattr(storage, "path", None) or getattr(storage, "url", None) if storage is not None else None
    if chosen is not None and storage is not None and (
            own is None or location(os.fspath(own)) != location(os.fspath(chosen))):
        if callable(getattr(storage, "reset", None)):
            storage.reset(os.fspath(chosen))
        elif own is not None:
            raise ValueError(f"checkpoint_id={os.fspath(chosen)!r}, but the {type(storage).__name__} given "
                             f"points at {os.fspath(own)!r} and has no reset() to point it there; pass one")
    return None if chosen is None else os.fspath(chosen)


def _bound_calls(storage: Any, coord: Coordinator) -> None:
    """Bound the storage's calls by the exchange timeout: a stuck store fails the save or load
    as a stuck peer does (storage not derived from our ABCs may lack the hook)."""
    hook = getattr(storage, "bound_calls", None)
    if hook is not None:
        hook(coord.timeout.total_seconds())


# torch DCP's planner hooks, which our protocol does not call, and what to override instead
_TORCH_HOOKS = {
    "set_up_planner": "transform_state_dict (rename or drop keys; called on save and on load)",
    "create_local_plan": "create_local_save_plan / create_local_load_plan",
    "create_global_plan": "create_global_save_plan",
    "finish_plan": "create_global_save_plan (the plan each rank writes)",
    "transform_tensor": "resolve_data (save) or transform the state dict after load",
    "lookup_tensor": "resolve_data (save) or resolve_target (load)",
    "commit_tensor": "nothing: change the tensors after load() returns",
    "resolve_bytes": "nothing: change the values after load() returns",
    "load_bytes": "nothing: change the values after load() returns",
}


def _refuse_torch_hooks(planner: Any) -> None:
    """A planner subclass overriding torch DCP's hook names would be silently ignored (our
    protocol has other names): refuse it, naming the hook and what to override instead."""
    if type(planner).__module__.startswith("torch.distributed.checkpoint"):
        raise UnsupportedValueError(
            f"planner={type(planner).__name__}(): torch.distributed.checkpoint's planners do not fit this library's "
            "planner protocol; pass StandardPlanner() (or a subclass of it) instead")
    for cls in type(planner).__mro__:
        if cls.__module__.startswith(("hyper_parallel.", "torch.")) or cls is object:
            continue
        found = sorted(set(vars(cls)) & _TORCH_HOOKS.keys())
        if found:
            name = found[0]
            raise UnsupportedValueError(
                f"{cls.__qualname__}.{name}: a torch.distributed.checkpoint planner hook, which this library's "
                f"planners never call (so it would be silently ignored); override {_TORCH_HOOKS[name]} instead "
                "(see StandardPlanner)")


def _for_this_call(planner: Any, allow_pickle: bool) -> Any:
    """The planner to use for one call: ``allow_pickle=True`` applies to this call only, so a
    planner object reused later never inherits it."""
    _refuse_torch_hooks(planner)
    if allow_pickle and hasattr(planner, "allow_pickle") and not planner.allow_pickle:
        planner = planner_copy(planner)
        planner.allow_pickle = True
    return planner


def planner_copy(planner: Any) -> Any:
    """A shallow copy of ``planner`` for one call (a planner holds one call's state, and the
    caller may use the object meanwhile) whose plan-cache hooks (:mod:`.plan_cache`) still run
    on the caller's object, where a subclass keeps its counts."""
    dup = copy.copy(planner)
    with contextlib.suppress(AttributeError, TypeError):  # a planner that takes no attributes
        dup._plan_cache_owner = getattr(planner, "_plan_cache_owner", planner)
    return dup


def _cache_scope(planner: Any, coord: Coordinator) -> tuple | None:
    """Where a planner's plans may be reused: same planner kind and options (``cache_key()``,
    told apart by its ``repr``), same group (by a token that is never reused), same rank.
    None: this planner is not cached."""
    key = getattr(planner, "cache_key", None)
    if key is None or not getattr(planner, "enable_plan_caching", True):
        return None
    return (type(planner).__module__, type(planner).__qualname__, key(), coord.group_token, coord.rank)


def _cached_plans(scope: tuple | None) -> dict[str, CachedSaveResult]:
    """This rank's cached plans for ``scope``, by fingerprint (a snapshot)."""
    return {} if scope is None else _PLAN_CACHE.under(entry_prefix(scope))


def _announce_plan(planner: Any, scope: tuple | None, fingerprint: str, used: CachedSaveResult | None) -> None:
    """Tell the planner's plan-cache hooks what the ranks agreed (see :mod:`.plan_cache`):
    ``_cached_plans_key``, then ``get_cached()`` once, returning ``used`` (None: a new plan)."""
    if scope is None:
        return
    key = entry_key(scope, fingerprint)
    if used is not None:
        _PLAN_CACHE.touch(key)
    planner = getattr(planner, "_plan_cache_owner", planner)
    if not hasattr(planner, "get_cached"):
        return
    with _HOOKS_LOCK:  # the attributes are per call; another thread's save may share the planner
        planner._cached_plans_key = key
        planner._plan_cache_decision = (used,)
        try:
            planner.get_cached()
        finally:
            planner._plan_cache_decision = None


def _remember_plan(planner: Any, scope: tuple | None, fingerprint: str, plan: SavePlan, meta: md.Metadata,
                   where: str | None) -> None:
    """After the commit of a save that made a new plan: ``planner.cache_result`` (whose base
    stores it), or store it directly for a planner without that hook. The save has succeeded,
    so a hook that raises is a warning."""
    if scope is None:
        return
    key = entry_key(scope, fingerprint)
    planner = getattr(planner, "_plan_cache_owner", planner)
    hook = getattr(planner, "cache_result", None)
    if hook is None:
        _PLAN_CACHE[key] = CachedSaveResult(plan, None)
        return
    try:
        with _HOOKS_LOCK:
            planner._cached_plans_key = key
            hook(plan, meta)
    except Exception as exc:
        warnings.warn(f"save to {where or 'storage'} is committed, but {type(planner).__qualname__}.cache_result "
                      f"raised {type(exc).__name__}: {exc}; the plan may not be cached", stacklevel=3)


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
        storage_writer: a :class:`StorageWriter`; default: :class:`FileSystemWriter`.
        planner: a :class:`SavePlanner`; default: :class:`StandardPlanner`.
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
        ValueError / TypeError: a bad argument (``timeout``, ``user_metadata``), named.

    Example::

        save(model.state_dict(), "/ckpt/step100")
    """
    where = _resolve_path(path, checkpoint_id, storage_writer)
    if state_dict is None:
        raise ValueError("save() needs a state_dict")
    if thread_count == 1 and getattr(storage_writer, "thread_count", 1) > 1:  # torch's FileSystemWriter(thread_count=)
        thread_count = storage_writer.thread_count
    # an earlier async save to this place must not commit over this one
    in_flight.wait_for_saves_to(in_flight.place_of(where, storage_writer))
    if not use_collectives and not no_dist and _distributed():
        as_timeout(timeout)  # checked as everywhere, though this rank saves alone
        if user_metadata is not None:
            check_user_metadata(user_metadata)  # no collective here: this rank alone
        return _save_rank_local(state_dict, where, storage_writer, planner, process_group, allow_pickle,
                                thread_count, sync_files, user_metadata)
    scoped = process_group is None and not no_dist  # a mesh over some ranks may choose the group
    process_group = process_group if process_group is not None or no_dist else _mesh_group(state_dict)
    scoped = (scoped and process_group is not None) or (_mesh_scoped and not no_dist)
    coord = Coordinator(process_group, no_dist or not use_collectives, coordinator_rank, timeout)
    planner = _for_this_call(planner if planner is not None else StandardPlanner(), allow_pickle)
    scope = _cache_scope(planner, coord)
    writer: StorageWriter = storage_writer  # type: ignore[assignment]
    local: list[SavePlan] = []
    cached: dict[str, CachedSaveResult] = {}

    def plan_locally() -> _Summary:
        nonlocal writer
        if user_metadata is not None:  # inside the exchange: a bad value on one rank fails every rank
            check_user_metadata(user_metadata)
        if writer is None:
            writer = writer_for(where, sync_files)
        writer.set_up(coord.rank, coord.is_coordinator)
        _bound_calls(writer, coord)
        flat = state_dict if isinstance(state_dict, FlatStateDict) else FlatStateDict.of(flatten(state_dict))
        if hasattr(planner, "group_ranks"):  # mesh ranks are recorded as ranks of the saving group
            planner.group_ranks = coord.group_ranks if coord.world_size > 1 else None
        planner.set_up_save(flat, coord.is_coordinator)
        local.append(planner.create_local_save_plan())
        if coord.world_size == 1:
            _check_complete_alone(local[0])
        writer.prepare()
        cached.update(_cached_plans(scope))
        digest = planner.structure_digest(local[0]) if hasattr(planner, "structure_digest") else plan_digest(local[0])
        plain = (_plain_digests(planner, local[0], coord.world_size <= PLAIN_DETAIL_RANKS)
                 if coord.world_size > 1 else None)
        return _Summary(digest, uuid.uuid4().hex[:16], list(cached) if scope is not None else None,
                        location(where) if where is not None else None, plain)

    summaries = coord.exchange("save (planning)", plan_locally)
    _check_one_location([s.place for s in summaries], coord)
    if coord.is_coordinator and coord.world_size > 1:
        _warn_divergent_plain([s.plain for s in summaries], coord)
    save_id = summaries[coord.coordinator_rank].save_id
    fingerprint, mine, used = _agree_on_plan(coord, planner, local[0], summaries, scope, cached)
    own_files = data_file_names(coord.rank, save_id, thread_count)
    what = f"save to {where or 'storage'}"
    mine_written: list[Any] = []

    def write() -> Any:
        _announce_plan(planner, scope, fingerprint, used)  # in the exchange: a hook that raises fails every rank
        reuse = incremental.reusable(mine.entries) if incremental is not None else None
        result = write_plan(mine, planner, writer, coord.rank, save_id, thread_count,
                            hashes=incremental is not None, reuse=reuse)
        mine_written.append(result)
        return result.for_coordinator()

    try:
        results = write_and_report(coord, writer, "save (writing data)", write, own_files, what, save_id)
        meta = commit_and_agree(
            coord, writer, "save (commit)",
            lambda: build_metadata(mine.entries, results, save_id, coord.world_size, user_metadata or {}),
            own_files, what, save_id, guard=_part_guard(coord, set(mine.entries), where) if scoped else None)
    except BaseException:
        if incremental is not None:
            incremental.reset()  # not committed, or not known to be: the next save writes everything
        raise
    if used is None:
        _remember_plan(planner, scope, fingerprint, mine, meta, where)
    if incremental is not None:
        done = mine_written[0]
        incremental.committed(mine.entries, done.digests, done.known_reused, meta)
    return meta


class _Summary(NamedTuple):
    """What a rank tells the others in a save's planning exchange."""

    digest: str  # of its structure (StandardPlanner) or its whole local plan
    save_id: str  # the coordinator's is used
    cached: list[str] | None  # fingerprints of the plans it has cached (None: caching off)
    place: str | None  # where it saves (:func:`.storage.location`)
    plain: tuple[int, dict[str, int] | None] | None  # :func:`_plain_digests`


def _check_one_location(places: list[str | None], coord: Coordinator) -> None:
    """Every rank of a collective save must write the same checkpoint: ranks naming different
    directories would commit metadata naming files that lie elsewhere, or leave a rank's
    directory without the checkpoint it believes it saved (checked on every rank from the
    same exchange, so every rank raises alike). Symlinked names of one directory agree;
    names of one shared directory under different mount points do not: name it alike."""
    if None in places or len(set(places)) <= 1:
        return
    shown = ", ".join(f"rank {coord._name(r)} {p!r}" for r, p in enumerate(places[:8]))
    raise ValueError(
        f"save: the ranks saving together name different checkpoints ({shown}"
        f"{' ...' if len(places) > 8 else ''}). One collective save writes one checkpoint, which every "
        "rank must name alike; to save parts apart, save each with a process_group of its own ranks, "
        "or use_collectives=False for rank-local checkpoints")


PLAIN_DETAIL_RANKS = 64  # up to this many ranks, the divergence warning names the keys


def _canonical(v: Any) -> Any:
    """A plain value with its dicts in a fixed order (equal dicts built in another order match)."""
    if isinstance(v, dict):
        return ["$dict", sorted(([repr(k), _canonical(x)] for k, x in v.items()), key=lambda kv: kv[0])]
    if isinstance(v, (list, tuple)):
        return [type(v).__name__, [_canonical(x) for x in v]]
    return repr(v)


def _plain_digests(planner: SavePlanner, plan: SavePlan, per_key: bool) -> tuple[int, dict[str, int] | None]:
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


def _warn_divergent_plain(digests: list[tuple[int, dict[str, int] | None]], coord: Coordinator) -> None:
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


def _part_guard(coord: Coordinator, keys: set[str], where: str | None) -> Callable[[bytes | None], None]:
    """For a save whose group a mesh over some ranks chose (no ``process_group`` given):
    refuse to replace a checkpoint holding tensors this save does not. That is another part
    of the model (a pipeline stage on a mesh of its own, saving into the same directory
    through its own group) or a whole model this part belongs to; replacing it would lose the
    rest while every rank reports success. A caller's explicit subgroup is trusted."""
    def guard(previous: bytes | None) -> None:
        if previous is None:
            return
        try:
            old = md.Metadata.from_json(previous).entries
        except Exception:  # unreadable: the commit replaces it, as any save does
            return
        lost = sorted(k for k, e in old.items() if e.kind != "object" and k not in keys)
        if lost:
            raise CheckpointError(
                f"{where or 'storage'} holds a checkpoint with tensors this save does not have ({len(lost)}, e.g. "
                f"{lost[0]!r}), and this save runs on ranks {coord.group_ranks[:8]} of {dist.get_world_size()} "
                "only: replacing that checkpoint would lose them. Parts of one model (pipeline stages on "
                "meshes of their own) save into one checkpoint through one group: pass "
                "process_group=dist.group.WORLD (or a group of every part's ranks); or save each part to a "
                "directory of its own")
    return guard


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _mesh_group(state_dict: Any) -> Any:
    """The group of the one mesh every DTensor of ``state_dict`` lives on, when that mesh is
    a root mesh over some ranks only (``init_device_mesh(..., rank_list=)``); else None.

    Slices of a bigger mesh (``mesh["tp"]``) do not count: their ranks save with the rest.
    """
    if not _distributed() or isinstance(state_dict, FlatStateDict):
        return None
    meshes: dict[int, Any] = {}

    def walk(v: Any, depth: int = 0) -> None:
        if isinstance(v, DTensor):
            meshes[id(v.device_mesh)] = v.device_mesh
        elif isinstance(v, dict) and depth < 64:
            for x in v.values():
                walk(x, depth + 1)
        elif isinstance(v, (list, tuple)) and depth < 64:
            for x in v:
                walk(x, depth + 1)

    walk(state_dict)
    if len(meshes) != 1:
        return None
    mesh = next(iter(meshes.values()))
    ranks = sorted(int(r) for r in mesh.mesh.flatten().tolist())
    if mesh._get_root_mesh() is not mesh or len(ranks) == dist.get_world_size():
        return None
    from ....platform import member_group

    return member_group(ranks)


def _save_rank_local(state_dict: Any, where: str | None, writer: StorageWriter | None, planner: Any,
                     process_group: Any, allow_pickle: bool, thread_count: int, sync_files: bool,
                     user_metadata: dict[str, Any] | None) -> md.Metadata:
    """``save(..., use_collectives=False)``: this rank's shards and fragment, no collective."""
    rank = dist.get_rank(process_group) if process_group is not None else dist.get_rank()
    world = dist.get_world_size(process_group) if process_group is not None else dist.get_world_size()
    writer = writer if writer is not None else writer_for(where, sync_files)
    writer.set_up(rank, rank == 0)
    planner = _for_this_call(planner if planner is not None else StandardPlanner(), allow_pickle)
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
        mark_failed(writer, rank, exc)
        raise
    unmark_failed(writer, rank)
    reclaim_replaced(writer, previous, built.file_names())
    return built


def _agree_on_plan(coord: Coordinator, planner: SavePlanner, local: SavePlan,
                   summaries: list[_Summary], scope: tuple | None,
                   cached: dict[str, CachedSaveResult]) -> tuple[str, SavePlan, CachedSaveResult | None]:
    """This rank's part of the save's global plan: ``(fingerprint of every rank's local plan,
    this rank's plan, the cache entry used or None)``. A cached plan is used only when EVERY
    rank has it for this exact set of local plans; a miss anywhere is a miss everywhere (else
    ranks would run different collectives). A new plan is cached after the commit
    (:func:`_remember_plan`), so only plans that made a checkpoint are kept.

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
        with paused_gc():  # unpickling every rank's plan: many small objects at scale
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
        storage_reader: a :class:`StorageReader`; default: :class:`FileSystemReader`.
        planner: a :class:`LoadPlanner`; default: :class:`StandardPlanner`.
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
    if strict not in (True, False, "all"):
        raise ValueError(f"strict must be True, False or 'all', found {strict!r}")
    if broadcast_groups is not None and broadcast_replicated_tensors is False:
        raise ValueError("broadcast_groups needs broadcast_replicated_tensors=True")
    where = _resolve_path(path, checkpoint_id, storage_reader)
    # an async save in flight to this place would commit under the reader (and remove the old files)
    in_flight.wait_for_saves_to(in_flight.place_of(where, storage_reader))
    if isinstance(state_dict, dict) and not state_dict and process_group is None:
        return state_dict  # nothing to load: no collective (HyperParallel's ranks outside a rank_list mesh)
    rank_local = not use_collectives and not no_dist and _distributed()
    if rank_local:
        my_rank = dist.get_rank(process_group) if process_group is not None else dist.get_rank()
        coord = Coordinator(None, True, 0, timeout)
    else:
        process_group = process_group if process_group is not None or no_dist else _mesh_group(state_dict)
        coord = Coordinator(process_group, no_dist or not use_collectives, coordinator_rank, timeout)
        my_rank = coord.rank
    planner = _for_this_call(planner if planner is not None else StandardPlanner(), allow_pickle)
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
        _bound_calls(reader, coord)
        flat = flatten(state_dict) if state_dict is not None else None
        if flat is not None:
            materialized.extend(_materialize_meta(flat))
        if rank_local:
            try:  # a whole checkpoint (or a foreign one, e.g. Hugging Face files) needs no fragment
                raw.append(reader.read_metadata())
            except NotACheckpointError:
                frag = read_fragment(reader, my_rank, where or "checkpoint")
                check_own_fragment(reader, frag, where or "checkpoint")
                raw.append(frag.to_json())
        elif coord.is_coordinator:
            raw.append(metadata_bytes(reader, where or "checkpoint"))
            if broadcast_replicated_tensors is None:  # decided once, for every rank
                auto_share.append(not getattr(reader, "memory_backed", False))

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

            share = sharing_wanted(coord, enabled, rank_local)
            planned: dict[str, Any] = {}

            def plan_and_read() -> tuple[Needs | None, bytes]:
                meta = md.Metadata.from_json(meta_bytes, where=label)
                planner.set_up_load(FlatStateDict.of(flat) if flat else None, meta, coord.is_coordinator,
                                    rank=my_rank)
                plan = planner.create_local_load_plan()
                _check_keys(planner, strict)
                asked = _asked_for(meta, planner) if strict == "all" else b""
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
        _check_all_asked_for(meta, [asked for _, asked in outcomes])
    if flat is None:
        order = {k: i for i, k in enumerate(meta.entries)}  # as saved
        return unflatten({meta.entries[k].path: values[k] for k in sorted(values, key=order.__getitem__)})
    # Putting values back can raise too (a Stateful's load_state_dict): in an exchange of its
    # own, after every rank has read, so no rank is left waiting and none applies half-read data.
    coord.exchange("load (applying)", lambda: _apply(flat, values, planner, materialized))
    return state_dict


def _materialize_meta(flat: Any) -> list[Any]:
    """Targets on the meta device (a model built under ``torch.device("meta")``) hold no memory
    to load into: each leaf gets an empty tensor of its shape and dtype instead (a DTensor
    keeps its mesh and placements, on the mesh's device; a plain tensor goes to the CPU), as
    torch DCP does. The caller's containers receive them only once the load succeeded
    (:func:`_apply`); the caller then puts them into the model
    (``model.load_state_dict(sd, assign=True)``). Returns the leaves replaced."""
    out = []
    for key, leaf in flat.leaves.items():
        value = leaf.value
        if not isinstance(value, torch.Tensor) or value.device.type != "meta":
            continue
        if leaf.set is None:
            raise UnsupportedValueError(f"{key!r}: the target is on the meta device and cannot be replaced "
                                        "where it sits; materialize it first (model.to_empty(device=...))")
        if isinstance(value, DTensor):
            local = torch.empty_like(value._local_tensor, device=value.device_mesh.device_type)
            leaf.value = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                            shape=value.shape, stride=value.stride())
        else:
            leaf.value = torch.empty_like(value, device="cpu")
        out.append(leaf)
    return out


def _asked_for(meta: md.Metadata, planner: Any) -> bytes:
    """A bitmap over the checkpoint's sorted keys: those this rank's target asked for."""
    keys = sorted(meta.entries)
    asked = set(meta.entries) - set(getattr(planner, "unexpected_keys", []))
    bits = bytearray(-(-len(keys) // 8))
    for i, k in enumerate(keys):
        if k in asked:
            bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def _check_all_asked_for(meta: md.Metadata, bitmaps: list[bytes]) -> None:
    keys = sorted(meta.entries)
    union = bytearray(-(-len(keys) // 8))
    for b in bitmaps:
        for i, x in enumerate(b):
            union[i] |= x
    left = [k for i, k in enumerate(keys) if not union[i // 8] >> (i % 8) & 1]
    if left:
        raise StateDictMismatchError(
            f"load(strict='all'): {len(left)} checkpoint key(s) were asked for by no rank: "
            f"{', '.join(map(repr, left[:20]))}{' ...' if len(left) > 20 else ''}")


def _apply(flat: Any, values: dict[str, Any], planner: Any, materialized: list[Any] = ()) -> None:
    """Put loaded values where the target's leaves came from, then call Stateful loads.

    Keys are the planner's; ``planner.original_key`` maps each back to the target's key
    (planners that rename keys on load implement it).
    """
    original = getattr(planner, "original_key", None)
    own = {id(leaf.value) for leaf in flat.leaves.values()}
    filled: set[int] = set()
    for key, value in values.items():
        name = original(key) if original is not None else key
        leaf = flat.leaves.get(name) if name is not None else None
        if leaf is not None:
            filled.add(id(leaf))
        if leaf is None:
            if name is None and id(value) not in own:
                raise StateDictMismatchError(
                    f"{key!r}: the planner's transform_state_dict renamed a target key to it, and which one "
                    "cannot be told (several keys hold the same value); override transform_key instead so "
                    "the loaded value can be put back")
            continue
        if value is leaf.value:
            continue
        if isinstance(leaf.value, dict) and isinstance(value, dict):  # a plain dict stored whole
            update_in_place(leaf.value, value)  # the caller may hold it (a data position)
        elif leaf.set is not None:
            leaf.set(value)
    missing = {(original(k) if original is not None else k) or k for k in getattr(planner, "missing_keys", ())}
    replaced = {id(leaf) for leaf in materialized}
    for key, leaf in flat.leaves.items():  # the tensors that replace meta targets, loaded in place
        if id(leaf) not in replaced:
            continue
        local = leaf.value._local_tensor if isinstance(leaf.value, DTensor) else leaf.value
        # one strict=False skipped stays on meta; an empty shard (a rank holding none of an
        # uneven Shard, a size-0 tensor) had nothing to read but is loaded all the same
        if id(leaf) in filled or (not local.numel() and key not in missing):
            leaf.set(leaf.value)
    for obj, inner in flat.statefuls:
        obj.load_state_dict(inner)


def _check_complete_alone(plan: SavePlan) -> None:
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


def _check_keys(planner: Any, strict: bool | str) -> None:
    """Keys the target asks for must exist (unless strict=False, which warns); checkpoint keys
    nobody asks for are fine (``strict="all"`` checks those across ranks, after reading)."""
    missing = list(getattr(planner, "missing_keys", []))
    if not missing:
        return
    original = getattr(planner, "original_key", None)

    def named(key: str) -> str:  # a key the planner renamed (topology_mapper) shows both names
        name = original(key) if original is not None else key
        return repr(key) if name in (None, key) else f"{name!r} (checkpoint key {key!r})"

    shown = ", ".join(map(named, missing[:20])) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
    if strict:
        raise StateDictMismatchError(
            f"the target asks for key(s) the checkpoint does not hold: {shown}. Pass strict=False to load "
            "only the keys that exist")
    warnings.warn(f"load(strict=False) skipped key(s) the checkpoint does not hold: {shown}", stacklevel=3)
