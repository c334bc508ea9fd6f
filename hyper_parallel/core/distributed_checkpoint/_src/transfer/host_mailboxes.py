"""Bytes that ranks on one host hand each other through shared memory, not the network.

The ranks of a node exchange large parts of their data when a save regroups rows
(:mod:`.row_exchange`). Over gloo each byte crosses TCP on loopback: two kernel copies
and a protocol, about 0.5 GB/s each way on this machine, which was most of a 2-rank
``Shard(1)`` consolidated save. On one host a rank can instead copy its outgoing parts
into memory its peers have mapped, once, and each peer copies them from there into place.

:class:`HostMailboxes` is that memory: every rank creates an area of two slots (rounds use
them in turn, so a rank may fill the next slot while its peers still read the last one) in
``/dev/shm``, maps every other rank's area read-only, and removes its own file as soon as
every rank has mapped it (the mappings stay; nothing is left behind, even after a crash
later on). :meth:`HostMailboxes.open` returns None (the caller then uses the network) unless
every rank of the group mapped every other's area: ranks on several hosts, no ``/dev/shm``
or too little room in it (the area is reserved when it is made), containers with separate ones.

Who writes where, and when a slot may be read, is the caller's protocol: a barrier after
each round's writes (see :func:`.row_exchange.regroup_rows`).
"""

from __future__ import annotations

import mmap
import os
import socket
import uuid

import numpy as np

from ..coordination.coordinator import Coordinator

SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE


class HostMailboxes:
    """This rank's two outgoing slots and every peer's, mapped (see the module docstring)."""

    def __init__(self, slot_bytes: list[int], maps: list[mmap.mmap | None], rank: int):
        self._slots, self._maps, self._rank = slot_bytes, maps, rank
        self._views = [np.frombuffer(m, dtype=np.uint8) if m is not None else None for m in maps]

    @classmethod
    def open(cls, coord: Coordinator, slot_bytes: int, phase: str) -> HostMailboxes | None:
        """Every rank of ``coord``'s group calls this with the bytes it sends in one round at
        most; returns the mailboxes, or None on every rank when some rank cannot map them."""
        size = 2 * max(_PAGE, -(-slot_bytes // _PAGE) * _PAGE)
        path = own = None
        try:
            if os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK):
                path = os.path.join(SHM_DIR, f"hp-dcp-{uuid.uuid4().hex}")
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
                try:
                    # reserved now, not on first touch: a full /dev/shm (a container's 64 MiB)
                    # then fails here, and the ranks use the network, instead of a SIGBUS later
                    os.posix_fallocate(fd, 0, size)
                    own = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
        except OSError:
            _remove(path)
            path, own = None, None
        maps: list[mmap.mmap | None] = []
        try:
            everyone = coord.exchange(f"{phase} (shared memory)", lambda: (socket.gethostname(), path, size // 2))
            ok = all(p is not None for _, p, _ in everyone) and len({h for h, _, _ in everyone}) == 1
            if ok:
                for r, (_, peer, _) in enumerate(everyone):
                    maps.append(own if r == coord.rank else _map(peer))
                ok = all(m is not None for m in maps)
            ok = all(coord.exchange(f"{phase} (shared memory mapped)", lambda: ok))
        finally:
            _remove(path)  # every rank has mapped it, or none will use it
        if not ok:
            for m in {id(m): m for m in [*maps, own] if m is not None}.values():
                m.close()
            return None
        return cls([s for _, _, s in everyone], maps, coord.rank)

    def outbox(self, round_no: int) -> np.ndarray:
        """This rank's slot for round ``round_no`` (writable)."""
        return self._slot(self._rank, round_no)

    def inbox(self, src: int, round_no: int) -> np.ndarray:
        """Rank ``src``'s slot for round ``round_no`` (read-only for a peer)."""
        return self._slot(src, round_no)

    def _slot(self, rank: int, round_no: int) -> np.ndarray:
        n = self._slots[rank]
        view = self._views[rank]
        assert view is not None
        at = (round_no % 2) * n
        return view[at:at + n]

    def close(self) -> None:
        """Unmap every area (a peer still reading keeps its own mapping). An area some view
        still points into is left to be unmapped when the last view goes."""
        self._views = []
        for m in self._maps:
            if m is not None:
                try:
                    m.close()
                except BufferError:
                    pass
        self._maps = []


def _map(path: str) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size, access=mmap.ACCESS_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def _remove(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except OSError:
            pass
