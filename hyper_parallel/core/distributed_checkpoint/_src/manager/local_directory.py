"""The local tier's directory on one node: where each rank's shard files lie, and their removal.

``local_dir/tier-<16 hex>/r<rank>/step_<step>-<timeline>.safetensors`` (names in
:mod:`.local_format`): one subdirectory per manager, one per rank whose files (its own, or
copies received from it) this node keeps. :class:`TierDirectory` names those paths, lists
the rank directories, commits files into them, sweeps the ``.tmp-`` files of writes cut
short, retires deleted files so the next write in that directory reuses their pages, and
prunes the files of earlier timelines.

It is not the shard file (:mod:`.local_format`), nor the choice of what to keep (the local
save's retention in :mod:`.local_save`, recovery's in :mod:`.local_recovery`).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterable

from .local_format import (
    TMP_PREFIX,
    rank_dir_name,
    rank_of_dir,
    scan_rank_dir,
    shard_file_name,
    tier_dir_name,
    write_shard_file,
)

__all__ = ["TierDirectory"]


class TierDirectory:
    """The files of one manager's local tier under ``local_dir`` on this node.

    ``root`` is ``local_dir/tier-<hash of directory>``: jobs sharing ``/dev/shm`` never
    touch each other's files. Ranks on one node may share it; every method is local.
    """

    def __init__(self, local_dir: str, directory: str):
        self.root = os.path.join(local_dir, tier_dir_name(directory))
        # a retired file per rank directory this rank writes, to overwrite instead of creating one
        self._spares: dict[str, str] = {}

    def path(self, owner: int, step: int, timeline: str) -> str:
        """The committed path of ``owner``'s file of ``step`` in run ``timeline``."""
        return os.path.join(self.root, rank_dir_name(owner), shard_file_name(step, timeline))

    def rank_dir(self, owner: int) -> str:
        return os.path.join(self.root, rank_dir_name(owner))

    def rank_dirs(self) -> list[str]:
        """Every rank directory present, in name order."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return [os.path.join(self.root, n) for n in sorted(names) if rank_of_dir(n) is not None]

    def sweep_temporary(self) -> None:
        """Remove the ``.tmp-`` files of saves and copies cut short (at start, before any save)."""
        for sub in self.rank_dirs():
            with contextlib.suppress(FileNotFoundError):
                for name in os.listdir(sub):
                    if name.startswith(TMP_PREFIX):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(os.path.join(sub, name))

    def remove_except(self, owners: Iterable[int], keep: set[tuple[int, str]]) -> None:
        """Delete the committed files of ``owners`` whose ``(step, timeline)`` ``keep`` does not
        name. The first one of each directory is retired (renamed to a ``.tmp-`` name: never
        read again) for the next write there to overwrite."""
        for owner in owners:
            sub = self.rank_dir(owner)
            for step, timeline, path in sorted(scan_rank_dir(sub)):
                if (step, timeline) not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        if self._spares.get(sub) is None:  # retired: the next file written here reuses it
                            spare = os.path.join(sub, f"{TMP_PREFIX}spare-{uuid.uuid4().hex[:12]}")
                            os.replace(path, spare)  # no longer a committed name: never read again
                            self._spares[sub] = spare
                        else:
                            os.unlink(path)

    def write(self, final: str, pieces: list[memoryview], sync: bool) -> int:
        """Commit a shard file at ``final`` (see :func:`write_shard_file`), over the retired file
        of its directory if there is one (its pages are reused). Returns the bytes written."""
        return write_shard_file(final, pieces, sync, spare=self._spares.pop(os.path.dirname(final), None))

    def prune(self, timeline: str, keep: set[tuple[int, str]]) -> None:
        """Delete every committed file of a timeline other than ``timeline`` that ``keep`` does not name."""
        for sub in self.rank_dirs():
            for step, tl, path in scan_rank_dir(sub):
                if tl != timeline and (step, tl) not in keep:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
