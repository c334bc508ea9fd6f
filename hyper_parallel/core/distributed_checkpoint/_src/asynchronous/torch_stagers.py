"""torch DCP's stagers and checkpointer types as plain configuration for :func:`~.api.async_save`.

What maps (torch -> here):

- ``DefaultStager(StagingOptions(...))``: ``use_async_staging=True`` -> ``staging="lazy"``
  (the call returns before the copies are done; torch then returns an ``AsyncSaveResponse``
  whose ``staging_completion`` says when they are), False -> ``staging="eager"``;
  ``use_pinned_memory`` -> whether staging buffers of accelerator tensors are pinned;
  ``use_shared_memory`` (for torch's process-based writer) and ``use_non_blocking_copy`` (copies
  here are issued non-blocking into pinned memory and waited for before the snapshot counts as
  taken) are accepted either way.
- ``BlockingAsyncStager`` (and torch's ``FileSystemWriter``, which is one) -> ``staging="eager"``;
  ``cache_staged_state_dict``: the staging buffers here are always reused across saves.
- ``AsyncCheckpointerType.THREAD``/``PROCESS``: the save runs on background threads of this
  process, at a lower CPU priority, with its exchanges on a gloo group of its own; the README
  ("Async saves and torch's PROCESS checkpointer") gives the measurement behind accepting
  ``PROCESS`` this way.
- Any other stager (a user's ``AsyncStager``, torch's ``_ReplicationStager``) is refused,
  naming it.

What it is not: the staging itself (:mod:`.buffers`, :mod:`.checkpointer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint import staging as _torch_staging

from ..base.errors import UnsupportedValueError
from ..base.overrides import foreign_base, own_methods

__all__ = ["StagingChoice", "staging_of", "check_checkpointer_type"]


@dataclass(frozen=True)
class StagingChoice:
    """How an async save stages, from torch's stager: ``staging`` ("eager"/"lazy"), whether
    to pin accelerator staging buffers (None: the checkpointer's default), and whether torch
    would return an ``AsyncSaveResponse`` (staging and upload futures) rather than a Future."""

    staging: str
    pin_memory: bool | None = None
    staging_response: bool = False


def staging_of(async_stager: Any, staging: str) -> StagingChoice:
    """The staging ``async_stager`` (torch's, or None) stands for; ``staging``: the caller's
    own choice, used when no stager is given.

    Raises:
        UnsupportedValueError: a stager other than torch's ``DefaultStager`` /
            ``BlockingAsyncStager``, or one with code of its own.
    """
    if async_stager is None:
        return StagingChoice(staging)
    cls = type(async_stager)
    base = foreign_base(cls)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if own_methods(cls) or base is None:
        raise UnsupportedValueError(
            f"async_stager={name}: a custom stager is not run here (its stage() would be skipped); an async save "
            "stages into the checkpointer's reused buffers: pass staging='eager' (copy before returning) or "
            "staging='lazy' (copy in the background), or torch's DefaultStager(StagingOptions(...))")
    if base is _torch_staging.DefaultStager:
        options = async_stager._config
        lazy = bool(options.use_async_staging)
        return StagingChoice("lazy" if lazy else "eager", bool(options.use_pinned_memory), lazy)
    if issubclass(base, _torch_staging.BlockingAsyncStager):  # torch's FileSystemWriter is one too
        return StagingChoice("eager")
    raise UnsupportedValueError(
        f"async_stager={name}: of torch's stagers only DefaultStager and BlockingAsyncStager are taken as "
        "configuration; pass one of them, or staging='eager'/'lazy'")


def check_checkpointer_type(async_checkpointer_type: Any) -> None:
    """torch's ``AsyncCheckpointerType`` (or its value ``"thread"``/``"process"``), or None;
    both run as background threads here (see the module docstring)."""
    if async_checkpointer_type is None:
        return
    value = getattr(async_checkpointer_type, "value", async_checkpointer_type)
    if value not in ("thread", "process"):
        raise ValueError(f"async_checkpointer_type must be AsyncCheckpointerType.THREAD or .PROCESS, "
                         f"got {async_checkpointer_type!r}")
