"""Which chunks of a rank's save plan an incremental save writes, and which it reuses.

Every chunk the last step stored is checked (:mod:`.unchanged`). The checks run in passes,
so that the writes start early and overlap the reading:

1. :meth:`ChunkChecks.triage` reads no tensor: it compares version stamps only. It returns
   the chunks to write at once: every chunk of a box (a saved box's column bands are reused
   or written together) that nothing was stored for, or whose memory was written in place
   since (what changes every step, known without a look at its bytes);
2. while those are written, :meth:`ChunkChecks.hash_pending` runs the spot checks of the
   other chunks, and hashes in full those the spot checks leave undecided (the rotating
   re-hash, tensors replaced by copies), except those whose box is being written anyway. It
   returns the chunks of the boxes found changed, which are written next, into a file of
   their own;
3. :meth:`ChunkChecks.finish` settles the undecided chunks that were written anyway, using
   the hash taken as they were written, and lists what is reused.

A box stored as column bands whose bands are all due for their full hash at once is hashed
whole, in its tensor's own memory (:func:`.unchanged.whole_box`), when the hash of that memory
taken with the bands' digests vouches for them; the hash is taken when such a box is first
written (in pass 2, beside the writes) and again whenever its bands are hashed one by one.

At first every chunk was hashed before the first byte was written; then the spot checks
still were (an 80-tensor step began writing ~11 ms in; with stamps alone, ~5 ms).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..base.box import Box
from ..format import metadata as md
from ..planning.planner import SavePlan, SavePlanner, WriteItem
from .streams import StreamFence
from .unchanged import Pending, UnchangedStats, Verdict, box_digest, known_changed, settle, triage, whole_box

ChunkKey = tuple[str, int]  # (key, sub id)

# values whose bytes can be hashed without consuming them (slab iterables cannot)
_HASHABLE = (torch.Tensor, np.ndarray, bytes, bytearray, memoryview)


class ChunkChecks:
    """One incremental save's checks of a rank's plan against ``reuse``, the chunks stored
    earlier by (key, sub id). ``tiles(key)``: the column bands per box of ``key``;
    ``tables``: the keys stored as tables (their reused chunks are listed in ``rows``).

    Outputs: ``verdicts`` (every chunk's), ``stats``, and for the chunks reused ``reused``
    ``(key, sub, earlier file)``, ``known_reused`` (the prior record of each) and ``rows``.
    """

    def __init__(self, plan: SavePlan, reuse: dict[ChunkKey, Any] | None, tiles: Callable[[str], int],
                 tables: set[str]):
        self.plan, self.reuse, self.tiles, self.tables = plan, reuse or {}, tiles, tables
        self.stats = UnchangedStats()
        self.verdicts: dict[ChunkKey, Verdict] = {}
        self.reused: list[tuple[str, int, md.FileRecord]] = []
        self.known_reused: dict[ChunkKey, Any] = {}
        self.rows: list[tuple[str, int, Box, str, str]] = []
        self._tiles: dict[str, int] = {}
        self._unread: list[tuple[WriteItem, Any, Any]] = []  # (item, prior, stamp) left to pass 2
        self._pending: dict[ChunkKey, tuple[Pending, Any]] = {}
        self._changed: set[tuple[str, int]] = set()  # boxes written
        self._box_hashes: dict[ChunkKey, bytes] = {}  # band -> the hash of its box's memory, taken this save
        self._planner: SavePlanner | None = None
        self._fence: StreamFence | None = None

    def _box(self, key: str, sub: int) -> tuple[str, int]:
        tiles = self._tiles.get(key)
        if tiles is None:
            tiles = self._tiles[key] = self.tiles(key)
        return key, sub // tiles

    def _record(self, ks: ChunkKey, verdict: Verdict) -> None:
        self.verdicts[ks] = verdict
        if verdict.behind_counter:
            self.stats.behind_counter.add(ks[0])

    def _written(self, items: list[WriteItem], hashed: dict[ChunkKey, bytes]) -> None:
        for item in items:
            self.stats.written_bytes += item.nbytes
            if (item.key, item.sub) not in hashed:  # hashed as it is written
                self.stats.hashed_bytes += item.nbytes

    def triage(self, planner: SavePlanner, fence: StreamFence) -> list[WriteItem]:
        """Pass 1, from version stamps alone: the chunks to write at once. A chunk without a
        stamp has no cheap test: its bytes decide at once, as they always did (hashed in
        pass 2, or written now where they cannot be hashed, e.g. a streamed snapshot, whose
        chunks must all be written in one round)."""
        self._planner, self._fence = planner, fence
        stamp_of_item = getattr(planner, "source_stamp", None)
        for item in self.plan.items:
            ks = (item.key, item.sub)
            prior = self.reuse.get(ks)
            if prior is not None and prior.box != item.box:
                prior = None
            stamp = stamp_of_item(item) if stamp_of_item is not None else None
            if known_changed(prior, stamp):
                self._changed.add(self._box(*ks))
                if prior is not None or stamp is None:  # nothing to read or record
                    self._record(ks, triage(prior, stamp, None, item.nbytes, self.stats))
                    continue
            elif stamp is None:
                if self._check(item, prior, stamp):
                    self._changed.add(self._box(*ks))
                continue
            self._unread.append((item, prior, stamp))  # spot-checked in pass 2 (a new one: for the next save)
        first = [item for item in self.plan.items if self._box(item.key, item.sub) in self._changed]
        self._written(first, {})
        return first

    @property
    def pending(self) -> bool:
        """Whether :meth:`hash_pending` has chunks to check."""
        return bool(self._unread) or any(self._box(*ks) not in self._changed for ks in self._pending)

    def _check(self, item: WriteItem, prior: Any, stamp: Any, new: dict | None = None) -> bool:
        """Tests 1 and 2 on one chunk's bytes: whether its box is found changed (a chunk left
        undecided is kept for its full hash and counts as unchanged for now). ``new``: where
        to keep the value of a chunk stored for the first time, by box and sub id."""
        ks = (item.key, item.sub)
        value = self._planner.resolve_data(item) if stamp is not None or prior is not None else None
        if new is not None and prior is None and isinstance(value, torch.Tensor):
            new.setdefault(self._box(*ks), {})[item.sub] = value
        if isinstance(value, torch.Tensor):
            self._fence.before_copy(value)
        got = triage(prior, stamp, value, item.nbytes, self.stats)
        if isinstance(got, Pending):
            if isinstance(value, _HASHABLE):
                self._pending[ks] = (got, value)  # a view of the caller's data, held until hashed
                return False
            got = settle(got, None, self.stats)  # cannot be hashed: written
        self._record(ks, got)
        return prior is None or got.digest != prior.digest

    def _spot_check(self) -> set[tuple[str, int]]:
        """The spot checks of the chunks pass 1 left; the boxes they found changed. Boxes of
        column bands stored for the first time get the hash of their memory, for later saves."""
        new: dict[tuple[str, int], dict[int, Any]] = {}
        found = {self._box(item.key, item.sub) for item, prior, stamp in self._unread
                 if self._check(item, prior, stamp, new)}
        self._unread = []
        for (key, _), bands in new.items():
            if len(bands) == self._tiles[key] > 1:
                whole = whole_box([bands[sub] for sub in sorted(bands)])
                if whole is not None:
                    d = box_digest(whole)
                    self._box_hashes.update({(key, sub): d for sub in bands})
        return found

    def _hash_whole_box(self, members: list[ChunkKey], hashed: dict[ChunkKey, bytes]) -> None:
        """Every band of one box is due for its full hash: hash the box's memory once. Where
        the hash recorded with each band's digest equals it, the bands are settled unchanged;
        otherwise the hash is kept (for the bands their own hashes then find unchanged)."""
        pend = [self._pending[ks] for ks in members]
        whole = whole_box([value for _, value in pend])
        if whole is None:
            return
        d = box_digest(whole)
        if all(getattr(p.prior, "box_digest", None) == (d, p.prior.digest) for p, _ in pend):
            for ks, (p, _) in zip(members, pend, strict=True):
                del self._pending[ks]
                verdict = settle(p, p.prior.digest, self.stats)
                self.stats.whole_box_bytes += p.nbytes
                self._record(ks, verdict)
                hashed[ks] = p.prior.digest
            return
        self._box_hashes.update({ks: d for ks in members})

    def hash_pending(self, digest: Callable[[Any], bytes | None]) -> tuple[list[WriteItem], dict[ChunkKey, bytes]]:
        """Pass 2: spot-check the chunks pass 1 left, then hash the undecided ones of boxes
        not written yet (``digest(value)``: the full hash of a chunk's bytes); the chunks of
        the boxes found changed, to write now, and the hashes taken (the writer need not
        take them again)."""
        found = self._spot_check() - self._changed
        self._changed |= found
        hashed: dict[ChunkKey, bytes] = {}
        boxes: dict[tuple[str, int], list[ChunkKey]] = {}
        for ks in self._pending:
            box = self._box(*ks)
            if box not in self._changed:
                boxes.setdefault(box, []).append(ks)
        for (key, _), members in boxes.items():
            if len(members) == self._tiles[key] > 1:
                self._hash_whole_box(sorted(members), hashed)
        for ks in list(self._pending):
            box = self._box(*ks)
            if box in self._changed:
                continue  # written anyway: settled by finish() with the hash taken while writing
            p, value = self._pending.pop(ks)
            verdict = settle(p, digest(value), self.stats)
            value = None
            if ks in self._box_hashes and verdict.digest is not None and verdict.digest == p.prior.digest:
                verdict.box_digest = (self._box_hashes[ks], verdict.digest)
            self._record(ks, verdict)
            if verdict.digest is not None:
                hashed[ks] = verdict.digest
            if verdict.digest is None or verdict.digest != p.prior.digest:
                found.add(box)
        self._changed |= found
        later = [item for item in self.plan.items if self._box(item.key, item.sub) in found]
        self._written(later, hashed)
        return later, hashed

    def finish(self, written: dict[ChunkKey, bytes]) -> None:
        """Pass 3, after the writes: settle the undecided chunks written in pass 1 with
        ``written``, the hashes taken as they were written; list the chunks reused."""
        for ks, (p, _) in self._pending.items():
            self._record(ks, settle(p, written.get(ks), self.stats, count=False))
        self._pending.clear()
        for ks, d in self._box_hashes.items():  # bands written from the memory hashed this save
            verdict = self.verdicts.get(ks)
            if ks in written and verdict is not None:
                verdict.box_digest = (d, written[ks])
        for item in self.plan.items:
            if self._box(item.key, item.sub) in self._changed:
                continue
            prior = self.reuse[(item.key, item.sub)]
            self.reused.append((item.key, item.sub, prior.file))
            self.known_reused[(item.key, item.sub)] = prior
            if item.key in self.tables:
                self.rows.append((item.key, item.sub, item.box, prior.file.dir, prior.file.name))
