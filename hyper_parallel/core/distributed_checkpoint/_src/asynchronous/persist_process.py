"""HyperParallel's child-process asynchronous save: stage to host, persist in another process.

HyperParallel's ``async_save`` copies the state dict to host memory in the caller
(:func:`build_staged_state_dict`), then runs the whole save of that copy in one background
:class:`multiprocessing.Process` while a thread waits for it and completes a future. This module
holds those pieces, for code written against them:

- :class:`DataCopier` and :func:`build_staged_state_dict`: a structural copy of a state dict
  whose tensors (and DTensors' local shards, keeping mesh, placements and global shape) are new
  host copies; copy handlers are registered per type, the most derived registered class wins.
- :func:`save_impl`: one save as the child runs it (HyperParallel's ``api._save_impl``): our
  :func:`~..engine.checkpoint.save`, with ``use_storage_comm=True`` coordinating the ranks
  through a file store in the checkpoint directory when the process has no process group.
- :func:`create_persist_process`: the child to start: :func:`execute_async_persist` (no
  coordination, or through storage) or :func:`execute_async_persist_with_gloo` (a fresh gloo
  group on the job's rendezvous, which needs ``MASTER_ADDR``/``MASTER_PORT``).
- :func:`resolve_async_persist_result`: the parent's join thread: waits on the child's queue
  (blocking with a timeout, never spinning), runs the callback, merges the child's plan cache
  and completes the future, or fails it with the child's traceback or exit code.

It is not this library's ``async_save`` (:mod:`.api`), which stages into reused (pinned)
buffers and writes from a thread of the training process on a dedicated gloo group; that one
accepts HyperParallel's arguments too (``use_gloo=``, ``callback=``).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import multiprocessing
import os
import queue
import traceback
from argparse import Namespace
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .....platform import get_platform
from ..base.file_exchange import FileType
from ..engine.checkpoint import save
from ..format.chunk_info import CHUNK_INFO
from ..format.records import Metadata
from ..planning.plan_cache import PLAN_CACHE

__all__ = ["platform", "DataCopier", "build_staged_state_dict", "AsyncPersistStatus", "AsyncSaveResponse",
           "save_impl", "create_persist_process", "execute_async_persist", "execute_async_persist_with_gloo",
           "resolve_async_persist_result", "FileType"]

platform = get_platform()
"""HyperParallel's platform object: its ``detach`` is what staging copies through."""

RESULT_POLL_SECONDS = 0.1
"""How long the join thread blocks on the child's queue before checking that the child lives."""


class DataCopier:
    """Copies a state dict's values into host memory, by type.

    :meth:`register` adds a handler for types; :meth:`dispatch` finds an object's handler (its
    exact type, else its most derived registered base class, whatever the registration order:
    a DTensor must not be staged as the plain tensor it derives from); :meth:`copy` uses it, or
    a deep copy for an object nothing handles.
    """

    _registry: dict[type, Callable[[Any], Any]] = {}

    @classmethod
    def register(cls, *types: type) -> Callable[[Callable[[Any], Any]], Callable[[Any], Any]]:
        """Decorator: the function copies objects of ``types``."""
        def decorator(func: Callable[[Any], Any]) -> Callable[[Any], Any]:
            for t in types:
                cls._registry[t] = func
            return func
        return decorator

    @classmethod
    def dispatch(cls, obj: Any) -> Callable[[Any], Any] | None:
        """The handler of ``obj``, or ``None`` when no registered type matches."""
        found = cls._registry.get(type(obj))
        if found is not None:
            return found
        best: type | None = None
        for registered in cls._registry:
            if isinstance(obj, registered) and (best is None or issubclass(registered, best)):
                best = registered
        return None if best is None else cls._registry[best]

    @classmethod
    def copy(cls, obj: Any) -> Any:
        """``obj`` with its tensors copied to host memory (its handler, else a deep copy whose
        attributes are copied by their own handlers)."""
        handler = cls.dispatch(obj)
        if handler is not None:
            return handler(obj)
        out = copy.deepcopy(obj)
        for name, value in list(getattr(out, "__dict__", {}).items()):
            if not callable(value):
                setattr(out, name, cls.copy(value))
        return out


def _copy_tensor_to_cpu(tensor: Any) -> Any:
    """A host copy of ``tensor`` without autograd history (``platform.detach``, then
    ``to("cpu", copy=True)``), keeping its ``chunk_info`` mark."""
    out = platform.detach(tensor).to("cpu", copy=True)
    if hasattr(tensor, CHUNK_INFO):
        setattr(out, CHUNK_INFO, getattr(tensor, CHUNK_INFO))
    return out


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))


@DataCopier.register(int, float, complex, bool, str, type(None), enum.Enum, torch.dtype)
def _copy_constant(obj: Any) -> Any:
    return obj


@DataCopier.register(bytes, bytearray)
def _copy_bytes(obj: Any) -> bytes:
    return bytes(obj)


@DataCopier.register(np.ndarray)
def _copy_ndarray(obj: np.ndarray) -> np.ndarray:
    return obj.copy()


@DataCopier.register(torch.Tensor)
def _copy_tensor(obj: torch.Tensor) -> torch.Tensor:
    return _copy_tensor_to_cpu(obj)


@DataCopier.register(DTensor)
def _copy_dtensor(obj: DTensor) -> DTensor:
    """The local shard copied to the host, on the same mesh and placements, with the global
    shape stated (a RaggedShard's cannot be told from its flat local run)."""
    shape = tuple(obj.shape)
    return DTensor.from_local(_copy_tensor_to_cpu(obj.to_local()), obj.device_mesh, obj.placements,
                              run_check=False, shape=shape, stride=_contiguous_stride(shape))


@DataCopier.register(Namespace)
def _copy_namespace(obj: Namespace) -> Namespace:
    return Namespace(**DataCopier.copy(vars(obj)))


@DataCopier.register(list)
def _copy_list(obj: list) -> list:
    return [DataCopier.copy(v) for v in obj]


@DataCopier.register(tuple)
def _copy_tuple(obj: tuple) -> tuple:
    return tuple(DataCopier.copy(v) for v in obj)


@DataCopier.register(dict)
def _copy_dict(obj: dict) -> dict:
    return {DataCopier.copy(k): DataCopier.copy(v) for k, v in obj.items()}


def build_staged_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state_dict`` with the same nesting and keys whose tensors are new host
    copies (DTensors keep mesh, placements and global shape; ``bytearray`` becomes ``bytes``),
    so the original can change while the copy is saved.

    Example::

        staged = build_staged_state_dict({"model": model.state_dict(), "step": 3})
    """
    return DataCopier.copy(state_dict)


class AsyncPersistStatus(enum.Enum):
    """What the child puts on the queue: ``(SUCCESS, (metadata, plan cache))`` or
    ``(FAILURE, traceback text)``."""

    SUCCESS = enum.auto()
    FAILURE = enum.auto()


@dataclasses.dataclass
class AsyncSaveResponse:
    """HyperParallel's child-process save handle: ``persist_completion`` completes with the
    checkpoint's metadata once the child has committed it (staging was done before)."""

    persist_completion: Future

    def get_result(self, timeout: float | None = None) -> Any:
        """The metadata, waiting up to ``timeout`` seconds; raises what the save raised."""
        return self.persist_completion.result(timeout=timeout)


def _rank() -> int:
    try:
        return int(dist.get_rank())
    except (RuntimeError, ValueError):
        return 0


def _world_size() -> int:
    try:
        return int(dist.get_world_size())
    except (RuntimeError, ValueError):
        return 1


@contextmanager
def _storage_world(checkpoint_dir: str, rank: int, world_size: int) -> Iterator[None]:
    """A gloo default group whose rendezvous is a file store in ``checkpoint_dir``, destroyed
    (and the store file removed by the last rank) on the way out."""
    store_path = os.path.join(checkpoint_dir, ".hp_exchange_store")
    os.makedirs(checkpoint_dir, exist_ok=True)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size)
    try:
        yield
        dist.barrier()  # every rank is done with the store before the file goes
    finally:
        dist.destroy_process_group()
        if rank == 0:
            try:
                os.remove(store_path)
            except OSError:
                pass  # gone already (the store removes it with its last user)


def save_impl(state_dict: dict[str, Any], *, checkpoint_id: str | os.PathLike | None = None,
              storage_writer: Any = None, planner: Any = None, no_dist: bool = False,
              use_collectives: bool = True, use_storage_comm: bool = False) -> Any:
    """One save as HyperParallel's persist child runs it (its ``api._save_impl``).

    ``no_dist`` turns ``use_collectives`` off, and ``use_collectives=False`` turns
    ``use_storage_comm`` off. ``use_storage_comm=True`` in a process without a process group
    (a persist child) makes a gloo group whose rendezvous is a file store in the checkpoint
    directory, with this rank and world size from ``RANK``/``WORLD_SIZE``; in a process with
    a group, that group coordinates the save.

    Raises:
        ValueError: neither ``checkpoint_id`` nor ``storage_writer``; ``use_storage_comm``
            without a directory (``checkpoint_id``, or a writer's ``checkpoint_dir``/``path``);
            ``use_storage_comm`` without a group and without ``RANK``/``WORLD_SIZE``.
    """
    use_collectives = use_collectives and not no_dist
    use_storage_comm = use_storage_comm and use_collectives
    if storage_writer is None and checkpoint_id is None:
        raise ValueError("save needs checkpoint_id (the checkpoint directory) or a storage_writer")
    where = checkpoint_id
    if where is None:
        where = getattr(storage_writer, "checkpoint_dir", None) or getattr(storage_writer, "path", None)
    if use_storage_comm and where is None:
        raise ValueError("use_storage_comm exchanges the plans and write results through files in the checkpoint "
                         "directory: pass checkpoint_id, or a storage_writer with a checkpoint_dir")
    kwargs = {"checkpoint_id": checkpoint_id, "storage_writer": storage_writer, "planner": planner,
              "no_dist": no_dist, "use_collectives": use_collectives}
    if use_storage_comm and not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError("use_storage_comm without a process group needs RANK and WORLD_SIZE in the environment")
        with _storage_world(os.fspath(where), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])):
            return save(state_dict, **kwargs)
    return save(state_dict, **kwargs)


def _forget_inherited_groups() -> None:
    """Drop the process groups a forked child inherited (their communicators belong to the
    parent), so it can make its own default group."""
    import torch.distributed.distributed_c10d as c10d

    unregister = getattr(c10d, "_unregister_all_process_groups", None)
    if unregister is not None:
        unregister()
    c10d._world = c10d._World()


def _cached_plans() -> dict[str, Any]:
    return dict(PLAN_CACHE.items())


def _portable(meta: Any) -> Metadata:
    """The saved checkpoint's metadata as a plain record that crosses to the parent (what ``save``
    returns is a view of our document, which holds references back to it)."""
    if type(meta) is Metadata:
        return meta
    return Metadata(state_dict_metadata=dict(meta.state_dict_metadata),
                    planner_data=dict(getattr(meta, "planner_data", None) or {}),
                    storage_data=dict(getattr(meta, "storage_data", None) or {}))


def execute_async_persist(result_queue: Any, staged: dict[str, Any], checkpoint_id: str | os.PathLike | None,
                          storage_writer: Any, planner: Any, no_dist: bool, use_collectives: bool,
                          use_storage_comm: bool) -> None:
    """The persist child without a group of its own: :func:`save_impl` of ``staged``, then
    ``(SUCCESS, (metadata, plan cache))`` or ``(FAILURE, traceback)`` on ``result_queue``.
    Coordinating through storage, it first forgets the groups it inherited, keeping its rank
    and world size for the file-store group."""
    try:
        if use_storage_comm and use_collectives and not no_dist and dist.is_initialized():
            os.environ["RANK"], os.environ["WORLD_SIZE"] = str(_rank()), str(_world_size())
            _forget_inherited_groups()
        meta = save_impl(staged, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
                         no_dist=no_dist, use_collectives=use_collectives, use_storage_comm=use_storage_comm)
        result_queue.put((AsyncPersistStatus.SUCCESS, (_portable(meta), _cached_plans())))
    except Exception:  # noqa: BLE001 - handed to the parent, which raises it from the future
        result_queue.put((AsyncPersistStatus.FAILURE, traceback.format_exc()))


def execute_async_persist_with_gloo(result_queue: Any, staged: dict[str, Any],
                                    checkpoint_id: str | os.PathLike | None, storage_writer: Any, planner: Any,
                                    rank: int, world_size: int, master_addr: str, master_port: int) -> None:
    """The persist child on gloo: forgets the inherited groups, joins a fresh gloo default group
    on the job's rendezvous store (``master_addr:master_port``, keys prefixed by this process's
    name, which carries a per-save count every rank shares), saves ``staged`` and puts the
    result on ``result_queue`` as :func:`execute_async_persist` does."""
    try:
        _forget_inherited_groups()
        store = dist.PrefixStore(multiprocessing.current_process().name,
                                 dist.TCPStore(master_addr, int(master_port), is_master=False))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        meta = save_impl(staged, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner)
        result_queue.put((AsyncPersistStatus.SUCCESS, (_portable(meta), _cached_plans())))
    except Exception:  # noqa: BLE001 - handed to the parent
        result_queue.put((AsyncPersistStatus.FAILURE, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


_gloo_saves = 0


def create_persist_process(result_queue: Any, staged: dict[str, Any], checkpoint_id: str | os.PathLike | None,
                           storage_writer: Any, planner: Any, no_dist: bool, use_collectives: bool,
                           use_gloo: bool) -> multiprocessing.Process:
    """The persist child for one async save, not started.

    With nothing to coordinate (``no_dist``, ``use_collectives=False`` or one rank) it runs
    :func:`execute_async_persist` without communication, ``use_gloo`` ignored; with ranks to
    coordinate, :func:`execute_async_persist_with_gloo` when ``use_gloo``, else
    :func:`execute_async_persist` through storage.

    Raises:
        AssertionError: ``use_gloo`` with ranks to coordinate but no ``MASTER_ADDR`` or
            ``MASTER_PORT`` in the environment (the child could not rendezvous).
    """
    global _gloo_saves
    world_size = _world_size()
    need_comm = use_collectives and not no_dist and world_size > 1
    if not need_comm or not use_gloo:
        if need_comm:  # a child not forked from here learns its place from the environment
            os.environ.setdefault("RANK", str(_rank()))
            os.environ.setdefault("WORLD_SIZE", str(world_size))
        return multiprocessing.Process(
            target=execute_async_persist, name="AsyncCheckpointPersist",
            args=(result_queue, staged, checkpoint_id, storage_writer, planner, no_dist, use_collectives,
                  need_comm))
    master_addr, master_port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if master_addr is None:
        raise AssertionError("async save over gloo needs MASTER_ADDR (the job's rendezvous address) in the environment")
    if master_port is None:
        raise AssertionError("async save over gloo needs MASTER_PORT (the job's rendezvous port) in the environment")
    proc = multiprocessing.Process(
        target=execute_async_persist_with_gloo, name=f"AsyncCheckpointPersistGloo_{_gloo_saves}",
        args=(result_queue, staged, checkpoint_id, storage_writer, planner, _rank(), world_size, master_addr,
              int(master_port)))
    _gloo_saves += 1
    return proc


def resolve_async_persist_result(proc: Any, result_queue: Any, persist_future: Future,
                                 async_callback: Callable[[], None]) -> None:
    """Wait for the persist child and complete ``persist_future`` (the parent's join thread).

    Blocks on ``result_queue`` in ``RESULT_POLL_SECONDS`` steps while the child lives, then
    joins it. On success runs ``async_callback``, merges the child's plan cache into this
    process's and sets the metadata; a child failure, a callback error, an unknown status or
    a child that died without a result fails the future with a RuntimeError saying which.
    """
    result = None
    while result is None:
        try:
            result = result_queue.get(timeout=RESULT_POLL_SECONDS)
        except queue.Empty:
            if proc.is_alive():
                continue
            try:  # it may have put its result just before exiting
                result = result_queue.get_nowait()
            except queue.Empty:
                pass
            break
    proc.join()
    if persist_future.done():
        return
    if result is None:
        persist_future.set_exception(RuntimeError(
            f"the async save's persist process exited with code {proc.exitcode} without a result"))
        return
    status, payload = result
    if status == AsyncPersistStatus.SUCCESS:
        try:
            async_callback()
            PLAN_CACHE.update(payload[1])
        except Exception:  # noqa: BLE001 - the future carries it
            persist_future.set_exception(RuntimeError(traceback.format_exc()))
        else:
            persist_future.set_result(payload[0])
    elif status == AsyncPersistStatus.FAILURE:
        persist_future.set_exception(RuntimeError(payload))
    else:
        persist_future.set_exception(RuntimeError(f"the persist process's queue returned an unexpected status: "
                                                  f"{status!r}"))

