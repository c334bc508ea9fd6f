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
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["node_identity", "Topology", "MappedFile", "send_file", "recv_file", "wait_all"]


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
