"""The local tier of a CheckpointManager: frequent saves to node-local storage, copies on
peers of other nodes, and recovery from them without reading the durable directory.

A durable step costs shared-storage bandwidth, so it is taken rarely; a node that dies loses
everything since. The local tier saves every ``local_interval_steps`` to ``local_dir`` on each
node (``/dev/shm`` or a local NVMe disk: it survives a process restart, not the loss of the
node) and keeps a copy of every rank's shards on ``replicas - 1`` other nodes, so a job that
loses a node resumes from the newest local step instead of the older durable one.

**A local save, on every rank** (:meth:`LocalTier.save`; the manager calls it alike on
every rank):

1. Wait for this rank's previous local save (bounded: see "Bounded waits").
2. Snapshot: flatten the state dict and copy every tensor, array and bytes value into a
   reused host buffer (the staging buffers of :mod:`.async_staging`), whose layout is the
   shard file's body. This is the only time training is blocked.
3. In the background (one thread per process, at a lower CPU priority than training), write
   the rank's shard file (one file, its own shards only, see :mod:`.local_format`): the
   header, then the staging buffer as it is, under a temporary name (or over a retired file)
   renamed into place: the commit of this rank's part.
4. Replicate: send the header and the staging buffer to this rank's peers and receive the
   files of the ranks it keeps copies for (:mod:`.local_replication` says who), on a
   dedicated gloo group; each received file is written to a temporary name and renamed
   once whole.
5. Confirm: one all-reduce (MIN) of "my file and every copy I keep for this step are
   committed" on the same group. A *confirmed* step is complete on every rank and survives
   the loss of any ``replicas - 1`` nodes.
6. Retention: each rank keeps, in the directories it writes (its own and those of the ranks
   it keeps copies for), the newest ``local_keep`` confirmed steps plus at most
   ``local_keep`` newer unconfirmed ones, and deletes the rest. The newest confirmed step
   is never deleted by a newer unconfirmed one, so a crash at any point leaves a complete
   step behind.

**Recovery** (:meth:`LocalTier.recover`, from ``CheckpointManager.load``):

1. Every rank settles its local save in flight (one exchange, which also tells every rank
   who shares its ``local_dir``).
2. One rank per directory lists it (reading only the headers of the shard files), and every
   rank shares what it found: ``(owner rank, step, timeline, size, fingerprint)`` per file,
   with the fingerprint of its own target (one exchange). Every rank then makes the same
   choice (:func:`decide`): the newest step whose every rank has a copy somewhere whose
   fingerprint equals that rank's target (same keys, dtypes, shapes, sharding). Partial
   steps (a rank's file missing: a ``.tmp-`` file is not a file) are never chosen, nor are
   steps of an *abandoned* timeline (below). If the durable directory has a newer committed
   step, or no local step is complete, the answer is "durable" and the manager loads from
   ``directory`` as before (this is also how a changed layout ends: the fingerprints differ).
3. Each rank without a copy in its own directory allocates the file it will receive it
   into (one exchange): a full ``local_dir`` is then an ENOSPC that every rank learns before
   any transfer, and the manager loads the durable step instead (or, with none, every rank
   raises a CheckpointError naming the ranks; the local steps are kept).
4. Each such rank receives its copy from a rank of a directory that has one (the least
   loaded) over the process group, straight into that file (restoring its copy); then every
   rank reads its file into its own tensors (in place, crc32c checked) (one exchange). A
   checksum failure anywhere excludes that copy and the choice is made again (another copy,
   an older step, or the durable tier).
5. Non-tensor values and Stateful objects are put back only after every rank has read
   successfully (one exchange).
6. Files of the runs before are deleted except the ``local_keep`` newest complete steps up
   to the one loaded; the job continues on a new *timeline*, so files of an abandoned run
   never mix with the new run's steps.

**Abandoned timelines.** Step 6 deletes only what the new run's ranks can see: a run at
another world size (an elastic scale-down) loads from the durable tier and never sees the
directories of the nodes it left out, whose files come back with those nodes. So step
numbers alone cannot tell a newer local step from an abandoned one. Every durable step
records the timeline that committed it (the manager's user metadata), and every local file
records its timeline's *durable base*: the newest durable step (and its timeline) when the
timeline began. A local step is used only if the newest durable step is absent, was
committed by the step's own timeline, or is its durable base; otherwise a later run
committed it and the local step's run was abandoned. A durable step saved before timelines
were recorded leaves the choice to step numbers, as before; a local file without a durable
base (written before it was recorded) counts unless a run that records timelines committed
the newest durable step.

Nothing in recovery reads ``directory``.

**Bounded waits.** Every replication wait, the confirmation, and the making of the
replication group (at the first local save: a peer dead before it never joins) are bounded
by ``replication_timeout`` (gloo retries connecting to a peer that died halfway through
making a group, each try waiting that long: up to about five times it); a peer that fails
or stalls past it ends replication for the rest of the run on the ranks that notice (a gloo
group cannot recover from a timeout; the next start builds a new one) with a warning, while
local saves go on unreplicated and unconfirmed. The next local save waits for the previous one at most ``2 *
replication_timeout`` plus the write time, and is skipped (with a warning) past that.

**Memory** (``local_dir`` in ``/dev/shm`` is memory): per node, about ``(local_keep + 2) *
replicas`` times the node's shard bytes (the kept steps, the one being written, one retired
file per directory), plus per process one staging buffer and one receive buffer per rank it
keeps copies for.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..backends.locations import is_url
from ..base.coordination import Coordinator, new_gloo_group
from ..base.errors import CheckpointError, CorruptCheckpointError
from ..base.priority import BACKGROUND_NICE, lower_this_thread
from ..staging.buffers import BufferPool as _BufferPool
from ..staging.buffers import StagingStats
from ..staging.buffers import copy_into as _copy_into
from ..staging.buffers import copy_value as _copy_value
from ..staging.buffers import tensor_spec as _tensor_spec
from ..state.flatten import Flat, flatten, update_in_place
from .local_format import FORMAT_NAME as LOCAL_FORMAT
from .local_format import FORMAT_VERSION as LOCAL_VERSION
from .local_format import (
    TMP_PREFIX,
    LocalEntry,
    Manifest,
    ShardFile,
    build_shard_file,
    describe,
    parse_manifest,
    rank_dir_name,
    rank_of_dir,
    read_into,
    read_manifest,
    scan_rank_dir,
    shard_file_name,
    tier_dir_name,
    tmp_path_for,
    write_shard_file,
)
from .local_replication import MappedFile, Topology, node_identity, recv_file, send_file, wait_all

__all__ = ["LocalTier", "LocalSaveTiming", "Recovery", "decide", "new_timeline"]

_MAGIC = 0x48504C54  # "HPLT": the head of every replication message
_TAG_HEAD, _TAG_FILE, _TAG_BODY, _TAG_FETCH = 0x4C01, 0x4C02, 0x4C04, 0x4C03
_SAVE_WAIT_SLACK_S = 60.0  # on top of 2 * replication_timeout: the write itself


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
class Recovery:
    """What the last ``load`` found: ``source`` ``"local"`` or ``"durable"`` (the local tier
    had nothing complete and newer); ``holders[rank]`` the rank whose copy each rank loaded;
    bytes this rank received from a peer and read from its ``local_dir``; wall seconds of
    the local part."""

    source: str
    step: int | None
    holders: dict[int, int] = field(default_factory=dict)
    bytes_fetched: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    attempts: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step of the protocol

    @property
    def touched(self) -> bool:
        """A local copy was read into the target and then found damaged: unless a durable
        step loads over it, the target holds part of that copy."""
        return self.source == "durable" and self.attempts > 1


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
    error: BaseException | None = None
    blocking_s: float = 0.0
    waited_s: float = 0.0
    state_dict_s: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


def new_timeline() -> str:
    """A new timeline id: creation time (hex ns) and 8 random hex digits."""
    return f"{time.time_ns():016x}{uuid.uuid4().hex[:8]}"


class LocalTier:
    """The local tier of one CheckpointManager (see the module docstring for the protocol).

    Every rank of the group constructs it (collective: it learns every rank's node) and
    calls :meth:`save` (the first one makes the replication group), :meth:`recover`,
    :meth:`loaded` and :meth:`wait` alike; :meth:`close` is local.

    Args:
        local_dir: this node's directory for the tier (``/dev/shm/...`` or local NVMe);
            ranks on one node may share it.
        directory: the durable directory of the manager (recorded in every file, so files of
            another manager are never loaded).
        interval_steps: save when ``step % interval_steps == 0``.
        keep: confirmed steps kept per rank and copy (``local_keep``).
        replicas: copies of each rank's shards, its own included (at most the node count).
        node_rank: this rank's node; None: from the launcher (see :mod:`.local_replication`).
        process_group, timeout: as for the manager (recovery's exchanges and transfers).
        replication_timeout: seconds any replication wait may take (see "Bounded waits").
        sync_files: fsync shard files (off: the tier survives process restarts, and
            checksums catch what a machine crash lost).
        durable: the newest durable step and the timeline that committed it (None: none),
            recorded in every file of this timeline (see "Recovery").
    """

    def __init__(self, local_dir: str | os.PathLike, *, directory: str, interval_steps: int, keep: int,
                 replicas: int, node_rank: int | None, process_group: Any = None, timeout: timedelta | None = None,
                 replication_timeout: float = 60.0, sync_files: bool = False,
                 durable: tuple[int, str | None] | None = None):
        self.local_dir = os.path.abspath(os.fspath(local_dir))
        self.directory = directory if is_url(directory) else os.path.abspath(directory)
        # One subdirectory per manager directory: jobs sharing /dev/shm never touch each other's files.
        self.root = os.path.join(self.local_dir, tier_dir_name(self.directory))
        self.interval_steps, self.keep, self.replicas = interval_steps, keep, replicas
        self.replication_timeout = float(replication_timeout)
        self.sync_files = sync_files
        self.coord = Coordinator(process_group, False, 0, timeout)
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self.timings: deque[LocalSaveTiming] = deque(maxlen=100)
        self.last_recovery: Recovery | None = None
        self.replication_error: str | None = None  # why replication stopped (None: it runs)
        self.save_errors: list[str] = []
        self._last_step: int | None = None
        # the newest durable step when this timeline began: written into every file of it
        self.durable_base: tuple[int, str | None] | None = durable
        self._confirmed: list[tuple[int, str]] = []
        self._unconfirmed: list[tuple[int, str]] = []
        self._layouts: dict = {}  # describe()'s cache of DTensor layouts
        self._stats = StagingStats()
        self._pool = _BufferPool(1, self._stats)
        self._job: _Job | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._group: Any = None
        self._closed = False
        # Buffers of transfers that failed while gloo may still use them: never freed or reused.
        self._abandoned: list[Any] = []
        self._rx: dict[int, torch.Tensor] = {}  # receive buffers by source rank
        self._spares: dict[str, str] = {}  # a retired file per directory this rank writes, to overwrite
        self._room: tuple[MappedFile, str] | None = None  # recovery: (the file receiving this rank's copy, its name)
        identity = node_identity(node_rank)

        def start() -> tuple:
            os.makedirs(self.root, exist_ok=True)
            self._sweep_temporary()
            return identity, (interval_steps, keep, replicas), new_timeline()

        infos = self.coord.exchange("local tier (start)", start)
        settings = {info[1] for info in infos}
        if len(settings) > 1:
            raise ValueError("CheckpointManager: the ranks passed different local tier settings (local_interval_steps, "
                             f"local_keep, replicas) by rank: {[info[1] for info in infos]}; pass the same on every "
                             "rank")
        sources = {info[0][0] for info in infos}
        if len(sources) > 1:
            raise ValueError(f"CheckpointManager: node identities come from different sources on different ranks "
                             f"({sorted(sources)}); pass node_rank= on every rank or on none")
        self.identity = identity
        self.topology = Topology.of([info[0][1] for info in infos], replicas)
        self.timeline = infos[self.coord.coordinator_rank][2]
        self.node = self.topology.nodes[self.rank]
        self.peers = self.topology.peers(self.rank)
        self.sources = self.topology.sources(self.rank)
        self._needs_group = self.coord.distributed and self.world_size > 1  # made at the first save
        if replicas > 1 and self.topology.node_count < replicas and self.rank == 0:
            warnings.warn(f"CheckpointManager: replicas={replicas} but the job spans {self.topology.node_count} "
                          f"node(s) (by {identity[0]}): each rank's shards get {self.topology.node_count - 1} "
                          "copies on other nodes", stacklevel=3)

    # ------------------------------------------------------------------ saving

    def due(self, step: int) -> bool:
        return step % self.interval_steps == 0

    def save(self, step: int, state_dict: dict[str, Any]) -> bool:
        """Start the local save of ``step`` if it is due; return whether it started.

        Blocks for the previous local save (bounded) and the snapshot; the rest runs in the
        background. Raises for a state dict the tier cannot store (UnsupportedValueError) and
        for a step older than the last one saved or loaded.
        """
        self._check_open()
        if not self.due(step):
            return False
        if self._last_step is not None and step <= self._last_step:
            if step == self._last_step:
                return False
            raise ValueError(f"local save of step {step}: step {self._last_step} was already saved or loaded; "
                             "steps only go forward")
        started = time.perf_counter()
        if not self._wait_previous(self.replication_timeout * 2 + _SAVE_WAIT_SLACK_S):
            self._stop_replication(f"the local save of step {self._job.step if self._job else '?'} is still running "
                                   f"after {self.replication_timeout * 2 + _SAVE_WAIT_SLACK_S:.0f}s")
            warnings.warn(f"CheckpointManager: local save of step {step} skipped: the previous one is still "
                          "running (storage or a peer is stuck)", stacklevel=3)
            return False
        if self._needs_group and self._group is None:
            self._make_group()
        waited = time.perf_counter()
        job = _Job(step, self.timeline, self.durable_base, started, waited_s=waited - started)
        try:
            flat = flatten(state_dict)
            job.state_dict_s = time.perf_counter() - waited
            self._snapshot(job, flat)
        except Exception as exc:
            job.error = exc
        job.blocking_s = time.perf_counter() - started
        self._last_step = step
        self._submit(job)  # a failed snapshot still takes part in replication, so peers stay in step
        if job.error is not None:
            raise job.error
        return True

    def _make_group(self) -> None:
        """Make the replication group (collective: every rank makes its first local save at the
        same step). A peer that is dead or later than ``replication_timeout`` ends replication
        for this run, as any replication wait does (the save goes on unreplicated), instead of
        raising gloo's bare "Wait timeout" into the training loop; it is not tried again."""
        try:
            self._group = new_gloo_group(self.coord.group_ranks, timedelta(seconds=self.replication_timeout),
                                         nice=BACKGROUND_NICE)  # its I/O threads in the background
        except RuntimeError as exc:
            self._needs_group = False
            self._stop_replication(f"making the replication group: a rank did not join within "
                                   f"{self.replication_timeout:g}s ({type(exc).__name__}: {exc})")
            return

    def _snapshot(self, job: _Job, flat: Flat) -> None:
        """Copy every payload (tensors, arrays, bytes) into one reused staging buffer, laid out
        as the shard file's body: the background thread writes and sends it as it is."""
        entries, values, job.fingerprint = describe(flat, self._layouts)
        signature, sources, pinned = [], [], False
        for e, v in zip(entries, values, strict=True):
            if e.kind != "object":
                spec = _tensor_spec(v)
                signature.append((e.key, spec))
                sources.append(v)
                pinned = pinned or (spec[0] == "tensor" and spec[3] not in ("cpu", "meta"))
        buffer = self._pool.acquire(tuple(signature), {}, pinned) if signature else None
        try:
            if buffer is not None:
                _copy_into([(buffer.targets[key], v) for (key, _), v in zip(signature, sources, strict=True)])
            job.objects = {e.key: _copy_value(v) for e, v in zip(entries, values, strict=True) if e.kind == "object"}
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
                            "world_size": self.world_size, "timeline": job.timeline, "directory": self.directory,
                            "node": self.node, "fingerprint": job.fingerprint,
                            "durable_base": _encode_base(job.durable_base)}
                spans, body = _body_of(job.buffer)
                shard = build_shard_file(manifest, job.entries, spans, body, job.objects)
                target = self._path(self.rank, job.step, job.timeline)
                written = write_shard_file(target, [memoryview(shard.header), shard.body], self.sync_files,
                                           spare=self._take_spare(os.path.dirname(target)))
                path = target
        except Exception as exc:
            self._note_error(job.step, exc)
            shard = None
        t1 = time.perf_counter()
        try:
            ok, sent, received, in_doubt = self._replicate(job.step, job.timeline, shard if path is not None else None)
        finally:
            if job.buffer is not None and not in_doubt:
                self._pool.release(job.buffer)
            elif job.buffer is not None:  # a send that failed may still read it: never reuse it
                self._abandoned.append(job.buffer)
            job.buffer, job.objects = None, {}
        confirmed = self._confirm(path is not None and ok)
        self._retain((job.step, job.timeline), confirmed, path is not None)
        self.timings.append(LocalSaveTiming(
            job.step, job.blocking_s, job.waited_s, job.state_dict_s, job.blocking_s - job.waited_s - job.state_dict_s,
            t1 - t0, time.perf_counter() - t1, time.thread_time() - cpu0, confirmed, written, sent, received))

    # ------------------------------------------------------------------ replication

    def _replicate(self, step: int, timeline: str, shard: ShardFile | None) -> tuple[bool, int, int, bool]:
        """Send this rank's file to its peers, receive its sources' files. Returns (all went
        well, bytes sent, bytes received, whether a failed send may still read the file)."""
        if self.replication_error is not None:  # stopped (or its group could never be made)
            return False, 0, 0, False
        if self._group is None or (not self.peers and not self.sources):
            return True, 0, 0, False
        deadline = time.monotonic() + self.replication_timeout
        keep_alive: list[Any] = []  # everything gloo may touch until the transfers are over
        sent = received = 0
        failed = False
        try:
            has = shard is not None
            hlen, blen = (len(shard.header), shard.body.nbytes) if has else (0, 0)
            head = torch.tensor([_MAGIC, step, hlen, blen, int(has)], dtype=torch.int64)
            keep_alive.append(head)
            works = []
            if has:
                header_t = torch.frombuffer(bytearray(shard.header), dtype=torch.uint8)
                body_t = torch.frombuffer(shard.body, dtype=torch.uint8) if blen else None
                keep_alive += [header_t, body_t]
            for peer in self.peers:
                dst = self._global(peer)
                works.append(dist.isend(head, dst=dst, group=self._group, tag=_TAG_HEAD))
                if has:
                    works.append(dist.isend(header_t, dst=dst, group=self._group, tag=_TAG_FILE))
                    if blen:
                        works.append(dist.isend(body_t, dst=dst, group=self._group, tag=_TAG_BODY))
                    sent += hlen + blen
            heads = []
            for src in self.sources:
                h = torch.zeros(5, dtype=torch.int64)
                keep_alive.append(h)
                heads.append((src, h, dist.irecv(h, src=self._global(src), group=self._group, tag=_TAG_HEAD)))
            incoming = []
            for src, h, work in heads:
                wait_all([work], deadline)
                magic, their_step, their_hlen, their_blen, their_has = h.tolist()
                if magic != _MAGIC or their_step != step:
                    raise RuntimeError(f"replication out of step: rank {src} sent step {their_step} while this rank "
                                       f"saves step {step}")
                if not their_has:
                    continue
                header_r = torch.empty(their_hlen, dtype=torch.uint8)
                body_r = self._receive_buffer(src, their_blen)
                keep_alive += [header_r, body_r]
                works.append(dist.irecv(header_r, src=self._global(src), group=self._group, tag=_TAG_FILE))
                if their_blen:
                    works.append(dist.irecv(body_r, src=self._global(src), group=self._group, tag=_TAG_BODY))
                incoming.append((src, header_r, body_r))
            wait_all(works, deadline)
            for src, header_r, body_r in incoming:
                header_b = header_r.numpy().tobytes()
                final = self._path(src, step, timeline)
                man = parse_manifest(header_b, len(header_b) + body_r.numel(), final)
                if (man.rank, man.step, man.timeline, man.world_size) != (src, step, timeline, self.world_size):
                    raise RuntimeError(f"rank {src} sent a file of rank {man.rank}, step {man.step}; expected its "
                                       f"step {step}")
                pieces = [memoryview(header_b), memoryview(body_r.numpy()).cast("B")] if body_r.numel() else [
                    memoryview(header_b)]
                received += write_shard_file(final, pieces, self.sync_files,
                                             spare=self._take_spare(os.path.dirname(final)))
            return True, sent, received, False
        except Exception as exc:
            failed = True
            self._stop_replication(f"step {step}: {type(exc).__name__}: {exc}")
            return False, sent, received, bool(sent)
        finally:
            if failed:  # transfers may still be pending on these buffers: keep them alive
                self._abandoned.append(keep_alive)
                self._rx.clear()

    def _receive_buffer(self, src: int, nbytes: int) -> torch.Tensor:
        """A receive buffer for ``src``'s files, reused from save to save (memory that is
        already mapped: receiving into fresh pages costs a page fault per 4 KiB)."""
        buf = self._rx.get(src)
        if buf is None or buf.numel() < nbytes:
            buf = self._rx[src] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return buf[:nbytes]

    def _confirm(self, ok: bool) -> bool:
        """Every rank learns whether every rank committed its file and its copies."""
        if self._group is None:
            return ok
        if self.replication_error is not None:
            return False
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group,
                            async_op=True).wait(timedelta(seconds=self.replication_timeout))
        except Exception as exc:
            self._abandoned.append(flag)
            self._stop_replication(f"confirming a step: {type(exc).__name__}: {exc}")
            return False
        return bool(flag.item())

    def _stop_replication(self, why: str) -> None:
        if self.replication_error is None:
            self.replication_error = why
            warnings.warn(f"CheckpointManager (rank {self.coord.global_rank}): local tier replication stopped for this "
                          f"run ({why}); local saves continue on this node only, unconfirmed. The next start "
                          "replicates again", stacklevel=2)

    def _global(self, group_rank: int) -> int:
        return self.coord._global(group_rank)

    # ------------------------------------------------------------------ retention

    def _retain(self, key: tuple[int, str], confirmed: bool, committed: bool) -> None:
        if confirmed:
            self._confirmed = sorted({*self._confirmed, key})[-self.keep:]
        elif committed:
            self._unconfirmed = sorted({*self._unconfirmed, key})[-self.keep:]
        newest = self._confirmed[-1] if self._confirmed else None
        self._unconfirmed = [k for k in self._unconfirmed if newest is None or k[0] > newest[0]]
        keep = set(self._confirmed) | set(self._unconfirmed)
        for owner in (self.rank, *self.sources):
            sub = os.path.join(self.root, rank_dir_name(owner))
            for step, timeline, path in sorted(scan_rank_dir(sub)):
                if (step, timeline) not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        if self._spares.get(sub) is None:  # retired: the next file written here reuses it
                            spare = os.path.join(sub, f"{TMP_PREFIX}spare-{uuid.uuid4().hex[:12]}")
                            os.replace(path, spare)  # no longer a committed name: never read again
                            self._spares[sub] = spare
                        else:
                            os.unlink(path)

    def _take_spare(self, sub: str) -> str | None:
        return self._spares.pop(sub, None)

    def _sweep_temporary(self) -> None:
        """Remove the ``.tmp-`` files of saves and copies cut short (at start, before any save)."""
        for sub in self._rank_dirs():
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(sub):
                    if name.startswith(TMP_PREFIX):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(sub, name))

    def _rank_dirs(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [os.path.join(self.root, n) for n in sorted(names) if rank_of_dir(n) is not None]

    def _path(self, owner: int, step: int, timeline: str) -> str:
        return os.path.join(self.root, rank_dir_name(owner), shard_file_name(step, timeline))

    # ------------------------------------------------------------------ waiting

    def _wait_previous(self, timeout: float | None) -> bool:
        job = self._job
        return job is None or job.done.wait(timeout)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for this rank's local save in flight (default bound: as a save waits);
        False if it is still running."""
        return self._wait_previous(self.replication_timeout * 2 + _SAVE_WAIT_SLACK_S if timeout is None else timeout)

    def _note_error(self, step: int, exc: BaseException) -> None:
        message = f"step {step}: {type(exc).__name__}: {exc}"
        self.save_errors.append(message)
        warnings.warn(f"CheckpointManager (rank {self.coord.global_rank}): local save failed ({message}); the step "
                      "is not complete on this rank and will not be chosen", stacklevel=2)

    # ------------------------------------------------------------------ recovery

    def recover(self, state_dict: dict[str, Any], *, durable: tuple[int, str | None] | None,
                step: int | None = None) -> int | None:
        """Load the newest complete local step (or ``step``) into ``state_dict``; collective.

        ``durable`` is the newest durable step and the timeline that committed it (None: no
        durable step). Returns the step loaded, or None when the manager must load from the
        durable tier (nothing complete locally, a newer durable step, a durable step a later
        run committed, or a changed layout). See the module docstring for the protocol.

        Raises:
            LostContactError / RankFailedError: a rank failed or vanished (on every rank).
            ValueError: ranks asked for different steps.
        """
        self._check_open()
        started = time.perf_counter()
        durable_latest, durable_timeline = durable if durable is not None else (None, None)
        here = (self.node, self.root)
        # 1. Every rank settles its save in flight (its retention may still delete files), and
        #    says which directory it reads, so that one rank per directory lists it.
        phases: dict[str, float] = {}
        mark = [started]

        def lap(name: str) -> None:
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - mark[0]
            mark[0] = now

        first = self.coord.exchange("local tier recovery (settling local saves)", lambda: (self.wait(), here))
        lap("settle")
        dirs = [d for _, d in first]
        lists = dirs.index(here) == self.rank
        target: dict[str, Any] = {}

        def needs() -> Any:
            flat = flatten(state_dict)
            entries, values, fp = describe(flat, self._layouts)
            target.update(flat=flat, entries=entries, values=values)
            return fp

        # 2. What every directory holds, then (only when some hold a step) what every rank
        #    needs: flattening calls the Statefuls' state_dict(), and torch's get_state_dict
        #    initializes an empty optimizer's state with a step, which a fresh start must not.
        held = self.coord.exchange("local tier recovery (what each node holds)",
                                   lambda: (step, self._holdings() if lists else [], new_timeline()))
        if len({r[0] for r in held}) > 1:
            raise ValueError(f"CheckpointManager.load: the ranks asked for different steps {[r[0] for r in held]} "
                             "(by rank); every rank must pass the same step")
        self.timeline = held[self.coord.coordinator_rank][2]
        self.durable_base = durable  # what the files of the new timeline record
        # whether a step could be chosen at all, whatever the layouts: if not, no state_dict()
        unshaped = [(None, [(o, st, tl, size, None, base) for o, st, tl, size, _, base in h]) for _, h, _ in held]
        hopeless = not all(s for s, _ in first) or decide(
            unshaped, dirs, durable_latest=durable_latest, durable_timeline=durable_timeline, want=step,
            excluded=set(), keep=self.keep)["kind"] != "local"
        if hopeless:
            lap("report")
            self.last_recovery = Recovery("durable", None, seconds=time.perf_counter() - started,
                                          attempts=0, phases=phases)
            return None
        fps = self.coord.exchange("local tier recovery (what each rank needs)", needs)
        reports = [(s, fp, h, t) for (s, h, t), fp in zip(held, fps, strict=True)]
        lap("report")
        excluded: set[tuple[Any, int, int, str]] = set()
        attempts = 0
        while True:
            attempts += 1
            if not all(s for s, _ in first):
                decision = {"kind": "durable", "why": "a local save is still running"}
            else:
                decision = decide([(fp, held) for _, fp, held, _ in reports], dirs, durable_latest=durable_latest,
                                  durable_timeline=durable_timeline, want=step, excluded=excluded, keep=self.keep)
            if decision["kind"] == "durable":
                self.last_recovery = Recovery("durable", None, seconds=time.perf_counter() - started,
                                              attempts=attempts, phases=phases)
                return None
            chosen = (decision["step"], decision["timeline"])
            sources = decision["sources"]
            # 3. Room for the copies that travel, before any transfer: a full local_dir is known to
            #    every rank at once (receiving into a mapped file that cannot grow failed inside gloo).
            full = [why for why in self.coord.exchange("local tier recovery (room for copies)",
                                                       lambda c=chosen, src=sources: self._make_room(c, src))
                    if why is not None]
            if full:
                self._drop_room()
                why = "; ".join(full)
                if durable_latest is None:
                    raise CheckpointError(f"CheckpointManager: local step {chosen[0]} cannot be recovered: {why}. "
                                          "Free space in local_dir (the local steps are kept) and start again")
                if self.rank == 0:
                    warnings.warn(f"CheckpointManager: local step {chosen[0]} cannot be recovered ({why}); loading "
                                  f"durable step {durable_latest} instead", stacklevel=2)
                self.last_recovery = Recovery("durable", None, seconds=time.perf_counter() - started,
                                              attempts=attempts, phases=phases)
                return None
            # 4. Missing copies travel, then every rank reads its own file (checksums checked).
            results = self.coord.exchange("local tier recovery (fetching and reading)",
                                          lambda c=chosen, src=sources: self._fetch_and_read(c, src, target))
            lap("fetch_read")
            bad = [(dirs[sources[r][0]], r, *chosen) for r, (_, why) in enumerate(results) if why is not None]
            if not bad:
                break
            excluded.update(bad)
            if self.rank == 0:
                warnings.warn(f"CheckpointManager: local step {chosen[0]}: damaged copies "
                              f"({'; '.join(why for _, why in results if why)}); trying other copies", stacklevel=2)
        # 5. Values and Stateful objects go back only once every rank has read everything.
        values = target["values_loaded"]
        self.coord.exchange("local tier recovery (applying)", lambda: _apply(target["flat"], values))
        lap("apply")
        self._prune({tuple(k) for k in decision["keep"]})
        lap("prune")
        self._confirmed = sorted(tuple(k) for k in decision["keep"])[-self.keep:]
        self._unconfirmed = []
        self._last_step = chosen[0]
        self.last_recovery = Recovery("local", chosen[0], {r: h for r, (h, _) in sources.items()},
                                      results[self.rank][0], target["bytes_read"], time.perf_counter() - started,
                                      attempts, phases)
        return chosen[0]

    def _fetch_and_read(self, chosen: tuple[int, str], sources: dict[int, tuple[int, int]],
                        target: dict[str, Any]) -> tuple[int, str | None]:
        """(bytes this rank received, None or why its copy is damaged)."""
        fetched = self._fetch(chosen, sources)
        return fetched, self._read(chosen, sources[self.rank][0], target)

    def loaded(self, step: int | None) -> None:
        """The manager loaded ``step`` from the durable tier (or nothing): later local saves
        continue from it, and the files of earlier runs are removed."""
        self._last_step = step
        self._confirmed, self._unconfirmed = [], []
        self._prune(set())
        if self.last_recovery is not None and self.last_recovery.source == "durable":
            self.last_recovery.step = step

    def _holdings(self) -> list[tuple[int, int, str, int, str, tuple[int | None, str | None] | None]]:
        """What this rank's ``local_dir`` holds for this manager and world size: ``(owner,
        step, timeline, size, fingerprint, durable base)`` per file."""
        out = []
        for sub in self._rank_dirs():
            owner = rank_of_dir(os.path.basename(sub))
            for step, timeline, path in scan_rank_dir(sub):
                try:
                    man = read_manifest(path)
                except (OSError, CorruptCheckpointError):
                    continue  # not ours, damaged, or removed meanwhile: not a copy
                if (man.directory, man.world_size, man.rank, man.step, man.timeline) != (
                        self.directory, self.world_size, owner, step, timeline):
                    continue
                out.append((owner, step, timeline, man.size, man.fingerprint, man.durable_base))
        return out

    def _make_room(self, chosen: tuple[int, str], sources: dict[int, tuple[int, int]]) -> str | None:
        """Allocate the file this rank receives its copy into (if it lacks its own); None, or
        why it cannot (a full or unwritable ``local_dir``)."""
        holder, size = sources[self.rank]
        if holder == self.rank:
            return None
        final = self._path(self.rank, chosen[0], chosen[1])
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            self._room = (MappedFile(tmp_path_for(final), size), final)
        except OSError as exc:
            return (f"rank {self.rank} cannot store its copy ({size} bytes) in {os.path.dirname(final)}: "
                    f"{type(exc).__name__}: {exc}")
        return None

    def _drop_room(self) -> None:
        if self._room is not None:
            mf, _ = self._room
            self._room = None
            mf.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(mf.path)

    def _fetch(self, chosen: tuple[int, str], sources: dict) -> int:
        """Send the copies this rank was picked to serve; receive this rank's own if it lacks it
        (into the file :meth:`_make_room` allocated)."""
        step, timeline = chosen
        group = self.coord.group
        deadline = time.monotonic() + self.coord.timeout.total_seconds()
        outgoing: list[MappedFile] = []
        works = []
        receiving, self._room = self._room, None
        done = False
        try:
            for owner, (holder, _) in sorted(sources.items()):
                owner = int(owner)
                if holder == self.rank and owner != self.rank:
                    mf = MappedFile(self._path(owner, step, timeline))
                    outgoing.append(mf)
                    works.append(send_file(mf, self._global(owner), group, _TAG_FETCH))
            holder, size = sources[self.rank]
            if receiving is not None:
                works.append(recv_file(receiving[0], self._global(holder), group, _TAG_FETCH))
            wait_all(works, deadline)
            done = True
            if receiving is None:
                return 0
            mf, final = receiving
            mf.close()
            os.replace(mf.path, final)
            return size
        finally:
            maps = outgoing + ([receiving[0]] if receiving is not None else [])
            if not done:  # transfers may still be pending on these buffers: keep them mapped
                self._abandoned.extend(maps)
            for mf in maps:
                if done:
                    mf.close()
            if receiving is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(receiving[0].path)

    def _read(self, chosen: tuple[int, str], holder: int, target: dict[str, Any]) -> str | None:
        """Read this rank's file into the target; a damaged copy is reported, not raised."""
        try:
            man: Manifest = read_manifest(self._path(self.rank, *chosen))
            values, stats = read_into(man, target["entries"], target["values"])
        except (CorruptCheckpointError, FileNotFoundError) as exc:
            return f"rank {self.rank} (copy from rank {holder}'s directory): {exc}"
        target["values_loaded"] = values
        target["bytes_read"] = stats.bytes_read
        return None

    def _prune(self, keep: set[tuple[int, str]]) -> None:
        """Delete every committed file of an earlier timeline that ``keep`` does not name."""
        for sub in self._rank_dirs():
            for step, timeline, path in scan_rank_dir(sub):
                if timeline != self.timeline and (step, timeline) not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the local tier is closed")

    def close(self, timeout: float | None = None) -> None:
        """Wait (bounded) for the local save in flight, stop the thread, free the group. Local."""
        if self._closed:
            return
        self._closed = True
        finished = self.wait(timeout)
        if self._thread is not None and finished:
            self._queue.put(None)
            self._thread.join(5)
        self._pool.clear()
        if self._group is not None and finished:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)
        self._group = None

    @property
    def staging_stats(self) -> StagingStats:
        return self._stats


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


def decide(reports: list[tuple[str, list[tuple]]], dirs: list[Any], *, durable_latest: int | None,
           want: int | None, excluded: set[tuple[Any, int, int, str]], keep: int,
           durable_timeline: str | None = None) -> dict[str, Any]:
    """Recovery's choice (pure, the same on every rank): the newest local step complete over
    every directory's holdings, and who gives each rank its copy; or ``{"kind": "durable"}``.

    ``reports[r]`` is rank r's target fingerprint and what it listed (one rank per directory
    lists it): ``(owner, step, timeline, size, fingerprint[, durable base])`` per file.
    ``dirs[r]`` names the directory rank r reads; every rank with that directory can serve its
    files. A file counts for ``owner`` only when its fingerprint equals ``owner``'s target
    fingerprint and ``(dir, owner, step, timeline)`` is not excluded. A rank reads its own
    directory's copy when there is one; otherwise the least loaded rank of a directory holding
    it sends it.

    A step of a timeline that a later run abandoned is never chosen: when the newest durable
    step (``durable_latest``, committed by ``durable_timeline``) was committed by another
    timeline and is not the durable base the step's files record (the newest durable step
    when their timeline began), a run after theirs committed it (e.g. at another world size,
    which could not see or prune these files). Without a recorded ``durable_timeline`` (a
    step saved before timelines were recorded) only step numbers count, as before; files
    without a durable base (written before it was recorded) count unless a run that records
    timelines committed the newest durable step.
    """
    world = len(reports)
    targets = [fp for fp, _ in reports]
    members: dict[Any, list[int]] = {}
    for r, d in enumerate(dirs):
        members.setdefault(d, []).append(r)
    have: dict[tuple[int, str], dict[int, dict[Any, int]]] = {}
    bases: dict[tuple[int, str], set[Any]] = {}
    for lister, (_, holdings) in enumerate(reports):
        d = dirs[lister]
        for owner, step, timeline, size, fp, *base in holdings:
            if not 0 <= owner < world or fp != targets[owner] or (d, owner, step, timeline) in excluded:
                continue
            have.setdefault((step, timeline), {}).setdefault(owner, {})[d] = size
            bases.setdefault((step, timeline), set()).add(tuple(base[0]) if base and base[0] is not None else None)

    def abandoned(key: tuple[int, str]) -> bool:
        if durable_latest is None or durable_timeline is None or key[1] == durable_timeline:
            return False
        return bases[key] != {(durable_latest, durable_timeline)}

    complete = sorted(k for k, owners in have.items() if len(owners) == world and not abandoned(k))
    eligible = [k for k in complete if want is None or k[0] == want]
    if not eligible:
        return {"kind": "durable", "why": "no complete local step" + ("" if want is None else f" {want}")}
    best = eligible[-1]
    if want is None and durable_latest is not None and best[0] < durable_latest:
        return {"kind": "durable", "why": f"durable step {durable_latest} is newer than local step {best[0]}"}
    load: dict[int, int] = {}
    sources: dict[int, tuple[int, int]] = {}
    for owner in range(world):
        where = have[best][owner]
        if dirs[owner] in where:
            sources[owner] = (owner, where[dirs[owner]])
            continue
        holder, size = min(((r, size) for d, size in where.items() for r in members[d]),
                           key=lambda rs: (load.get(rs[0], 0), rs[0]))
        load[holder] = load.get(holder, 0) + size
        sources[owner] = (holder, size)
    return {"kind": "local", "step": best[0], "timeline": best[1], "sources": sources,
            "keep": [list(k) for k in complete if k <= best][-keep:]}


def _encode_base(base: tuple[int, str | None] | None) -> dict[str, Any]:
    """A timeline's durable base as the manifest records it (see :mod:`.local_format`)."""
    step, timeline = base if base is not None else (None, None)
    return {"step": step, "timeline": timeline}


def _apply(flat: Flat, values: dict[str, Any]) -> None:
    """Put the loaded non-tensor values where they came from, then give Stateful objects
    their filled state (tensors were filled in place)."""
    for key, value in values.items():
        leaf = flat.leaves.get(key)
        if leaf is None or value is leaf.value:
            continue
        if isinstance(leaf.value, dict) and isinstance(value, dict):  # kept, as load keeps it
            update_in_place(leaf.value, value)
        elif leaf.set is not None:
            leaf.set(value)
    for obj, inner in flat.statefuls:
        obj.load_state_dict(inner)
