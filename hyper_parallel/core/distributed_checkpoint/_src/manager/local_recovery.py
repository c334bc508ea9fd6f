"""Recovery from the local tier: choosing a complete local step, fetching missing copies, reading.

Steps 1 to 6 of recovery (the protocol is in :mod:`.local_tier`'s docstring): every rank
settles its local save, one rank per directory lists it, every rank makes the same choice
(:func:`decide`: the newest step whose every rank has a copy matching its target's
fingerprint, never one of an abandoned timeline, or "durable"), allocates room for the copy
it lacks, receives it from the least loaded holder, reads its file into its tensors
(checksums checked; a damaged copy is excluded and the choice made again), puts values and
Stateful objects back once every rank has read, and prunes the files of earlier runs.

A copy is never loaded unless every byte read from it passed its checksum: a file whose
header (manifest and values) fails its check is left out when the directory is listed, a
payload that fails its check when it is read; either way recovery takes another copy, an
older step or the durable tier, and rank 0 warns naming each such file, its step, and what
loads instead.

Nothing here reads the durable directory. It is not the local save (:mod:`.local_save`) nor
the replication of new steps (:mod:`.local_replication`).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..base.errors import CheckpointError, CorruptCheckpointError
from ..base.options import LocalTierOptions
from ..coordination.coordinator import Coordinator
from ..state.flatten import FlatLeaves, flatten, update_in_place
from .local_directory import TierDirectory
from .local_format import (
    Manifest,
    describe,
    new_timeline,
    rank_of_dir,
    read_into,
    read_manifest,
    scan_rank_dir,
    tmp_path_for,
)
from .local_replication import TAG_FETCH, MappedFile, recv_file, send_file, wait_all

__all__ = ["Recovery", "Recoverer", "decide"]


@dataclass
class Recovery:
    """What the last ``load`` found: ``source`` ``"local"`` or ``"durable"`` (the local tier
    had nothing complete and newer); ``holders[rank]`` the rank whose copy each rank loaded;
    bytes this rank received from a peer and read from its ``local_dir``; wall seconds of
    the local part."""

    source: str
    step: int | None
    holders: dict[int, int] = field(default_factory=dict)
    bytes_fetched: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    attempts: int = 0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step of the protocol

    @property
    def touched(self) -> bool:
        """A local copy was read into the target and then found damaged: unless a durable
        step loads over it, the target holds part of that copy."""
        return self.source == "durable" and self.attempts > 1



class Recoverer:
    """This rank's side of recovery (collective: every rank calls :meth:`recover` alike).

    ``settle`` waits (bounded) for this rank's local save in flight and says whether it
    finished; ``layouts`` is :func:`describe`'s cache of DTensor layouts (shared with the
    local save). ``last`` is what the last recovery found.
    """

    def __init__(self, coord: Coordinator, files: TierDirectory, options: LocalTierOptions, *, directory: str,
                 node: int, layouts: dict, settle: Callable[[], bool]):
        self.coord, self.files = coord, files
        self.rank, self.world_size = coord.rank, coord.world_size
        self.directory, self.node, self.keep = directory, node, options.keep
        self._layouts = layouts
        self._settle = settle
        self.last: Recovery | None = None
        self._room: tuple[MappedFile, str] | None = None  # the file receiving this rank's copy, its name
        # Buffers of transfers that failed while gloo may still use them: never freed or reused.
        self._abandoned: list[Any] = []

    def recover(self, state_dict: dict[str, Any], *, durable: tuple[int, str | None] | None, step: int | None,
                begin: Callable[[str, tuple[int, str | None] | None], None]) -> tuple[int, list] | None:
        """Load the newest complete local step (or ``step``) into ``state_dict``; collective.

        ``durable`` is the newest durable step and the timeline that committed it (None: no
        durable step). ``begin(timeline, durable)`` is called once the ranks agreed on the new
        run's timeline (before anything is chosen). Returns the step loaded and the local steps
        kept up to it (oldest first, at most ``keep``), or None when the manager must load from
        the durable tier (nothing complete locally, a newer durable step, a durable step a later
        run committed, or a changed layout). See the module docstring for the protocol.

        Raises:
            LostContactError / RankFailedError: a rank failed or vanished (on every rank).
            ValueError: ranks asked for different steps.
        """
        started = time.perf_counter()
        durable_latest, durable_timeline = durable if durable is not None else (None, None)
        here = (self.node, self.files.root)
        # 1. Every rank settles its save in flight (its retention may still delete files), and
        #    says which directory it reads, so that one rank per directory lists it.
        phases: dict[str, float] = {}
        mark = [started]

        def lap(name: str) -> None:
            now = time.perf_counter()
            phases[name] = phases.get(name, 0.0) + now - mark[0]
            mark[0] = now

        first = self.coord.exchange("local tier recovery (settling local saves)", lambda: (self._settle(), here))
        lap("settle")
        dirs = [d for _, d in first]
        lists = dirs.index(here) == self.rank
        target: dict[str, Any] = {}

        def needs() -> Any:
            flat = flatten(state_dict)
            entries, values, fp = describe(flat, self._layouts)
            target.update(flat=flat, entries=entries, values=values)
            return fp

        # 2. What every directory holds, then (only when some hold a step) what every rank
        #    needs: flattening calls the Statefuls' state_dict(), and torch's get_state_dict
        #    initializes an empty optimizer's state with a step, which a fresh start must not.
        held = self.coord.exchange("local tier recovery (what each node holds)",
                                   lambda: (step, *(self._holdings() if lists else ([], [])), new_timeline()))
        refused = [why for _, _, damaged, _ in held for why in damaged]  # copies whose header failed its check

        def report(outcome: str) -> None:
            if refused and self.rank == 0:
                _warn_refused(refused, outcome)
        if len({r[0] for r in held}) > 1:
            raise ValueError(f"CheckpointManager.load: the ranks asked for different steps {[r[0] for r in held]} "
                             "(by rank); every rank must pass the same step")
        timeline = held[self.coord.coordinator_rank][3]
        begin(timeline, durable)  # what the files of the new timeline record
        # whether a step could be chosen at all, whatever the layouts: if not, no state_dict()
        unshaped = [(None, [(o, st, tl, size, None, base) for o, st, tl, size, _, base in h]) for _, h, _, _ in held]
        hopeless = not all(s for s, _ in first) or decide(
            unshaped, dirs, durable_latest=durable_latest, durable_timeline=durable_timeline, want=step,
            excluded=set(), keep=self.keep)["kind"] != "local"
        if hopeless:
            lap("report")
            report(_durable_outcome(durable_latest if step is None else step))
            self.last = Recovery("durable", None, seconds=time.perf_counter() - started,
                                          attempts=0, phases=phases)
            return None
        fps = self.coord.exchange("local tier recovery (what each rank needs)", needs)
        reports = [(s, fp, h, t) for (s, h, _, t), fp in zip(held, fps, strict=True)]
        lap("report")
        excluded: set[tuple[Any, int, int, str]] = set()
        attempts = 0
        while True:
            attempts += 1
            if not all(s for s, _ in first):
                decision = {"kind": "durable", "why": "a local save is still running"}
            else:
                decision = decide([(fp, held) for _, fp, held, _ in reports], dirs, durable_latest=durable_latest,
                                  durable_timeline=durable_timeline, want=step, excluded=excluded, keep=self.keep)
            if decision["kind"] == "durable":
                report(_durable_outcome(durable_latest if step is None else step))
                self.last = Recovery("durable", None, seconds=time.perf_counter() - started,
                                              attempts=attempts, phases=phases)
                return None
            chosen = (decision["step"], decision["timeline"])
            sources = decision["sources"]
            # 3. Room for the copies that travel, before any transfer: a full local_dir is known to
            #    every rank at once (receiving into a mapped file that cannot grow failed inside gloo).
            full = [why for why in self.coord.exchange("local tier recovery (room for copies)",
                                                       lambda c=chosen, src=sources: self._make_room(c, src))
                    if why is not None]
            if full:
                self._drop_room()
                why = "; ".join(full)
                if durable_latest is None:
                    raise CheckpointError(f"CheckpointManager: local step {chosen[0]} cannot be recovered: {why}. "
                                          "Free space in local_dir (the local steps are kept) and start again")
                report(_durable_outcome(durable_latest if step is None else step))
                if self.rank == 0:
                    warnings.warn(f"CheckpointManager: local step {chosen[0]} cannot be recovered ({why}); loading "
                                  f"durable step {durable_latest} instead", stacklevel=2)
                self.last = Recovery("durable", None, seconds=time.perf_counter() - started,
                                              attempts=attempts, phases=phases)
                return None
            # 4. Missing copies travel, then every rank reads its own file (checksums checked).
            results = self.coord.exchange("local tier recovery (fetching and reading)",
                                          lambda c=chosen, src=sources: self._fetch_and_read(c, src, target))
            lap("fetch_read")
            bad = [(dirs[sources[r][0]], r, *chosen) for r, (_, why) in enumerate(results) if why is not None]
            if not bad:
                break
            excluded.update(bad)
            if self.rank == 0:
                warnings.warn(f"CheckpointManager: local step {chosen[0]}: damaged copies "
                              f"({'; '.join(why for _, why in results if why)}); trying other copies", stacklevel=2)
        report(f"local step {chosen[0]} loads from copies that passed their checks")
        # 5. Values and Stateful objects go back only once every rank has read everything.
        values = target["values_loaded"]
        self.coord.exchange("local tier recovery (applying)", lambda: _apply(target["flat"], values))
        lap("apply")
        self.files.prune(timeline, {tuple(k) for k in decision["keep"]})
        lap("prune")
        self.last = Recovery("local", chosen[0], {r: h for r, (h, _) in sources.items()},
                                      results[self.rank][0], target["bytes_read"], time.perf_counter() - started,
                                      attempts, phases)
        return chosen[0], sorted(tuple(k) for k in decision["keep"])[-self.keep:]

    def _fetch_and_read(self, chosen: tuple[int, str], sources: dict[int, tuple[int, int]],
                        target: dict[str, Any]) -> tuple[int, str | None]:
        """(bytes this rank received, None or why its copy is damaged)."""
        fetched = self._fetch(chosen, sources)
        return fetched, self._read(chosen, sources[self.rank][0], target)

    def _holdings(self) -> tuple[list[tuple[int, int, str, int, str, tuple[int | None, str | None] | None]],
                                 list[str]]:
        """What this rank's ``local_dir`` holds for this manager and world size: ``(owner,
        step, timeline, size, fingerprint, durable base)`` per file; and why each committed
        file whose header failed its check (damaged, or an unverifiable older version) is
        not a copy: ``"step <n>: <path>: <why>"``."""
        out, refused = [], []
        for sub in self.files.rank_dirs():
            owner = rank_of_dir(os.path.basename(sub))
            for step, timeline, path in scan_rank_dir(sub):
                try:
                    man = read_manifest(path)
                except OSError:
                    continue  # removed meanwhile: not a copy
                except CorruptCheckpointError as exc:
                    refused.append(f"step {step}: {exc}")  # its message names the file
                    continue
                if (man.directory, man.world_size, man.rank, man.step, man.timeline) != (
                        self.directory, self.world_size, owner, step, timeline):
                    continue
                out.append((owner, step, timeline, man.size, man.fingerprint, man.durable_base))
        return out, refused

    def _make_room(self, chosen: tuple[int, str], sources: dict[int, tuple[int, int]]) -> str | None:
        """Allocate the file this rank receives its copy into (if it lacks its own); None, or
        why it cannot (a full or unwritable ``local_dir``)."""
        holder, size = sources[self.rank]
        if holder == self.rank:
            return None
        final = self.files.path(self.rank, chosen[0], chosen[1])
        try:
            os.makedirs(os.path.dirname(final), exist_ok=True)
            self._room = (MappedFile(tmp_path_for(final), size), final)
        except OSError as exc:
            return (f"rank {self.rank} cannot store its copy ({size} bytes) in {os.path.dirname(final)}: "
                    f"{type(exc).__name__}: {exc}")
        return None

    def _drop_room(self) -> None:
        if self._room is not None:
            mf, _ = self._room
            self._room = None
            mf.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(mf.path)

    def _fetch(self, chosen: tuple[int, str], sources: dict) -> int:
        """Send the copies this rank was picked to serve; receive this rank's own if it lacks it
        (into the file :meth:`_make_room` allocated)."""
        step, timeline = chosen
        group = self.coord.group
        deadline = time.monotonic() + self.coord.timeout.total_seconds()
        outgoing: list[MappedFile] = []
        works = []
        receiving, self._room = self._room, None
        done = False
        try:
            for owner, (holder, _) in sorted(sources.items()):
                owner = int(owner)
                if holder == self.rank and owner != self.rank:
                    mf = MappedFile(self.files.path(owner, step, timeline))
                    outgoing.append(mf)
                    works.append(send_file(mf, self.coord._global(owner), group, TAG_FETCH))
            holder, size = sources[self.rank]
            if receiving is not None:
                works.append(recv_file(receiving[0], self.coord._global(holder), group, TAG_FETCH))
            wait_all(works, deadline)
            done = True
            if receiving is None:
                return 0
            mf, final = receiving
            mf.close()
            os.replace(mf.path, final)
            return size
        finally:
            maps = outgoing + ([receiving[0]] if receiving is not None else [])
            if not done:  # transfers may still be pending on these buffers: keep them mapped
                self._abandoned.extend(maps)
            for mf in maps:
                if done:
                    mf.close()
            if receiving is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(receiving[0].path)

    def _read(self, chosen: tuple[int, str], holder: int, target: dict[str, Any]) -> str | None:
        """Read this rank's file into the target; a damaged copy is reported, not raised."""
        try:
            man: Manifest = read_manifest(self.files.path(self.rank, *chosen))
            values, stats = read_into(man, target["entries"], target["values"])
        except (CorruptCheckpointError, FileNotFoundError) as exc:
            return f"rank {self.rank} (copy from rank {holder}'s directory): {exc}"
        target["values_loaded"] = values
        target["bytes_read"] = stats.bytes_read
        return None


def decide(reports: list[tuple[str, list[tuple]]], dirs: list[Any], *, durable_latest: int | None,
           want: int | None, excluded: set[tuple[Any, int, int, str]], keep: int,
           durable_timeline: str | None = None) -> dict[str, Any]:
    """Recovery's choice (pure, the same on every rank): the newest local step complete over
    every directory's holdings, and who gives each rank its copy; or ``{"kind": "durable"}``.

    ``reports[r]`` is rank r's target fingerprint and what it listed (one rank per directory
    lists it): ``(owner, step, timeline, size, fingerprint[, durable base])`` per file.
    ``dirs[r]`` names the directory rank r reads; every rank with that directory can serve its
    files. A file counts for ``owner`` only when its fingerprint equals ``owner``'s target
    fingerprint and ``(dir, owner, step, timeline)`` is not excluded. A rank reads its own
    directory's copy when there is one; otherwise the least loaded rank of a directory holding
    it sends it.

    A step of a timeline that a later run abandoned is never chosen: when the newest durable
    step (``durable_latest``, committed by ``durable_timeline``) was committed by another
    timeline and is not the durable base the step's files record (the newest durable step
    when their timeline began), a run after theirs committed it (e.g. at another world size,
    which could not see or prune these files). Without a recorded ``durable_timeline`` (a
    step saved before timelines were recorded) only step numbers count, as before; files
    without a durable base (written before it was recorded) count unless a run that records
    timelines committed the newest durable step.
    """
    world = len(reports)
    targets = [fp for fp, _ in reports]
    members: dict[Any, list[int]] = {}
    for r, d in enumerate(dirs):
        members.setdefault(d, []).append(r)
    have: dict[tuple[int, str], dict[int, dict[Any, int]]] = {}
    bases: dict[tuple[int, str], set[Any]] = {}
    for lister, (_, holdings) in enumerate(reports):
        d = dirs[lister]
        for owner, step, timeline, size, fp, *base in holdings:
            if not 0 <= owner < world or fp != targets[owner] or (d, owner, step, timeline) in excluded:
                continue
            have.setdefault((step, timeline), {}).setdefault(owner, {})[d] = size
            bases.setdefault((step, timeline), set()).add(tuple(base[0]) if base and base[0] is not None else None)

    def abandoned(key: tuple[int, str]) -> bool:
        if durable_latest is None or durable_timeline is None or key[1] == durable_timeline:
            return False
        return bases[key] != {(durable_latest, durable_timeline)}

    complete = sorted(k for k, owners in have.items() if len(owners) == world and not abandoned(k))
    eligible = [k for k in complete if want is None or k[0] == want]
    if not eligible:
        return {"kind": "durable", "why": "no complete local step" + ("" if want is None else f" {want}")}
    best = eligible[-1]
    if want is None and durable_latest is not None and best[0] < durable_latest:
        return {"kind": "durable", "why": f"durable step {durable_latest} is newer than local step {best[0]}"}
    load: dict[int, int] = {}
    sources: dict[int, tuple[int, int]] = {}
    for owner in range(world):
        where = have[best][owner]
        if dirs[owner] in where:
            sources[owner] = (owner, where[dirs[owner]])
            continue
        holder, size = min(((r, size) for d, size in where.items() for r in members[d]),
                           key=lambda rs: (load.get(rs[0], 0), rs[0]))
        load[holder] = load.get(holder, 0) + size
        sources[owner] = (holder, size)
    return {"kind": "local", "step": best[0], "timeline": best[1], "sources": sources,
            "keep": [list(k) for k in complete if k <= best][-keep:]}


_REFUSED_SHOWN = 8  # files named in one warning


def _durable_outcome(durable: int | None) -> str:
    """What loads when recovery leaves it to the durable tier (``durable``: the step the
    manager then loads; None: none), for a warning."""
    if durable is None:
        return "no local step can be loaded and there is no durable step: nothing loads"
    return f"durable step {durable} loads instead"


def _warn_refused(refused: list[str], outcome: str) -> None:
    """One warning naming the local copies left out because their header failed its check."""
    shown = "; ".join(refused[:_REFUSED_SHOWN])
    more = f"; and {len(refused) - _REFUSED_SHOWN} more" if len(refused) > _REFUSED_SHOWN else ""
    warnings.warn(f"CheckpointManager: {len(refused)} local cop{'y' if len(refused) == 1 else 'ies'} failed "
                  f"{'its' if len(refused) == 1 else 'their'} integrity check and will not be loaded ({shown}{more}); "
                  f"{outcome}", stacklevel=3)


def _apply(flat: FlatLeaves, values: dict[str, Any]) -> None:
    """Put the loaded non-tensor values where they came from, then give Stateful objects
    their filled state (tensors were filled in place)."""
    for key, value in values.items():
        leaf = flat.leaves.get(key)
        if leaf is None or value is leaf.value:
            continue
        if isinstance(leaf.value, dict) and isinstance(value, dict):  # kept, as load keeps it
            update_in_place(leaf.value, value)
        elif leaf.set is not None:
            leaf.set(value)
    for obj, inner in flat.statefuls:
        obj.load_state_dict(inner)
