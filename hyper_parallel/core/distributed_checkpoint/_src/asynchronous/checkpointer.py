"""AsyncCheckpointer: one process's async saves; training pauses only while a snapshot is taken.

One async save, on every rank of the group, in this order:

1. If ``max_in_flight`` saves are already running (1 by default), wait for the oldest. If an
   earlier save failed and no ``async_save``/``wait()`` has reported it yet, raise
   :class:`AsyncSaveError` now (its cause is the original error) and start nothing, even
   if ``result()`` raised it already: every rank must take the same path, and a job may
   call ``result()`` on some ranks only. (Process exit warns only of failures nobody saw.)
2. On first use with a group: create a dedicated gloo group with the same ranks (collective,
   synchronous, once). Every background exchange of the save runs on it, so it never
   interleaves with training collectives on the default group.
3. Flatten the state dict (``Stateful.state_dict()`` is called now); copy plain values.
4. ``staging="eager"``: copy every tensor (DTensor local shards, plain tensors, numpy arrays)
   into a staging buffer (:mod:`.buffers`), then return. ``staging="lazy"``: return now; a
   stager thread copies, and :meth:`AsyncSaveFuture.wait_staged` (or
   :func:`~.api.register_optimizer_hook`) blocks until it has, so call it before the
   parameters change again.
5. A writer thread runs the ordinary :func:`~.engine.checkpoint.save` on the snapshot with the
   dedicated group: the same planning, dedup, writing, and commit (``.metadata`` written
   last). Saves run one after another, in call order, on every rank.

Under a memory budget (``max_host_bytes``) steps 4 and 5 overlap: the snapshot holds meta
stand-ins, and once the writer has planned, a stager copies the tensors piece by piece into
a ring of ``max_host_bytes`` that the writer empties (:mod:`.streamed_staging`). The snapshot
is complete when the last piece is copied; ``staging="eager"`` returns then, ``"lazy"`` at
once (``wait_staged``/the optimizer hook wait for it).

Exit and fork: see :mod:`.process_hooks`. ``dist.destroy_process_group()`` also destroys the
dedicated group, failing a save still in flight (uncommitted): call ``wait()`` (or
``result()``) before it. The public functions (``async_save``, ...) are in :mod:`.api`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import os
import queue
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..backends.fsspec import start_io_thread
from ..backends.locations import is_url, local_path
from ..backends.protocol import StorageWriter
from ..backends.torch_storage import as_our_writer
from ..base.errors import LostContactError, UnsupportedValueError
from ..base.options import AsyncOptions, Coordination, WriteOptions, as_keywords, pick
from ..base.priority import BACKGROUND_NICE, lower_this_thread
from ..coordination.coordinator import as_timeout, group_timeout, is_broken, new_gloo_group
from ..engine import in_flight
from ..engine.checkpoint import save
from ..engine.scope import mesh_group as _mesh_group
from ..planning.per_call import planner_copy
from ..planning.per_call import refuse_torch_hooks as _refuse_torch_hooks
from ..planning.planner import SavePlanner
from ..planning.standard_planner import StandardPlanner
from ..planning.torch_planners import as_our_planner
from ..state.flatten import flatten
from ..state.version_stamp import stamp_of
from . import buffers
from .buffers import BufferPool, StagingBuffer, StagingRing, StagingStats, copy_value, tensor_spec, wrap_dtensor
from .process_hooks import install_exit_hooks, track
from .response import AsyncSaveError, AsyncSaveFuture, AsyncStagingError
from .staged_snapshot import StagedSnapshot
from .streamed_staging import MIN_HOST_BYTES, MIN_RING_BYTES, BudgetStream, forget_locals

__all__ = ["AsyncCheckpointer", "PathLike", "SaveRequest"]

PathLike = str | os.PathLike
_STAGING_MODES = ("eager", "lazy")
#: the planner attributes that decide its column bands (StandardPlanner.tiles)
_BAND_SETTINGS = ("max_tiles", "tile_min_chunk_bytes", "tile_min_band_bytes")


class _Unstageable:
    """Stands in for a failed snapshot: save() calls ``state_dict()`` inside its first
    exchange, so the failure is reported on every rank instead of leaving peers waiting."""

    def __init__(self, error: BaseException):
        self.error = error

    def state_dict(self) -> dict[str, Any]:
        raise AsyncStagingError(f"taking the snapshot failed: {type(self.error).__name__}: "
                                f"{self.error}") from self.error

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Never called; present so that flatten treats this as a Stateful."""


@dataclass(frozen=True)
class SaveRequest:
    """One async save as asked for: where it goes, its planner, and its options as records.

    ``AsyncCheckpointer.save`` and ``async_save`` build it once from their keywords
    (:meth:`of`); the checkpointer then hands it down whole, and a job carries the request
    as the background save will run it (:meth:`AsyncCheckpointer._start`).
    """

    path: PathLike | None = None
    checkpoint_id: PathLike | None = None
    storage_writer: StorageWriter | None = None
    planner: SavePlanner | None = None
    coordination: Coordination = Coordination()
    write: WriteOptions = WriteOptions()
    options: AsyncOptions = AsyncOptions()
    incremental: Any = None  # the checkpoint manager's IncrementalState (see engine.incremental)

    @classmethod
    def of(cls, values: dict[str, Any]) -> SaveRequest:
        """The request that the keywords ``values`` of ``save``/``async_save`` (their
        ``locals()``) ask for."""
        return cls(values.get("path"), values.get("checkpoint_id"), values.get("storage_writer"),
                   values.get("planner"), pick(Coordination, values), pick(WriteOptions, values),
                   pick(AsyncOptions, values), values.get("incremental"))


@dataclass
class _Job:
    """One save: what to write, and its snapshot as it is being taken."""

    owner: AsyncCheckpointer
    response: AsyncSaveFuture
    request: SaveRequest  # as the background save runs it: its own group, planner copy, absolute path
    started: float
    mesh_scoped: bool = False  # the group is the ranks of the state's mesh (see engine.scope)
    paths: dict[str, tuple] = field(default_factory=dict)  # key -> path in the nested state dict
    values: dict[str, Any] = field(default_factory=dict)  # key -> snapshot of a non-tensor leaf
    signature: tuple = ()  # ((key, tensor spec), ...): the structure that picks the buffer
    bands: tuple = ()  # ((key, column bands), ...): host tensors staged as their bands (staged_bands)
    templates: dict[str, Any] = field(default_factory=dict)  # key -> source tensor (until staged)
    stamps: dict[str, Any] | None = None  # incremental: key -> its source's version stamp, read before copying
    pinned: bool = False
    events: dict[torch.device, Any] = field(default_factory=dict)  # lazy: training-stream marks
    buffer: StagingBuffer | None = None
    error: BaseException | None = None
    place: str | None = None  # where it saves (:func:`place_of`)
    stream: BudgetStream | None = None  # under a memory budget: the tensors, copied as they are written
    whole_bytes: int = 0  # under a memory budget: bytes of numpy arrays copied whole at the call


class AsyncCheckpointer:
    """Staging buffers, the dedicated gloo group(s), and the saves in flight of one process.

    :func:`async_save` uses a default instance (:func:`default_checkpointer`); make your own
    to keep a separate set of buffers or different limits.

    Args:
        max_in_flight: saves allowed in flight at once; a further ``save`` first waits for
            the oldest. Each save in flight holds its own staging buffer.
        exit_timeout_s: how long process exit waits for saves in flight before abandoning
            them (an abandoned save never commits).
        max_cached_structures: structures whose buffers stay cached between saves.
        wait_timeout_s: the longest a call waits for an earlier save by default (making room
            for a new save, ``result()``); past it, the call raises instead of blocking forever
            on a stuck storage. ``result(timeout=None)`` still waits without bound.
        background_nice: the niceness (Linux) of the threads that stage and write saves in
            the background, and of their gloo group's threads, so the training loop goes first
            on contended cores (see :mod:`.priority`); 0 runs them at the caller's priority.
            A save's ``callback`` runs on the writer thread, at this niceness too.
        stage_bands: whether the snapshot lays out host tensors that the save cuts into
            column bands (see ``StandardPlanner.max_tiles``) band by band, as the data file
            holds them, so the background write copies nothing (:mod:`.staged_bands`). Such a
            snapshot takes ~1.3x as long as a flat copy (strided reads), and the background
            save then uses less than half the CPU: the bands would otherwise be copied out of
            a flat snapshot there, strided just the same, plus a pass through bounce memory.
            None (the default) and True: staged as bands (tensors on an accelerator never
            are: their snapshot is one device-to-host copy each); False: a flat snapshot,
            the shortest pause where spare cores absorb the background copies.
        max_host_bytes: a bound on the host (pinned, with accelerator tensors) memory that
            snapshots take, whatever the state's size; None (default): a whole snapshot per
            save. With a bound, a save copies its tensors piece by piece into one reused ring
            of this many bytes while the writer writes the pieces and the ring takes the next
            ones (numpy arrays in the state are copied whole at the call and count against
            it). A state larger than the bound cannot be snapshotted before anything is
            written, so the snapshot is complete only once all but the last ``max_host_bytes``
            have been written: ``staging="eager"`` returns then (its blocking time is about
            the time to write the state minus the bound; nothing is read from the tensors
            afterwards, so they may change at once, as without a bound); ``staging="lazy"``
            returns at once and ``response.wait_staged()`` or :func:`~.api.register_optimizer_hook`
            wait for that point, so forward and backward run meanwhile. A state within the
            bound is copied whole ahead of the writes (the call returns after the save's
            planning exchange and the copies). At least ``16 MiB * thread_count`` (a storage
            writer keeps up to 8 MiB of parts before it writes them, and the ring must hold
            those and the next piece); tensors larger than the ring are cut into row slabs.
            ``response.peak_staged_bytes`` and ``stats.peak_staged_bytes`` report what was
            held. Needs the :class:`StandardPlanner`'s data handling (a subclass that holds or
            resolves data its own way is refused); ``stage_bands`` does not apply (the ring's
            pieces are the bands). An incremental save (the manager's) writes every chunk.

    Example::

        ckpt = AsyncCheckpointer()
        for step in range(steps):
            train_step()
            if step % 100 == 0:
                ckpt.save(state, f"/ckpt/step{step}")   # returns once staged
        ckpt.wait()                                    # raises if a save failed
    """

    def __init__(self, max_in_flight: int = 1, exit_timeout_s: float = 600.0, max_cached_structures: int = 2,
                 wait_timeout_s: float = 3600.0, background_nice: int = BACKGROUND_NICE,
                 stage_bands: bool | None = None, max_host_bytes: int | None = None):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if not 0 <= background_nice <= 19:
            raise ValueError(f"background_nice must be within 0..19, got {background_nice}")
        if stage_bands not in (None, True, False):
            raise ValueError(f"stage_bands must be None, True or False, got {stage_bands!r}")
        if max_host_bytes is not None:
            if isinstance(max_host_bytes, bool) or not isinstance(max_host_bytes, int):
                raise TypeError(f"max_host_bytes must be an int (bytes) or None, got {max_host_bytes!r}")
            if max_host_bytes < MIN_HOST_BYTES:
                raise ValueError(f"max_host_bytes must be at least {MIN_HOST_BYTES} ({MIN_HOST_BYTES >> 20} MiB "
                                 f"per writer thread), got {max_host_bytes}")
        self.max_host_bytes = max_host_bytes
        self._ring: StagingRing | None = None
        self.background_nice = background_nice
        self.stage_bands = stage_bands
        self.max_in_flight = max_in_flight
        self.exit_timeout_s = exit_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.stats = StagingStats()
        self._pool = BufferPool(max_cached_structures, self.stats)
        # (planner's band settings, structure, layouts) -> the bands it stages, for as many structures
        self._band_choices: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()
        self._in_flight: deque[_Job] = deque()
        self._unreported: list[tuple[AsyncSaveFuture, BaseException]] = []
        self._groups: dict[tuple[tuple[int, ...], timedelta | None], tuple[Any, Any]] = {}
        self._threads_pid: int | None = None
        self._write_queue: queue.Queue[_Job | None] = queue.Queue()
        self._stage_queue: queue.Queue[_Job | None] = queue.Queue()
        self._stop: Callable[[], Any] = lambda: None
        self._streams: dict[torch.device, Any] = {}
        track(self)

    # ------------------------------------------------------------------ public

    def save(
        self,
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
        staging: str = "eager",
        callback: Callable[..., Any] | None = None,
        use_gloo: bool = True,
        incremental: Any = None,
        pin_memory: bool | None = None,
    ) -> AsyncSaveFuture:
        """Start an async save; see :func:`async_save` for the arguments (``incremental``: as
        for :func:`~.api.save`; the checkpoint manager passes it; ``pin_memory=False``: never pin
        the staging buffers of accelerator tensors, None/True: pin them)."""
        return self._start(state_dict, SaveRequest.of(locals()))

    def _start(self, state_dict: dict[str, Any] | None, request: SaveRequest) -> AsyncSaveFuture:
        """Start the async save ``request`` of ``state_dict`` (what :meth:`save` does)."""
        started = time.perf_counter()
        coord, write, staging = request.coordination, request.write, request.options.staging
        path, checkpoint_id = request.path, request.checkpoint_id
        # torch DCP's planner and storage objects stand for ours (now: errors belong to the call)
        storage_writer, planner = as_our_writer(request.storage_writer), as_our_planner(request.planner, "save")
        self._ensure_threads()
        if state_dict is None:
            raise ValueError("async_save() needs a state_dict")
        if staging not in _STAGING_MODES:
            raise ValueError(f"staging must be one of {_STAGING_MODES}, got {staging!r}")
        if path is not None and checkpoint_id is not None and os.fspath(path) != os.fspath(checkpoint_id):
            raise ValueError(f"path={path!r} and checkpoint_id={checkpoint_id!r} disagree; pass one")
        where = path if path is not None else checkpoint_id
        if where is None and storage_writer is None:
            raise ValueError("say where the checkpoint goes: path=/checkpoint_id= or a storage writer")
        user_metadata = write.user_metadata
        if user_metadata is not None:
            # checked by the background save's first exchange (a bad value on one rank must fail
            # every rank, not leave the others waiting in a collective); a snapshot of it now
            with contextlib.suppress(Exception):
                user_metadata = copy.deepcopy(user_metadata)
        timeout = as_timeout(coord.timeout)  # before any collective, alike on every rank
        where = None if where is None else os.fspath(where)
        given = where
        if where is not None and not is_url(where):  # the caller's directory now, not the writer's later
            where = os.path.abspath(local_path(where))
        elif where is not None and self.background_nice:
            # the writer would start fsspec's process-wide I/O thread at its own niceness
            start_io_thread()

        if self.max_host_bytes is not None:
            self._check_budget_args(write.thread_count, planner)
        self._make_room()
        distributed = not coord.no_dist and coord.use_collectives and dist.is_available() and dist.is_initialized()
        mesh_scoped, process_group = False, coord.process_group
        if distributed and process_group is None:
            process_group = _mesh_group(state_dict)  # DTensors on one mesh over some ranks: those ranks
            mesh_scoped = process_group is not None  # so the save guards the parts it lacks (api._part_guard)
        group = self._dedicated_group(process_group, timeout) if distributed else None

        response = AsyncSaveFuture(given, staging, request.options.callback, self.wait_timeout_s)
        # the background save plans with a copy: the caller may pass the same planner to a save
        # (or another async save) while this one is still writing, and a planner holds one call's state
        if planner is not None:
            _refuse_torch_hooks(planner)  # now, not from result()
        planner = planner_copy(planner) if planner is not None else None
        background = dataclasses.replace(
            request, path=where, checkpoint_id=None, storage_writer=storage_writer, planner=planner,
            # on the dedicated group; with it, the timeout is the group's (a timeout here would make it
            # a gloo twin of its own); without one, it bounds the storage calls
            coordination=dataclasses.replace(coord, process_group=group, timeout=timeout if group is None else None),
            write=dataclasses.replace(write, user_metadata=user_metadata))
        job = _Job(self, response, background, started, mesh_scoped, place=in_flight.place_of(where, storage_writer))
        try:
            self._prepare(job, state_dict)
        except Exception as exc:  # reported on every rank by the background save
            job.error = exc
        with self._lock:
            self._in_flight.append(job)
        in_flight.started(id(job), job.place, response._finished, self.wait_timeout_s)
        if job.stream is not None and job.error is None:  # copied while the writer writes
            self._write_queue.put(job)
            if staging == "eager":
                response._staged.wait()  # every tensor read: all but the last max_host_bytes written
        else:
            if staging == "eager" or job.error is not None:
                self._stage(job)
            else:
                self._stage_queue.put(job)
            self._write_queue.put(job)
        response.blocking_s = time.perf_counter() - started
        return response

    def wait(self, timeout: float | None = None) -> None:
        """Wait until no save is in flight; raise the first failure not reported yet.

        Raises:
            AsyncSaveError: an earlier save failed (cause chained); reported once.
            TimeoutError: saves still in flight after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                oldest = self._in_flight[0] if self._in_flight else None
            if oldest is None:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not oldest.response._finished.wait(left):
                raise TimeoutError(f"async saves still in flight after {timeout}s")
        self._raise_unreported()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until every save in flight has taken its snapshot (for lazy staging).

        Raises:
            TimeoutError: a snapshot is still being taken after ``timeout`` seconds.
        """
        with self._lock:
            jobs = list(self._in_flight)
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            job.response.wait_staged(left)

    @property
    def in_flight(self) -> int:
        """Number of saves started and not finished."""
        with self._lock:
            return len(self._in_flight)

    def close(self, timeout: float | None = None) -> None:
        """Wait for saves in flight, then free the staging buffers and the dedicated groups.

        The checkpointer can still be used afterwards (it allocates again). Nothing is freed
        while a save is still in flight (after ``timeout``, or an interrupt): its group and
        buffers stay, it goes on, and a later ``close()`` frees them.

        Raises:
            AsyncSaveError: as :meth:`wait`.
            TimeoutError: saves still in flight after ``timeout`` seconds (they go on).
        """
        try:
            self.wait(timeout)
        finally:
            if not self.in_flight:
                self._free()

    def _free(self) -> None:
        """Free the staging buffers, the threads and the dedicated groups (no save in flight)."""
        self._pool.clear()
        if self._ring is not None:
            with self._lock:
                self.stats.held_bytes -= self._ring.capacity
            self._ring = None
        self._stop_threads()
        for world, group in self._groups.values():
            if world is dist.group.WORLD:
                try:
                    dist.destroy_process_group(group)
                except Exception:  # the world may be gone already; nothing left to free
                    pass
        self._groups.clear()

    # ------------------------------------------------------------------ internals

    def _make_room(self) -> None:
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            with self._lock:
                if len(self._in_flight) < self.max_in_flight:
                    break
                oldest = self._in_flight[0]
            if not oldest.response._finished.wait(max(0.0, deadline - time.monotonic())):
                raise AsyncSaveError(
                    f"the async save to {oldest.response.checkpoint_id!r} is still running after "
                    f"{self.wait_timeout_s}s (max_in_flight={self.max_in_flight}), so no new save was started; "
                    "its storage may be stuck") from TimeoutError(self.wait_timeout_s)
        self._raise_unreported()

    def _raise_unreported(self) -> None:
        with self._lock:
            failures, self._unreported = self._unreported, []
        if failures:
            where, error = failures[0][0].checkpoint_id, failures[0][1]
            more = f" ({len(failures) - 1} later async save(s) failed too)" if len(failures) > 1 else ""
            raise AsyncSaveError(f"the async save to {where!r} failed{more}: {error}") from error

    def _dedicated_group(self, process_group: Any, timeout: timedelta | float | None) -> Any:
        """The gloo group with ``process_group``'s ranks and ``timeout`` that background saves
        use (made once per ranks and timeout; made again after an exchange failed on it)."""
        ranks = tuple(dist.get_process_group_ranks(process_group or dist.group.WORLD))
        world = dist.group.WORLD
        timeout = as_timeout(timeout)
        cached = self._groups.get((ranks, timeout))
        if cached is not None and cached[0] is world and not is_broken(cached[1]):
            return cached[1]
        made_timeout = timeout or group_timeout(process_group or world)
        try:
            group = new_gloo_group(ranks, made_timeout, nice=self.background_nice)
        except RuntimeError as exc:  # a rank that did not call async_save, or not in time
            raise LostContactError(
                f"async_save: setting up its gloo group with ranks {list(ranks)[:16]} failed on rank "
                f"{dist.get_rank()} ({exc}). A rank did not call async_save, or was later than the "
                f"timeout ({made_timeout})") from exc
        self._groups[(ranks, timeout)] = (world, group)
        return group

    def _check_budget_args(self, thread_count: int, planner: SavePlanner | None) -> None:
        """Under a memory budget: refuse, now, what the streamed snapshot cannot serve."""
        if self.max_host_bytes < MIN_HOST_BYTES * max(1, thread_count):
            raise ValueError(f"max_host_bytes={self.max_host_bytes} is too small for thread_count={thread_count}: "
                             f"each writer thread needs {MIN_HOST_BYTES >> 20} MiB of it; pass thread_count="
                             f"{max(1, self.max_host_bytes // MIN_HOST_BYTES)} or raise max_host_bytes")
        if planner is not None and not (hasattr(planner, "can_stream") and planner.can_stream()):
            raise UnsupportedValueError(
                f"max_host_bytes: the planner {type(planner).__name__} holds or resolves write data its own way, "
                "so it cannot be handed a snapshot that is copied while it is written; use StandardPlanner (or a "
                "subclass that only renames keys with transform_key), or an AsyncCheckpointer without max_host_bytes")

    def _prepare(self, job: _Job, state_dict: dict[str, Any]) -> None:
        """Flatten, copy plain values, and find the structure of the tensors (no tensor copies)."""
        flat = flatten(state_dict)
        signature, templates, devices = [], {}, set()
        for key, leaf in flat.leaves.items():
            spec = tensor_spec(leaf.value)
            if spec is None:
                job.values[key] = copy_value(leaf.value)
                continue
            signature.append((key, spec))
            templates[key] = leaf.value
            if spec[0] != "ndarray" and spec[3] not in ("cpu", "meta"):
                tensor = leaf.value._local_tensor if spec[0] == "dtensor" else leaf.value
                devices.add(tensor.device)
        job.paths = {key: leaf.path for key, leaf in flat.leaves.items()}
        pin = job.request.options.pin_memory is not False  # pin staging buffers of accelerator tensors
        job.signature, job.templates, job.pinned = tuple(signature), templates, bool(devices) and pin
        if job.response.staging == "lazy" or self.max_host_bytes is not None:
            job.events = {d: _record_event(d) for d in devices if d.type == "cuda"}
        if self.max_host_bytes is not None:
            self._prepare_stream(job)

    def _prepare_stream(self, job: _Job) -> None:
        """Under a memory budget: meta stand-ins for the tensors, streamed from the live ones;
        numpy arrays copied whole now (they count against the budget)."""
        arrays = {key: t for key, t in job.templates.items() if isinstance(t, np.ndarray)}
        job.whole_bytes = sum(a.nbytes for a in arrays.values())
        limit = self.max_host_bytes - job.whole_bytes
        files = max(1, job.request.write.thread_count or 1)
        if limit < MIN_RING_BYTES * files:
            raise UnsupportedValueError(
                f"max_host_bytes={self.max_host_bytes}: the state's numpy arrays ({sorted(arrays)[:5]}) take "
                f"{job.whole_bytes} bytes of it, copied whole, and leave {limit} for the tensors, less than the "
                f"{MIN_RING_BYTES * files} needed; raise max_host_bytes or keep large arrays as tensors")
        ring = self._ring
        if ring is None or (job.pinned and not ring.pinned):
            ring = self._ring = StagingRing(self.max_host_bytes, job.pinned)
            with self._lock:
                self.stats.allocations += 1
                self.stats.allocated_bytes += ring.capacity
                self.stats.held_bytes += ring.capacity
        stream = BudgetStream(ring, limit, lambda: self._streamed(job), self.background_nice, job.events)
        for key, value in job.templates.items():
            if key in arrays:
                job.values[key] = copy_value(value)
            else:
                logical = stream.add(_source(value))
                job.values[key] = wrap_dtensor(logical, value) if isinstance(value, DTensor) else logical
        job.stream, job.signature, job.templates = stream, (), {}

    def _ring_for(self, stream: BudgetStream) -> None:
        """Give ``stream`` a ring with no piece of an earlier save in it. After a failed save,
        its error (or a storage writer) may still refer to pieces: then a new ring is used and
        the old one is freed once those references go (staging memory exceeds the budget till then)."""
        ring = stream.ring
        if ring.in_use:
            gc.collect()  # references in cycles (tracebacks, closures)
        if not ring.in_use:
            return
        warnings.warn(f"async save: {ring.in_use} bytes of an earlier save's staging pieces are still referred to "
                      "(by a failed save's error or a storage writer); this save uses a new staging ring, so staging "
                      "memory exceeds max_host_bytes until they are freed", stacklevel=1)
        fresh = StagingRing(ring.capacity, ring.pinned)
        with self._lock:
            self.stats.allocations += 1
            self.stats.allocated_bytes += fresh.capacity
            if self._ring is ring:
                self._ring = fresh  # the old one is no longer held by us
        stream.ring = fresh

    def _streamed(self, job: _Job) -> None:
        """The streamed snapshot is complete (or failed): the live tensors are not read again."""
        job.response.staging_s = time.perf_counter() - job.started
        job.response._mark_staged()

    def _stage(self, job: _Job) -> None:
        """Copy the job's tensors into a staging buffer (caller's thread for eager)."""
        start = time.perf_counter()
        try:
            if job.error is None and job.signature:
                job.bands = self._bands(job)
                job.buffer = self._pool.acquire(job.signature, job.templates, job.pinned, job.bands)
                self._peak(job, job.buffer.nbytes)
                sources = [(job.buffer.targets[key], _source(job.templates[key])) for key, _ in job.signature]
                if job.request.incremental is not None:
                    # what tells the incremental save that a source is unchanged is the source's
                    # memory and version counter, not the staging buffer's (reused every save)
                    job.stamps = {key: stamp_of(_source(job.templates[key])) for key, _ in job.signature}
                if job.events:
                    self._copy_on_side_streams(job, sources)
                else:
                    buffers.copy_into(sources)
        except Exception as exc:
            job.error = exc
        finally:
            job.templates = {}
            job.response.staging_s = time.perf_counter() - start
            job.response._mark_staged(job.error)

    def _bands(self, job: _Job) -> tuple:
        """((key, column bands), ...): the host tensors to stage as the bands the save will
        cut them into (on the stager's thread for a lazy save: it costs per-tensor work)."""
        wanted = self.stage_bands is not False
        planner = job.request.planner
        planner = StandardPlanner() if planner is None else planner
        # a rank-local save (no collectives) stores chunks whole: nothing to cut into bands
        if not wanted or not job.request.coordination.use_collectives or not hasattr(planner, "staging_bands"):
            return ()
        # What staging_bands reads: the planner's class and band settings, each tensor's spec
        # (dtype, shape, device, mesh, placements) and layout. Unchanged, so is its answer:
        # asking again per tensor would cost every call ~15 us a tensor.
        choice = (type(planner), *(getattr(planner, name, None) for name in _BAND_SETTINGS), job.signature,
                  tuple(getattr(_source(t), "layout", None) for t in job.templates.values()))
        with self._lock:
            bands = self._band_choices.get(choice)
            if bands is not None:
                self._band_choices.move_to_end(choice)
                return bands
        tiles = ((key, planner.staging_bands(key, job.templates[key])) for key, _ in job.signature)
        bands = tuple((key, t) for key, t in tiles if t > 1)
        with self._lock:
            self._band_choices[choice] = bands
            while len(self._band_choices) > self._pool.max_structures:
                self._band_choices.popitem(last=False)
        return bands

    def _copy_on_side_streams(self, job: _Job, pairs: list[tuple[Any, Any]]) -> None:
        # Lazy staging from CUDA: copy on a side stream once the training stream has reached
        # the point where async_save was called, so training kernels keep running meanwhile.
        by_device: dict[Any, list[tuple[Any, Any]]] = {}
        for target, source in pairs:
            device = None if isinstance(source, np.ndarray) else source.device
            by_device.setdefault(device if device in job.events else None, []).append((target, source))
        buffers.copy_into(by_device.pop(None, []))
        for device, device_pairs in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_event(job.events[device])
            with torch.cuda.stream(stream):
                buffers.copy_into(device_pairs)  # synchronises the (side) stream before returning

    def _staged_state_dict(self, job: _Job) -> dict[str, Any]:
        if job.error is not None:
            return {"snapshot": _Unstageable(job.error)}
        staged = job.buffer.staged if job.buffer is not None else {}
        # Already flat, with the original paths: save() must not re-flatten (that would lose
        # the keys of Stateful objects whose state holds no tensors).
        return StagedSnapshot.staged(
            {key: (path, staged[key] if key in staged else job.values[key]) for key, path in job.paths.items()},
            bands=dict(job.buffer.banded) if job.buffer is not None else {},
            stamps=job.stamps if job.stamps is not None else {}, stream=job.stream)

    def _peak(self, job: _Job, nbytes: int) -> None:
        job.response.peak_staged_bytes = nbytes
        with self._lock:
            self.stats.peak_staged_bytes = max(self.stats.peak_staged_bytes, nbytes)

    def _ensure_threads(self) -> None:
        """Start the writer and stager threads (again after close(), or in a forked child)."""
        with self._lock:
            if self._threads_pid == os.getpid():
                return
            self._threads_pid = os.getpid()
            self._write_queue, self._stage_queue = queue.Queue(), queue.Queue()
            for jobs, name in ((self._write_queue, "_write"), (self._stage_queue, "_stage")):
                threading.Thread(target=_worker_loop, args=(jobs, name, self.background_nice),
                                 name=f"hp-dcp-async{name}", daemon=True).start()
            # Idle threads hold no reference to the checkpointer; when it is collected, they end.
            self._stop = weakref.finalize(self, _stop_workers, self._write_queue, self._stage_queue)
            self._stop.atexit = False
        install_exit_hooks()

    def _forget_parent(self) -> None:
        """In a forked child: the parent's threads, saves, locks and groups are not ours."""
        self._lock = threading.Lock()
        self._pool._lock = threading.Lock()
        self._in_flight.clear()
        in_flight.forget_all()
        self._groups.clear()
        self._streams.clear()
        self._ring = None
        self._threads_pid = None
        self._stop = lambda: None

    def _stop_threads(self) -> None:
        with self._lock:
            if self._threads_pid != os.getpid():
                return
            self._threads_pid = None
            self._stop()

    def _write(self, job: _Job) -> None:
        if job.stream is None:
            job.response._staged.wait()
        meta, error = None, None
        try:
            in_flight.wait_for_earlier_saves(id(job))  # another checkpointer's, to the same place
            if job.stream is not None:
                self._ring_for(job.stream)
                job.stream.begin()
            r = job.request
            meta = save(self._staged_state_dict(job), path=r.path, storage_writer=r.storage_writer, planner=r.planner,
                        **as_keywords(r.coordination, r.write), incremental=r.incremental,
                        _mesh_scoped=job.mesh_scoped)
        except BaseException as exc:  # every failure belongs to the response, never to the thread
            error = exc
            if (job.request.coordination.process_group is not None and not dist.is_initialized()
                    and not isinstance(exc, LostContactError)):
                error = LostContactError(  # torch's own words ("group is not registered") say less
                    "dist.destroy_process_group() ran while this async save was in flight; it was not "
                    f"committed ({type(exc).__name__}: {exc}). Wait for saves in flight first (resp.result())")
                error.__cause__ = exc
        finally:
            if job.buffer is not None:
                self._pool.release(job.buffer)
                job.buffer = None
            if job.stream is not None:
                forget_locals(error)  # the pieces the writer held when it failed go back to the ring
                job.stream.close()  # before the response resolves: a waiter sees it staged
                self._peak(job, job.stream.ring.peak + job.whole_bytes)
                job.stream = None
            job.paths, job.values = {}, {}
        response = job.response
        with self._lock:
            self._in_flight.remove(job)
            if error is not None:
                self._unreported.append((response, error))
        in_flight.ended(id(job))
        response._finish(meta, error, time.perf_counter() - job.started)

    def _drain_at_exit(self) -> None:
        deadline = time.monotonic() + self.exit_timeout_s
        with self._lock:
            jobs = list(self._in_flight)
        abandoned = []
        for job in jobs:
            if not job.response._finished.wait(max(0.0, deadline - time.monotonic())):
                abandoned.append(job.response.checkpoint_id)
        if abandoned:
            warnings.warn(
                f"process exit: abandoning async save(s) to {abandoned} after {self.exit_timeout_s}s; "
                "an abandoned save is never committed (no new .metadata), so the directory holds the "
                "previous checkpoint or none", stacklevel=1)
        with self._lock:
            failures, self._unreported = self._unreported, []
        for response, error in failures:
            if not response._observed:  # result()/exception() already told the caller
                warnings.warn(f"process exit: the async save to {response.checkpoint_id!r} failed and nobody "
                              f"waited for it: {error}", stacklevel=1)


def _source(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _record_event(device: torch.device) -> Any:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _worker_loop(jobs: queue.Queue, method: str, nice: int) -> None:
    """Run ``job.owner.<method>(job)`` for each queued job, until a None arrives."""
    in_flight.mark_background()
    lower_this_thread(nice)
    while True:
        job = jobs.get()
        if job is None:
            return
        getattr(job.owner, method)(job)
        job = None  # do not keep the checkpointer alive while idle


def _stop_workers(*queues: queue.Queue) -> None:
    for jobs in queues:
        jobs.put(None)

