"""torch DCP's save and load procedures, run over this library's coordination: for planners and
storage objects that carry code of their own.

``save``/``load`` map torch's unmodified default planners and filesystem storage onto this
library's own path; a planner or storage object on torch DCP's protocol with hooks of its own
(a subclass of torch's ``DefaultLoadPlanner`` overriding ``resolve_tensor``, torch's
``_EmptyStateDictLoadPlanner``, a ``FileSystemWriter`` subclass with its own file system, any
object implementing torch's ABCs, HyperParallel's newer names through
:mod:`..planning.hyper_parallel_protocol`) is run here instead, in torch's call order and with its
semantics:

save (:func:`run_save`): ``storage_writer.reset(checkpoint_id)`` (when given) ->
``set_up_planner(state_dict, storage_meta=storage_writer.storage_meta(), is_coordinator)`` ->
``set_up_storage_writer(is_coordinator[, rank=, use_collectives=])`` -> ``create_local_plan`` ->
``storage_writer.prepare_local_plan`` -> gather to the coordinator -> ``create_global_plan`` ->
``storage_writer.prepare_global_plan`` -> scatter -> ``finish_plan`` ->
``storage_writer.write_data(plan, planner)`` (its future waited for) -> gather the results ->
``storage_writer.finish(metadata, results)`` on the coordinator; every rank returns the
coordinator's ``Metadata``. Top-level ``Stateful`` values are saved as their ``state_dict()``.

load (:func:`run_load`): ``storage_reader.reset(checkpoint_id)`` (when given) ->
``read_metadata()`` on every rank (a reader that takes keyword arguments is asked
``read_metadata(rank=)`` when that fails: a rank-local checkpoint) -> ``set_up_planner(state_dict,
metadata, is_coordinator)`` -> ``set_up_storage_reader(metadata, is_coordinator[, rank=,
use_collectives=])`` -> ``create_local_plan`` -> ``prepare_local_plan`` -> gather ->
``create_global_plan`` -> ``prepare_global_plan`` -> scatter -> ``finish_plan`` ->
``read_data(plan, planner)`` (waited for). Top-level ``Stateful`` values get
``load_state_dict`` with their loaded state afterwards.

The optional arguments are passed as torch 2.13 passes them: ``storage_meta`` only to a
``set_up_planner`` that names it, ``rank``/``use_collectives`` only to a
``set_up_storage_*`` whose signature has ``**kwargs``. torch's ``validate_checkpoint_id`` is
what torch asks its own classes when no storage is given; here the storage is chosen by
:mod:`..backends.resolve` then, so it is not called.

Every step runs inside an exchange of :class:`~..coordination.coordinator.Coordinator`: a hook that
raises on one rank fails every rank with the same :class:`~..base.errors.RankFailedError`
(torch's ``CheckpointException``) whose ``failures`` map the rank to its exception and stack,
a rank that never arrives fails the others after ``timeout``, and one process (``no_dist``, no
process group, a rank-local save) runs everything locally, its hooks' errors raised as that
same ``RankFailedError`` naming the one rank, as torch's ``_DistWrapper`` raises them. Plans travel as
torch's do (each rank's local plan to the coordinator, each rank's final plan back to it
alone); results go to the coordinator only.

Two extensions of torch's protocol, for HyperParallel's planners and readers whose global step
runs on every rank: a planner with ``own_global_plan(all_plans)`` gets every rank's local plan
on every rank and returns this rank's plan (save: and the ``Metadata``); the storage object's
``prepare_global_plan`` still runs on the coordinator over the gathered results, and a reader
with ``prepare_own_plan(plan)`` is given this rank's plan after the scatter.

Pickles: while :func:`run_load` runs, a reader that inherits torch's ``FileSystemReader.read_metadata``
(``pickle.load``) reads ``.metadata`` with the allowlist unpickler
(:func:`~..backends.torch_format.safe_metadata_reads`), and a planner that inherits torch's
``DefaultLoadPlanner.load_bytes`` (``weights_only=False``) decodes byte items with
``weights_only=True`` (:func:`~..planning.torch_protocol.safe_byte_loads`; ``allow_pickle=True``
is the caller's opt-in to torch's way). A planner's own ``load_bytes``, and a reader's own
``read_metadata``/``read_data``, are the caller's code and run as written.

What it is not: this library's own save and load (:mod:`.checkpoint`, which dispatches here),
the planners and storage it runs (torch's, the caller's, :mod:`..backends.torch_format`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.stateful import Stateful

from ..backends.torch_format import safe_metadata_reads
from ..base.errors import CheckpointError, RankFailedError
from ..coordination.coordinator import Coordinator, rank_failure
from ..planning.hyper_parallel_protocol import as_torch_planner, as_torch_reader
from ..planning.torch_protocol import safe_byte_loads, torch_save_planner

__all__ = ["run_save", "run_load"]


def _takes(fn: Any, name: str) -> bool:
    """Whether ``fn``'s signature has a parameter called ``name`` (torch's test for optional args)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _value(done: Any) -> Any:
    """What a storage's ``write_data``/``read_data`` returned, waited for: torch's future
    (``wait()``), a ``concurrent.futures.Future`` (``result()``), or the value itself."""
    if hasattr(done, "wait") and hasattr(done, "value"):
        done.wait()
        return done.value()
    if callable(getattr(done, "result", None)):
        return done.result()
    return done


def _planned(coord: Coordinator, what: str, planner: Any, storage: Any, local_step: Any,
             global_step: Any) -> tuple[Any, Any]:
    """This rank's central plan, and (on the coordinator; save) the global metadata.

    torch's shape: local plans gathered to the coordinator, ``global_step(plans) -> (plans,
    metadata)`` there, each rank's plan scattered back. A planner with ``own_global_plan``:
    every rank gets every local plan and plans itself; the storage's global step still runs on
    the coordinator over what the ranks planned.
    """
    kept: list[Any] = []
    if callable(getattr(planner, "own_global_plan", None)):
        local_plans = coord.exchange(f"{what} (local plan)", local_step)

        def own_step() -> Any:
            result = planner.own_global_plan(local_plans)
            plan, meta = result if what == "save" else (result, None)
            kept.append(meta)
            return plan

        own_plans = coord.gather_to_coordinator(f"{what} (global plan)", own_step)

        def storage_step() -> None:
            if coord.is_coordinator:
                kept.append(_one_per_rank(storage.prepare_global_plan(own_plans), coord, what))
    else:
        gathered = coord.gather_to_coordinator(f"{what} (local plan)", local_step)

        def storage_step() -> None:
            if coord.is_coordinator:
                plans, meta = global_step(gathered)
                kept.append(meta)
                kept.append(_one_per_rank(storage.prepare_global_plan(_one_per_rank(plans, coord, what)), coord,
                                          what))
    coord.exchange(f"{what} (storage global plan)", storage_step)
    mine = coord.scatter(kept[-1] if coord.is_coordinator else None, f"{what} (plan scatter)")
    own = getattr(storage, "prepare_own_plan", None)
    if callable(own):
        prepared: list[Any] = []
        coord.exchange(f"{what} (own plan)", lambda: prepared.append(own(mine)))
        mine = prepared[0]
    return mine, kept[0] if kept else None


@contextmanager
def _failures_as_torch_raises(coord: Coordinator, what: str, rank: int) -> Iterator[None]:
    """A hook's error in one process raised as torch raises it: a ``CheckpointException``
    (:class:`RankFailedError`) naming this rank, its ``failures[rank]`` the exception and
    stack. With several ranks the exchanges already do that; this library's own errors are
    ``CheckpointException`` already and stay what they are."""
    try:
        yield
    except Exception as exc:
        if coord.distributed or isinstance(exc, CheckpointException):
            raise
        raise RankFailedError(what, {rank: rank_failure(exc)}) from exc


def _one_per_rank(plans: Any, coord: Coordinator, what: str) -> list[Any]:
    plans = list(plans)
    if len(plans) != coord.world_size:
        raise CheckpointError(f"{what}: the global plan has {len(plans)} plans for {coord.world_size} ranks; a "
                              "planner's create_global_plan and a storage's prepare_global_plan return one per rank")
    return plans


def run_save(state_dict: dict[str, Any], storage_writer: Any, planner: Any, coord: Coordinator, *,
             checkpoint_id: Any = None, use_collectives: bool = True, rank: int | None = None) -> Any:
    """Save ``state_dict`` through torch's protocol (the order is in the module docstring).

    Args:
        state_dict: the state dict, as torch's ``save`` takes it (top-level ``Stateful`` values
            are saved as their ``state_dict()``).
        storage_writer: an object on torch's ``StorageWriter`` protocol.
        planner: on torch's ``SavePlanner`` protocol, HyperParallel's newer names, or None
            (torch's ``DefaultSavePlanner``).
        coord: the ranks saving together (a local one for ``use_collectives=False``).
        checkpoint_id: passed to ``storage_writer.reset`` when given.
        use_collectives: passed to ``set_up_storage_writer``; False: ``coord`` is local and
            ``rank`` is this process's rank (torch's rank-local save).
        rank: the rank the storage and planners are told (default: ``coord.rank``).

    Returns:
        The checkpoint's ``Metadata`` (torch's, or whatever the planner's global step built),
        the coordinator's, on every rank.

    Raises:
        RankFailedError: a hook failed on some rank (every rank raises it, naming the rank).
        CheckpointError: a global step returned the wrong number of plans.
    """
    rank = coord.rank if rank is None else rank
    with _failures_as_torch_raises(coord, "save", rank):
        return _run_save(state_dict, storage_writer, planner, coord, checkpoint_id, use_collectives, rank)


def _run_save(state_dict: dict[str, Any], storage_writer: Any, planner: Any, coord: Coordinator,
              checkpoint_id: Any, use_collectives: bool, rank: int) -> Any:
    is_coordinator = coord.is_coordinator if use_collectives else rank == coord.coordinator_rank
    planner = torch_save_planner(as_torch_planner(planner, "save", rank, use_collectives))
    if checkpoint_id is not None:
        storage_writer.reset(checkpoint_id)
    state = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}

    def local_step() -> Any:
        storage_meta = storage_writer.storage_meta() if callable(getattr(storage_writer, "storage_meta", None)) \
            else None
        if _takes(planner.set_up_planner, "storage_meta"):
            planner.set_up_planner(state_dict=state, storage_meta=storage_meta, is_coordinator=is_coordinator)
        else:
            planner.set_up_planner(state, is_coordinator)
        if _takes(storage_writer.set_up_storage_writer, "kwargs"):
            storage_writer.set_up_storage_writer(is_coordinator, rank=rank, use_collectives=use_collectives)
        else:
            storage_writer.set_up_storage_writer(is_coordinator)
        return storage_writer.prepare_local_plan(planner.create_local_plan())

    central, metadata = _planned(coord, "save", planner, storage_writer, local_step, planner.create_global_plan)

    def write() -> Any:
        final = planner.finish_plan(central)
        return _value(storage_writer.write_data(final, planner))

    results = coord.gather_to_coordinator("save (writing data)", write)

    def finish() -> None:
        if coord.is_coordinator:
            storage_writer.finish(metadata=metadata, results=results)

    coord.exchange("save (finish)", finish)
    return coord.broadcast(metadata if coord.is_coordinator else None, "save (metadata)")


def run_load(state_dict: dict[str, Any], storage_reader: Any, planner: Any, coord: Coordinator, *,
             checkpoint_id: Any = None, rank: int | None = None, allow_pickle: bool = False) -> dict[str, Any]:
    """Load into ``state_dict`` in place through torch's protocol (the order is in the module docstring).

    Args:
        state_dict: the target, as torch's ``load`` takes it (top-level ``Stateful`` values get
            ``load_state_dict``); ``{}`` with a planner that builds the state from the metadata
            (torch's ``_EmptyStateDictLoadPlanner``).
        storage_reader: an object on torch's ``StorageReader`` protocol, or HyperParallel's newer names.
        planner: on torch's ``LoadPlanner`` protocol, HyperParallel's newer names, or None
            (torch's ``DefaultLoadPlanner``).
        coord: the ranks loading together.
        checkpoint_id: passed to ``storage_reader.reset`` when given.
        rank: the rank the storage and planner are told (default: ``coord.rank``).
        allow_pickle: byte items decoded by torch's default ``load_bytes`` may be unpickled
            beyond ``weights_only`` rules.

    Returns:
        ``state_dict``.

    Raises:
        RankFailedError: a hook failed on some rank (every rank raises it, naming the rank).
    """
    rank = coord.rank if rank is None else rank
    with _failures_as_torch_raises(coord, "load", rank):
        return _run_load(state_dict, storage_reader, planner, coord, checkpoint_id, rank, allow_pickle)


def _run_load(state_dict: dict[str, Any], storage_reader: Any, planner: Any, coord: Coordinator,
              checkpoint_id: Any, rank: int, allow_pickle: bool) -> dict[str, Any]:
    reader = as_torch_reader(storage_reader)
    planner = as_torch_planner(planner, "load", rank)
    planner = DefaultLoadPlanner() if planner is None else planner
    if checkpoint_id is not None:
        reader.reset(checkpoint_id)
    keys = sorted(state_dict)
    state = {k: state_dict[k].state_dict() if isinstance(state_dict[k], Stateful) else state_dict[k] for k in keys}
    is_coordinator = coord.is_coordinator

    def local_step() -> Any:
        use_collectives = True
        try:
            metadata = reader.read_metadata()
        except Exception as global_failed:
            if not _takes(reader.read_metadata, "kwargs"):
                raise
            try:  # torch's fallback: a rank-local checkpoint's own metadata
                metadata = reader.read_metadata(rank=rank)
            except Exception:
                raise global_failed from None
            use_collectives = False
        planner.set_up_planner(state, metadata, is_coordinator)
        if _takes(reader.set_up_storage_reader, "kwargs"):
            reader.set_up_storage_reader(metadata, is_coordinator, rank=rank, use_collectives=use_collectives)
        else:
            reader.set_up_storage_reader(metadata, is_coordinator)
        return reader.prepare_local_plan(planner.create_local_plan())

    def read() -> None:
        final = planner.finish_plan(central)
        with safe_byte_loads(planner, allow_pickle):
            _value(reader.read_data(final, planner))

    with safe_metadata_reads(reader):
        central, _ = _planned(coord, "load", planner, reader, local_step,
                              lambda plans: (planner.create_global_plan(plans), None))
        coord.exchange("load (reading)", read)
    for key in keys:
        if isinstance(state_dict[key], Stateful):
            state_dict[key].load_state_dict(state[key])
        else:
            state_dict[key] = state[key]
    if not keys:  # a planner that built the state from the metadata filled the dict given
        state_dict.update(state)
    return state_dict
