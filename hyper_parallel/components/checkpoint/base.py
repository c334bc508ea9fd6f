"""The checkpointer interface: one object per storage format that saves a training payload and loads it back.

A training loop decides *when* to save and *what* goes in the payload (a dict: ``model``,
``optimizer``, ``extra_state``); a checkpointer only knows how that payload is written to a
path and read back. Swapping formats is swapping checkpointers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["CheckpointerBase"]


class CheckpointerBase(ABC):
    """Save and load a training payload at a checkpoint path."""

    @abstractmethod
    def save(self, path: str, state: dict[str, Any], *, global_step: int, save_async: bool = False) -> None:
        """Write ``state`` to ``path`` as the checkpoint of ``global_step`` (``save_async``: return
        before it is written; :meth:`maybe_wait_for_async_save` waits)."""

    @abstractmethod
    def load(self, path: str, state: dict[str, Any], *, strict_model: bool = True,
             extra_state_skeleton: dict[str, Any] | None = None) -> dict[str, Any]:
        """Fill ``state`` in place from the checkpoint at ``path`` and return it. ``strict_model``:
        every model entry must be loaded; ``extra_state_skeleton``: the shape of the saved
        ``extra_state`` to restore (None: do not restore it)."""

    def maybe_wait_for_async_save(self) -> None:
        """Wait until an asynchronous save is written (nothing to wait for by default)."""
        return None

    def find_latest_checkpoint(self, checkpoint_dir: str) -> str | None:
        """The newest complete checkpoint under ``checkpoint_dir``, or None."""
        raise NotImplementedError(f"{type(self).__name__} does not discover checkpoints")
