"""Exceptions raised by the distributed checkpoint.

Every error says what was expected, what was found, and where (key, file, rank), so that a
user reading one line of a log on one rank knows what to fix.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every error this package raises on purpose."""


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
