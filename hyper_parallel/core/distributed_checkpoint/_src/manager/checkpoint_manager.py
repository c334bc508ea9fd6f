"""CheckpointManager: step directories, retention and resume for a training loop.

The face of :mod:`.manager` and its cross-rank protocol; the parts are the directory on
storage (:mod:`.step_directory`), what it holds (:mod:`.step_listing`), retention
(:mod:`.retention`), background deletion (:mod:`.step_deletion`), the owner claim
(:mod:`.ownership`) and the local tier (:mod:`.local_tier`).

A training job keeps its checkpoints in one directory (a local or shared path, or an fsspec
URL such as ``s3://bucket/run``), one *step directory* per saved step::

    directory/
      .manager-owner.json      which job writes here now (host, pid); see "One writer" below
      step_00000100/           an ordinary checkpoint: .metadata + data files
      step_00000200/
      ...

Step directories are named ``step_`` + the step number zero-padded to 8 digits (longer
numbers keep all their digits); other names in the directory are ignored and never touched.

**Committed steps.** A step counts only once its ``.metadata`` is in place and parses (the
commit protocol of :mod:`.commit` puts it there last, atomically). Discovery lists the
directory once (one recursive listing on object stores) and reads each step's
``.metadata``; no "latest" pointer exists, so none can run ahead of a commit. Every rank
sees the same steps: the coordinator (rank 0 of the group) lists and decides, and its result
reaches every rank through a status-checked exchange, so an error on the coordinator (a
listing that fails) fails every rank instead of hanging them.

**Retention** (after each commit, never before; :mod:`.retention`): keep the newest ``keep_latest`` committed
steps, every step divisible by ``keep_every_steps``, and the ``keep_best`` best steps by the
metric ``best_metric`` (metrics are stored in each step's ``.metadata``, so "best" survives
restarts); the union is kept, and always the newest committed step and the step being saved.
With no rule set, every step is kept. Only the coordinator deletes, in a background thread:
first the step's ``.metadata`` (the step stops counting), then its data files, then the
directory. A crash in between leaves a step directory without ``.metadata``: uncommitted,
never loaded, swept at the next start.

**Sweep at start.** The coordinator removes (in the background) every step directory that
has no ``.metadata`` (a crashed save, a failed save, a deletion cut short) and, inside
committed steps, the data files their ``.metadata`` does not name (debris of an interrupted
save). A step whose ``.metadata`` exists but cannot be read (corrupt, nested too deeply, or
written by a newer version) is neither counted nor deleted nor overwritten: a warning names
it at start, and ``save`` of that step refuses (:class:`CheckpointError` naming the file and
why) until it is moved away. What such a step names is unknown (and so is what a step
directory that is a symbolic link names: the manager never walks one), so while one is there
the sweep, retention and failed-save cleanup delete nothing of the step directories present at
start (they stay whole; steps this run saves are retired as usual).

**Failed saves.** The coordinator removes what a save that did not commit left in its step
directory: the data files and temporary metadata this library writes that no ``.metadata``
there names, then the directory if nothing else is in it; any other file stays. A step path
that is a symbolic link is never written, deleted or walked: ``save`` refuses it (a failed
save's cleanup would otherwise empty whatever the link points at).

**One writer** (:mod:`.ownership`). The manager assumes it is the only writer of its directory while it is
open: that is what makes the sweep safe (nothing else can be in flight). The coordinator
claims the directory in ``.manager-owner.json`` before it lists or sweeps anything; a
manager refuses to start while that file names a live process on this host (another job, or
another open manager in this process), takes over otherwise (the previous job is gone), and
raises at its next save if another manager has taken over meanwhile. The claim is atomic:
on local and shared filesystems every claim holds an exclusive ``flock`` of the owner file
while it reads, decides and writes; on S3 it is a conditional put (created only if absent,
a stale record replaced only if unchanged since read). Of managers started at the same
moment exactly one wins; the others raise :class:`CheckpointError` before they touch
anything, so no sweep of theirs meets a step the winner writes. Limits: a writer on another
host cannot be checked for liveness (do not point two running jobs at one directory); a
filesystem without locks (a warning says so) and fsspec stores other than S3 make the
claim a plain read-then-write.

**Async saves** (``async_save=True``): at most one save is in flight. ``save`` of the next
step first waits for the previous one and settles it (every rank learns whether it
committed; retention runs; a failure is raised as :class:`AsyncSaveError` on every rank).
The same happens in ``wait()``, ``load()`` and ``close()``; in ``load(state, step=k)`` that
retention pass never deletes step ``k`` (a step ``all_steps()`` listed while the save was in
flight still loads; a later save's retention may delete it). Calls that the interval policy
skips touch nothing and never block, so errors surface at the next call that saves.

**Incremental checkpoints** (``incremental=True``): each rank remembers the content hash of
every chunk it stored in the newest committed step; the next save writes only the chunks
whose bytes changed and names the earlier step's file for the rest (see
:mod:`.incremental`). By default every chunk is hashed in full at every save, so each
committed step holds exactly the bytes of the call whatever wrote the memory;
``incremental_check="version_counter"`` opts in to trusting torch's version counter (a tensor
it says is untouched is only spot-checked, and hashed in full once every
``incremental_rehash_every`` saves), which misses writes through ``.data``, numpy, DLPack and
raw pointers for up to that many saves.
Retention still deletes whole steps, except the files of a deleted step that a kept step
names: those stay in its directory (without ``.metadata``, so it is not a step any more)
until nothing names them.

**Local tier** (``local_dir=...``): every ``local_interval_steps`` each rank also saves its
own shards to node-local storage and replicates them to peers on other nodes, and ``load``
resumes from the newest local step complete across the surviving nodes before it considers
``directory`` (see :mod:`.local_tier`). The manager calls it at three places: ``save``
(``_local.save``), ``load`` (``_local.recover`` / ``_local.loaded``) and ``wait``/close.
Each durable step records in its user metadata the *timeline* (run) that saved it (the
local tier's, or one per manager without a local tier), so that recovery can tell a local
step of an abandoned run from one the newest durable step does not supersede.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

from ..asynchronous.checkpointer import AsyncCheckpointer, SaveRequest
from ..asynchronous.response import AsyncSaveError, AsyncSaveFuture
from ..backends.protocol import StorageReader, StorageWriter
from ..base.errors import CheckpointError, CommitError, CorruptCheckpointError, NotACheckpointError
from ..base.options import (
    Coordination,
    IncrementalOptions,
    LocalTierOptions,
    RetentionOptions,
    WriteOptions,
    as_keywords,
    pick,
)
from ..coordination.coordinator import DEFAULT_TIMEOUT, Coordinator, as_timeout
from ..engine.checkpoint import load as _load
from ..engine.checkpoint import save as _save
from ..engine.commit import unreferenced_files
from ..engine.incremental import CHECKS, CONTENT, VERSION_COUNTER, IncrementalState
from ..format import metadata as md
from ..format.validation import step_dir_name
from ..format.values import is_json_value
from ..transfer.unchanged import UnchangedStats
from .local_format import new_timeline
from .local_tier import LocalTier
from .ownership import Ownership
from .retention import Retention
from .step_deletion import Deleter
from .step_directory import Directory, Listed, PathLike, open_directory
from .step_listing import USER_KEY, encode_metrics, metrics_of, scan, timeline_of

__all__ = ["CheckpointManager", "SaveTiming"]


# ----------------------------------------------------------------------------- the manager


class _Option:
    """A manager attribute that reads field ``field`` (default: the attribute's name) of the
    option record the manager keeps as ``record``."""

    def __init__(self, record: str, field: str | None = None):
        self.record, self.field = record, field

    def __set_name__(self, owner: type, name: str) -> None:
        self.field = self.field or name

    def __get__(self, manager: Any, owner: type | None = None) -> Any:
        return self if manager is None else getattr(getattr(manager, self.record), self.field)


@dataclass(frozen=True)
class SaveTiming:
    """What one save cost this process: ``blocking_s`` the ``save`` call (for async, until the
    snapshot was taken), ``total_s`` until committed (None while in flight or if it failed)."""

    step: int
    blocking_s: float
    total_s: float | None


@dataclass
class _Pending:
    """A save whose outcome every rank has not yet learned (async: in flight)."""

    step: int
    response: AsyncSaveFuture | None = None
    meta: md.Metadata | None = None  # sync saves, on the coordinator
    blocking_s: float = 0.0


class CheckpointManager:
    """Saves a training job's checkpoints into step directories, keeps some, resumes from the newest.

    Every rank of the group constructs it and calls ``save``/``load``/``wait``/``close`` alike
    (same arguments, same order); ``latest_step``/``all_steps``/``best_step``/``metrics`` are
    local and may be called anywhere.

    Args:
        directory: where the step directories go: a local/shared path or an fsspec URL.
        save_interval_steps: ``save(step, ...)`` saves only when ``step`` is a multiple of it
            (or ``force=True``).
        keep_latest: keep the newest N committed steps.
        keep_every_steps: keep every step divisible by it (milestones).
        keep_best: keep the N best steps by ``best_metric`` (needs ``best_metric``).
        best_metric: the key in ``save(..., metrics=)`` that ranks steps; ``best_mode``
            ``"min"`` (a loss) or ``"max"`` (an accuracy).
        async_save: return from ``save`` once a snapshot is taken; a background thread writes
            and commits (one save in flight; see the module docstring). An
            :class:`~.async_staging.AsyncCheckpointer` (``max_in_flight=1``) instead of True
            is used for these saves with its settings, e.g. ``AsyncCheckpointer(stage_bands=False)``
            or ``background_nice=0``; the manager closes it when it closes.
        incremental: write only the chunks that changed since the previous committed step of
            this manager and reference the earlier files for the rest (the first save, and
            the first after a restart or a failed save, writes everything).
        incremental_check: what decides that a chunk is unchanged. ``"content"`` (default):
            its full 128-bit content hash, taken at every save, so every committed step holds
            exactly the bytes the state had at the call, whatever wrote the memory.
            ``"version_counter"`` (opt-in, cheaper when most of the state is frozen): a tensor
            whose memory and torch version counter did not move is only spot-checked (~32 KiB
            read) and reused unread. The counter does not see writes through ``.data``
            (``p.data[i] += x``), numpy views (``t.numpy()``), DLPack, ``untyped_storage()``,
            ctypes/raw-pointer kernels, torch's fused optimizers or in-place collectives; such
            a write that the spot check misses (a few elements or rows) is committed stale by
            up to ``incremental_rehash_every - 1`` saves in a row, which load and verify
            without error. See :mod:`.incremental`.
        incremental_rehash_every: with ``incremental_check="version_counter"``, every chunk
            reused unread is still hashed in full at least once every this many saves (default
            8; about 1/8 of the unchanged bytes per save). 1: hash every chunk at every save.
        process_group: the ranks that save together (default: the whole world).
        timeout: bound on every cross-rank exchange and object-store call of a save or load:
            seconds > 0 or a positive timedelta (default None: 30 min).
        storage_options: options of the fsspec filesystem for a URL ``directory`` (e.g.
            ``{"client_kwargs": {"endpoint_url": ...}}``).
        local_dir: turns on the local tier: this node's directory for it (``/dev/shm/job``
            or local NVMe; ranks of one node may share it). None: no local tier.
        local_interval_steps: local saves when ``step`` is a multiple of it (default 1,
            every step); independent of ``save_interval_steps``.
        local_keep: confirmed local steps kept on each node (per rank and copy).
        replicas: copies of each rank's shards in the local tier, its own included; the
            others go to ranks on other nodes.
        node_rank: this rank's node (default: torchrun's ``GROUP_RANK``, else ``RANK //
            LOCAL_WORLD_SIZE``, else the host name); tests simulate nodes with it.
        replication_timeout: seconds any wait of the local tier for a peer may take; a peer
            slower than that ends replication for the run (local saves go on).

    The local tier's settings (``local_interval_steps``, ``local_keep``, ``replicas``,
    ``node_rank``, ``replication_timeout``) need ``local_dir``: without it, any of them not
    at its default is refused (ValueError), not ignored.

    The retention rules keep the union of what each rule keeps, plus always the newest
    committed step; with none set, every step is kept. Retention runs after each commit.

    Raises:
        ValueError / TypeError: a bad argument (named in the message), on every rank alike
            and before any collective.
        CheckpointError: another open manager (a live process on this host) owns ``directory``,
            or claimed it at the same moment.
        RankFailedError: listing the directory failed on the coordinator (on every rank).

    Example::

        with CheckpointManager("/ckpt/run1", save_interval_steps=100, keep_latest=3,
                               keep_best=1, best_metric="loss", async_save=True) as mgr:
            start = mgr.load(state) or 0          # resume from the newest committed step
            for step in range(start + 1, steps + 1):
                loss = train_step()
                mgr.save(step, state, metrics={"loss": loss})
    """

    def __init__(
        self,
        directory: PathLike,
        *,
        save_interval_steps: int = 1,
        keep_latest: int | None = None,
        keep_every_steps: int | None = None,
        keep_best: int | None = None,
        best_metric: str | None = None,
        best_mode: str = "min",
        async_save: bool | AsyncCheckpointer = False,
        incremental: bool = False,
        incremental_check: str = CONTENT,
        incremental_rehash_every: int | None = None,
        process_group: Any = None,
        timeout: timedelta | float | None = None,
        storage_options: dict[str, Any] | None = None,
        local_dir: PathLike | None = None,
        local_interval_steps: int | None = None,
        local_keep: int = 2,
        replicas: int = 2,
        node_rank: int | None = None,
        replication_timeout: float = 60.0,
    ):
        # the keywords as records, each checked (ValueError/TypeError before any collective, in this order)
        self._rules = _checked_retention(pick(RetentionOptions, locals()))
        self._coordination = Coordination(process_group=process_group, timeout=as_timeout(timeout))
        self._local_options = _checked_local_tier(LocalTierOptions(
            local_dir=local_dir, interval_steps=local_interval_steps, keep=local_keep, replicas=replicas,
            node_rank=node_rank, replication_timeout=replication_timeout))
        self.directory = os.fspath(directory)
        # coordinator: also who names which files of which step
        self._retention = Retention(self._rules)
        if isinstance(async_save, AsyncCheckpointer) and async_save.max_in_flight != 1:
            raise ValueError(f"async_save: the manager keeps one save in flight; pass an AsyncCheckpointer with "
                             f"max_in_flight=1 (this one has {async_save.max_in_flight})")
        if not isinstance(async_save, (bool, AsyncCheckpointer)):
            raise TypeError(f"async_save must be True, False or an AsyncCheckpointer, got {async_save!r}")
        self.async_save = bool(async_save)
        self._incremental_options = inc = _checked_incremental(IncrementalOptions(
            enabled=incremental, check=incremental_check, rehash_every=incremental_rehash_every))
        self._inc = IncrementalState(rehash_every=inc.rehash_every, check=inc.check) if inc.enabled else None
        self._root = self._root_for(directory, storage_options)
        if hasattr(self._root, "bound_calls"):  # an object store: its calls end within the timeout too
            self._root.bound_calls((self.timeout or DEFAULT_TIMEOUT).total_seconds())
        self._steps: dict[int, dict[str, Any] | None] = {}  # committed step -> metrics, same on every rank
        # committed step -> the timeline (run) that wrote it; None: written before timelines were recorded
        self._timelines: dict[int, str | None] = {}
        self._run_timeline = ""  # this run's timeline without a local tier (the coordinator's; see _start)
        self._pending: _Pending | None = None
        self._timings: deque[SaveTiming] = deque(maxlen=100)
        self._closed = False
        self._async: AsyncCheckpointer | None = (
            async_save if isinstance(async_save, AsyncCheckpointer) else AsyncCheckpointer(max_in_flight=1)
            if async_save else None)
        self._owner = Ownership(self._root, self.directory)
        self._coord = _coordinator_of(self._coordination)
        self._deleter = Deleter(self._root) if self._coord.is_coordinator else None
        self._local: LocalTier | None = None
        try:
            self._start()
            if self._local_options.local_dir is not None:
                self._local = LocalTier(self._local_options, self._coordination, directory=self._root.url,
                                        durable=self._durable_latest())
        except BaseException:
            self._release()  # a failed start must not keep the directory claimed
            raise

    # The keywords of the constructor, read back from the records (read-only).
    save_interval_steps = _Option("_rules")
    keep_latest = _Option("_rules")
    keep_every_steps = _Option("_rules")
    keep_best = _Option("_rules")
    best_metric = _Option("_rules")
    best_mode = _Option("_rules")
    incremental = _Option("_incremental_options", "enabled")
    incremental_check = _Option("_incremental_options", "check")
    process_group = _Option("_coordination")
    timeout = _Option("_coordination")

    # ------------------------------------------------------------------ queries (local)

    def latest_step(self) -> int | None:
        """The newest committed step, or None. Local: as of this rank's last manager call."""
        return max(self._steps) if self._steps else None

    def all_steps(self) -> list[int]:
        """Every committed step the manager keeps, oldest first (not the one in flight)."""
        return sorted(self._steps)

    def _durable_latest(self) -> tuple[int, str | None] | None:
        """The newest committed step and the timeline that wrote it (None: no step)."""
        latest = self.latest_step()
        return None if latest is None else (latest, self._timelines.get(latest))

    def _timeline(self) -> str:
        """The timeline recorded in the durable steps this run saves: the local tier's (a new
        one at every load), else one per manager. Local recovery uses it to tell whether the
        newest durable step was written by the run that wrote a local step."""
        return self._local.timeline if self._local is not None else self._run_timeline

    def best_step(self) -> int | None:
        """The best committed step by ``best_metric`` (None without a metric or a scored step)."""
        return self._retention.best(self._steps)

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with committed ``step`` (the coordinator's), or None."""
        m = self._steps.get(step)
        return dict(m) if m is not None else None

    def step_path(self, step: int) -> str:
        """Where ``step`` is (or would be) saved."""
        return self._root.step_path(step_dir_name(step))

    @property
    def save_timings(self) -> list[SaveTiming]:
        """This process's last 100 saves: time the call blocked, time until committed."""
        return list(self._timings)

    @property
    def incremental_stats(self) -> UnchangedStats | None:
        """This rank's checks in the last committed incremental save: bytes reused unread,
        hashed, spot-checked and written, and the keys found changing behind torch's version
        counter (see :mod:`.incremental`); None before one, or without ``incremental``."""
        return self._inc.last if self._inc is not None else None

    @property
    def local_tier(self) -> LocalTier | None:
        """The local tier (its ``timings``, ``last_recovery``, ``replication_error``), or None."""
        return self._local

    # ------------------------------------------------------------------ save / load

    def save(self, step: int, state_dict: dict[str, Any], *, metrics: dict[str, Any] | None = None,
             force: bool = False) -> bool:
        """Save ``state_dict`` as ``step`` if the policy says so; return whether it saved.

        Skipped (False, nothing touched, no collective): ``step`` is not a multiple of
        ``save_interval_steps`` and ``force`` is False. With a local tier, a local save of
        ``step`` starts first when ``step`` is a multiple of ``local_interval_steps`` (the
        return value still says whether the durable save ran). Otherwise every rank first settles the
        previous async save (waits for it; raises its failure), then agrees on ``step``; a
        ``step`` equal to the newest committed one is skipped (False). With ``async_save`` the
        call returns once the snapshot is taken.

        Args:
            step: the training step (an int >= 0, larger than every committed step).
            state_dict: what :func:`save` accepts (e.g. ``{"app": TrainState(...)}``).
            metrics: ``{name: value}`` stored with the step (the coordinator's values); values
                are JSON-representable, or 0-d tensors / numpy scalars (stored as numbers).
                ``best_metric`` ranks steps by one of them.
            force: save even off the interval (e.g. the last step of training).

        Raises:
            ValueError: ``step`` is older than the newest committed step, or ranks disagree.
            CheckpointError: the step's path is a symbolic link, or holds a ``.metadata`` this
                manager cannot read (see the module docstring); nothing is written or removed.
            AsyncSaveError: the previous async save failed (nothing new is started).
            RankFailedError / CommitError / LostContactError: a synchronous save failed (as
                :func:`save`).
        """
        self._check_open()
        _check_step(step)
        if metrics is not None:
            metrics = _plain_metrics(metrics)
        if self._local is not None:
            self._local.save(step, state_dict)
        if not force and step % self.save_interval_steps:
            return False
        self._settle()
        self._agree("save", step)
        latest = self.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                return False
            raise ValueError(
                f"step {step} is older than the newest committed step {latest} in {self.directory!r}: steps "
                "only go forward (a resume would pick the newer one). Resume from it, or move the newer "
                "step directories away to restart an older timeline")
        name = step_dir_name(step)
        user = {USER_KEY: {"step": step, "metrics": None if metrics is None else encode_metrics(metrics),
                           "timeline": self._timeline()}}
        writer = self._storage_writer(name)
        started = time.perf_counter()
        if self._inc is not None:
            self._inc.begin(name)
        if self._async is not None:
            response = self._async._start(state_dict, SaveRequest(
                storage_writer=writer, coordination=self._coordination, write=WriteOptions(user_metadata=user),
                incremental=self._inc))
            self._pending = _Pending(step, response=response, blocking_s=response.blocking_s)
            return True
        try:
            meta = _save(state_dict, storage_writer=writer, **as_keywords(self._coordination), user_metadata=user,
                         incremental=self._inc)
        except Exception as exc:
            # Not committed unless a CommitError says it may be: the coordinator (alone deleting)
            # clears the step's debris; a CommitError step is left for the next start to judge.
            if self._deleter is not None and not isinstance(exc, CommitError):
                self._deleter.submit("failed", name, keep=self._retention.kept_files(name))
            self._timings.append(SaveTiming(step, time.perf_counter() - started, None))
            raise
        elapsed = time.perf_counter() - started
        self._pending = _Pending(step, meta=meta, blocking_s=elapsed)
        self._settle()
        return True

    def load(self, state_dict: dict[str, Any], step: int | None = None) -> int | None:
        """Load committed ``step`` (default: the newest) into ``state_dict`` in place.

        Settles an async save in flight first; the retention that follows never deletes
        ``step`` (a step ``all_steps()`` listed while the save was in flight still loads; a
        later save's retention may delete it). Returns the step loaded, or None (and leaves
        ``state_dict`` untouched) when ``step`` is None and nothing is committed yet.

        With a local tier, the newest step complete in the local tiers of the surviving
        nodes (or ``step``, if it is one) loads from there, reading nothing from
        ``directory``, unless ``directory`` holds a newer committed step or its newest step
        was committed by a later run than the one that saved the local step (e.g. a run at
        another world size, which could not see this node's files); otherwise (nothing
        complete, a changed layout) the durable step loads as without a local tier.

        Raises:
            NotACheckpointError: ``step`` is not a committed step of this directory.
            ValueError: ``step`` is not None or an int >= 0, or ranks asked for different steps.
            Errors of :func:`load` (mismatched keys, corrupt data) on every rank.
        """
        self._check_open()
        if step is not None:
            _check_step(step)
        self._settle(protect=() if step is None else (step,))
        if self._local is not None:
            recovered = self._local.recover(state_dict, durable=self._durable_latest(), step=step)
            if recovered is not None:
                return recovered
        chosen = self.latest_step() if step is None else step
        self._agree("load", chosen)
        if chosen is None:
            recovery = self._local.last_recovery if self._local is not None else None
            if recovery is not None and recovery.touched:
                raise CorruptCheckpointError(
                    f"{self.directory!r}: every copy of the newest local step was damaged and there is no durable "
                    "step to fall back to; the state dict may hold part of a damaged copy. Start from freshly "
                    "initialized objects")
            if self._local is not None:
                self._local.loaded(None)
            return None
        if chosen not in self._steps:
            raise NotACheckpointError(
                f"step {chosen} is not a committed checkpoint in {self.directory!r}; committed steps: "
                f"{self.all_steps() or 'none'}")
        _load(state_dict, storage_reader=self._storage_reader(step_dir_name(chosen)), **as_keywords(self._coordination))
        if self._local is not None:
            self._local.loaded(chosen)
        return chosen

    def wait(self) -> None:
        """Wait until the save in flight is committed (and retention has run); raise its error.

        On the coordinator, also waits for background deletions to finish.

        Raises:
            AsyncSaveError: the save in flight failed (on every rank).
        """
        self._check_open()
        self._settle()
        if self._local is not None:
            self._local.wait()
        if self._deleter is not None:
            self._deleter.wait_for()

    def close(self) -> None:
        """Settle the save in flight, finish deletions, release the owner file and threads.

        Idempotent. Raises the in-flight save's error, after releasing everything.
        """
        if self._closed:
            return
        try:
            self._settle()
        finally:
            self._release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        # An error is on its way out, and the ranks may no longer be in step: no collectives.
        # A save in flight still commits (or fails) on its own; wait for it here, bounded.
        with contextlib.suppress(Exception):
            if self._pending is not None and self._pending.response is not None:
                self._pending.response.exception()
        self._pending = None
        self._release()

    # ------------------------------------------------------------------ storage hooks

    def _root_for(self, directory: PathLike, storage_options: dict[str, Any] | None) -> Directory:
        return open_directory(directory, storage_options)

    def _storage_writer(self, name: str) -> StorageWriter:
        return self._root.writer(name)

    def _storage_reader(self, name: str) -> StorageReader:
        # References to earlier steps' files are sibling directories: readers resolve them.
        return self._root.reader(name)

    # ------------------------------------------------------------------ internals

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the CheckpointManager of {self.directory!r} is closed")

    def _coordinator(self) -> Coordinator:
        """The manager's coordinator, made again (a collective) if an exchange on its group
        failed: gloo cannot use a group after a timeout or a lost peer, and a job that catches
        a failed save and trains on must still checkpoint later. Called where every rank is."""
        if self._coord.broken:
            self._coord = _coordinator_of(self._coordination)
        return self._coord

    def _on_coordinator(self, phase: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the coordinator; every rank gets its result, or every rank raises."""
        coord = self._coordinator()
        return coord.exchange(phase, lambda: fn() if coord.is_coordinator else None)[coord.coordinator_rank]

    def _start(self) -> None:
        found: dict[str, Any] = {}

        def discover() -> dict[int, dict[str, Any] | None]:
            self._root.make_root()
            self._owner.claim()
            infos, listing, parsed = scan(self._root)
            for step, meta in parsed.items():
                self._retention.learn(step, meta)
            # a step whose .metadata cannot be read, or that is a symbolic link (never walked), may
            # name files of any step directory here: keep them all, whole, while it is here
            unknown = [f"step {i.step} ({i.error})" for i in infos if i.state == "unreadable"]
            unknown += [f"{self._root.step_path(n)} (a symbolic link, never walked)" for n in self._root.linked_steps()]
            if unknown:
                self._retention.doubt(listing)
                one = len(unknown) == 1
                warnings.warn(
                    f"CheckpointManager: {', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}: unreadable, "
                    f"so ignored and left in place; while {'it is' if one else 'they are'} here the manager deletes "
                    f"nothing {'it' if one else 'they'} might reference: the start-up sweep and retention keep all "
                    f"{len(listing)} step directories present now, whole (`hyper-dcp verify` "
                    f"{'it' if one else 'them'}, or move {'it' if one else 'them'} away and restart)", stacklevel=4)
            for info in infos:
                name = step_dir_name(info.step)
                if self._retention.in_doubt(name):
                    continue
                if info.state == "uncommitted":
                    keep = self._retention.kept_files(name)
                    found.setdefault("sweep", []).append((name, keep))
                    if keep:
                        self._retention.lingering.add(name)
                else:
                    debris = unreferenced_files(Listed(listing[name]),
                                                self._retention.referenced_files(parsed[info.step]))
                    if debris:
                        found.setdefault("debris", []).append((name, debris))
            committed = [i.step for i in infos if i.state == "committed"]
            return ({i.step: i.metrics for i in infos if i.state == "committed"},
                    {s: timeline_of(parsed[s]) for s in committed}, new_timeline())

        self._steps, self._timelines, self._run_timeline = self._on_coordinator(
            "manager start (listing the directory)", discover)
        if self._deleter is not None:
            for name, keep in found.get("sweep", []):
                self._deleter.submit("step", name, keep=keep)
            for name, files in found.get("debris", []):
                self._deleter.submit("files", name, files)

    def _agree(self, what: str, step: int | None) -> None:
        """Every rank names the same ``step`` (the coordinator also checks it still owns the
        directory and that no deletion of that step's directory is pending)."""
        def check() -> int | None:
            if self._coord.is_coordinator:
                self._owner.check()
                if step is not None and what == "save":
                    self._deleter.wait_for(step_dir_name(step))  # type: ignore[union-attr]
                    self._check_writable(step)
            return step

        steps = self._coordinator().exchange(f"manager {what} (step {step})", check)
        if len(set(steps)) > 1:
            raise ValueError(f"CheckpointManager.{what}: the ranks passed different steps {steps} (by rank); "
                             "every rank must call it with the same step")

    def _check_writable(self, step: int) -> None:
        """Refuse to save ``step`` into a symbolic link, or over a ``.metadata`` this manager
        cannot read (a newer version's, a corrupt one): a failed save would delete that step,
        a good one replace it, and it may be the only copy of someone's checkpoint."""
        name = step_dir_name(step)
        self._root.check_step(name)
        try:
            raw = self._root.step_metadata(name)
        except NotACheckpointError:
            return  # nothing committed there (the usual case: no directory yet)
        where = f"{self._root.step_path(name)}/{md.METADATA_FILE}"
        try:
            md.Metadata.from_json(raw, where=where)
        except CheckpointError as exc:
            raise CheckpointError(
                f"not saving step {step}: {exc}. The manager neither counts, deletes nor overwrites a step whose "
                f"{md.METADATA_FILE} it cannot read; move {self._root.step_path(name)!r} away (or load it with the "
                "hyper-parallel that wrote it), then save again") from None

    def _settle(self, protect: Iterable[int] = ()) -> None:
        """Every rank learns the outcome of the last save; the coordinator updates the steps,
        plans retention (never deleting ``protect``: a step about to be loaded), and starts
        the deletions after everyone agreed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        own_error: BaseException | None = None
        meta = pending.meta
        response = pending.response
        if response is not None:
            try:
                meta = response.result()
            except BaseException as exc:  # reported to every rank below
                own_error = exc
                # ...and by us alone: the checkpointer would raise it again at the next save.
                with contextlib.suppress(AsyncSaveError, TimeoutError):
                    self._async.wait(timeout=0)  # type: ignore[union-attr]
            self._timings.append(SaveTiming(pending.step, pending.blocking_s,
                                            response.total_s if own_error is None else None))
        else:
            self._timings.append(SaveTiming(pending.step, pending.blocking_s, pending.blocking_s))
        name = step_dir_name(pending.step)
        plan: dict[str, Any] = {}

        def bookkeeping() -> tuple[str | None, Any]:
            error = None if own_error is None else f"{type(own_error).__name__}: {own_error}"
            if not self._coord.is_coordinator:
                return error, None
            committed = meta
            finished = response is None or response.done()
            if own_error is not None and finished:  # the save may have committed all the same
                committed = self._probe(name)
            steps, timelines = dict(self._steps), dict(self._timelines)
            if committed is not None:
                steps[pending.step] = metrics_of(committed)
                timelines[pending.step] = timeline_of(committed)
                self._retention.learn(pending.step, committed)
                doomed = self._retention.plan(steps, protect={pending.step, *protect})
                for s in doomed:
                    del steps[s]
                    timelines.pop(s, None)
                plan["delete"], plan["release"] = self._retention.forget(doomed)
            elif finished:
                plan["cleanup"] = True
            return error, (committed is not None, steps, timelines)

        results = self._coordinator().exchange(f"manager (settling the save of step {pending.step})", bookkeeping)
        committed, self._steps, self._timelines = results[self._coord.coordinator_rank][1]
        if self._deleter is not None:
            for s, keep in plan.get("delete", []):
                self._deleter.submit("step", step_dir_name(s), keep=keep)
            for name in plan.get("release", []):
                self._deleter.submit("step", name)
            if plan.get("cleanup") and not self._retention.in_doubt(name):
                self._deleter.submit("failed", name, keep=self._retention.kept_files(name))
        failures = {r: e for r, (e, _) in enumerate(results) if e is not None}
        if not failures:
            return
        detail = "; ".join(f"rank {r}: {e}" for r, e in failures.items())
        where = self.step_path(pending.step)
        if committed:
            warnings.warn(f"CheckpointManager: step {pending.step} is committed at {where}, but its save "
                          f"reported errors: {detail}", stacklevel=3)
            return
        raise AsyncSaveError(f"the async save of step {pending.step} to {where} failed ({detail}); the newest "
                             f"committed step is {self.latest_step()}") from own_error

    def _probe(self, name: str) -> md.Metadata | None:
        """The step's committed metadata, or None when it has none (or it does not parse)."""
        try:
            return md.Metadata.from_json(self._root.step_metadata(name))
        except NotACheckpointError:
            return None
        except CheckpointError as exc:
            warnings.warn(f"CheckpointManager: {self._root.step_path(name)}: {exc}", stacklevel=4)
            return None

    def _release(self) -> None:
        """Free threads, groups and the owner file (no collectives)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._local is not None:
                self._local.close()
            if self._async is not None:
                with contextlib.suppress(AsyncSaveError):
                    self._async.close()
        finally:
            if self._deleter is not None:
                self._deleter.wait_for()
                self._deleter.stop()
            self._owner.release(remove_record=self._deleter is not None)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, steps={self.all_steps()}, "
                f"in_flight={self._pending.step if self._pending else None})")


def _plain_metrics(metrics: Any) -> dict[str, Any]:
    """``metrics`` with 0-d tensors and numpy scalars turned into numbers; validated."""
    if not isinstance(metrics, dict) or not all(type(k) is str for k in metrics):
        raise ValueError(f"metrics must be a dict with str keys, got {metrics!r:.200}")
    plain = {k: v.item() if getattr(v, "ndim", None) == 0 and hasattr(v, "item") else v for k, v in metrics.items()}
    if not is_json_value(plain):
        raise ValueError(f"metrics values must be numbers, strings, bools, None, or lists/dicts of them (or 0-d "
                         f"tensors), got {metrics!r:.200}")
    return plain


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _coordinator_of(coordination: Coordination) -> Coordinator:
    """The coordinator of the manager's exchanges (collective where the group is distributed)."""
    c = coordination
    return Coordinator(c.process_group, c.no_dist, c.coordinator_rank, c.timeout)


def _checked_retention(rules: RetentionOptions) -> RetentionOptions:
    """``rules``, or a ValueError naming the keyword that is wrong."""
    _check_count("save_interval_steps", rules.save_interval_steps)
    for name in ("keep_latest", "keep_every_steps", "keep_best"):
        if getattr(rules, name) is not None:
            _check_count(name, getattr(rules, name))
    if rules.best_mode not in ("min", "max"):
        raise ValueError(f"best_mode must be 'min' or 'max', got {rules.best_mode!r}")
    if rules.keep_best is not None and not rules.best_metric:
        raise ValueError("keep_best needs best_metric: the key of save(..., metrics=) that ranks steps")
    return rules


# the manager's keyword for each setting of LocalTierOptions (in the order errors name them)
_LOCAL_KEYWORDS = {"interval_steps": "local_interval_steps", "node_rank": "node_rank", "keep": "local_keep",
                   "replicas": "replicas", "replication_timeout": "replication_timeout"}


def _checked_local_tier(local: LocalTierOptions) -> LocalTierOptions:
    """``local`` with its defaults filled in (``interval_steps`` 1, the timeout a float), or a
    ValueError naming the keyword that is wrong. Without ``local_dir`` every setting of the tier
    must be at its default: refused rather than ignored."""
    if local.local_dir is None:
        default = LocalTierOptions()
        given = [keyword for name, keyword in _LOCAL_KEYWORDS.items() if getattr(local, name) != getattr(default, name)]
        if given:
            verb = "configures" if len(given) == 1 else "configure"
            raise ValueError(f"{', '.join(given)} {verb} the local tier, which is off without local_dir: "
                             "pass local_dir too, or leave them at their defaults")
        return local
    local = replace(local, interval_steps=1 if local.interval_steps is None else local.interval_steps)
    for name in ("interval_steps", "keep", "replicas"):
        _check_count(_LOCAL_KEYWORDS[name], getattr(local, name))
    timeout = local.replication_timeout
    if not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"replication_timeout must be a number of seconds > 0, got {timeout!r}")
    return replace(local, replication_timeout=float(timeout))


def _checked_incremental(inc: IncrementalOptions) -> IncrementalOptions:
    """``inc``, or a ValueError naming the keyword that is wrong (its settings need ``incremental``)."""
    if not inc.enabled and (inc.rehash_every is not None or inc.check != CONTENT):
        raise ValueError("incremental_check and incremental_rehash_every configure incremental saves, which "
                         "are off: pass incremental=True too, or leave them at their defaults")
    if inc.check not in CHECKS:
        raise ValueError(f"incremental_check must be one of {CHECKS}, got {inc.check!r}")
    if inc.check == CONTENT and inc.rehash_every not in (None, 1):
        raise ValueError(f"incremental_rehash_every={inc.rehash_every!r} configures "
                         f"incremental_check={VERSION_COUNTER!r}; the default check {CONTENT!r} hashes every "
                         "chunk at every save. Pass incremental_check='version_counter' too to trust torch's "
                         "version counter between re-hashes")
    return inc
