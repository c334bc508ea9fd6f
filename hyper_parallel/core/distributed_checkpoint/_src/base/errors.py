"""Exceptions raised by the distributed checkpoint.

Every error says what was expected, what was found, and where (key, file, rank), so that a
user reading one line of a log on one rank knows what to fix.

Every one of them is also torch DCP's ``CheckpointException``, so code written for
``torch.distributed.checkpoint`` (``except CheckpointException``) catches ours; and still a
``RuntimeError``, so ``except Exception`` keeps catching them (torch's class derives from
``BaseException`` only).

Every one of them also pickles whole (type, message, attributes): errors cross process
boundaries (worker processes, ``multiprocessing``, a rank's error sent to its peers), so a
class whose ``__init__`` takes more than the message says how to rebuild itself
(``__reduce__``).
"""

from __future__ import annotations

import pickle
import traceback
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException


class CheckpointError(RuntimeError, CheckpointException):
    """Base class of every error this package raises on purpose.

    ``failures`` (torch's ``CheckpointException.failures``) maps each failing rank to what
    failed there: filled by :class:`RankFailedError` (rank -> :class:`RankFailure`, torch's
    ``(exception, stack)`` pair that also reads as the error's text); empty for an error
    raised on this rank alone.
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


class StateDictLookupError(StateDictMismatchError, ValueError):
    """A ``MetadataIndex`` names nothing in a state dict: no such key, or no chunk of the
    value at that offset on this rank. Also a ``ValueError``, what torch DCP's ``utils``
    raise for the same lookups, so ``except ValueError`` written for torch catches it."""


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

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException's default calls cls(*args), which lacks committed and save_id
        return type(self), (self.args[0] if self.args else "", self.committed, self.save_id), self.__dict__


class RankFailure(tuple):
    """One rank's failure in the two shapes code reads it in.

    torch's ``CheckpointException.failures`` maps a rank to ``(exception, stack)`` (a
    ``traceback.StackSummary``), and torch code unpacks it (``exc, stack = failures[r]``,
    ``type(failures[r][0])``); this library's messages and its users read a rank's failure as
    one line of text (``str(f)``, ``"disk full" in f``, ``f == "OSError: disk full"``). A
    RankFailure is the pair, and compares, contains and prints as the text.

    The exception is the failing rank's own when it crosses processes intact (it pickles and
    unpickles as itself), otherwise a ``RuntimeError`` carrying the text.
    """

    text: str

    def __new__(cls, exception: BaseException, stack: Any, text: str) -> RankFailure:
        made = super().__new__(cls, (exception, stack))
        made.text = text
        return made

    @classmethod
    def of(cls, exc: BaseException, text: str) -> RankFailure:
        """``exc`` (raised here) as it will travel to the other ranks."""
        stack = traceback.extract_tb(exc.__traceback__)
        try:
            pickle.loads(pickle.dumps((exc, stack)))
            kept: BaseException = exc
        except Exception:  # an exception that cannot cross processes: its text does
            kept = RuntimeError(text)
        return cls(kept, stack, text)

    @property
    def exception(self) -> BaseException:
        return self[0]

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return repr(self.text)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return self.text == other
        return tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash(self.text)

    def __contains__(self, item: object) -> bool:
        if isinstance(item, str):
            return item in self.text
        return tuple.__contains__(self, item)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self[0], self[1], self.text)


class RankFailedError(CheckpointError):
    """Raised on every rank when one or more ranks failed a phase of save or load.

    ``failures`` maps each failing rank to its :class:`RankFailure` (torch's ``(exception,
    stack)`` pair, reading as the error's text; a plain string given here is kept as text);
    the message lists them all, root causes first, so every rank's log tells the same story.
    """

    def __init__(self, phase: str, failures: dict[int, Any]):
        self.phase = phase
        self.failures = dict(sorted(failures.items()))
        lines = [f"checkpoint {phase} failed on rank(s) {sorted(self.failures)}:"]
        lines += [f"  [rank {r}] {msg}" for r, msg in self.failures.items()]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[Any, ...]:
        # rebuilt from its fields (the default would call cls(message), which lacks failures)
        return type(self), (self.phase, self.failures), self.__dict__


class StorageError(CheckpointError, OSError):
    """The storage failed a save with an operating-system error: a read-only or full disk,
    a path through a regular file, a lost mount or connection.

    A save in one process (``no_dist=True``, or no process group) raises it where a save of
    several ranks raises :class:`RankFailedError` naming the same error: both are
    :class:`CheckpointError` (so torch's ``CheckpointException``), and the OS's error is the
    ``__cause__``. It is also an ``OSError`` of the original's kind (:func:`storage_error`
    picks ``StoragePermissionError`` for a ``PermissionError``, ...) with its ``errno``,
    ``strerror`` and ``filename``, so ``except OSError`` / ``except PermissionError`` still
    catch it. ``context`` says what was being done (e.g. ``"checkpoint save to '/ckpt'"``).
    """

    def __init__(self, *args: Any) -> None:
        # RuntimeError's __init__ comes first in the MRO and would leave errno/filename unset
        OSError.__init__(self, *args)

    @property
    def context(self) -> str:
        return self.__dict__.get("_context", "")

    @context.setter
    def context(self, value: str) -> None:
        self._context = value

    def __str__(self) -> str:
        text = OSError.__str__(self)
        return f"{self.context} failed: {text}" if self.context else text

    # pickles as OSError does: cls(*args) with errno, strerror, filename(s), then __dict__


class StoragePermissionError(StorageError, PermissionError):
    """:class:`StorageError` of a ``PermissionError`` (EACCES, EPERM)."""


class StorageFileNotFoundError(StorageError, FileNotFoundError):
    """:class:`StorageError` of a ``FileNotFoundError`` (ENOENT)."""


class StorageFileExistsError(StorageError, FileExistsError):
    """:class:`StorageError` of a ``FileExistsError`` (EEXIST)."""


class StorageNotADirectoryError(StorageError, NotADirectoryError):
    """:class:`StorageError` of a ``NotADirectoryError`` (ENOTDIR: a path through a regular file)."""


class StorageIsADirectoryError(StorageError, IsADirectoryError):
    """:class:`StorageError` of an ``IsADirectoryError`` (EISDIR)."""


class StorageInterruptedError(StorageError, InterruptedError):
    """:class:`StorageError` of an ``InterruptedError`` (EINTR)."""


class StorageConnectionError(StorageError, ConnectionError):
    """:class:`StorageError` of a ``ConnectionError`` (a remote store's connection failed)."""


_STORAGE_KINDS: dict[type[OSError], type[StorageError]] = {
    PermissionError: StoragePermissionError, FileNotFoundError: StorageFileNotFoundError,
    FileExistsError: StorageFileExistsError, NotADirectoryError: StorageNotADirectoryError,
    IsADirectoryError: StorageIsADirectoryError, InterruptedError: StorageInterruptedError,
    ConnectionError: StorageConnectionError,
}


def storage_error(exc: OSError, context: str) -> StorageError:
    """``exc`` as a :class:`StorageError` of its kind (its nearest base with a variant, e.g.
    ``BrokenPipeError`` -> ``StorageConnectionError``), keeping its errno, strerror and
    file names; ``context`` says what failed (``"checkpoint save to '/ckpt'"``). The caller
    raises it ``from exc``, so the original stays visible as the cause."""
    kind = next((_STORAGE_KINDS[c] for c in type(exc).__mro__ if c in _STORAGE_KINDS), StorageError)
    if exc.errno is not None:
        args: tuple[Any, ...] = (exc.errno, exc.strerror)
        if exc.filename is not None or exc.filename2 is not None:
            args += (exc.filename, None, exc.filename2)
    else:
        args = exc.args
    out = kind(*args)
    out.context = context
    return out
