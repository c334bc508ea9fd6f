"""Who writes a manager directory: the owner record, its atomic claim, liveness, release.

The manager assumes it is the only writer of its directory while it is open (that is what
makes its start-up sweep safe). Its coordinator claims the directory in
``.manager-owner.json`` (:data:`OWNER_FILE`: host, pid, process start, a token per manager)
before it lists or sweeps anything, refuses to start while the file names a live manager
(another job on this host, or another open manager in this process), takes over otherwise,
and raises at its next save if another manager has taken over meanwhile (:class:`Ownership`).

The claim is atomic: on local and shared filesystems every claim holds an exclusive
``flock`` of the owner file while it reads, decides and writes (:func:`claim_local`); on S3
it is a conditional put, created only if absent (If-None-Match) and a stale record replaced
only if unchanged since read (If-Match on its ETag) (:func:`claim_fsspec`). A filesystem
without locks and fsspec stores without conditional puts make it a plain read-then-write
(a warning says so). A writer on another host cannot be checked for liveness.

It is not the step directories' storage (:mod:`.step_directory`, whose ``claim_owner``
methods call these functions) nor their deletion.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from ..base.errors import CheckpointError

__all__ = ["OWNER_FILE", "Ownership", "owner_alive", "parse_owner", "process_start"]

OWNER_FILE = ".manager-owner.json"
OPEN_TOKENS: set[str] = set()  # owner tokens of the managers open in this process
_OWNER_LOCK_WAIT_S = 60.0  # a claim holds the lock for one read and one write


# ----------------------------------------------------------------------------- the record


def parse_owner(raw: bytes | None) -> dict[str, Any] | None:
    """An owner record (None: none, or not one: it does not parse)."""
    if raw is None:
        return None
    try:
        owner = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return owner if isinstance(owner, dict) else None


def _who(raw: bytes | None) -> str:
    owner = parse_owner(raw) or {}
    return f"pid {owner.get('pid')} on {owner.get('host')}, since {owner.get('since')}"


def process_start(pid: int) -> str | None:
    """The start time of ``pid`` (Linux /proc), so a reused pid is not taken for the owner."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the manager ``owner`` names is still open (only checkable on this host)."""
    if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
        return False
    pid = owner["pid"]
    if pid == os.getpid():
        return owner.get("token") in OPEN_TOKENS
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    started = process_start(pid)
    return started is None or owner.get("started") in (None, started)


# ----------------------------------------------------------------------------- a manager's claim


class Ownership:
    """One manager's claim on ``root`` (its coordinator's :class:`~.step_directory.Directory`).

    ``directory`` is how error messages name it.
    """

    def __init__(self, root: Any, directory: str):
        self.root, self.directory = root, directory
        self.token = uuid.uuid4().hex

    def claim(self) -> None:
        """Become the directory's owner, or refuse while a live owner holds it
        (:class:`CheckpointError`). Atomic: of managers starting at once, one wins, and the
        others raise here, before their start-up sweep could touch a step the winner writes."""
        pid = os.getpid()
        record = json.dumps({
            "host": socket.gethostname(), "pid": pid, "started": process_start(pid), "token": self.token,
            "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode()
        # open before the record lands: a manager of this process claiming next sees it alive
        OPEN_TOKENS.add(self.token)
        # a manager dropped without close() (a notebook cell run again) no longer holds the directory
        weakref.finalize(self, OPEN_TOKENS.discard, self.token)
        self.root.claim_owner(record, self._refuse_if_held)

    def _refuse_if_held(self, raw: bytes | None) -> None:
        owner = parse_owner(raw)
        if owner is not None and owner.get("token") != self.token and owner_alive(owner):
            raise CheckpointError(
                f"{self.directory!r} is in use by another CheckpointManager (pid {owner.get('pid')} on "
                f"{owner.get('host')}, since {owner.get('since')}): one job writes a directory at a time. "
                "Close that manager or use another directory")

    def owns(self, raw: bytes) -> bool:
        """Whether owner record ``raw`` is this manager's."""
        owner = parse_owner(raw)
        return owner is not None and owner.get("token") == self.token

    def check(self) -> None:
        """Raise :class:`CheckpointError` if another writer took the directory over."""
        raw = self.root.read_owner()
        if raw is not None and self.owns(raw):
            return
        owner = parse_owner(raw)
        who = (f"pid {owner.get('pid')} on {owner.get('host')}" if owner is not None
               else "someone (the owner file is gone)")
        raise CheckpointError(
            f"another writer took over {self.directory!r} ({who}); this manager stops saving there. "
            "Two jobs must not share a checkpoint directory")

    def release(self, remove_record: bool) -> None:
        """The manager closes: it is no longer open in this process, and (``remove_record``,
        on the coordinator) its owner record goes if it is still its own."""
        try:
            if remove_record:
                with contextlib.suppress(Exception):
                    self.root.release_owner(self.owns)
        finally:
            OPEN_TOKENS.discard(self.token)


# ----------------------------------------------------------------------------- local and shared filesystems


def read_local_owner(root: str) -> bytes | None:
    """The owner record in directory ``root`` (None: none)."""
    try:
        with open(os.path.join(root, OWNER_FILE), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def claim_local(root: str, record: bytes, refuse: Callable[[bytes | None], None]) -> None:
    """Put ``record`` in ``root``'s owner file unless ``refuse(what it holds now)`` raises, as
    one step: every claim holds an exclusive lock (``flock``) on the owner file while it reads,
    decides and writes, so of managers starting at the same moment one writes and the others
    read its record."""
    with _owner_locked(root, create=True) as fd:
        refuse(_read_fd(fd) or None)
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)


def release_local(root: str, mine: Callable[[bytes], bool]) -> None:
    """Remove ``root``'s owner file if ``mine(its record)`` (under the claim's lock)."""
    with _owner_locked(root, create=False) as fd:
        if fd is not None and mine(_read_fd(fd)):
            os.unlink(os.path.join(root, OWNER_FILE))


@contextlib.contextmanager
def _owner_locked(root: str, create: bool) -> Iterator[int | None]:
    """The owner file, open and locked exclusively (None: absent and ``create`` False). A
    file removed or replaced while we waited for its lock is not the owner file any more:
    lock the one in place then."""
    path = os.path.join(root, OWNER_FILE)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    deadline = time.monotonic() + _OWNER_LOCK_WAIT_S
    while True:
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:
            yield None
            return
        try:
            if _lock(fd, path, deadline):
                try:
                    now = os.stat(path, follow_symlinks=False)
                except FileNotFoundError:
                    now = None
                here = os.fstat(fd)
                if now is None or (now.st_dev, now.st_ino) != (here.st_dev, here.st_ino):
                    continue  # (the finally closes it, which unlocks it)
            yield fd
            return
        finally:
            os.close(fd)


def _read_fd(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 16, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _lock(fd: int, path: str, deadline: float) -> bool:
    """Lock ``fd`` exclusively, waiting until ``deadline``; False where the filesystem has no
    locks (then the claim is a plain read and write, and a warning says so)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"{path!r} stayed locked for {_OWNER_LOCK_WAIT_S:g}s: another CheckpointManager is starting "
                    "or closing there and does not finish (a stuck filesystem?)") from None
            time.sleep(0.005)
        except OSError as exc:  # e.g. ENOLCK, EOPNOTSUPP: a filesystem mounted without locks
            warnings.warn(f"CheckpointManager: cannot lock {path!r} ({exc}); claiming the directory is not atomic "
                          "on this filesystem: do not start two jobs on one directory at once", stacklevel=4)
            return False


# ----------------------------------------------------------------------------- object stores (fsspec)
# ``store`` is a :class:`~.step_directory.FsspecDirectory`: its filesystem ``fs``, bounded
# calls ``_call``, keys ``_key`` and ``_forget_cached_listings``.


def read_fsspec_owner(store: Any) -> bytes | None:
    """The owner object of ``store`` (None: none)."""
    try:
        return store._call(f"reading {OWNER_FILE}", store.fs.cat_file, store._key(OWNER_FILE))
    except FileNotFoundError:
        return None


def claim_fsspec(store: Any, record: bytes, refuse: Callable[[bytes | None], None]) -> None:
    """Put ``record`` as the owner object unless ``refuse(what it holds now)`` raises, with
    a conditional put, so of managers starting at the same moment one writes and the others
    fail: created only if absent (If-None-Match), replaced only if unchanged since read
    (If-Match on its ETag, S3). Stores without If-Match replace a stale record
    unconditionally: there, two jobs taking over one directory at once are not told apart."""
    key = store._key(OWNER_FILE)
    for _ in range(3):
        etag, raw = _read_owner_tagged(store, key)
        refuse(raw)
        try:
            _put_owner(store, key, record, etag, replace=raw is not None)
            return
        except Exception as exc:
            if not _lost_race(exc, replacing=raw is not None):
                raise
        finally:
            store._forget_cached_listings()
        # another manager's put came first: its record is fresh, so it is alive whatever
        # its host; only a record that is gone again (that manager closed) is tried anew
        _, now = _read_owner_tagged(store, key)
        if now is not None:
            refuse(now)
            raise CheckpointError(f"{store.url!r} was claimed by another CheckpointManager at the same moment "
                                  f"({_who(now)}): one job writes a directory at a time")
    raise CheckpointError(f"{store.url!r}: could not claim the directory (its owner record changed at every try)")


def _put_owner(store: Any, key: str, record: bytes, etag: str | None, replace: bool) -> None:
    """One put of the owner record, conditional where the store allows (see claim_fsspec)."""
    fs = store.fs
    try:
        if not replace:
            store._call(f"creating {OWNER_FILE}", fs.pipe_file, key, record, mode="create")
        elif etag is not None and hasattr(fs, "call_s3"):
            bucket, path, _ = fs.split_path(key)
            store._call(f"replacing {OWNER_FILE}", fs.call_s3, "put_object", Bucket=bucket, Key=path,
                        Body=record, IfMatch=etag)
        else:
            store._call(f"writing {OWNER_FILE}", fs.pipe_file, key, record)
    except Exception as exc:
        if not _no_conditional_put(exc):
            raise
        warnings.warn(f"CheckpointManager: {store.url!r}: the store refuses conditional puts ({exc}); claiming "
                      "the directory is not atomic there: do not start two jobs on one directory at once",
                      stacklevel=5)
        store._call(f"writing {OWNER_FILE}", fs.pipe_file, key, record)


def _read_owner_tagged(store: Any, key: str) -> tuple[str | None, bytes | None]:
    """(ETag, bytes) of the owner object, or (None, None). The ETag is read first: a record
    that changes in between fails the If-Match put, never passes it with stale content."""
    store._forget_cached_listings()
    try:
        etag = store._call(f"reading {OWNER_FILE}", store.fs.info, key).get("ETag")
        return etag, store._call(f"reading {OWNER_FILE}", store.fs.cat_file, key)
    except FileNotFoundError:
        return None, None


def release_fsspec(store: Any, mine: Callable[[bytes], bool]) -> None:
    """Remove the owner object if ``mine(its record)``."""
    raw = store.read_owner()
    if raw is not None and mine(raw):
        with contextlib.suppress(FileNotFoundError):
            store._call(f"deleting {OWNER_FILE}", store.fs.rm_file, store._key(OWNER_FILE))


def _store_code(exc: BaseException) -> str | None:
    """The S3 error code behind an exception (s3fs chains the botocore error as the cause)."""
    response = getattr(exc.__cause__, "response", None) or getattr(exc, "response", None)
    return response.get("Error", {}).get("Code") if isinstance(response, dict) else None


def _lost_race(exc: BaseException, replacing: bool) -> bool:
    """Whether a conditional put failed because the object changed meanwhile: it appeared, or
    (``replacing`` a record) it went or changed."""
    return (isinstance(exc, FileExistsError) or (replacing and isinstance(exc, FileNotFoundError))
            or _store_code(exc) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"))


def _no_conditional_put(exc: BaseException) -> bool:
    """Whether a put failed because the filesystem or store has no conditional puts (an fsspec
    filesystem without ``mode="create"``, an S3-compatible store answering 501)."""
    return (isinstance(exc, TypeError) and "mode" in str(exc)) or _store_code(exc) in ("NotImplemented", "501")
