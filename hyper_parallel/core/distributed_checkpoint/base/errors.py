"""Exceptions raised by the distributed checkpoint.

Every error says what was expected, what was found, and where (key, file, rank), so that a
user reading one line of a log on one rank knows what to fix.

Every one of them is also torch DCP's ``CheckpointException``, so code written for
``torch.distributed.checkpoint`` (``except CheckpointException``) catches ours; and still a
``RuntimeError``, so ``except Exception`` keeps catching them (torch's class derives from
``BaseException`` only).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(RuntimeError, CheckpointException):
    """Base class of every error this package raises on purpose.

    ``failures`` (torch's ``CheckpointException.failures``) maps each failing rank to what
    failed there: filled by :class:`RankFailedError` (rank -> its error's text, never a
    pickled exception); empty for an error raised on this rank alone.
    """

    # RuntimeError's message, not CheckpointException's "ranks:" report (which needs failures)
    __str__ = BaseException.__str__

    @property
    def failures(self) -> dict[int, Any]:
        return self.__dict__.get("_failures", {})

    @failures.setter
    def failures(self, value: dict[int, Any]) -> None:
        self._failures = value


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path holds no committed checkpoint (no valid ``.metadata``)."""


class MetadataError(CheckpointError, ValueError):
    """``.metadata`` is unreadable, of an unknown version, or fails validation."""


class CorruptCheckpointError(CheckpointError):
    """Data read back does not match what the metadata promises (checksum, size, file)."""


class StateDictMismatchError(CheckpointError, KeyError):
    """The target state dict does not match the checkpoint (keys, shapes, dtypes, kinds)."""

    def __str__(self) -> str:  # KeyError would quote the message; keep it readable
        return str(self.args[0]) if self.args else ""


class UnsupportedValueError(CheckpointError, TypeError):
    """A state-dict value cannot be saved safely (e.g. needs pickle without opt-in)."""


class LostContactError(CheckpointError):
    """A collective of a save or load failed: a peer crashed, hung past the timeout, or never
    called. The process group used for checkpoint exchanges is unusable afterwards."""


class StorageTimeoutError(CheckpointError, TimeoutError):
    """A storage call (an upload, a ranged read, the metadata commit) got no answer within the
    save's or load's ``timeout``: the store or its endpoint is stuck. The call's thread is left
    behind (a blocked socket cannot be interrupted); nothing is committed on its account."""


class CommitError(CheckpointError):
    """A save failed at or around its commit point; ``committed`` says what the path holds.

    - ``committed is True``: the new checkpoint IS committed (its ``.metadata`` is in place and
      nothing deleted its data); something after the commit failed, e.g. a peer was lost.
    - ``committed is None``: this rank cannot know: it lost contact with the coordinator
      during the commit. The path holds either this save or the checkpoint it replaced, both
      whole; ``load`` decides (compare ``Metadata.save_id`` with ``save_id``). This rank kept
      its data files, because the new ``.metadata`` may name them.

    ``save_id`` is the id of the save that failed (it appears in its data-file names).
    """

    def __init__(self, message: str, committed: bool | None, save_id: str):
        super().__init__(message)
        self.committed = committed
        self.save_id = save_id


class RankFailedError(CheckpointError):
    """Raised on every rank when one or more ranks failed a phase of save or load.

    ``failures`` maps each failing rank to the text of its error; the message lists them
    all, root causes first, so every rank's log tells the same story.
    """

    def __init__(self, phase: str, failures: dict[int, str]):
        self.phase = phase
        self.failures = dict(sorted(failures.items()))
        lines = [f"checkpoint {phase} failed on rank(s) {sorted(self.failures)}:"]
        lines += [f"  [rank {r}] {msg}" for r, msg in self.failures.items()]
        super().__init__("\n".join(lines))
