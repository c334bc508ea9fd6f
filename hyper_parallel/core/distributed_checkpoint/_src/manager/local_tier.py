"""The local tier of a CheckpointManager: frequent saves to node-local storage, copies on
peers of other nodes, and recovery from them without reading the durable directory.

A durable step costs shared-storage bandwidth, so it is taken rarely; a node that dies loses
everything since. The local tier saves every ``local_interval_steps`` to ``local_dir`` on each
node (``/dev/shm`` or a local NVMe disk: it survives a process restart, not the loss of the
node) and keeps a copy of every rank's shards on ``replicas - 1`` other nodes, so a job that
loses a node resumes from the newest local step instead of the older durable one.

**A local save, on every rank** (:meth:`LocalTier.save`, :mod:`.local_save`; the manager
calls it alike on every rank):

1. Wait for this rank's previous local save (bounded: see "Bounded waits").
2. Snapshot: flatten the state dict and copy every tensor, array and bytes value into a
   reused host buffer (the staging buffers of :mod:`..asynchronous.checkpointer`), whose layout is the
   shard file's body. This is the only time training is blocked.
3. In the background (one thread per process, at a lower CPU priority than training), write
   the rank's shard file (one file, its own shards only, see :mod:`.local_format`): the
   header, then the staging buffer as it is, under a temporary name (or over a retired file)
   renamed into place: the commit of this rank's part.
4. Replicate: send the header and the staging buffer to this rank's peers and receive the
   files of the ranks it keeps copies for (:mod:`.local_replication` says who), on a
   dedicated gloo group (:class:`~.local_replication.Replicator`); each received file is
   written to a temporary name and renamed once whole.
5. Confirm: one all-reduce (MIN) of "my file and every copy I keep for this step are
   committed" on the same group. A *confirmed* step is complete on every rank and survives
   the loss of any ``replicas - 1`` nodes.
6. Retention: each rank keeps, in the directories it writes (its own and those of the ranks
   it keeps copies for), the newest ``local_keep`` confirmed steps plus at most
   ``local_keep`` newer unconfirmed ones, and deletes the rest. The newest confirmed step
   is never deleted by a newer unconfirmed one, so a crash at any point leaves a complete
   step behind.

**Recovery** (:meth:`LocalTier.recover`, :mod:`.local_recovery`, from ``CheckpointManager.load``):

1. Every rank settles its local save in flight (one exchange, which also tells every rank
   who shares its ``local_dir``).
2. One rank per directory lists it (reading only the headers of the shard files, each
   verified against its checksum: a file that fails is no copy, and rank 0 warns naming it
   and its step), and every rank shares what it found: ``(owner rank, step, timeline, size,
   fingerprint)`` per file, with the fingerprint of its own target (one exchange). Every rank then makes the same
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

This module schedules saves and composes the parts: the save (:mod:`.local_save`), the
replication (:mod:`.local_replication`), recovery (:mod:`.local_recovery`) and the files on
this node (:mod:`.local_directory`, :mod:`.local_format`).
"""

from __future__ import annotations

import os
import time
import warnings
from collections import deque
from typing import Any

from ..asynchronous.buffers import StagingStats
from ..backends.locations import is_url
from ..base.options import Coordination, LocalTierOptions
from ..coordination.coordinator import Coordinator
from .local_directory import TierDirectory
from .local_format import new_timeline
from .local_recovery import Recoverer, Recovery
from .local_replication import Replicator, Topology, node_identity
from .local_save import LocalSaver, LocalSaveTiming

__all__ = ["LocalTier"]

_SAVE_WAIT_SLACK_S = 60.0  # on top of 2 * replication_timeout: the write itself


class LocalTier:
    """The local tier of one CheckpointManager (see the module docstring for the protocol).

    Every rank of the group constructs it (collective: it learns every rank's node) and
    calls :meth:`save` (the first one makes the replication group), :meth:`recover`,
    :meth:`loaded` and :meth:`wait` alike; :meth:`close` is local.

    Args:
        options: the tier's settings, as the manager checked them: ``local_dir`` (this node's
            directory, ``/dev/shm/...`` or local NVMe; ranks on one node may share it),
            ``interval_steps`` (save when ``step % interval_steps == 0``), ``keep`` (confirmed
            steps kept per rank and copy), ``replicas`` (copies of each rank's shards, its own
            included; at most the node count), ``node_rank`` (None: from the launcher, see
            :mod:`.local_replication`), ``replication_timeout`` (seconds any replication wait
            may take, see "Bounded waits") and ``sync_files``.
        coordination: the manager's ranks and timeout (recovery's exchanges and transfers).
        directory: the durable directory of the manager (recorded in every file, so files of
            another manager are never loaded).
        durable: the newest durable step and the timeline that committed it (None: none),
            recorded in every file of this timeline (see "Recovery").
    """

    def __init__(self, options: LocalTierOptions, coordination: Coordination, *, directory: str,
                 durable: tuple[int, str | None] | None = None):
        self.options = options
        self.local_dir = os.path.abspath(os.fspath(options.local_dir))
        self.directory = directory if is_url(directory) else os.path.abspath(directory)
        # One subdirectory per manager directory: jobs sharing /dev/shm never touch each other's files.
        self.files = TierDirectory(self.local_dir, self.directory)
        self.root = self.files.root
        c = coordination
        self.coord = Coordinator(c.process_group, c.no_dist, c.coordinator_rank, c.timeout)
        self.rank, self.world_size = self.coord.rank, self.coord.world_size
        self._last_step: int | None = None
        # the newest durable step when this timeline began: written into every file of it
        self.durable_base: tuple[int, str | None] | None = durable
        self._layouts: dict = {}  # describe()'s cache of DTensor layouts
        self._closed = False
        identity = node_identity(options.node_rank)
        replicas = options.replicas

        def start() -> tuple:
            os.makedirs(self.root, exist_ok=True)
            self.files.sweep_temporary()
            return identity, (options.interval_steps, options.keep, replicas), new_timeline()

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
        self._replicator = Replicator(self.coord, self.files, self.peers, self.sources, options)
        self._saver = LocalSaver(self.files, self._replicator, options, layouts=self._layouts,
                                 global_rank=self.coord.global_rank,
                                 manifest={"rank": self.rank, "world_size": self.world_size,
                                           "directory": self.directory, "node": self.node})
        self._recoverer = Recoverer(self.coord, self.files, options, directory=self.directory, node=self.node,
                                    layouts=self._layouts, settle=self.wait)
        if replicas > 1 and self.topology.node_count < replicas and self.rank == 0:
            warnings.warn(f"CheckpointManager: replicas={replicas} but the job spans {self.topology.node_count} "
                          f"node(s) (by {identity[0]}): each rank's shards get {self.topology.node_count - 1} "
                          "copies on other nodes", stacklevel=3)

    # ------------------------------------------------------------------ what the tier reports

    @property
    def timings(self) -> deque[LocalSaveTiming]:
        """This rank's last 100 local saves."""
        return self._saver.timings

    @property
    def save_errors(self) -> list[str]:
        """Why local saves of this rank failed (their steps are not complete here)."""
        return self._saver.save_errors

    @property
    def replication_error(self) -> str | None:
        """Why replication stopped for this run (None: it runs)."""
        return self._replicator.error

    @property
    def last_recovery(self) -> Recovery | None:
        """What the last ``recover`` found (None: none yet)."""
        return self._recoverer.last

    @property
    def staging_stats(self) -> StagingStats:
        return self._saver.stats

    # ------------------------------------------------------------------ saving

    def due(self, step: int) -> bool:
        return step % self.options.interval_steps == 0

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
        bound = self.options.replication_timeout * 2 + _SAVE_WAIT_SLACK_S
        if not self._saver.wait(bound):
            in_flight = self._saver.in_flight
            self._replicator.stop(f"the local save of step {in_flight if in_flight is not None else '?'} is still "
                                  f"running after {bound:.0f}s")
            warnings.warn(f"CheckpointManager: local save of step {step} skipped: the previous one is still "
                          "running (storage or a peer is stuck)", stacklevel=3)
            return False
        self._replicator.ensure_group()
        error = self._saver.start(step, state_dict, timeline=self.timeline, durable_base=self.durable_base,
                                  started=started)
        self._last_step = step
        if error is not None:
            raise error
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for this rank's local save in flight (default bound: as a save waits);
        False if it is still running."""
        bound = self.options.replication_timeout * 2 + _SAVE_WAIT_SLACK_S
        return self._saver.wait(bound if timeout is None else timeout)

    # ------------------------------------------------------------------ recovery

    def recover(self, state_dict: dict[str, Any], *, durable: tuple[int, str | None] | None,
                step: int | None = None) -> int | None:
        """Load the newest complete local step (or ``step``) into ``state_dict``; collective.

        ``durable`` is the newest durable step and the timeline that committed it (None: no
        durable step). Returns the step loaded, or None when the manager must load from the
        durable tier (nothing complete locally, a newer durable step, a durable step a later
        run committed, or a changed layout). See the module docstring for the protocol; the
        job continues on a new timeline either way.

        Raises:
            LostContactError / RankFailedError: a rank failed or vanished (on every rank).
            ValueError: ranks asked for different steps.
            CheckpointError: the chosen step cannot be stored and no durable step exists.
        """
        self._check_open()
        found = self._recoverer.recover(state_dict, durable=durable, step=step, begin=self._begin)
        if found is None:
            return None
        loaded, kept = found
        self._saver.restart(kept)
        self._last_step = loaded
        return loaded

    def _begin(self, timeline: str, durable: tuple[int, str | None] | None) -> None:
        """A new run (timeline) starts, from ``durable``: the files it writes record both."""
        self.timeline, self.durable_base = timeline, durable

    def loaded(self, step: int | None) -> None:
        """The manager loaded ``step`` from the durable tier (or nothing): later local saves
        continue from it, and the files of earlier runs are removed."""
        self._last_step = step
        self._saver.restart([])
        self.files.prune(self.timeline, set())
        if self.last_recovery is not None and self.last_recovery.source == "durable":
            self.last_recovery.step = step

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
        self._saver.close(finished)
        self._replicator.close(finished)
