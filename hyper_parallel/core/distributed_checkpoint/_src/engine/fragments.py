"""Rank-local checkpoints: every rank writes its own shards and metadata, with no collective.

``save(sd, path, use_collectives=False)`` on rank ``r`` of ``N`` writes ``r``'s data files
and then, atomically, ``.metadata-r<r:05d>``: a metadata *fragment* describing only the
chunks ``r`` holds (a table store per key) and recording ``(r, N)``. Nothing is
deduplicated and no rank waits for another, which is what code written for
HyperParallel's and torch's rank-local checkpointing expects.

Readers:

- ``load(..., use_collectives=False)`` on rank ``r`` reads only its own fragment: a
  same-layout load (every target region must be in ``r``'s own chunks).
- Every other reader (a collective or one-process load, a load under another layout,
  ``inspect``, ``verify``, ``reshard``) reads all fragments and treats them as one
  checkpoint: they must all be present (ranks ``0..N-1``, the same ``N``), agree on each
  key's kind, dtype and shape, and carry the same ``user_metadata``; otherwise the reader
  raises, naming the missing or disagreeing ranks. Never a silently incomplete load.

A directory that holds a committed ``.metadata`` is a collective checkpoint: its fragments,
if any, are ignored (and a rank-local save refuses to write there).

Saving over a rank-local checkpoint: a rank whose save fails keeps its old fragment (if
every rank fails, the old checkpoint stays whole) and writes ``.metadata-r<r>.failed``
beside it; its next successful save removes that marker. A reader that finds some ranks
marked and others not refuses (the marked fragments are older than the others'); all marked
is the old checkpoint, whole. The marker is written *before* the rank writes anything (it
names the fragment being replaced) and removed once the new fragment is committed, so a rank
killed outright mid-save (no ``except`` runs) leaves it too: a killed rank's old fragment
never loads beside the others' new ones, and marked ranks of which some had committed their
new fragment are refused as well. What no marker can show: a rank that had not *started* its
save when the job died (its old fragment is then unmarked, like a finished one); such a mix is
told apart only by ``user_metadata``, so put the step there (the checkpoint manager does).
Rank 0 also removes the fragments of ranks beyond its world size (a bigger world's earlier
save), so they do not make readers refuse.
"""

from __future__ import annotations

import json
import re
import warnings
from typing import Any

import numpy as np

from ..backends.protocol import StorageReader, StorageWriter
from ..base.errors import CorruptCheckpointError, MetadataError, NotACheckpointError
from ..format import metadata as md
from ..format.values import encode_value
from ..planning.planner import WriteItem

_FRAGMENT = re.compile(r"^\.metadata-r(\d{5,7})$")


def fragment_name(rank: int) -> str:
    """The file name of rank ``rank``'s metadata fragment."""
    return f".metadata-r{rank:05d}"


def fragment_ranks(names: list[str]) -> list[int]:
    """The ranks whose fragments are among ``names`` (a directory listing)."""
    return sorted(int(m.group(1)) for n in names if (m := _FRAGMENT.match(n)))


_FAILED = re.compile(r"^\.metadata-r(\d{5,7})\.failed$")


def failed_name(rank: int) -> str:
    """The marker a rank whose rank-local save failed leaves beside its (older) fragment."""
    return f"{fragment_name(rank)}.failed"


def failed_ranks(names: list[str]) -> set[int]:
    return {int(m.group(1)) for n in names if (m := _FAILED.match(n))}


def mark_in_progress(writer: StorageWriter, rank: int, replacing: str) -> None:
    """Before a rank-local save writes anything: mark this rank's fragment (save id
    ``replacing``) as about to be replaced. A rank killed outright (no ``except`` runs) then
    still leaves the mark, so its old fragment never loads beside the others' newer ones. Raises
    if the mark cannot be written: the save must not start unmarked."""
    writer.commit(json.dumps({"replacing": replacing, "error": "save in progress (or killed)"}).encode(),
                  failed_name(rank))


def mark_failed(writer: StorageWriter, rank: int, exc: BaseException, replacing: str | None = None) -> None:
    """Mark this rank's fragment (save id ``replacing``) as older than a save that failed
    (best effort: warns)."""
    try:
        writer.commit(json.dumps({"replacing": replacing, "error": f"{type(exc).__name__}: {exc}"[:500]}).encode(),
                      failed_name(rank))
    except Exception as err:  # the save's own error is the one to raise
        warnings.warn(f"rank-local save of rank {rank} failed and could not mark its older fragment ({err}); "
                      "a reader may take it for part of the others' newer save", stacklevel=3)


def unmark_failed(writer: StorageWriter, rank: int) -> None:
    try:
        writer.remove([failed_name(rank)])
    except Exception as err:
        warnings.warn(f"rank {rank}: could not remove {failed_name(rank)} ({err}); readers will refuse the "
                      "checkpoint until it is removed", stacklevel=3)


def check_not_mixed(failed: set[int], world: int, where: str, reader: StorageReader | None = None,
                    fragments: list[md.Metadata] | None = None) -> None:
    """Refuse fragments of which some are older than the others (their rank's last save failed,
    or was killed). Every rank marked is the old checkpoint, whole, unless some of them had
    committed their new fragment before they stopped (the mark names the fragment it replaces):
    then the marked fragments are of two saves, refused too. ``reader``/``fragments`` give the
    marks' contents and the fragments' save ids (read only when every rank is marked)."""
    if failed and not set(range(world)) <= failed:
        raise MetadataError(
            f"{where}: the last rank-local save failed on rank(s) {sorted(failed)[:20]} (or was killed there), "
            f"whose fragments are older than the other ranks' ({failed_name(min(failed))} says why); they do not "
            "form one checkpoint. Save again from every rank")
    if not failed or reader is None or fragments is None:
        return
    newer = []
    for frag in fragments:
        rank = frag.fragment[0]  # type: ignore[index]
        try:
            mark = json.loads(read_small(reader, failed_name(rank)))
        except Exception:  # an unreadable mark: it still says "older"
            continue
        replacing = mark.get("replacing") if isinstance(mark, dict) else None
        if replacing is not None and replacing != frag.save_id:
            newer.append(rank)
    if newer and len(newer) < len(fragments):
        raise MetadataError(
            f"{where}: every rank's last rank-local save failed or was killed, but rank(s) {newer[:20]} had already "
            "committed their new fragments and the others had not; they do not form one checkpoint. Save again "
            "from every rank")


def check_own_fragment(reader: StorageReader, frag: md.Metadata, where: str) -> None:
    """For a rank-local load of its own fragment: when this rank's last save failed, the
    other ranks must have failed too (else their fragments are newer than this one). Costs
    one missing-file lookup when it did not fail."""
    rank, world = frag.fragment  # type: ignore[misc]
    try:
        reader.file_size(failed_name(rank))
    except (NotACheckpointError, CorruptCheckpointError, OSError):  # no marker: the usual case
        return
    try:
        names = reader.list_files()
    except (NotImplementedError, OSError):
        names = [failed_name(rank)]
    check_not_mixed(failed_ranks(names), world, where)


def read_small(reader: StorageReader, name: str) -> bytes:
    """A whole (small) file of the checkpoint, through the reader's byte-range interface."""
    buf = bytearray(reader.file_size(name))
    reader.read_into(name, 0, memoryview(buf))
    return bytes(buf)


def read_fragment(reader: StorageReader, rank: int, where: str = "checkpoint") -> md.Metadata:
    """Rank ``rank``'s fragment, parsed and checked to be that rank's."""
    name = fragment_name(rank)
    try:
        raw = read_small(reader, name)
    except Exception as exc:
        raise NotACheckpointError(f"{where} has no metadata fragment of rank {rank} ({name}): {exc}") from None
    meta = md.Metadata.from_json(raw, where=f"{where}/{name}")
    if meta.fragment is None or meta.fragment[0] != rank:
        raise MetadataError(f"{where}/{name} is not rank {rank}'s fragment (it says {meta.fragment})")
    return meta


def merge_fragments(fragments: list[md.Metadata], where: str = "checkpoint") -> md.Metadata:
    """One checkpoint from every rank's fragment (see the module docstring for the rules)."""
    worlds = {f.fragment[1] for f in fragments}
    if len(worlds) != 1:
        by = {f.fragment[0]: f.fragment[1] for f in fragments}
        raise MetadataError(f"{where}: the rank-local fragments come from saves of different world sizes "
                            f"({by}); remove the stale ones")
    world = worlds.pop()
    have = {f.fragment[0] for f in fragments}
    missing = sorted(set(range(world)) - have)
    if missing:
        raise MetadataError(
            f"{where}: a rank-local checkpoint of {world} ranks, but the metadata fragment(s) of rank(s) "
            f"{missing[:20]} are missing; their shards cannot be loaded (save again from every rank)")
    fragments = sorted(fragments, key=lambda f: f.fragment[0])
    users = {repr(f.user) for f in fragments}
    if len(users) != 1:
        raise MetadataError(f"{where}: the rank-local fragments carry different user_metadata "
                            f"({sorted(users)[:3]}); they come from different saves")
    files: list[md.FileRecord] = []
    entries: dict[str, md.Entry] = {}
    rows: dict[str, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = {}
    differ: list[str] = []  # plain values the ranks saved differently
    for frag in fragments:
        base = len(files)
        files.extend(frag.files)
        for key, e in frag.entries.items():
            seen = entries.get(key)
            if seen is None:
                entries[key] = md.Entry(key, e.kind, e.path, e.dtype, e.shape, e.layout, e.value)
            elif (seen.kind, seen.dtype, seen.shape) != (e.kind, e.dtype, e.shape):
                raise MetadataError(f"{where}: {key!r} differs between rank-local fragments: "
                                    f"{seen.kind} {seen.dtype} {seen.shape} vs {e.kind} {e.dtype} {e.shape} "
                                    f"(rank {frag.fragment[0]})")
            elif e.kind == "object" and seen.value is not e.value and (
                    seen.value != e.value or encode_value(seen.value) != encode_value(e.value)):
                differ.append(key)
            if isinstance(e.store, md.TableStore):
                subs = e.store.subs if e.store.subs is not None else np.arange(len(e.store))
                rows.setdefault(key, []).append((e.store.offsets, e.store.sizes, e.store.file + base, subs))
    for key, parts in rows.items():
        entry = entries[key]
        ndim = len(entry.shape or ())
        n = sum(len(p[2]) for p in parts)  # chunks (a 0-d tensor's boxes have no columns: not -1)
        entry.store = md.TableStore(np.concatenate([p[0] for p in parts]).reshape(n, ndim),
                                    np.concatenate([p[1] for p in parts]).reshape(n, ndim),
                                    np.concatenate([p[2] for p in parts]).astype(np.int32),
                                    subs=np.concatenate([p[3] for p in parts]).astype(np.int32))
    if differ:
        keys = sorted(set(differ))
        warnings.warn(f"{where}: the ranks' fragments hold different plain values under {len(keys)} key(s) "
                      f"({', '.join(map(repr, keys[:8]))}{' ...' if len(keys) > 8 else ''}); read as one "
                      "checkpoint it gives rank 0's. load(..., use_collectives=False) gives each rank its own",
                      stacklevel=3)
    merged = md.Metadata(entries, fragments[0].save_id, world, user=fragments[0].user, files=files)
    return merged


def fragment_of(meta: md.Metadata, rank: int, world: int) -> md.Metadata:
    """Mark a rank's metadata as its fragment of a rank-local checkpoint."""
    meta.fragment = (rank, world)
    return meta


def table_sub_ids(entries: dict[str, Any], items: list[Any]) -> list[Any]:
    """Items of a rank-local save with sub ids 0..n-1 per key (each rank's own table)."""
    counts: dict[str, int] = {}
    out = []
    for item in items:
        out.append(WriteItem(item.key, item.box, item.nbytes, counts.get(item.key, 0)))
        counts[item.key] = counts.get(item.key, 0) + 1
    return out
