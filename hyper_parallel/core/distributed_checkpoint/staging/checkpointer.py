"""async_save: training pauses only while a snapshot of the state dict is taken.

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
   into a staging buffer, then return. ``staging="lazy"``: return now; a stager thread
   copies, and :meth:`AsyncSaveResponse.wait_staged` (or :func:`register_optimizer_hook`)
   blocks until it has, so call it before the parameters change again.
5. A writer thread runs the ordinary :func:`~.api.save` on the snapshot with the dedicated
   group: the same planning, dedup, writing, and commit (``.metadata`` written last). Saves
   run one after another, in call order, on every rank.

Staging buffers: one flat host allocation per state-dict *structure* (keys, kinds, dtypes,
shapes, layouts of the tensors), every tensor at a 64-byte aligned offset, one copy per
tensor. A later save of the same structure reuses it; ``stats.allocations`` counts
allocations. Buffers are pinned when the tensors live on an accelerator.

Exit: an ``atexit`` hook (and a ``multiprocessing`` finalizer, for worker processes) waits
up to ``exit_timeout_s`` for saves in flight. A save that does not finish by then is
abandoned; it never commits half-written, because ``.metadata`` is written only after every
rank's data is written, so the directory holds either the new checkpoint, the previous one,
or none. ``dist.destroy_process_group()`` also destroys the dedicated group, failing a save
still in flight (uncommitted): call ``wait()`` (or ``result()``) before it.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import inspect
import os
import queue
import threading
import time
import warnings
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..backends.fsspec import start_io_thread
from ..backends.locations import is_url, local_path
from ..backends.protocol import StorageWriter
from ..base.coordination import as_timeout, group_timeout, is_broken
from ..base.errors import CheckpointError, LostContactError, UnsupportedValueError
from ..base.priority import BACKGROUND_NICE, lower_priority, lower_this_thread, thread_ids
from ..engine import in_flight
from ..engine.checkpoint import save
from ..engine.scope import mesh_group as _mesh_group
from ..format import metadata as md
from ..planning.per_call import planner_copy
from ..planning.per_call import refuse_torch_hooks as _refuse_torch_hooks
from ..planning.planner import SavePlanner
from ..planning.staged_bands import BandedSnapshot
from ..planning.standard_planner import StandardPlanner
from ..sharding.grid import band_columns
from ..state.flatten import FlatStateDict, flatten

__all__ = [
    "async_save",
    "AsyncSaveResponse",
    "AsyncCheckpointer",
    "AsyncSaveError",
    "AsyncStagingError",
    "StagingStats",
    "default_checkpointer",
    "register_optimizer_hook",
]

PathLike = str | os.PathLike
ALIGN = 64  # byte alignment of every tensor in a staging buffer
# Large tensors start on page boundaries (and the buffer on one), so the background write can
# hand their memory to O_DIRECT as it is, with no copy through a bounce buffer.
PAGE_ALIGN, PAGE_ALIGN_MIN = 4096, 64 << 10
_BOUNDED = object()  # "wait at most the checkpointer's wait_timeout_s"
_STAGING_MODES = ("eager", "lazy")


class AsyncSaveError(CheckpointError):
    """An earlier async save failed; raised by the next ``async_save`` or ``wait()``.

    ``__cause__`` is the original error (a :class:`RankFailedError` when ranks saved together).
    """


class AsyncStagingError(CheckpointError):
    """Taking the snapshot of a state dict failed (reported on every rank, like a save error)."""


@dataclass
class StagingStats:
    """Counters of a checkpointer's staging buffers.

    ``allocations``: staging buffers allocated so far (one per new structure, or per extra save
    in flight); ``allocated_bytes``: their total size; ``reuses``: snapshots taken into an
    existing buffer; ``held_bytes``: bytes of the buffers held now (in use or cached).
    """

    allocations: int = 0
    allocated_bytes: int = 0
    reuses: int = 0
    held_bytes: int = 0


# ---------------------------------------------------------------------------- snapshot


def _tensor_spec(value: Any) -> tuple | None:
    """What fixes a leaf's place in a staging buffer, or None for a value copied otherwise."""
    if isinstance(value, DTensor):
        local = value._local_tensor
        return ("dtensor", local.dtype, tuple(local.shape), local.device.type, value.device_mesh,
                tuple(value.placements), tuple(value.shape), tuple(value.stride()))
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.device.type)
    if isinstance(value, np.ndarray) and not value.dtype.hasobject:
        return ("ndarray", value.dtype, value.shape)
    return None


def _nbytes(spec: tuple) -> int:
    return spec[1].itemsize * int(np.prod(spec[2], dtype=np.int64))


def _copy_value(value: Any) -> Any:
    """A snapshot of a non-tensor leaf: immutable values as they are, the rest deep-copied."""
    if value is None or type(value) in (bool, int, float, complex, str, bytes):
        return value
    if isinstance(value, bytearray):
        return bytes(value)
    return copy.deepcopy(value)


class _StagingBuffer:
    """One flat host allocation holding every tensor of one structure, plus the staged values.

    ``targets[key]`` is what a source is copied into (a typed view, or a numpy view);
    ``staged[key]`` is what the save sees (the view, or a DTensor wrapping it with the
    source's mesh, placements, global shape and stride).
    """

    def __init__(self, signature: tuple, templates: dict[str, Any], pinned: bool, bands: tuple = ()):
        self.signature = signature
        self.key = (signature, bands)
        tiles = dict(bands)  # key -> column bands it is staged as (absent: row-major)
        layout, pos = [], 0  # per leaf: its column bands (None: row-major), (offset, bytes) of each part
        for key, spec in signature:
            cols = band_columns(spec[2][1], tiles[key]) if key in tiles else None
            parts = []
            for n in _part_bytes(spec, cols):
                pos += -pos % (PAGE_ALIGN if n >= PAGE_ALIGN_MIN or cols else ALIGN)
                parts.append((pos, n))
                pos += n
            layout.append((cols, parts))
        self.nbytes = pos
        self.flat = _allocate(pos, pinned)
        self.pinned = self.flat.is_pinned() if pos else pinned
        self.targets: dict[str, Any] = {}
        self.staged: dict[str, Any] = {}
        self.banded: dict[str, BandedSnapshot] = {}
        for (key, spec), (cols, parts) in zip(signature, layout, strict=True):
            kind, dtype, shape = spec[0], spec[1], spec[2]
            if cols:  # band k of every row, contiguously, each band on a page boundary
                views = [self.flat[off:off + m].view(dtype).view(shape[0], size, *shape[2:])
                         for (off, m), (_, size) in zip(parts, cols, strict=True)]
                logical = torch.empty(shape, dtype=dtype, device="meta")
                self.targets[key] = _Bands(views, cols)
                self.banded[key] = BandedSnapshot(logical, views, cols)
                self.staged[key] = _wrap_dtensor(logical, templates[key]) if kind == "dtensor" else logical
                continue
            (off, n), = parts
            raw = self.flat[off:off + n]
            if kind == "ndarray":
                view = raw.numpy().view(dtype).reshape(shape)
                self.targets[key] = self.staged[key] = view
                continue
            view = raw.view(dtype).view(shape)
            self.targets[key] = view
            self.staged[key] = _wrap_dtensor(view, templates[key]) if kind == "dtensor" else view


def _part_bytes(spec: tuple, cols: list[tuple[int, int]] | None) -> list[int]:
    """Bytes of each part a leaf is staged as: itself, or each of its column bands ``cols``."""
    if not cols:
        return [_nbytes(spec)]
    shape = spec[2]
    per_col = spec[1].itemsize * int(np.prod((shape[0], *shape[2:]), dtype=np.int64))
    return [size * per_col for _, size in cols]


class _Bands(NamedTuple):
    """A staging target made of column bands: ``views[k]`` takes columns ``cols[k]``."""

    views: list[torch.Tensor]
    cols: list[tuple[int, int]]


def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of host memory starting on a page boundary (pinned if asked and possible)."""
    raw = None
    if pinned:
        try:
            raw = torch.empty(nbytes + PAGE_ALIGN, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:  # pageable memory still works, but copies are slower and synchronous
            warnings.warn(f"async_save: pinning a {nbytes}-byte staging buffer failed ({exc}); using pageable "
                          "memory, so snapshots from the accelerator are slower and block on each copy",
                          stacklevel=2)
    if raw is None:
        raw = torch.empty(nbytes + PAGE_ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE_ALIGN
    return raw[skip:skip + nbytes]


def _wrap_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor over the staged local shard with ``like``'s mesh, placements, shape, stride."""
    mesh = like.device_mesh
    if mesh.device_type == local.device.type:
        return DTensor.from_local(local, mesh, like.placements, shape=like.shape, stride=like.stride(),
                                  run_check=False)
    # from_local would copy the snapshot back onto the mesh's accelerator; wrap it in place.
    return DTensor(local, like._spec, requires_grad=False)


def _copy_into(pairs: list[tuple[Any, Any]]) -> None:
    """Copy every source into its staging target: one copy per tensor, no allocation.

    Copies from an accelerator are issued asynchronously into pinned memory on the current
    stream, then each device involved is synchronised before this returns.
    """
    devices: set[torch.device] = set()
    with torch.no_grad():
        for target, source in pairs:
            if isinstance(target, np.ndarray):
                np.copyto(target, source, casting="no")
                continue
            if isinstance(target, _Bands):  # a host tensor staged as its column bands
                for view, (lo, size) in zip(target.views, target.cols, strict=True):
                    view.copy_(source[:, lo:lo + size])
                continue
            on_device = source.device.type not in ("cpu", "meta")
            target.copy_(source, non_blocking=on_device and target.is_pinned())
            if on_device:
                devices.add(source.device)
    for device in devices:
        _synchronize(device)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif hasattr(torch, "accelerator") and torch.accelerator.is_available():
        torch.accelerator.synchronize(device)


class _BufferPool:
    """Staging buffers by structure, kept for the ``max_structures`` most recently used ones."""

    def __init__(self, max_structures: int, stats: StagingStats):
        self.max_structures = max(1, max_structures)
        self.stats = stats
        self._free: OrderedDict[tuple, list[_StagingBuffer]] = OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, signature: tuple, templates: dict[str, Any], pinned: bool, bands: tuple = ()) -> _StagingBuffer:
        key = (signature, bands)
        with self._lock:
            free = self._free.get(key)
            if free:
                self._free.move_to_end(key)
                self.stats.reuses += 1
                return free.pop()
        buffer = _StagingBuffer(signature, templates, pinned, bands)
        with self._lock:
            self.stats.allocations += 1
            self.stats.allocated_bytes += buffer.nbytes
            self.stats.held_bytes += buffer.nbytes
        return buffer

    def release(self, buffer: _StagingBuffer) -> None:
        with self._lock:
            self._free.setdefault(buffer.key, []).append(buffer)
            self._free.move_to_end(buffer.key)
            while len(self._free) > self.max_structures:
                _, evicted = self._free.popitem(last=False)
                self.stats.held_bytes -= sum(b.nbytes for b in evicted)

    def clear(self) -> None:
        with self._lock:
            for buffers in self._free.values():
                self.stats.held_bytes -= sum(b.nbytes for b in buffers)
            self._free.clear()


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


# ---------------------------------------------------------------------------- response


class AsyncSaveResponse:
    """The handle of one async save.

    Attributes:
        checkpoint_id: where the checkpoint goes (None when only a storage writer was given).
        staging: ``"eager"`` or ``"lazy"``.
        persist_completion: a :class:`concurrent.futures.Future` resolved with the committed
            :class:`~.metadata.Metadata` (on every rank), or with
            the save's error.
        blocking_s: seconds the ``async_save`` call took.
        staging_s: seconds the snapshot copies took (set once staged).
        total_s: seconds from the call to the end of the save (set once done).
    """

    def __init__(self, checkpoint_id: str | None, staging: str, callback: Callable | None,
                 wait_timeout_s: float | None = None):
        self.checkpoint_id = checkpoint_id
        self.wait_timeout_s = wait_timeout_s
        self.staging = staging
        self.persist_completion: Future = Future()
        self.blocking_s = 0.0
        self.staging_s: float | None = None
        self.total_s: float | None = None
        self._callback = callback
        self._staged = threading.Event()
        self._finished = threading.Event()
        self._callback_thread: int | None = None
        self._observed = False  # result()/exception() handed its outcome to the caller

    def _wait_finished(self, timeout: Any) -> None:
        # Inside the callback the save is over; waiting for the callback itself would deadlock.
        if threading.get_ident() == self._callback_thread:
            return
        if timeout is _BOUNDED:
            timeout = self.wait_timeout_s
        if not self._finished.wait(timeout):
            raise TimeoutError(f"async save to {self.checkpoint_id!r}: not finished after {timeout}s; it is "
                               "still running (pass a larger timeout, or None to wait without bound)")

    def done(self) -> bool:
        """True once the save committed or failed (and its callback ran)."""
        return self._finished.is_set()

    def staged(self) -> bool:
        """True once the snapshot is taken: the state dict's tensors are no longer read."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the snapshot is taken (returns at once for eager staging).

        Raises:
            TimeoutError: not staged within ``timeout`` seconds.
        """
        if not self._staged.wait(timeout):
            raise TimeoutError(f"async save to {self.checkpoint_id!r}: not staged after {timeout}s")

    def result(self, timeout: Any = _BOUNDED) -> md.Metadata | None:
        """Wait for the commit; return the committed Metadata (every rank).

        Args:
            timeout: seconds to wait; by default the checkpointer's ``wait_timeout_s`` (so a
                stuck storage never blocks the caller forever); None waits without bound.

        Raises:
            RankFailedError: the save failed on some rank (raised on every rank).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        self._wait_finished(timeout)
        self._observed = True
        return self.persist_completion.result()

    def get_result(self, timeout: Any = _BOUNDED) -> md.Metadata | None:
        """:meth:`result` (HyperParallel's name)."""
        return self.result(timeout)

    def exception(self, timeout: Any = _BOUNDED) -> BaseException | None:
        """The save's error, or None if it committed (waits like :meth:`result`)."""
        self._wait_finished(timeout)
        self._observed = True
        return self.persist_completion.exception()

    def __repr__(self) -> str:
        state = "done" if self.done() else ("staged" if self.staged() else "staging")
        return f"AsyncSaveResponse({self.checkpoint_id!r}, {self.staging}, {state})"


@dataclass
class _Job:
    """One save: what to write, and its snapshot as it is being taken."""

    owner: AsyncCheckpointer
    response: AsyncSaveResponse
    save_kwargs: dict[str, Any]
    group: Any
    started: float
    paths: dict[str, tuple] = field(default_factory=dict)  # key -> path in the nested state dict
    values: dict[str, Any] = field(default_factory=dict)  # key -> snapshot of a non-tensor leaf
    signature: tuple = ()  # ((key, tensor spec), ...): the structure that picks the buffer
    bands: tuple = ()  # ((key, column bands), ...): host tensors staged as their bands (staged_bands)
    templates: dict[str, Any] = field(default_factory=dict)  # key -> source tensor (until staged)
    pinned: bool = False
    events: dict[torch.device, Any] = field(default_factory=dict)  # lazy: training-stream marks
    buffer: _StagingBuffer | None = None
    error: BaseException | None = None
    place: str | None = None  # where it saves (:func:`place_of`)


# ---------------------------------------------------------------------------- checkpointer

_CHECKPOINTERS: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()
_HOOKS_PID: int | None = None
_HOOKS_LOCK = threading.Lock()


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
            snapshot takes about 1.5x as long as a flat copy (strided copies), but the
            background save then uses about half the CPU. None (the default): for
            ``staging="lazy"`` saves, whose copies run in the background anyway; True: also
            for eager saves, worth it where the training loop and the save compete for
            few cores; False: never.

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
                 stage_bands: bool | None = None):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if not 0 <= background_nice <= 19:
            raise ValueError(f"background_nice must be within 0..19, got {background_nice}")
        if stage_bands not in (None, True, False):
            raise ValueError(f"stage_bands must be None, True or False, got {stage_bands!r}")
        self.background_nice = background_nice
        self.stage_bands = stage_bands
        self.max_in_flight = max_in_flight
        self.exit_timeout_s = exit_timeout_s
        self.wait_timeout_s = wait_timeout_s
        self.stats = StagingStats()
        self._pool = _BufferPool(max_cached_structures, self.stats)
        self._lock = threading.Lock()
        self._in_flight: deque[_Job] = deque()
        self._unreported: list[tuple[AsyncSaveResponse, BaseException]] = []
        self._groups: dict[tuple[tuple[int, ...], timedelta | None], tuple[Any, Any]] = {}
        self._threads_pid: int | None = None
        self._write_queue: queue.Queue[_Job | None] = queue.Queue()
        self._stage_queue: queue.Queue[_Job | None] = queue.Queue()
        self._stop: Callable[[], Any] = lambda: None
        self._streams: dict[torch.device, Any] = {}
        _CHECKPOINTERS.add(self)

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
    ) -> AsyncSaveResponse:
        """Start an async save; see :func:`async_save` for the arguments (``incremental``: as
        for :func:`~.api.save`; the checkpoint manager passes it)."""
        started = time.perf_counter()
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
        if user_metadata is not None:
            # checked by the background save's first exchange (a bad value on one rank must fail
            # every rank, not leave the others waiting in a collective); a snapshot of it now
            with contextlib.suppress(Exception):
                user_metadata = copy.deepcopy(user_metadata)
        timeout = as_timeout(timeout)  # before any collective, alike on every rank
        where = None if where is None else os.fspath(where)
        given = where
        if where is not None and not is_url(where):  # the caller's directory now, not the writer's later
            where = os.path.abspath(local_path(where))
        elif where is not None and self.background_nice:
            # the writer would start fsspec's process-wide I/O thread at its own niceness
            start_io_thread()

        self._make_room()
        distributed = not no_dist and use_collectives and dist.is_available() and dist.is_initialized()
        mesh_scoped = False
        if distributed and process_group is None:
            process_group = _mesh_group(state_dict)  # DTensors on one mesh over some ranks: those ranks
            mesh_scoped = process_group is not None  # so the save guards the parts it lacks (api._part_guard)
        group = self._dedicated_group(process_group, timeout) if distributed else None

        response = AsyncSaveResponse(given, staging, callback, self.wait_timeout_s)
        # the background save plans with a copy: the caller may pass the same planner to a save
        # (or another async save) while this one is still writing, and a planner holds one call's state
        if planner is not None:
            _refuse_torch_hooks(planner)  # now, not from result()
        planner = planner_copy(planner) if planner is not None else None
        save_kwargs = dict(path=where, storage_writer=storage_writer, planner=planner, no_dist=no_dist,
                           use_collectives=use_collectives, coordinator_rank=coordinator_rank,
                           allow_pickle=allow_pickle, thread_count=thread_count, sync_files=sync_files,
                           user_metadata=user_metadata, incremental=incremental,
                           # with a group, the timeout is the dedicated group's (a timeout here would make
                           # it a gloo twin of its own); without one, it bounds the storage calls
                           timeout=timeout if group is None else None, _mesh_scoped=mesh_scoped)
        job = _Job(self, response, save_kwargs, group, started, place=in_flight.place_of(where, storage_writer))
        try:
            self._prepare(job, state_dict)
        except Exception as exc:  # reported on every rank by the background save
            job.error = exc
        with self._lock:
            self._in_flight.append(job)
        in_flight.started(id(job), job.place, response._finished, self.wait_timeout_s)
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
        before = thread_ids() if self.background_nice else set()
        try:
            if len(ranks) == dist.get_world_size():
                group = dist.new_group(list(ranks), timeout=made_timeout, backend="gloo")
            else:  # created by its members alone
                from ....platform import member_group

                group = member_group(ranks, backend="gloo", timeout=made_timeout)
        except RuntimeError as exc:  # a rank that did not call async_save, or not in time
            raise LostContactError(
                f"async_save: setting up its gloo group with ranks {list(ranks)[:16]} failed on rank "
                f"{dist.get_rank()} ({exc}). A rank did not call async_save, or was later than the "
                f"timeout ({made_timeout})") from exc
        if self.background_nice:
            lower_priority(thread_ids(gloo_only=True) - before, self.background_nice)  # its I/O threads
        self._groups[(ranks, timeout)] = (world, group)
        return group

    def _prepare(self, job: _Job, state_dict: dict[str, Any]) -> None:
        """Flatten, copy plain values, and find the structure of the tensors (no tensor copies)."""
        flat = flatten(state_dict)
        signature, templates, devices = [], {}, set()
        for key, leaf in flat.leaves.items():
            spec = _tensor_spec(leaf.value)
            if spec is None:
                job.values[key] = _copy_value(leaf.value)
                continue
            signature.append((key, spec))
            templates[key] = leaf.value
            if spec[0] != "ndarray" and spec[3] not in ("cpu", "meta"):
                tensor = leaf.value._local_tensor if spec[0] == "dtensor" else leaf.value
                devices.add(tensor.device)
        job.paths = {key: leaf.path for key, leaf in flat.leaves.items()}
        job.signature, job.templates, job.pinned = tuple(signature), templates, bool(devices)
        if job.response.staging == "lazy":
            job.events = {d: _record_event(d) for d in devices if d.type == "cuda"}

    def _stage(self, job: _Job) -> None:
        """Copy the job's tensors into a staging buffer (caller's thread for eager)."""
        start = time.perf_counter()
        try:
            if job.error is None and job.signature:
                job.bands = self._bands(job)
                job.buffer = self._pool.acquire(job.signature, job.templates, job.pinned, job.bands)
                sources = [(job.buffer.targets[key], _source(job.templates[key])) for key, _ in job.signature]
                if job.events:
                    self._copy_on_side_streams(job, sources)
                else:
                    _copy_into(sources)
        except Exception as exc:
            job.error = exc
        finally:
            job.templates = {}
            job.response.staging_s = time.perf_counter() - start
            job.response._staged.set()

    def _bands(self, job: _Job) -> tuple:
        """((key, column bands), ...): the host tensors to stage as the bands the save will
        cut them into (on the stager's thread for a lazy save: it costs per-tensor work)."""
        wanted = self.stage_bands if self.stage_bands is not None else job.response.staging == "lazy"
        planner = job.save_kwargs.get("planner")
        planner = StandardPlanner() if planner is None else planner
        # a rank-local save (no collectives) stores chunks whole: nothing to cut into bands
        if not wanted or not job.save_kwargs.get("use_collectives", True) or not hasattr(planner, "staging_bands"):
            return ()
        tiles = ((key, planner.staging_bands(key, job.templates[key])) for key, _ in job.signature)
        return tuple((key, t) for key, t in tiles if t > 1)

    def _copy_on_side_streams(self, job: _Job, pairs: list[tuple[Any, Any]]) -> None:
        # Lazy staging from CUDA: copy on a side stream once the training stream has reached
        # the point where async_save was called, so training kernels keep running meanwhile.
        by_device: dict[Any, list[tuple[Any, Any]]] = {}
        for target, source in pairs:
            device = None if isinstance(source, np.ndarray) else source.device
            by_device.setdefault(device if device in job.events else None, []).append((target, source))
        _copy_into(by_device.pop(None, []))
        for device, device_pairs in by_device.items():
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device)
            stream.wait_event(job.events[device])
            with torch.cuda.stream(stream):
                _copy_into(device_pairs)  # synchronises the (side) stream before returning

    def _staged_state_dict(self, job: _Job) -> dict[str, Any]:
        if job.error is not None:
            return {"snapshot": _Unstageable(job.error)}
        staged = job.buffer.staged if job.buffer is not None else {}
        # Already flat, with the original paths: save() must not re-flatten (that would lose
        # the keys of Stateful objects whose state holds no tensors).
        out = FlatStateDict.from_items(
            {key: (path, staged[key] if key in staged else job.values[key]) for key, path in job.paths.items()})
        out.bands = dict(job.buffer.banded) if job.buffer is not None else {}
        return out

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
        _install_exit_hooks()

    def _forget_parent(self) -> None:
        """In a forked child: the parent's threads, saves, locks and groups are not ours."""
        self._lock = threading.Lock()
        self._pool._lock = threading.Lock()
        self._in_flight.clear()
        in_flight.forget_all()
        self._groups.clear()
        self._streams.clear()
        self._threads_pid = None
        self._stop = lambda: None

    def _stop_threads(self) -> None:
        with self._lock:
            if self._threads_pid != os.getpid():
                return
            self._threads_pid = None
            self._stop()

    def _write(self, job: _Job) -> None:
        job.response._staged.wait()
        meta, error = None, None
        try:
            in_flight.wait_for_earlier_saves(id(job))  # another checkpointer's, to the same place
            meta = save(self._staged_state_dict(job), process_group=job.group, **job.save_kwargs)
        except BaseException as exc:  # every failure belongs to the response, never to the thread
            error = exc
            if job.group is not None and not dist.is_initialized() and not isinstance(exc, LostContactError):
                error = LostContactError(  # torch's own words ("group is not registered") say less
                    "dist.destroy_process_group() ran while this async save was in flight; it was not "
                    f"committed ({type(exc).__name__}: {exc}). Wait for saves in flight first (resp.result())")
                error.__cause__ = exc
        finally:
            if job.buffer is not None:
                self._pool.release(job.buffer)
                job.buffer = None
            job.paths, job.values = {}, {}
        response = job.response
        with self._lock:
            self._in_flight.remove(job)
            if error is not None:
                self._unreported.append((response, error))
        in_flight.ended(id(job))
        response.total_s = time.perf_counter() - job.started
        if error is None:
            response.persist_completion.set_result(meta)
        else:
            response.persist_completion.set_exception(error)
        if response._callback is not None:
            response._callback_thread = threading.get_ident()
            try:
                _call_back(response._callback, response)
            except Exception as exc:
                warnings.warn(f"async save callback {response._callback!r} raised {exc!r}", stacklevel=1)
            finally:
                response._callback_thread = None
        response._finished.set()

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


def _call_back(callback: Callable[..., Any], response: AsyncSaveResponse) -> None:
    """``callback(response)``, or ``callback()`` for a callback that takes no argument."""
    try:
        params = inspect.signature(callback).parameters.values()
        wants = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    except (TypeError, ValueError):  # no signature (some builtins): pass the response
        wants = True
    callback(response) if wants else callback()


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


def _after_fork_in_child() -> None:
    global _HOOKS_LOCK
    _HOOKS_LOCK = threading.Lock()
    for checkpointer in list(_CHECKPOINTERS):
        checkpointer._forget_parent()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _exit_hook() -> None:
    for checkpointer in list(_CHECKPOINTERS):
        checkpointer._drain_at_exit()


def _install_exit_hooks() -> None:
    """Register the exit wait once per process (atexit, plus multiprocessing's own exit path,
    which worker processes take instead of atexit)."""
    global _HOOKS_PID
    with _HOOKS_LOCK:
        if _HOOKS_PID == os.getpid():
            return
        _HOOKS_PID = os.getpid()
        atexit.register(_exit_hook)
        try:
            from multiprocessing import util

            util.Finalize(None, _exit_hook, exitpriority=100)
        except Exception:  # multiprocessing unavailable: atexit alone covers plain scripts
            pass


_DEFAULT: AsyncCheckpointer | None = None


def default_checkpointer() -> AsyncCheckpointer:
    """The process-wide :class:`AsyncCheckpointer` that :func:`async_save` uses (made on first use).

    Example::

        default_checkpointer().wait()   # e.g. before dist.destroy_process_group()
    """
    global _DEFAULT
    with _HOOKS_LOCK:
        if _DEFAULT is None:
            _DEFAULT = AsyncCheckpointer()
        return _DEFAULT


# ---------------------------------------------------------------------------- public API


def async_save(
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
    checkpointer: AsyncCheckpointer | None = None,
    use_gloo: bool = True,
    async_checkpointer_type: Any = None,
    async_stager: Any = None,
) -> AsyncSaveResponse:
    """Save like :func:`~.api.save`, but return once a snapshot of the state dict is taken.

    Every rank of the group calls it, in the same order. With ``staging="eager"`` the call
    copies every tensor into reused host buffers and returns; the state dict's tensors may
    then be modified or freed at once. A background thread writes the snapshot and commits
    ``.metadata`` exactly as :func:`~.api.save` does (same planning, dedup and files), with
    its cross-rank exchanges on a dedicated gloo group.

    At most ``checkpointer.max_in_flight`` (default 1) saves run at once: a further call
    first waits for the oldest. A failed save raises on its response and again, as
    :class:`AsyncSaveError`, on the next ``async_save`` or ``wait()``.

    Args:
        state_dict, path / checkpoint_id, storage_writer, planner, process_group, no_dist,
            use_collectives, coordinator_rank, allow_pickle, thread_count, sync_files, timeout,
            user_metadata: as for :func:`~.api.save`. ``timeout`` also bounds the dedicated
            group's collectives (default: ``process_group``'s timeout).
        staging: ``"eager"`` (copy now) or ``"lazy"`` (copy in the background: the call returns
            at once; call ``response.wait_staged()`` — or install
            :func:`register_optimizer_hook` — before the tensors change). Lazy snapshots read
            the live tensors, so anything a forward pass updates in place (BatchNorm running
            statistics) must be waited for before that forward pass.
        callback: called once in the background thread when the save committed or failed,
            before ``result()`` returns anywhere else: as ``callback(response)``, or as
            ``callback()`` if it takes no argument (HyperParallel's convention). Inside it,
            ``response.result()`` returns at once. It must not wait for other saves (they run
            after it); exceptions it raises become warnings.
        checkpointer: the :class:`AsyncCheckpointer` to use (default: :func:`default_checkpointer`).
        use_gloo: accepted for HyperParallel code. The background save always coordinates on
            a dedicated gloo group (so it never shares a communicator with training, on any
            device); ``use_gloo=False`` changes nothing.
        async_checkpointer_type: accepted for torch DCP code: the save always runs on
            background threads of this process (``THREAD``); ``PROCESS`` changes nothing.
        async_stager: torch DCP's custom stager; not supported (only None): staging is
            ``staging=`` and the checkpointer's reused buffers.

    Returns:
        An :class:`AsyncSaveResponse`: ``result()`` (or ``get_result()``) waits for the commit
        and returns the :class:`Metadata`, on every rank; ``persist_completion`` is the same as
        a Future.

    Raises:
        AsyncSaveError: the previous async save failed (nothing new is started).
        ValueError / TypeError: bad arguments (no destination, unknown ``staging``, a
            ``timeout`` that is not seconds > 0 or a timedelta, ...).
        Errors of the save itself (e.g. :class:`RankFailedError`, also for a ``user_metadata``
            that is not JSON-able, checked on every rank alike) come from ``result()``.

    Example::

        resp = async_save({"model": model.state_dict(), "optim": optim.state_dict()},
                          checkpoint_id=f"/ckpt/step{step}")
        optimizer.step()          # safe: the snapshot is already taken
        ...
        resp.result()             # the checkpoint is committed
    """
    del async_checkpointer_type  # see above
    if async_stager is not None:
        raise UnsupportedValueError(f"async_stager={async_stager!r}: torch DCP's stagers are not supported; staging "
                                    "is staging='eager' or 'lazy' into the checkpointer's reused buffers")
    return (checkpointer or default_checkpointer()).save(
        state_dict, path, checkpoint_id=checkpoint_id, storage_writer=storage_writer, planner=planner,
        process_group=process_group, no_dist=no_dist, use_collectives=use_collectives,
        coordinator_rank=coordinator_rank, allow_pickle=allow_pickle, thread_count=thread_count,
        sync_files=sync_files, timeout=timeout, user_metadata=user_metadata, staging=staging,
        callback=callback, use_gloo=use_gloo)


def register_optimizer_hook(
    optimizer: torch.optim.Optimizer, target: AsyncSaveResponse | AsyncCheckpointer | None = None
) -> Any:
    """Make ``optimizer.step()`` wait until lazy snapshots are taken, before it changes anything.

    With a checkpointer (default: :func:`default_checkpointer`) every step waits for the
    snapshots of all saves in flight at that moment; with a response, only for that save. The
    wait returns at once when the snapshot is done, so a lazy save whose copies finish during
    forward and backward costs the step nothing.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        target: an :class:`AsyncSaveResponse` or :class:`AsyncCheckpointer`.

    Returns:
        The hook's handle; ``handle.remove()`` uninstalls it.

    Example::

        register_optimizer_hook(optimizer)             # once
        for step in range(steps):
            loss = model(batch).sum(); loss.backward()
            if step % 100 == 0:
                async_save(state, f"/ckpt/{step}", staging="lazy")
            optimizer.step()                           # waits only if the copies are not done
    """
    waiter = (target if target is not None else default_checkpointer()).wait_staged

    def wait_for_snapshot(opt: Any, args: Any, kwargs: Any) -> None:
        waiter()

    return optimizer.register_step_pre_hook(wait_for_snapshot)
