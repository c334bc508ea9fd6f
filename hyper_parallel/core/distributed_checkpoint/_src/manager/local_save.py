"""A local save on one rank: the snapshot, the background write of its shard file, retention.

Steps 2, 3 and 6 of a local save (the protocol is in :mod:`.local_tier`): the snapshot
copies every tensor, array and bytes value of the flattened state dict into one reused
staging buffer laid out as the shard file's body (the only time training is blocked); a
background thread (one per process, at a lower CPU priority than training) writes the
rank's file (:mod:`.local_format`), hands it to the :class:`~.local_replication.Replicator`
(steps 4 and 5), and applies retention: the newest ``keep`` confirmed steps plus at most
``keep`` newer unconfirmed ones stay in the directories this rank writes, the newest
confirmed step is never deleted by a newer unconfirmed one.

It is not the scheduling of saves (:class:`~.local_tier.LocalTier`) nor recovery
(:mod:`.local_recovery`).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from ..asynchronous.buffers import BufferPool, StagingStats, copy_into, copy_value, tensor_spec
from ..base.options import LocalTierOptions
from ..base.priority import lower_this_thread
from ..state.flatten import FlatLeaves, flatten
from .local_directory import TierDirectory
from .local_format import FORMAT_NAME as LOCAL_FORMAT
from .local_format import FORMAT_VERSION as LOCAL_VERSION
from .local_format import LocalEntry, ShardFile, build_shard_file, describe
from .local_replication import Replicator

__all__ = ["LocalSaveTiming", "LocalSaver"]


@dataclass(frozen=True)
class LocalSaveTiming:
    """One local save on this rank.

    Training was blocked ``blocking_s``: ``waited_s`` for the previous local save, then
    ``state_dict_s`` flattening the state dict (Stateful ``state_dict()`` calls included),
    then ``snapshot_s`` copying the tensors. In the background: ``write_s`` writing the
    shard file, ``replicate_s`` sending/receiving copies and confirming, ``cpu_s`` the CPU
    time of all that. ``confirmed``: every rank confirmed the step (complete everywhere,
    with its copies).
    """

    step: int
    blocking_s: float
    waited_s: float
    state_dict_s: float
    snapshot_s: float
    write_s: float
    replicate_s: float
    cpu_s: float
    confirmed: bool
    bytes_written: int
    bytes_sent: int
    bytes_received: int


@dataclass
class _Job:
    step: int
    timeline: str
    durable_base: tuple[int, str | None] | None
    started: float
    entries: list[LocalEntry] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)  # copies of the JSON values
    fingerprint: str = ""
    buffer: Any = None
    error: Exception | None = None
    blocking_s: float = 0.0
    waited_s: float = 0.0
    state_dict_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


class LocalSaver:
    """This rank's local saves: one in flight at a time, written and replicated in the background.

    ``manifest`` holds the facts every file of this rank records besides its step, timeline
    and contents (rank, world size, directory, node). ``layouts`` is :func:`describe`'s
    cache of DTensor layouts (shared with recovery).
    """

    def __init__(self, files: TierDirectory, replicator: Replicator, options: LocalTierOptions, *,
                 manifest: dict[str, Any], layouts: dict, global_rank: int):
        self.files, self.replicator = files, replicator
        self.manifest = manifest
        self.rank = manifest["rank"]
        self.keep, self.sync_files = options.keep, options.sync_files
        self.global_rank = global_rank
        self.timings: deque[LocalSaveTiming] = deque(maxlen=100)
        self.save_errors: list[str] = []
        self.stats = StagingStats()
        self._layouts = layouts
        self._pool = BufferPool(1, self.stats)
        self._job: _Job | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._confirmed: list[tuple[int, str]] = []
        self._unconfirmed: list[tuple[int, str]] = []
        # Buffers of sends that failed while gloo may still read them: never freed or reused.
        self._abandoned: list[Any] = []

    @property
    def in_flight(self) -> int | None:
        """The step of the newest local save started (None: none yet)."""
        return self._job.step if self._job else None

    def start(self, step: int, state_dict: dict[str, Any], *, timeline: str,
              durable_base: tuple[int, str | None] | None, started: float) -> Exception | None:
        """Snapshot ``state_dict`` as ``step`` (``started``: when the save call began, before it
        waited) and queue its write. A snapshot that fails still takes part in replication, so
        peers stay in step; its error is returned, for the caller to raise."""
        waited = time.perf_counter()
        job = _Job(step, timeline, durable_base, started, waited_s=waited - started)
        try:
            flat = flatten(state_dict)
            job.state_dict_s = time.perf_counter() - waited
            self._snapshot(job, flat)
        except Exception as exc:
            job.error = exc
        job.blocking_s = time.perf_counter() - started
        self._submit(job)
        return job.error

    def _snapshot(self, job: _Job, flat: FlatLeaves) -> None:
        """Copy every payload (tensors, arrays, bytes) into one reused staging buffer, laid out
        as the shard file's body: the background thread writes and sends it as it is."""
        entries, values, job.fingerprint = describe(flat, self._layouts)
        signature, sources, pinned = [], [], False
        for e, v in zip(entries, values, strict=True):
            if e.kind != "object":
                spec = tensor_spec(v)
                signature.append((e.key, spec))
                sources.append(v)
                pinned = pinned or (spec[0] == "tensor" and spec[3] not in ("cpu", "meta"))
        buffer = self._pool.acquire(tuple(signature), {}, pinned) if signature else None
        try:
            if buffer is not None:
                copy_into([(buffer.targets[key], v) for (key, _), v in zip(signature, sources, strict=True)])
            job.objects = {e.key: copy_value(v) for e, v in zip(entries, values, strict=True) if e.kind == "object"}
        except BaseException:
            if buffer is not None:
                self._pool.release(buffer)
            raise
        job.entries, job.buffer = entries, buffer

    def _submit(self, job: _Job) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name="hp-dcp-local-tier", daemon=True)
            self._thread.start()
        self._job = job
        self._queue.put(job)

    def _worker(self) -> None:
        lower_this_thread()
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._run(job)
            except BaseException as exc:  # never let the thread die: the next save would wait forever
                self._note_error(job.step, exc)
            finally:
                job.done.set()

    def _run(self, job: _Job) -> None:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        shard: ShardFile | None = None
        path, written, in_doubt = None, 0, True
        try:
            if job.error is None:
                manifest = {"format": LOCAL_FORMAT, "version": LOCAL_VERSION, "step": job.step, "rank": self.rank,
                            "world_size": self.manifest["world_size"], "timeline": job.timeline,
                            "directory": self.manifest["directory"], "node": self.manifest["node"],
                            "fingerprint": job.fingerprint, "durable_base": _encode_base(job.durable_base)}
                spans, body = _body_of(job.buffer)
                shard = build_shard_file(manifest, job.entries, spans, body, job.objects)
                target = self.files.path(self.rank, job.step, job.timeline)
                written = self.files.write(target, [memoryview(shard.header), shard.body], self.sync_files)
                path = target
        except Exception as exc:
            self._note_error(job.step, exc)
            shard = None
        t1 = time.perf_counter()
        try:
            ok, sent, received, in_doubt = self.replicator.replicate(job.step, job.timeline,
                                                                     shard if path is not None else None)
        finally:
            if job.buffer is not None and not in_doubt:
                self._pool.release(job.buffer)
            elif job.buffer is not None:  # a send that failed may still read it: never reuse it
                self._abandoned.append(job.buffer)
            job.buffer, job.objects = None, {}
        confirmed = self.replicator.confirm(path is not None and ok)
        self._retain((job.step, job.timeline), confirmed, path is not None)
        self.timings.append(LocalSaveTiming(
            job.step, job.blocking_s, job.waited_s, job.state_dict_s, job.blocking_s - job.waited_s - job.state_dict_s,
            t1 - t0, time.perf_counter() - t1, time.thread_time() - cpu0, confirmed, written, sent, received))

    def _retain(self, key: tuple[int, str], confirmed: bool, committed: bool) -> None:
        """Retention after a local save (see the module docstring), in this rank's directory
        and those of the ranks it keeps copies for."""
        if confirmed:
            self._confirmed = sorted({*self._confirmed, key})[-self.keep:]
        elif committed:
            self._unconfirmed = sorted({*self._unconfirmed, key})[-self.keep:]
        newest = self._confirmed[-1] if self._confirmed else None
        self._unconfirmed = [k for k in self._unconfirmed if newest is None or k[0] > newest[0]]
        self.files.remove_except((self.rank, *self.replicator.sources),
                                 set(self._confirmed) | set(self._unconfirmed))

    def restart(self, confirmed: list[tuple[int, str]]) -> None:
        """After a load: the steps retention counts as confirmed (the loaded one and those
        kept below it), none unconfirmed."""
        self._confirmed, self._unconfirmed = confirmed, []

    def wait(self, timeout: float | None) -> bool:
        """Wait for the local save in flight; False if it is still running after ``timeout``."""
        job = self._job
        return job is None or job.done.wait(timeout)

    def _note_error(self, step: int, exc: BaseException) -> None:
        message = f"step {step}: {type(exc).__name__}: {exc}"
        self.save_errors.append(message)
        warnings.warn(f"CheckpointManager (rank {self.global_rank}): local save failed ({message}); the step "
                      "is not complete on this rank and will not be chosen", stacklevel=2)

    def close(self, finished: bool) -> None:
        """Stop the thread (only once the save in flight ``finished``) and free the buffers. Local."""
        if self._thread is not None and finished:
            self._queue.put(None)
            self._thread.join(5)
        self._pool.clear()


def _body_of(buffer: Any) -> tuple[dict[str, int], memoryview]:
    """Where each payload lies in a staging buffer, and the buffer's bytes up to the last one."""
    if buffer is None:
        return {}, memoryview(b"")
    base = buffer.flat.data_ptr()
    spans, end = {}, 0
    for key, view in buffer.targets.items():
        if isinstance(view, torch.Tensor):
            start, nbytes = view.data_ptr() - base, view.numel() * view.element_size()
        else:
            start, nbytes = view.__array_interface__["data"][0] - base, view.nbytes
        if not nbytes:
            start = 0
        spans[key] = start
        end = max(end, start + nbytes)
    return spans, memoryview(buffer.flat.numpy()).cast("B")[:end]


def _encode_base(base: tuple[int, str | None] | None) -> dict[str, Any]:
    """A timeline's durable base as the manifest records it (see :mod:`.local_format`)."""
    step, timeline = base if base is not None else (None, None)
    return {"step": step, "timeline": timeline}
