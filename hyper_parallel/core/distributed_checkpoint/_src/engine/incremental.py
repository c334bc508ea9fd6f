"""Incremental checkpoints: write only the chunks whose bytes changed since the last step.

A checkpoint manager with ``incremental=True`` gives each save an :class:`IncrementalState`:
what this rank stored in the newest committed step — for every chunk it is responsible for
(the writer rule gives a rank the same chunks at every step while the layouts stay the
same), the chunk's 128-bit content hash (xxh3-128), the data file that holds its bytes, and
what tells without reading them that the tensor still holds those bytes: the tensor's
:class:`~..state.version_stamp.VersionStamp` (its memory and torch's version counter) and a
spot-check hash of ~32 KiB of it.

At the next save a chunk whose key has the same kind, dtype, shape, layout and store as
before and whose box is the same is checked (:mod:`..transfer.unchanged`): an unchanged
stamp plus a matching spot check reuse it unread, in what a step costs nothing but the spot
check; otherwise its full hash decides. Reused chunks are not written: the new ``.metadata``
names the earlier step's file instead (grid stores say, per box, which step directory holds
it; see ``docs/format.md``). Every other chunk is written and hashed as it streams out.

**What decides "unchanged"** (``check``):

- ``"content"`` (the default): every chunk stored before is hashed in full at every save
  (xxh3-128 of its bytes, threaded beside the writes; a box of column bands is one hash of its
  own memory, see :mod:`..transfer.unchanged`) and reused only when the hash equals the stored
  one. Every committed step holds exactly the bytes the state had at the call, whatever wrote
  the memory. torch's version counter only ever makes a save *write* a chunk without hashing
  it first (its memory was written in place since), never reuse one.
- ``"version_counter"`` (an explicit opt-in): a chunk whose version stamp did not move and
  whose spot check matches is reused *unread*. A version counter misses some writes (the list
  is in :mod:`..state.version_stamp`: ``p.data[i] += x``, ``t.numpy()`` and DLPack views,
  ``untyped_storage()``/ctypes/raw-pointer kernels, torch's fused optimizers, in-place
  collectives), so the stamp is backed by:

  - the spot check (~32 KiB at spread places), which catches writes that touch the whole
    tensor (fused optimizers, custom kernels, ``.data.copy_``) at the first save after them;
  - a rotating full hash: each save hashes the chunks reused unread for longest, about
    ``1/rehash_every`` of their bytes, and every chunk at least once every ``rehash_every``
    saves (default 8). A sparse write behind the counter (one element, a few rows) that no
    spot check touches is therefore committed stale by up to ``rehash_every - 1`` saves in a
    row: they load without error and verify, holding the bytes of before the write;
  - a key once found changed under an unchanged stamp is hashed in full at every later save
    of this state, and a warning names it when an earlier step may have referenced stale bytes.

``rehash_every=1`` under ``"version_counter"`` hashes every chunk at every save, as
``"content"`` does.

References always point at the step that holds the bytes (never at a step that only
references them), and only at sibling step directories of the same manager, by plain
name. After a failed save the state is dropped and the next save writes everything; the
same after a restart (a new manager starts with an empty state).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

from ..base.box import Box
from ..base.dtypes import itemsize
from ..format import metadata as md
from ..format.validation import step_dir_name, step_of
from ..state.version_stamp import VersionStamp
from ..transfer.unchanged import UnchangedStats, Verdict

DEFAULT_REHASH_EVERY = 8
CONTENT = "content"  # every chunk hashed at every save: exact whatever wrote the memory
VERSION_COUNTER = "version_counter"  # opt-in: trust torch's version counter, re-hash on a rotation
CHECKS = (CONTENT, VERSION_COUNTER)


@dataclass(frozen=True)
class KnownChunk:
    """A chunk a rank stored (or referenced) in the newest committed step.

    ``stamp`` and ``sample``: the source tensor's version stamp and the chunk's spot-check hash
    when its bytes were last known to be these; ``hashed_at``: the save (counted by the state)
    that last hashed it in full; ``skipped``: reused unread since then; ``trust``: set for one
    save by :meth:`IncrementalState.reusable`, whether its stamp may stand for a full hash;
    ``box_digest``: for a column band, (the hash of its whole box's memory while every band
    held its stored bytes, its own digest then): its full hash can then be one hash of the box
    (see ``whole_box``) while its digest is still that one.
    """

    digest: bytes
    file: md.FileRecord  # where its bytes are, as the NEXT step names it (dir = a sibling step)
    box: Box
    spec: tuple  # the key's (kind, dtype, shape, layout, store) at that step
    stamp: VersionStamp | None = None
    sample: bytes | None = None
    hashed_at: int = 0
    skipped: bool = False
    trust: bool = False
    box_digest: tuple[bytes, bytes] | None = None

    @property
    def nbytes(self) -> int:
        return self.box.numel * itemsize(self.spec[1]) if self.spec[1] else 0


def spec_of(entry: Any) -> tuple:
    """What must not change for a chunk to be reused: kind, dtype, shape, layout and store."""
    store = entry.store
    store_key = (store.tiles, store.offset, store.copies, store.writer, repr(store.layout)) \
        if isinstance(store, md.GridStore) else None
    return (entry.kind, entry.dtype, tuple(entry.shape or ()), repr(entry.layout), store_key)


@dataclass
class IncrementalState:
    """One rank's memory of the newest committed step, for the manager's next save.

    Args:
        check: what decides that a chunk is unchanged (see the module docstring):
            ``"content"`` (default) its full hash at every save; ``"version_counter"``
            its version stamp and spot check, with a rotating full hash.
        rehash_every: under ``"version_counter"``, every chunk reused unread is hashed in
            full at least once every this many saves (default 8; the oldest first,
            ~1/rehash_every of their bytes per save); 1: hash every chunk at every save.
            Under ``"content"`` only None or 1 (what it does anyway) are accepted.
    """

    known: dict[tuple[str, int], KnownChunk] = field(default_factory=dict)
    step_dir: str | None = None  # the directory the save in progress writes
    rehash_every: int | None = None
    check: str = CONTENT
    saves: int = 0  # committed saves so far
    untracked: set[str] = field(default_factory=set)  # keys written behind the version counter
    last: UnchangedStats | None = None  # what the last committed save's checks cost and found

    def __post_init__(self) -> None:
        if self.check not in CHECKS:
            raise ValueError(f"check must be one of {CHECKS} (what decides that a chunk is unchanged), "
                             f"found {self.check!r}")
        if self.rehash_every is None:
            self.rehash_every = 1 if self.check == CONTENT else DEFAULT_REHASH_EVERY
        if isinstance(self.rehash_every, bool) or not isinstance(self.rehash_every, int) or self.rehash_every < 1:
            raise ValueError(f"rehash_every must be an int >= 1 (1: hash every chunk at every save), "
                             f"found {self.rehash_every!r}")
        if self.check == CONTENT and self.rehash_every != 1:
            raise ValueError(f"rehash_every={self.rehash_every} configures check={VERSION_COUNTER!r}: the default "
                             f"check {CONTENT!r} hashes every chunk at every save. Pass check={VERSION_COUNTER!r} "
                             "to trust torch's version counter between rotating re-hashes")

    def begin(self, step_dir: str) -> None:
        """A save into ``step_dir`` starts (the manager calls it before each save).

        Raises ValueError unless ``step_dir`` is a step directory name
        (:func:`~.validation.step_dir_name`): the next step names it in ``dirs``, where readers
        accept nothing else.
        """
        if step_of(step_dir) is None:
            raise ValueError(f"incremental saves go into step directories named like {step_dir_name(1)!r} "
                             f"(the next step references this one by that name), not {step_dir!r}")
        self.step_dir = step_dir

    def reset(self) -> None:
        """Forget everything stored: the next save writes every chunk (keys known to be
        written behind the version counter stay known)."""
        self.known.clear()

    def reusable(self, entries: dict[str, Any]) -> dict[tuple[str, int], KnownChunk]:
        """The known chunks whose key is stored the same way in ``entries`` (the new plan),
        each with ``trust`` set where its stamp may stand for a full hash at this save."""
        specs = {k: spec_of(e) for k, e in entries.items() if e.kind != "object"}
        same = {ks: c for ks, c in self.known.items() if specs.get(ks[0]) == c.spec}
        now = self.saves + 1
        stamped = sorted((c.hashed_at, ks) for ks, c in same.items()
                         if c.stamp is not None and ks[0] not in self.untracked)
        due = {ks for at, ks in stamped if now - at >= self.rehash_every}
        if self.rehash_every > 1:  # spread the full hashes: the oldest first, ~1/rehash_every of the bytes
            budget = sum(same[ks].nbytes for _, ks in stamped) / self.rehash_every
            spent = sum(same[ks].nbytes for ks in due)
            for _, ks in stamped:
                if spent >= budget:
                    break
                if ks not in due:
                    due.add(ks)
                    spent += same[ks].nbytes
        # under "content" nothing is trusted: every chunk is hashed in full (rehash_every is 1)
        trusted = {ks for _, ks in stamped} - due if self.check == VERSION_COUNTER else set()
        # (built directly: dataclasses.replace costs ~10x more, and a step checks every chunk)
        return {ks: KnownChunk(digest=c.digest, file=c.file, box=c.box, spec=c.spec, stamp=c.stamp,
                               sample=c.sample, hashed_at=c.hashed_at, skipped=c.skipped, trust=ks in trusted,
                               box_digest=c.box_digest)
                for ks, c in same.items()}

    def committed(self, entries: dict[str, Any], written: dict[tuple[str, int], tuple[bytes, Box, str]],
                  reused: dict[tuple[str, int], KnownChunk], meta: md.Metadata,
                  verdicts: dict[tuple[str, int], Verdict] | None = None,
                  stats: UnchangedStats | None = None) -> None:
        """The save into ``step_dir`` committed: remember what this rank stored.

        ``written``: (key, sub) -> (content hash, box, name of the data file it is in);
        ``reused``: the known chunks this save referenced instead of writing them;
        ``verdicts``/``stats``: the saver's checks of every chunk (:mod:`..transfer.unchanged`).
        """
        verdicts = verdicts or {}
        self.saves += 1
        now = self.saves
        behind = set(stats.behind_counter) if stats is not None else set()
        stale = sorted({ks[0] for ks, v in verdicts.items() if v.behind_counter and ks in self.known
                        and self.known[ks].skipped})
        self.untracked |= behind
        files = {f.name: f for f in meta.files if not f.dir}
        specs = {k: spec_of(e) for k, e in entries.items() if e.kind != "object"}
        known: dict[tuple[str, int], KnownChunk] = {}
        for ks, (digest, box, name) in written.items():
            f = files.get(name)
            if f is None or ks[0] not in specs:
                continue
            # as the next step will see it: a file of this step's (sibling) directory
            moved = md.FileRecord(f.name, self.step_dir or "", f.rank, f.index_offset, f.index_length,
                                  f.index_crc, f.size)
            v = verdicts.get(ks)
            known[ks] = KnownChunk(digest, moved, box, specs[ks[0]], v.stamp if v else None,
                                   v.sample if v else None, now, box_digest=v.box_digest if v else None)
        for ks, chunk in reused.items():
            if ks[0] not in specs:
                continue
            v = verdicts.get(ks)
            unread = v is not None and v.unread
            known[ks] = KnownChunk(chunk.digest, chunk.file, chunk.box, specs[ks[0]], v.stamp if v else None,
                                   v.sample if v else None, chunk.hashed_at if unread else now, unread,
                                   box_digest=v.box_digest if v else None)
        self.known = known
        self.last = stats
        if stale:
            warnings.warn(
                f"incremental checkpoint: {stale[:8]}{' ...' if len(stale) > 8 else ''} changed without torch's "
                "version counter moving (a write through .data, numpy or a raw-pointer kernel). This step "
                "stores their new bytes, but the steps before it that reused them unread (at most the last "
                f"{self.rehash_every - 1}) may hold older ones. These keys are "
                "hashed at every save from now on; write them in place through torch, or drop "
                "incremental_check='version_counter' (the default check hashes everything)", stacklevel=2)
