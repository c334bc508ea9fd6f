"""The commit protocol: when a save becomes the checkpoint, and who may delete what.

A save goes through these points, on every rank of the group:

1. **Write.** Each rank writes its data files under names that carry the save's id, so
   nothing of the checkpoint being replaced is ever overwritten.
2. **Report.** Each rank reports its outcome to the coordinator. A rank whose own work
   failed (it reported an error, or never reported) removes its new files: the coordinator
   never commits without every rank's success.
3. **Commit** (coordinator). The directory is listed once: a ``.metadata`` naming a data
   file that is not there (removed during the save) is refused, and the old checkpoint stays
   (:func:`check_files_present`). ``.metadata`` is written under a temporary name and atomically
   put in place (:meth:`StorageWriter.commit`). *This is the point of no return*: from now
   on nothing deletes the new data. If ``commit`` raises, the coordinator asks the storage
   what ``.metadata`` now holds: its own bytes mean committed after all (the error becomes
   a warning), anything else means not committed.
4. **Verdict.** Every rank learns the coordinator's outcome in one exchange. Not committed:
   every rank removes its new files and raises :class:`RankFailedError`; the old checkpoint
   is whole. Committed: the save returns.
5. **Reclaim** (every rank, after the verdict). The files of the replaced checkpoint are
   removed: the coordinator lists them, each with the rank its record names (the rank that
   wrote it, for a save), and sends the list with the committed metadata; each rank removes
   the files recorded under its rank, and those of ranks beyond the group are shared out.
   So no rank removes N files while the others wait for it; the save returns once every rank
   has removed its share. Files a sibling step still reads (a plain save over a manager's
   step directory) are kept (:func:`spare_siblings_files`). Best effort: a file that cannot
   be removed is a warning naming it, never an error, and it stays as an unreferenced file
   that ``hyper-dcp gc`` (or the checkpoint manager's sweep) reclaims later.

What a rank sees when a peer dies or hangs (the exchange fails with
:class:`LostContactError`):

- Before a rank reported success: it raises ``LostContactError`` and removes its files.
- After it reported success, before the verdict, on a rank other than the coordinator: it
  raises :class:`CommitError` with ``committed=None`` (the save may have committed; ``load``
  decides) and keeps its files, which the new ``.metadata`` may name.
- During the verdict, on the coordinator: ``CommitError(committed=True)`` if it committed
  (files kept), else ``LostContactError`` (files removed).

So the path always holds either the previous checkpoint or the new one, each whole; the
only debris a failure can leave is unreferenced data files.
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from ..backends.protocol import StorageWriter
from ..backends.resolve import reader_for
from ..base.errors import (
    CheckpointError,
    CommitError,
    LostContactError,
    NotACheckpointError,
    RankFailedError,
    StorageTimeoutError,
)
from ..coordination.coordinator import Coordinator
from ..format import metadata as md
from .fragments import failed_name, fragment_name, fragment_ranks
from .metadata_reader import metadata_bytes
from .phase_result import PhaseResult
from .step_siblings import SiblingsUnknownError, files_siblings_name

T = TypeVar("T")


def write_and_report(coord: Coordinator, writer: StorageWriter, phase: str, write: Callable[[], T],
                     own_files: list[str], what: str, save_id: str) -> list[T] | None:
    """Steps 1-2: run ``write`` (then the writer's ``flush``) and hand its result to the
    coordinator (payloads on the coordinator, None elsewhere). On failure, this rank's files are removed unless the
    coordinator may already commit them."""
    reported = False

    def run() -> T:
        nonlocal reported
        result = write()
        flush = getattr(writer, "flush", None)  # protocol writers that do not subclass StorageWriter
        if flush is not None:
            flush()  # a writer that defers syncing makes its files durable before the commit
        reported = True
        return result

    try:
        return coord.gather_to_coordinator(phase, run)
    except LostContactError as lost:
        if reported and not coord.is_coordinator:
            raise CommitError(
                f"{what}: lost contact with the coordinator after this rank's data was written ({lost}); "
                f"the save (id {save_id}) may have committed or not. load() decides", None, save_id) from lost
        remove_own_files(writer, own_files)
        raise
    except BaseException:
        remove_own_files(writer, own_files)
        raise


@dataclass(frozen=True)
class _Committed:
    """What the commit leaves on the coordinator: the Metadata it committed, what it replaced
    and the committed bytes (all None unless committed), or the error that stopped it."""

    meta: md.Metadata | None = None
    previous: Any = None
    payload: bytes | None = None
    error: BaseException | None = None


def _commit_here(coord: Coordinator, writer: StorageWriter, make_meta: Callable[[], md.Metadata],
                 guard: Callable[[bytes | None], None] | None) -> tuple[_Committed, tuple[str, str | None] | None]:
    """Step 3 on each rank: the coordinator commits; its verdict ("committed", "unknown" or
    "failed", with the cause) is what the other ranks learn. Never raises: a failure is a verdict."""
    if not coord.is_coordinator:
        return _Committed(), None
    try:
        meta = make_meta()
        previous, payload = commit_metadata(writer, meta, guard=guard)
        return _Committed(meta, previous, payload), ("committed", None)
    except CommitError as exc:
        return _Committed(error=exc), ("unknown", str(exc))
    except BaseException as exc:
        return _Committed(error=exc), ("failed", f"{type(exc).__name__}: {exc}")


def commit_and_agree(coord: Coordinator, writer: StorageWriter, phase: str, make_meta: Callable[[], md.Metadata],
                     own_files: list[str], what: str, save_id: str,
                     guard: Callable[[bytes | None], None] | None = None) -> md.Metadata:
    """Steps 3-5: the coordinator commits ``make_meta()``; every rank learns the verdict and
    gets the committed Metadata (the coordinator broadcasts it); raises as the module
    docstring says. ``guard`` (see :func:`commit_metadata`) may refuse to replace what the
    storage holds.
    """
    committing: PhaseResult[_Committed, Any] = PhaseResult(lambda: _commit_here(coord, writer, make_meta, guard))
    try:
        statuses, own = coord.statuses(phase, committing.shared)
    except LostContactError as lost:
        done = committing.kept_or_none or _Committed()
        if done.meta is not None:
            raise CommitError(f"{what} is committed (save id {save_id}), but contact with other ranks was lost "
                              f"during the commit: {lost}", True, save_id) from lost
        if isinstance(done.error, CommitError) or not coord.is_coordinator:
            raise CommitError(f"{what}: lost contact with the other ranks during the commit ({lost}); the save "
                              f"(id {save_id}) may have committed or not. load() decides", None, save_id) from lost
        remove_own_files(writer, own_files)
        raise
    done = committing.kept
    _raise_unless_committed(coord, writer, phase, statuses[coord.coordinator_rank], done, own_files, save_id)
    if own is not None:  # committed; a rank interrupted meanwhile still raises its interruption
        raise own
    payload = _share_and_reclaim(coord, writer, phase, done, what, save_id)
    if coord.is_coordinator:
        return done.meta
    return md.Metadata.from_json(payload)


def _raise_unless_committed(coord: Coordinator, writer: StorageWriter, phase: str, status: tuple[str, Any],
                            done: _Committed, own_files: list[str], save_id: str) -> None:
    """Step 4: every rank raises alike unless the coordinator's verdict is "committed" (a
    failed commit removes this rank's files; an unknown one leaves them for load to judge)."""
    kind, detail = status[1] if status[0] == "ok" else ("failed", status[1])
    if kind == "failed":
        remove_own_files(writer, own_files)
        error = done.error
        if not coord.distributed and error is not None:  # alone: the storage's own error, as it was
            raise error.__cause__ if isinstance(error, NotCommittedError) and error.__cause__ else error
        raise RankFailedError(phase, {coord._name(coord.coordinator_rank): detail}) from error
    if kind == "unknown":
        error = done.error
        raise error if isinstance(error, CommitError) else CommitError(detail, None, save_id)


def _share_and_reclaim(coord: Coordinator, writer: StorageWriter, phase: str, done: _Committed, what: str,
                       save_id: str) -> bytes | None:
    """Step 5: the committed bytes reach every rank (returned), and each removes its share of
    the replaced checkpoint's files."""
    # Every rank returns the committed metadata (the coordinator's, parsed) and removes its
    # share of the replaced checkpoint's files: those recorded under its rank (for a save,
    # the ones it wrote, so on storage only their writer sees they are still reachable).
    # The coordinator no longer unlinks N files alone while the job waits for it (~80 ms
    # per 512 MiB file on ext4 here); a save returns once every rank removed its share.
    garbage = (spare_siblings_files(writer, replaced_files(done.previous, done.meta.file_names()))
               if coord.is_coordinator else None)
    try:
        payload, garbage = coord.broadcast((done.payload, garbage), f"{phase} (metadata)")
    except LostContactError as lost:
        raise CommitError(f"{what} is committed (save id {save_id}), but contact with other ranks was lost "
                          f"right after: {lost}", True, save_id) from lost
    if garbage:  # (the same list on every rank) removed everywhere before any rank returns
        mine = [name for i, (name, rank) in enumerate(garbage)
                if (rank if 0 <= rank < coord.world_size else i) % coord.world_size == coord.rank]
        try:
            _, own = coord.statuses(f"{phase} (reclaim)", lambda: remove_replaced(writer, mine))
        except LostContactError as lost:
            raise CommitError(f"{what} is committed (save id {save_id}), but contact with other ranks was lost "
                              f"while the replaced checkpoint's files were removed: {lost}", True, save_id) from lost
        if own is not None:  # committed; an interruption during the removal is still raised
            raise own
    return payload


class NotCommittedError(Exception):
    """Internal: the coordinator's commit failed and ``.metadata`` is unchanged."""


def commit_metadata(writer: StorageWriter, meta: md.Metadata, name: str = md.METADATA_FILE,
                    guard: Callable[[bytes | None], None] | None = None) -> tuple[bytes | None, bytes]:
    """Put ``meta`` in place as the checkpoint's ``.metadata`` (or fragment ``name``); the
    point of no return. ``guard`` is called with the bytes of the metadata about to be
    replaced (None: none) and may raise to refuse: then nothing is committed.

    Returns the bytes of the metadata it replaced (None if there was none or it could not
    be read), for :func:`replaced_files` to use after the verdict, and the bytes committed.

    Raises:
        NotCommittedError: the storage kept the previous ``.metadata`` (cause chained).
        CommitError: ``commit`` failed and what the storage holds now cannot be read
            (``committed=None``).
    """
    other = {} if name == md.METADATA_FILE else {"name": name}
    try:
        previous = writer.read_committed(**other)
    except Exception as exc:  # an unreadable old checkpoint: commit anyway, reclaim nothing
        warnings.warn(f"could not read the checkpoint being replaced ({exc}); its data files will "
                      "not be removed after the commit", stacklevel=3)
        previous = None
    if guard is not None:
        guard(previous)
    check_files_present(writer, meta)
    payload = meta.to_json()
    try:
        writer.commit(payload, **other)
        return previous, payload
    except BaseException as exc:
        if isinstance(exc, StorageTimeoutError):  # the write may still land after any probe now
            raise CommitError(
                f"committing .metadata got no answer from the storage in time ({exc}); the write may still "
                f"land, so the checkpoint is either this save (save id {meta.save_id}) or the previous one, "
                "both whole (every rank keeps its files). load() decides", None, meta.save_id) from exc
        try:
            now = writer.read_committed(**other)
        except Exception as probe:
            raise CommitError(
                f"committing .metadata failed ({type(exc).__name__}: {exc}) and the storage could not "
                f"say what it holds now ({probe}); the checkpoint is either this save (save id "
                f"{meta.save_id}) or the previous one. load() decides", None, meta.save_id) from exc
        if now != payload:
            raise NotCommittedError(f"{type(exc).__name__}: {exc}") from exc
        warnings.warn(f"the checkpoint is committed (save id {meta.save_id}), but the storage reported "
                      f"an error after putting .metadata in place: {type(exc).__name__}: {exc}", stacklevel=3)
        return previous, payload


def replaced_files(previous: bytes | None, keep: Iterable[str]) -> list[tuple[str, int]]:
    """The data files of a replaced checkpoint (its ``.metadata`` bytes, ``previous``) that
    the new one does not use (``keep``), each with the rank that wrote it (-1: unknown)."""
    if previous is None:
        return []
    try:
        old = md.Metadata.from_json(previous)
    except Exception:  # not ours or corrupt: nothing we know to be garbage
        return []
    keep = set(keep)
    names: dict[str, int] = {}
    for f in old.files:
        if not f.dir and f.name not in keep:
            names.setdefault(f.name, f.rank)
    return sorted(names.items())


def check_files_present(writer: StorageWriter, meta: md.Metadata) -> None:
    """Refuse to commit ``meta`` when a data file it names in its own directory is not there.

    Something may remove files during a save (``hyper-dcp gc``, a cleanup job, a hand): a
    ``.metadata`` naming a missing file would be a checkpoint that does not load, and its
    commit would reclaim the checkpoint it replaces. One listing (:meth:`StorageWriter.list_files`),
    no reads; skipped for writers that cannot list.

    Raises:
        CheckpointError: names the missing files; nothing is committed, the previous
            checkpoint stays as it was.
    """
    names = meta.file_names()
    lister = getattr(writer, "list_files", None)
    if not names or lister is None:
        return
    try:
        there = set(lister())
    except NotImplementedError:
        return
    missing = [n for n in names if n not in there]
    if missing:
        where = getattr(writer, "path", None) or getattr(writer, "url", None) or "the checkpoint"
        raise CheckpointError(
            f"refusing to commit {where}/{md.METADATA_FILE}: {len(missing)} data file(s) it names are no longer "
            f"there ({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}); something removed them during "
            "the save (`hyper-dcp gc` or a cleanup job?). Nothing was committed and the previous checkpoint is "
            "kept as it was; save again")


def spare_siblings_files(writer: StorageWriter, garbage: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """``garbage`` (files of a replaced checkpoint) less those that sibling steps still read.

    A plain save over a CheckpointManager's step directory replaces a step whose files later
    incremental steps name (``../step_00000001/data-...``): those stay, with a warning naming
    them. When the siblings cannot be read safely (:class:`.SiblingsUnknownError`, or the
    storage fails), every replaced file stays (when in doubt, keep); ``hyper-dcp gc`` can
    remove them later. Never raises: the new checkpoint is already committed.
    """
    where = getattr(writer, "path", None) or getattr(writer, "url", None)
    if not garbage or where is None:
        return garbage
    try:
        named = files_siblings_name(where, getattr(writer, "storage_options", None))
    except Exception as exc:
        why = exc if isinstance(exc, SiblingsUnknownError) else f"{type(exc).__name__}: {exc}"
        warnings.warn(f"{where}: the new checkpoint is committed; the {len(garbage)} data file(s) of the checkpoint "
                      f"it replaced are all kept, because which of them other steps read is unknown ({why})",
                      stacklevel=3)
        return []
    kept = [name for name, _ in garbage if name in named]
    if kept:
        shown = "; ".join(f"{n} (read by {', '.join(named[n])})" for n in kept[:5])
        warnings.warn(f"{where}: the new checkpoint is committed; {len(kept)} data file(s) of the checkpoint it "
                      f"replaced are kept because other steps still read them: {shown}"
                      f"{' ...' if len(kept) > 5 else ''}", stacklevel=3)
    return [(name, rank) for name, rank in garbage if name not in named]


def reclaim_replaced(writer: StorageWriter, previous: bytes | None, keep: Iterable[str]) -> list[str]:
    """Remove the data files of the replaced checkpoint (best effort; never raises).

    ``keep`` are the files of the new checkpoint (never removed); files sibling steps read
    stay too (:func:`spare_siblings_files`). Returns the names that could not be removed,
    after warning about them.
    """
    return remove_replaced(writer, [name for name, _ in spare_siblings_files(writer, replaced_files(previous, keep))])


def remove_replaced(writer: StorageWriter, names: list[str]) -> list[str]:
    """Remove ``names``, files of a replaced checkpoint (best effort: warns about, and
    returns, the ones that could not be removed)."""
    return _remove(writer, names, "the new checkpoint is committed, but {n} data file(s) of the checkpoint it "
                                  "replaced could not be removed")


def remove_own_files(writer: StorageWriter, names: Iterable[str]) -> None:
    """Remove this rank's files of a save that did not commit (best effort; warns)."""
    _remove(writer, names, "the save did not commit and {n} of its data file(s) could not be removed")


def _remove(writer: StorageWriter, names: Iterable[str], what: str) -> list[str]:
    """Remove each of ``names``; warn once (``what``, with {n}) naming those that failed; return them."""
    left: list[tuple[str, str]] = []
    for name in names:
        try:
            writer.remove([name])
        except Exception as exc:
            left.append((name, f"{type(exc).__name__}: {exc}"))
    if left:
        shown = "; ".join(f"{n} ({why})" for n, why in left[:10])
        more = f" and {len(left) - 10} more" if len(left) > 10 else ""
        warnings.warn(f"{what.format(n=len(left))}: {shown}{more}. They are unreferenced; `hyper-dcp gc PATH` "
                      "removes them", stacklevel=4)
    return [n for n, _ in left]


_DEBRIS = re.compile(r"^(data-r\d+-\d+-[0-9a-f]+\.safetensors|\.metadata\.tmp-.*)$")


def unreferenced_files(reader: Any, referenced: list[str]) -> list[str]:
    """Files this library writes into a checkpoint directory that its ``.metadata`` does not
    name: data files of saves that failed or were replaced, stray temporary metadata. []
    when the storage cannot list its files."""
    try:
        names = reader.list_files()
    except (NotImplementedError, OSError):
        return []
    keep = set(referenced)
    return [n for n in names if n not in keep and _DEBRIS.match(n)]


@dataclass(frozen=True)
class GarbageReport:
    """What :func:`sweep_debris` did: the files it removed (or, dry, would remove), and the
    debris it left, each with why."""

    removed: list[str] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)


DEBRIS_MIN_AGE_S = 24 * 3600  # debris no committed metadata dates is left until this old


def sweep_debris(reader: Any, writer: StorageWriter, dry_run: bool = False, keep: Iterable[str] = (),
                 min_age_s: float = DEBRIS_MIN_AGE_S) -> GarbageReport:
    """Remove the debris of failed or replaced saves from a checkpoint directory.

    Debris is what this library writes that the committed ``.metadata`` (or, in a rank-local
    checkpoint, the rank fragments together) does not name (data files, temporary metadata);
    everything else is left alone. Fragments that are missing or disagree are an error, not a
    reason to delete. ``keep``: files other checkpoints name (later incremental steps,
    :func:`.step_siblings.files_siblings_name`).

    A save in progress writes data files that no ``.metadata`` names yet, so a debris file is
    removed only when it is *older than the committed metadata* (a save writes its data after
    the commit it replaces) or older than ``min_age_s`` (default a day: no save runs that
    long); the times are the storage's, from one listing taken before the metadata is read.
    Debris of a save that failed after the last commit goes at the next gc after a commit, or
    once it is ``min_age_s`` old. A storage that gives no times gets nothing removed. Each
    file left is reported with why.
    """
    try:
        times = reader.list_file_times()
    except (NotImplementedError, AttributeError):
        times = None
    except OSError:
        return GarbageReport()  # unlistable: nothing we know to be garbage
    try:
        referenced = md.Metadata.from_json(metadata_bytes(reader)).file_names()
    except NotACheckpointError:
        referenced = []
    if times is None:
        garbage = unreferenced_files(reader, [*referenced, *keep])
        return GarbageReport([], [(n, "the storage gives no modification times, so a file of a save in progress "
                                      "cannot be told from debris") for n in garbage])
    garbage = unreferenced_files(Listed(times), [*referenced, *keep])
    commits = [t for n, t in times.items() if n == md.METADATA_FILE or fragment_ranks([n])]
    since = min(commits) if commits else None
    too_old = time.time() - min_age_s
    report = GarbageReport()
    for name in garbage:
        if (since is None or times[name] >= since) and times[name] >= too_old:
            after = (f"written after the committed metadata ({_when(since)})" if since is not None
                     else "no committed metadata here")
            report.left.append((name, f"{after}: a save in progress may commit it; it is removed once older than "
                                      f"that metadata or {min_age_s:g}s old (a later gc)"))
            continue
        if not dry_run:
            writer.remove([name])
        report.removed.append(name)
    return report


def collect_garbage(reader: Any, writer: StorageWriter, dry_run: bool = False,
                    keep: Iterable[str] = ()) -> list[str]:
    """:func:`sweep_debris`, returning only the names removed (or, with ``dry_run``, that would be)."""
    return sweep_debris(reader, writer, dry_run, keep).removed


class Listed:
    """A fixed file listing in the shape :func:`unreferenced_files` reads."""

    def __init__(self, names: Iterable[str]):
        self.names = sorted(names)

    def list_files(self) -> list[str]:
        return self.names


def _when(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def drop_stale_fragments(where: str, writer: StorageWriter, world: int) -> None:
    """Rank 0 of a rank-local save removes the fragments (their files and markers) of ranks
    its world does not have: a bigger world's earlier save there would make every reader
    refuse the checkpoint as a mix of world sizes. Best effort."""
    try:
        names = reader_for(where).list_files()
    except Exception:  # unlistable storage (or no such place yet): nothing to drop
        return
    for r in fragment_ranks(names):
        if r >= world:
            raw = writer.read_committed(fragment_name(r))
            writer.remove([fragment_name(r), failed_name(r)])
            reclaim_replaced(writer, raw, [])
