"""Where the local tier's copies go (nodes, peers), and how shard files move between ranks.

**Node identity.** A rank's node is, in this order: the ``node_rank`` the caller passes
(tests simulate several nodes on one machine this way); torchrun's node rank
(``GROUP_RANK``); ``RANK // LOCAL_WORLD_SIZE`` when only those are set (launchers that
number ranks node by node); else the host name. Nodes are numbered by sorting the distinct
identities, the same on every rank.

**Peers.** With ``replicas`` copies of each rank's shards, a rank sends its file to
``replicas - 1`` peers, each on another node: the rank at the same position (index among
its node's ranks, modulo the target node's size) on the next nodes in node order, so the
copies of one node's ranks spread over the following nodes and no node receives two copies
of one rank. With fewer nodes than ``replicas`` there are only ``nodes - 1`` peers (one node:
none). :meth:`Topology.sources` inverts it: the ranks whose copies a rank keeps.

**Transfers.** A shard file travels as one message: the sender maps the file (a private,
read-only mapping: the page cache pages are sent as they are, no copy in user space) and the
receiver maps a temporary file of the announced size and receives straight into it, then
renames it into place once the bytes are in. Every wait is bounded by a deadline; a gloo
timeout makes the group unusable, which the caller must treat as final for that group.

**Replication** (:class:`Replicator`, steps 4 and 5 of a local save in :mod:`.local_tier`):
on a dedicated gloo group made at the first local save, each rank sends the header and the
staging buffer of its new file to its peers and receives the files of its sources (each
written to a temporary name and renamed once whole), then one all-reduce (MIN) confirms the
step on every rank. Any failure or a wait past ``replication_timeout`` stops replication for
the rest of the run (a gloo group cannot recover from a timeout), with a warning.

This module moves files between ranks; it does not write a rank's own file
(:mod:`.local_save`) nor choose what recovery fetches (:mod:`.local_recovery`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..base.options import LocalTierOptions
from ..base.priority import BACKGROUND_NICE
from ..coordination.coordinator import Coordinator, new_gloo_group
from .local_directory import TierDirectory
from .local_format import ShardFile, parse_manifest

__all__ = ["node_identity", "Topology", "MappedFile", "send_file", "recv_file", "wait_all", "Replicator"]

MAGIC = 0x48504C54  # "HPLT": the head of every replication message
# Message tags, distinct: a replication message's head, its file header, its body; a recovery fetch.
TAG_HEAD, TAG_FILE, TAG_BODY, TAG_FETCH = 0x4C01, 0x4C02, 0x4C04, 0x4C03


def node_identity(node_rank: int | None) -> tuple[str, Any]:
    """``(how it was found, the identity)`` of this process's node (see the module docstring)."""
    if node_rank is not None:
        if isinstance(node_rank, bool) or not isinstance(node_rank, int) or node_rank < 0:
            raise ValueError(f"node_rank must be an int >= 0, got {node_rank!r}")
        return "node_rank", node_rank
    env = os.environ
    if env.get("GROUP_RANK", "").isdigit():
        return "GROUP_RANK", int(env["GROUP_RANK"])
    if env.get("LOCAL_WORLD_SIZE", "").isdigit() and env.get("RANK", "").isdigit() and int(env["LOCAL_WORLD_SIZE"]):
        return "RANK // LOCAL_WORLD_SIZE", int(env["RANK"]) // int(env["LOCAL_WORLD_SIZE"])
    return "hostname", socket.gethostname()


@dataclass(frozen=True)
class Topology:
    """The node of every rank (group ranks) and who keeps copies of whose files."""

    nodes: tuple[int, ...]
    replicas: int

    @classmethod
    def of(cls, identities: list[Any], replicas: int) -> Topology:
        order = sorted(set(identities), key=lambda v: (type(v).__name__, v))
        index = {v: i for i, v in enumerate(order)}
        return cls(tuple(index[v] for v in identities), replicas)

    @property
    def node_count(self) -> int:
        return len(set(self.nodes))

    def members(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.nodes) if n == node]

    def peers(self, rank: int) -> list[int]:
        """The ranks (on other nodes) that keep a copy of ``rank``'s files, nearest node first."""
        k = self.node_count
        node = self.nodes[rank]
        position = self.members(node).index(rank)
        out = []
        for j in range(1, min(self.replicas - 1, k - 1) + 1):
            there = self.members((node + j) % k)
            out.append(there[position % len(there)])
        return out

    def sources(self, rank: int) -> list[int]:
        """The ranks whose copies ``rank`` keeps."""
        return [r for r in range(len(self.nodes)) if rank in self.peers(r)]


class MappedFile:
    """A file mapped into memory as a flat uint8 tensor (for sending or receiving it whole)."""

    def __init__(self, path: str, size: int | None = None):
        """``size`` None: map the existing file read-only; else create ``path`` with ``size``
        bytes and map it writable (receiving)."""
        self.path = path
        writable = size is not None
        self.fd = os.open(path, (os.O_RDWR | os.O_CREAT | os.O_EXCL) if writable else os.O_RDONLY, 0o644)
        try:
            if writable and size:
                # Blocks allocated now: writes through a mapping of a sparse file on a full
                # filesystem (tmpfs: /dev/shm) fail at the page fault (SIGBUS, or an error deep
                # inside a transfer); here they are a plain ENOSPC before anything is sent.
                os.posix_fallocate(self.fd, 0, size)
            self.size = os.fstat(self.fd).st_size
            # ACCESS_COPY: a private mapping that torch may treat as writable; nothing writes to it.
            self.map = mmap.mmap(self.fd, self.size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_COPY)
            self.tensor: torch.Tensor | None = torch.frombuffer(self.map, dtype=torch.uint8)
        except BaseException:
            os.close(self.fd)
            raise

    def head(self, n: int) -> bytes:
        return bytes(self.map[:n])

    def close(self) -> None:
        self.tensor = None
        with contextlib.suppress(BufferError, ValueError):
            self.map.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def send_file(mapped: MappedFile, dst: int, group: Any, tag: int) -> Any:
    """Post the send of a whole mapped file to global rank ``dst``; returns the work."""
    return dist.isend(mapped.tensor, dst=dst, group=group, tag=tag)


def recv_file(mapped: MappedFile, src: int, group: Any, tag: int) -> Any:
    """Post the receive of a whole file from global rank ``src`` into ``mapped``; returns the work."""
    return dist.irecv(mapped.tensor, src=src, group=group, tag=tag)


def wait_all(works: list[Any], deadline: float) -> None:
    """Wait for every work until ``deadline`` (time.monotonic); raises TimeoutError or the
    transport's error (after which the group is unusable)."""
    for work in works:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed before the transfer completed")
        work.wait(timedelta(seconds=left))


class Replicator:
    """This rank's side of the local tier's replication (see the module docstring).

    ``abandoned`` holds the buffers of transfers that failed while gloo may still use them:
    never freed or reused.
    """

    def __init__(self, coord: Coordinator, files: TierDirectory, peers: list[int], sources: list[int],
                 options: LocalTierOptions):
        self.coord, self.files = coord, files
        self.world_size = coord.world_size
        self.peers, self.sources = peers, sources
        self.replication_timeout = float(options.replication_timeout)
        self.sync_files = options.sync_files
        self.error: str | None = None  # why replication stopped (None: it runs)
        self.needs_group = coord.distributed and coord.world_size > 1  # made at the first save
        self.group: Any = None
        self.abandoned: list[Any] = []
        self._rx: dict[int, torch.Tensor] = {}  # receive buffers by source rank

    def ensure_group(self) -> None:
        """Make the replication group if it is still to be made (collective: every rank makes
        its first local save at the same step)."""
        if self.needs_group and self.group is None:
            self._make_group()

    def _make_group(self) -> None:
        """Make the replication group. A peer that is dead or later than ``replication_timeout``
        ends replication for this run, as any replication wait does (the save goes on
        unreplicated), instead of raising gloo's bare "Wait timeout" into the training loop;
        it is not tried again."""
        try:
            self.group = new_gloo_group(self.coord.group_ranks, timedelta(seconds=self.replication_timeout),
                                        nice=BACKGROUND_NICE)  # its I/O threads in the background
        except RuntimeError as exc:
            self.needs_group = False
            self.stop(f"making the replication group: a rank did not join within "
                      f"{self.replication_timeout:g}s ({type(exc).__name__}: {exc})")

    def replicate(self, step: int, timeline: str, shard: ShardFile | None) -> tuple[bool, int, int, bool]:
        """Send this rank's file to its peers, receive its sources' files. Returns (all went
        well, bytes sent, bytes received, whether a failed send may still read the file)."""
        if self.error is not None:  # stopped (or its group could never be made)
            return False, 0, 0, False
        if self.group is None or (not self.peers and not self.sources):
            return True, 0, 0, False
        deadline = time.monotonic() + self.replication_timeout
        keep_alive: list[Any] = []  # everything gloo may touch until the transfers are over
        sent = received = 0
        failed = False
        try:
            has = shard is not None
            hlen, blen = (len(shard.header), shard.body.nbytes) if has else (0, 0)
            head = torch.tensor([MAGIC, step, hlen, blen, int(has)], dtype=torch.int64)
            keep_alive.append(head)
            works = []
            if has:
                header_t = torch.frombuffer(bytearray(shard.header), dtype=torch.uint8)
                body_t = torch.frombuffer(shard.body, dtype=torch.uint8) if blen else None
                keep_alive += [header_t, body_t]
            for peer in self.peers:
                dst = self.coord._global(peer)
                works.append(dist.isend(head, dst=dst, group=self.group, tag=TAG_HEAD))
                if has:
                    works.append(dist.isend(header_t, dst=dst, group=self.group, tag=TAG_FILE))
                    if blen:
                        works.append(dist.isend(body_t, dst=dst, group=self.group, tag=TAG_BODY))
                    sent += hlen + blen
            heads = []
            for src in self.sources:
                h = torch.zeros(5, dtype=torch.int64)
                keep_alive.append(h)
                heads.append((src, h, dist.irecv(h, src=self.coord._global(src), group=self.group, tag=TAG_HEAD)))
            incoming = []
            for src, h, work in heads:
                wait_all([work], deadline)
                magic, their_step, their_hlen, their_blen, their_has = h.tolist()
                if magic != MAGIC or their_step != step:
                    raise RuntimeError(f"replication out of step: rank {src} sent step {their_step} while this rank "
                                       f"saves step {step}")
                if not their_has:
                    continue
                header_r = torch.empty(their_hlen, dtype=torch.uint8)
                body_r = self._receive_buffer(src, their_blen)
                keep_alive += [header_r, body_r]
                works.append(dist.irecv(header_r, src=self.coord._global(src), group=self.group, tag=TAG_FILE))
                if their_blen:
                    works.append(dist.irecv(body_r, src=self.coord._global(src), group=self.group, tag=TAG_BODY))
                incoming.append((src, header_r, body_r))
            wait_all(works, deadline)
            for src, header_r, body_r in incoming:
                header_b = header_r.numpy().tobytes()
                final = self.files.path(src, step, timeline)
                man = parse_manifest(header_b, len(header_b) + body_r.numel(), final)
                if (man.rank, man.step, man.timeline, man.world_size) != (src, step, timeline, self.world_size):
                    raise RuntimeError(f"rank {src} sent a file of rank {man.rank}, step {man.step}; expected its "
                                       f"step {step}")
                pieces = [memoryview(header_b), memoryview(body_r.numpy()).cast("B")] if body_r.numel() else [
                    memoryview(header_b)]
                received += self.files.write(final, pieces, self.sync_files)
            return True, sent, received, False
        except Exception as exc:
            failed = True
            self.stop(f"step {step}: {type(exc).__name__}: {exc}")
            return False, sent, received, bool(sent)
        finally:
            if failed:  # transfers may still be pending on these buffers: keep them alive
                self.abandoned.append(keep_alive)
                self._rx.clear()

    def _receive_buffer(self, src: int, nbytes: int) -> torch.Tensor:
        """A receive buffer for ``src``'s files, reused from save to save (memory that is
        already mapped: receiving into fresh pages costs a page fault per 4 KiB)."""
        buf = self._rx.get(src)
        if buf is None or buf.numel() < nbytes:
            buf = self._rx[src] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return buf[:nbytes]

    def confirm(self, ok: bool) -> bool:
        """Every rank learns whether every rank committed its file and its copies."""
        if self.group is None:
            return ok
        if self.error is not None:
            return False
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group,
                            async_op=True).wait(timedelta(seconds=self.replication_timeout))
        except Exception as exc:
            self.abandoned.append(flag)
            self.stop(f"confirming a step: {type(exc).__name__}: {exc}")
            return False
        return bool(flag.item())

    def stop(self, why: str) -> None:
        """End replication for this run (the first reason is kept), with a warning."""
        if self.error is None:
            self.error = why
            warnings.warn(f"CheckpointManager (rank {self.coord.global_rank}): local tier replication stopped for this "
                          f"run ({why}); local saves continue on this node only, unconfirmed. The next start "
                          "replicates again", stacklevel=2)

    def close(self, finished: bool) -> None:
        """Free the group (only once no transfer can still be using it: ``finished``). Local."""
        if self.group is not None and finished:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self.group)
        self.group = None
