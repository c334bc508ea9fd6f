"""Incremental checkpoints: write only the chunks whose bytes changed since the last step.

A checkpoint manager with ``incremental=True`` gives each save an :class:`IncrementalState`:
what this rank stored in the newest committed step — for every chunk it is responsible for
(the writer rule gives a rank the same chunks at every step while the layouts stay the
same), the chunk's 128-bit content hash (xxh3-128) and the data file that holds its bytes.

At the next save the rank hashes each chunk it is to write. A chunk whose key has the same
kind, dtype, shape, layout and store as before, whose box is the same, and whose hash is
equal is not written: the new ``.metadata`` names the earlier step's file instead (grid
stores say, per box, which step directory holds it; see ``docs/format.md``). Every other
chunk is written and hashed as it streams out. Nothing is called unchanged without a full
128-bit hash comparison of its bytes.

References always point at the step that holds the bytes (never at a step that only
references them), and only at sibling step directories of the same manager, by plain
name. After a failed save the state is dropped and the next save writes everything; the
same after a restart (a new manager starts with an empty state).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..base.box import Box
from ..format import metadata as md
from ..format.validation import step_dir_name, step_of


@dataclass(frozen=True)
class KnownChunk:
    """A chunk a rank stored (or referenced) in the newest committed step."""

    digest: bytes
    file: md.FileRecord  # where its bytes are, as the NEXT step names it (dir = a sibling step)
    box: Box
    spec: tuple  # the key's (kind, dtype, shape, layout, store) at that step


def spec_of(entry: Any) -> tuple:
    """What must not change for a chunk to be reused: kind, dtype, shape, layout and store."""
    store = entry.store
    store_key = (store.tiles, store.offset, store.copies, store.writer, repr(store.layout)) \
        if isinstance(store, md.GridStore) else None
    return (entry.kind, entry.dtype, tuple(entry.shape or ()), repr(entry.layout), store_key)


@dataclass
class IncrementalState:
    """One rank's memory of the newest committed step, for the manager's next save."""

    known: dict[tuple[str, int], KnownChunk] = field(default_factory=dict)
    step_dir: str | None = None  # the directory the save in progress writes

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
        """Forget everything: the next save writes every chunk."""
        self.known.clear()

    def reusable(self, entries: dict[str, Any]) -> dict[tuple[str, int], KnownChunk]:
        """The known chunks whose key is stored the same way in ``entries`` (the new plan)."""
        specs = {k: spec_of(e) for k, e in entries.items() if e.kind != "object"}
        return {ks: c for ks, c in self.known.items() if specs.get(ks[0]) == c.spec}

    def committed(self, entries: dict[str, Any], written: dict[tuple[str, int], tuple[bytes, Box, str]],
                  reused: dict[tuple[str, int], KnownChunk], meta: md.Metadata) -> None:
        """The save into ``step_dir`` committed: remember what this rank stored.

        ``written``: (key, sub) -> (content hash, box, name of the data file it is in);
        ``reused``: the known chunks this save referenced instead of writing them.
        """
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
            known[ks] = KnownChunk(digest, moved, box, specs[ks[0]])
        for ks, chunk in reused.items():
            if ks[0] in specs:
                known[ks] = KnownChunk(chunk.digest, chunk.file, chunk.box, specs[ks[0]])
        self.known = known
