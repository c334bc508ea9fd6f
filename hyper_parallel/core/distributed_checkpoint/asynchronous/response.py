"""The handle of one async save (:class:`AsyncSaveResponse`) and the errors an async save reports.

A response is resolved once, by the checkpointer's writer thread (:meth:`AsyncSaveResponse._finish`):
its Future gets the committed metadata or the error, its callback runs, then waiters wake.
This module neither stages nor saves.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..base.errors import CheckpointError
from ..format import metadata as md

__all__ = ["AsyncSaveError", "AsyncStagingError", "AsyncSaveResponse"]

_BOUNDED = object()  # "wait at most the checkpointer's wait_timeout_s"


class AsyncSaveError(CheckpointError):
    """An earlier async save failed; raised by the next ``async_save`` or ``wait()``.

    ``__cause__`` is the original error (a :class:`RankFailedError` when ranks saved together).
    """


class AsyncStagingError(CheckpointError):
    """Taking the snapshot of a state dict failed (reported on every rank, like a save error)."""



class AsyncSaveResponse:
    """The handle of one async save.

    Attributes:
        checkpoint_id: where the checkpoint goes (None when only a storage writer was given).
        staging: ``"eager"`` or ``"lazy"``.
        persist_completion: a :class:`concurrent.futures.Future` resolved with the committed
            :class:`~.metadata.Metadata` (on every rank), or with
            the save's error; ``upload_completion`` is the same Future (torch's name).
        staging_completion: a Future resolved (with None) once the snapshot is taken, as in
            torch's ``AsyncSaveResponse``.

    It behaves as the Future torch's ``async_save`` returns too: ``result()``, ``done()``,
    ``exception()``, ``add_done_callback(fn)``, ``cancel()`` (False: a save once started runs
    to its end), ``running()``, ``cancelled()``.
        blocking_s: seconds the ``async_save`` call took.
        staging_s: seconds the snapshot copies took (set once staged); under a memory budget
            (``max_host_bytes``), seconds from the call until the snapshot was complete (the
            copies overlap the writes), which is what a ``wait_staged()`` right after a lazy
            call waits.
        total_s: seconds from the call to the end of the save (set once done).
        peak_staged_bytes: the most bytes of snapshot data the save held at once (its whole
            staging buffer; under a memory budget, the ring's pieces in use at their peak
            plus numpy arrays copied whole); set when staged, or (budget) when done.
    """

    def __init__(self, checkpoint_id: str | None, staging: str, callback: Callable | None,
                 wait_timeout_s: float | None = None):
        self.checkpoint_id = checkpoint_id
        self.wait_timeout_s = wait_timeout_s
        self.staging = staging
        self.persist_completion: Future = Future()
        self.upload_completion = self.persist_completion  # torch's AsyncSaveResponse name
        self.staging_completion: Future = Future()
        self.blocking_s = 0.0
        self.staging_s: float | None = None
        self.total_s: float | None = None
        self.peak_staged_bytes: int | None = None
        self._callback = callback
        self._staged = threading.Event()
        self._finished = threading.Event()
        self._callback_thread: int | None = None
        self._observed = False  # result()/exception() handed its outcome to the caller
        self._done_lock = threading.Lock()
        self._done_callbacks: list[Callable[[Any], Any]] = []  # add_done_callback's, run once finished

    def _wait_finished(self, timeout: Any) -> None:
        # Inside the callback the save is over; waiting for the callback itself would deadlock.
        if threading.get_ident() == self._callback_thread:
            return
        if timeout is _BOUNDED:
            timeout = self.wait_timeout_s
        if not self._finished.wait(timeout):
            raise TimeoutError(f"async save to {self.checkpoint_id!r}: not finished after {timeout}s; it is "
                               "still running (pass a larger timeout, or None to wait without bound)")

    def done(self) -> bool:
        """True once the save committed or failed (and its callback ran)."""
        return self._finished.is_set()

    def add_done_callback(self, fn: Callable[[Any], Any]) -> None:
        """Call ``fn(self)`` once the save committed or failed (at once if it has), as
        :meth:`concurrent.futures.Future.add_done_callback` does: on the writer thread, after
        ``callback``, when ``result()`` returns at once. Exceptions it raises become warnings."""
        with self._done_lock:
            if not self._finished.is_set():
                self._done_callbacks.append(fn)
                return
        _run_done_callback(fn, self)

    def cancel(self) -> bool:
        """False: an async save cannot be cancelled once started (as a running Future)."""
        return False

    def cancelled(self) -> bool:
        """False (see :meth:`cancel`)."""
        return False

    def running(self) -> bool:
        """True until the save committed or failed."""
        return not self.done()

    def staged(self) -> bool:
        """True once the snapshot is taken: the state dict's tensors are no longer read."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the snapshot is taken (returns at once for eager staging).

        Raises:
            TimeoutError: not staged within ``timeout`` seconds.
        """
        if not self._staged.wait(timeout):
            raise TimeoutError(f"async save to {self.checkpoint_id!r}: not staged after {timeout}s")

    def result(self, timeout: Any = _BOUNDED) -> md.Metadata | None:
        """Wait for the commit; return the committed Metadata (every rank).

        Args:
            timeout: seconds to wait; by default the checkpointer's ``wait_timeout_s`` (so a
                stuck storage never blocks the caller forever); None waits without bound.

        Raises:
            RankFailedError: the save failed on some rank (raised on every rank).
            TimeoutError: not finished within ``timeout`` seconds.
        """
        self._wait_finished(timeout)
        self._observed = True
        return self.persist_completion.result()

    def get_result(self, timeout: Any = _BOUNDED) -> md.Metadata | None:
        """:meth:`result` (HyperParallel's name)."""
        return self.result(timeout)

    def exception(self, timeout: Any = _BOUNDED) -> BaseException | None:
        """The save's error, or None if it committed (waits like :meth:`result`)."""
        self._wait_finished(timeout)
        self._observed = True
        return self.persist_completion.exception()

    def __repr__(self) -> str:
        state = "done" if self.done() else ("staged" if self.staged() else "staging")
        return f"AsyncSaveResponse({self.checkpoint_id!r}, {self.staging}, {state})"

    def _mark_staged(self) -> None:
        """The snapshot is taken (stager or caller's thread): wake waiters, resolve the Future."""
        self._staged.set()
        if not self.staging_completion.done():
            self.staging_completion.set_result(None)

    def _finish(self, meta: md.Metadata | None, error: BaseException | None, total_s: float) -> None:
        """Resolve the save (writer thread): the Future, then the callback, then the waiters."""
        self.total_s = total_s
        if error is None:
            self.persist_completion.set_result(meta)
        else:
            self.persist_completion.set_exception(error)
        if self._callback is not None:
            self._callback_thread = threading.get_ident()
            try:
                _call_back(self._callback, self)
            except Exception as exc:
                warnings.warn(f"async save callback {self._callback!r} raised {exc!r}", stacklevel=1)
            finally:
                self._callback_thread = None
        with self._done_lock:
            self._finished.set()
            done, self._done_callbacks = self._done_callbacks, []
        for fn in done:
            _run_done_callback(fn, self)


def _run_done_callback(fn: Callable[[Any], Any], response: AsyncSaveResponse) -> None:
    try:
        fn(response)
    except Exception as exc:  # as concurrent.futures does: the save's outcome stands
        warnings.warn(f"async save done-callback {fn!r} raised {exc!r}", stacklevel=1)


def _call_back(callback: Callable[..., Any], response: AsyncSaveResponse) -> None:
    """``callback(response)``, or ``callback()`` for a callback that takes no argument."""
    try:
        params = inspect.signature(callback).parameters.values()
        wants = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    except (TypeError, ValueError):  # no signature (some builtins): pass the response
        wants = True
    callback(response) if wants else callback()

