"""The removal of step directories: in the background, one job at a time, ``.metadata`` first.

The coordinator's :class:`Deleter` removes what retention, the start-up sweep and failed
saves hand it: a whole step (its ``.metadata`` first, so the step stops counting before any
data goes; files later incremental steps name stay), some files of a step, or what a save
that did not commit left. A failure warns and leaves the step for the next start.

It does not decide what goes (:mod:`.retention`, :mod:`.checkpoint_manager`).
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Iterable

from ..base.errors import CheckpointError, NotACheckpointError
from ..engine.commit import unreferenced_files
from ..format import metadata as md
from .step_directory import Directory, Listed

__all__ = ["Deleter"]


class Deleter:
    """The coordinator's deletion thread: jobs run one at a time, in order; failures warn."""

    def __init__(self, root: Directory):
        self.root = root
        self._jobs: queue.Queue[tuple[str, str, tuple[str, ...]] | None] = queue.Queue()
        self._pending: dict[str, int] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []

    def submit(self, kind: str, name: str, files: Iterable[str] = (), keep: Iterable[str] = ()) -> None:
        """``kind`` "step": remove a whole step (``.metadata`` first) except the data files in
        ``keep`` (later steps name them); "files": only ``files``; "failed": what a save that
        did not commit left (see :meth:`_clean_failed`), except ``keep``."""
        with self._cond:
            self._pending[name] = self._pending.get(name, 0) + 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hp-dcp-manager-delete", daemon=True)
                self._thread.start()
        self._jobs.put((kind, name, tuple(files) if kind == "files" else tuple(keep)))

    def _clean_failed(self, name: str, keep: tuple[str, ...]) -> None:
        """After a save of step directory ``name`` that did not commit: remove the files this
        library writes there that no ``.metadata`` in it names (data files, temporary metadata),
        then the directory if nothing else is left; nothing else, and nothing at all when a
        ``.metadata`` there cannot be read (what it names is unknown)."""
        present = self.root.listing().get(name)  # a step path that is a symbolic link is never listed
        if present is None:
            return
        referenced = list(keep)
        if md.METADATA_FILE in present:
            try:
                referenced += md.Metadata.from_json(self.root.step_metadata(name)).file_names()
            except NotACheckpointError:
                pass
            except CheckpointError:
                return
        self.root.remove_files(name, unreferenced_files(Listed(present), referenced))
        self.root.remove_if_empty(name)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, name, files = job
            try:
                if kind == "step":
                    self.root.uncommit(name)  # the step stops counting before any data goes
                    if files:  # data later steps still name stays; the rest goes
                        present = self.root.listing().get(name, {})
                        self.root.remove_files(name, [f for f in present if f not in files])
                    else:
                        self.root.remove_tree(name)
                elif kind == "failed":
                    self._clean_failed(name, files)
                else:
                    self.root.remove_files(name, files)
            except Exception as exc:  # the step stays: the next start finds it and tries again
                message = f"{self.root.step_path(name)}: deletion failed ({type(exc).__name__}: {exc})"
                self.failures.append(message)
                warnings.warn(f"CheckpointManager: {message}; it is retried at the next start", stacklevel=1)
            finally:
                with self._cond:
                    self._pending[name] -= 1
                    if not self._pending[name]:
                        del self._pending[name]
                    self._cond.notify_all()

    def wait_for(self, name: str | None = None, timeout: float | None = None) -> bool:
        """Wait until nothing (or nothing for step dir ``name``) is pending; False on timeout."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._pending if name is None else name not in self._pending, timeout)

    def stop(self) -> None:
        with self._cond:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._jobs.put(None)
            thread.join()
