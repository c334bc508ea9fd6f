"""The handle of one async save and the errors an async save reports.

``async_save`` returns what torch's returns: a :class:`concurrent.futures.Future` (here an
:class:`AsyncSaveFuture`, which carries this library's extras) or, where torch would (an async
stager: torch's ``DefaultStager`` with ``use_async_staging=True``), torch's
``AsyncSaveResponse`` (here :class:`AsyncSaveResponse`, a subclass of it whose
``upload_completion`` is that Future and which answers the Future's extras too).

A save is resolved once, by the checkpointer's writer thread (:meth:`AsyncSaveFuture._finish`):
the Future gets the committed metadata or the error, the caller's callback runs, then waiters
wake. This module neither stages nor saves.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse as _TorchAsyncSaveResponse

from ..base.errors import CheckpointError
from ..format import metadata as md

__all__ = ["AsyncSaveError", "AsyncStagingError", "AsyncSaveFuture", "AsyncSaveResponse"]

_BOUNDED = object()  # "wait at most the checkpointer's wait_timeout_s"


class AsyncSaveError(CheckpointError):
    """An earlier async save failed; raised by the next ``async_save`` or ``wait()``.

    ``__cause__`` is the original error (a :class:`RankFailedError` when ranks saved together).
    """


class AsyncStagingError(CheckpointError):
    """Taking the snapshot of a state dict failed (reported on every rank, like a save error)."""



class AsyncSaveFuture(Future):
    """The handle of one async save: a :class:`concurrent.futures.Future` resolved with the
    committed :class:`~.metadata.Metadata` (on every rank) or with the save's error, as the
    Future torch's ``async_save`` returns. ``result()``, ``done()``, ``exception()``,
    ``add_done_callback(fn)``, ``cancel()`` (False: a save once started runs to its end),
    ``running()``, ``cancelled()`` are the Future's; ``concurrent.futures.wait`` takes it.

    Attributes:
        checkpoint_id: where the checkpoint goes (None when only a storage writer was given).
        staging: ``"eager"`` or ``"lazy"``.
        persist_completion: a plain Future resolved first, before ``callback`` runs
            (HyperParallel's name); this Future resolves after the callback, so ``done()`` means
            the callback ran.
        upload_completion: this Future (torch's ``AsyncSaveResponse`` name).
        staging_completion: a Future resolved (with None) once the snapshot is taken, as in
            torch's ``AsyncSaveResponse``.
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
        super().__init__()
        self.checkpoint_id = checkpoint_id
        self.wait_timeout_s = wait_timeout_s
        self.staging = staging
        self.persist_completion: Future = Future()  # resolved before the callback runs
        self.upload_completion: Future = self  # torch's AsyncSaveResponse name
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
        self._after_callback: list[Callable[[Any], Any]] = []  # add_done_callback's, run once finished

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
                self._after_callback.append(fn)
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
        return f"{type(self).__name__}({self.checkpoint_id!r}, {self.staging}, {state})"

    def _mark_staged(self, error: BaseException | None = None) -> None:
        """The snapshot is taken, or failed (stager, writer or caller's thread): wake waiters,
        resolve ``staging_completion`` (with the error, as torch's does)."""
        self._staged.set()
        if not self.staging_completion.done():
            if error is None:
                self.staging_completion.set_result(None)
            else:
                self.staging_completion.set_exception(error)

    def _finish(self, meta: md.Metadata | None, error: BaseException | None, total_s: float) -> None:
        """Resolve the save (writer thread): the Future, then the callback, then the waiters."""
        self.total_s = total_s
        self._mark_staged(error)  # a save that ends before its snapshot was taken failed taking it
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
        if error is None:  # this Future itself (concurrent.futures.wait, as_completed): once the callback ran
            super().set_result(meta)
        else:
            super().set_exception(error)
        with self._done_lock:
            self._finished.set()
            done, self._after_callback = self._after_callback, []
        for fn in done:
            _run_done_callback(fn, self)


class AsyncSaveResponse(_TorchAsyncSaveResponse):
    """torch's ``AsyncSaveResponse``, what ``async_save`` returns where torch's does (an async
    stager that stages in the background): ``staging_completion`` (resolved once the snapshot
    is taken) and ``upload_completion`` (the save's :class:`AsyncSaveFuture`). The Future's
    extras answer here too (``result()``, ``done()``, ``wait_staged()``, ``staging``,
    ``blocking_s`` ...), so code written for either shape runs.
    """

    def __init__(self, future: AsyncSaveFuture):
        super().__init__(staging_completion=future.staging_completion, upload_completion=future)

    def __getattr__(self, name: str) -> Any:  # only for names the instance and class lack
        future = self.__dict__.get("upload_completion")
        if future is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(future, name)

    def __repr__(self) -> str:
        return (f"AsyncSaveResponse(staging_completion={self.staging_completion!r}, "
                f"upload_completion={self.upload_completion!r})")


def _run_done_callback(fn: Callable[[Any], Any], response: AsyncSaveFuture) -> None:
    try:
        fn(response)
    except Exception as exc:  # as concurrent.futures does: the save's outcome stands
        warnings.warn(f"async save done-callback {fn!r} raised {exc!r}", stacklevel=1)


def _call_back(callback: Callable[..., Any], response: AsyncSaveFuture) -> None:
    """``callback(response)``, or ``callback()`` for a callback that takes no argument."""
    try:
        params = inspect.signature(callback).parameters.values()
        wants = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in params)
    except (TypeError, ValueError):  # no signature (some builtins): pass the response
        wants = True
    callback(response) if wants else callback()

