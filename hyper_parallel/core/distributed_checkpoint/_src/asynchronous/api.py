"""The public functions of async saves: :func:`async_save`, :func:`default_checkpointer`,
:func:`register_optimizer_hook`.

They are thin: the work is the process-wide :class:`~.checkpointer.AsyncCheckpointer`'s
(see :mod:`.checkpointer` for the order of one async save, :mod:`.buffers` for the staging
buffers, :mod:`.process_hooks` for fork and exit).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ..backends.protocol import StorageWriter
from ..planning.planner import SavePlanner
from .checkpointer import AsyncCheckpointer, PathLike, SaveRequest
from .process_hooks import process_lock
from .response import AsyncSaveFuture, AsyncSaveResponse
from .torch_stagers import check_checkpointer_type, staging_of

__all__ = ["async_save", "default_checkpointer", "register_optimizer_hook"]

_DEFAULT: AsyncCheckpointer | None = None


def default_checkpointer() -> AsyncCheckpointer:
    """The process-wide :class:`AsyncCheckpointer` that :func:`async_save` uses (made on first use).

    Example::

        default_checkpointer().wait()   # e.g. before dist.destroy_process_group()
    """
    global _DEFAULT
    with process_lock():
        if _DEFAULT is None:
            _DEFAULT = AsyncCheckpointer()
        return _DEFAULT


# ---------------------------------------------------------------------------- public API


def async_save(
    state_dict: dict[str, Any] | None = None,
    path: PathLike | None = None,
    *,
    checkpoint_id: PathLike | None = None,
    storage_writer: StorageWriter | None = None,
    planner: SavePlanner | None = None,
    process_group: Any = None,
    no_dist: bool = False,
    use_collectives: bool = True,
    coordinator_rank: int = 0,
    allow_pickle: bool = False,
    thread_count: int = 1,
    sync_files: bool = True,
    timeout: timedelta | float | None = None,
    user_metadata: dict[str, Any] | None = None,
    staging: str = "eager",
    callback: Callable[..., Any] | None = None,
    checkpointer: AsyncCheckpointer | None = None,
    use_gloo: bool = True,
    async_checkpointer_type: Any = None,
    async_stager: Any = None,
) -> AsyncSaveFuture | AsyncSaveResponse:
    """Save like :func:`save`, but return once a snapshot of the state dict is taken.

    Every rank of the group calls it, in the same order. With ``staging="eager"`` the call
    copies every tensor into reused host buffers and returns; the state dict's tensors may
    then be modified or freed at once. A background thread writes the snapshot and commits
    ``.metadata`` exactly as :func:`save` does (same planning, dedup and files), with
    its cross-rank exchanges on a dedicated gloo group.

    At most ``checkpointer.max_in_flight`` (default 1) saves run at once: a further call
    first waits for the oldest. A failed save raises on its response and again, as
    :class:`AsyncSaveError`, on the next ``async_save`` or ``wait()``.

    Args:
        state_dict, path / checkpoint_id, storage_writer, planner, process_group, no_dist,
            use_collectives, coordinator_rank, allow_pickle, thread_count, sync_files, timeout,
            user_metadata: as for :func:`save`. ``timeout`` also bounds the dedicated
            group's collectives (default: ``process_group``'s timeout).
        staging: ``"eager"`` (copy now) or ``"lazy"`` (copy in the background: the call returns
            at once; call ``response.wait_staged()`` — or install
            :func:`register_optimizer_hook` — before the tensors change). Lazy snapshots read
            the live tensors, so anything a forward pass updates in place (BatchNorm running
            statistics) must be waited for before that forward pass.
        callback: called once in the background thread when the save committed or failed,
            before ``result()`` returns anywhere else: as ``callback(response)``, or as
            ``callback()`` if it takes no argument (HyperParallel's convention). Inside it,
            ``response.result()`` returns at once. It must not wait for other saves (they run
            after it); exceptions it raises become warnings.
        checkpointer: the :class:`AsyncCheckpointer` to use (default: :func:`default_checkpointer`).
        use_gloo: accepted for HyperParallel code. The background save always coordinates on
            a dedicated gloo group (so it never shares a communicator with training, on any
            device); ``use_gloo=False`` changes nothing.
        async_checkpointer_type: torch DCP's ``AsyncCheckpointerType``: ``THREAD`` and
            ``PROCESS`` both run the save on background threads of this process, at a lower CPU
            priority, with their exchanges on a gloo group of their own (see
            :mod:`.torch_stagers` for why ``PROCESS`` is accepted so).
        async_stager: torch DCP's ``DefaultStager(StagingOptions(...))`` or
            ``BlockingAsyncStager``, taken as configuration (it overrides ``staging=``):
            ``use_async_staging=True`` stages lazily, False eagerly; ``use_pinned_memory``
            pins accelerator staging buffers or not (:mod:`.torch_stagers`). The stager stays
            the caller's (close it as torch asks); a custom stager is refused.

    Returns:
        What torch's ``async_save`` returns. Without an async stager: an
        :class:`AsyncSaveFuture`, a :class:`concurrent.futures.Future` (``result()``,
        ``done()``, ``add_done_callback``) whose ``result()`` (or ``get_result()``) waits for
        the commit and returns the :class:`Metadata`, on every rank. With torch's
        ``DefaultStager(StagingOptions(use_async_staging=True))`` (staging in the background),
        as torch: an :class:`AsyncSaveResponse`, a subclass of torch's, whose
        ``staging_completion`` resolves once the snapshot is taken and whose
        ``upload_completion`` is that Future. Either carries this library's extras
        (``wait_staged()``, ``staging``, ``blocking_s``, ``staging_completion`` ...).

    Raises:
        AsyncSaveError: the previous async save failed (nothing new is started).
        ValueError / TypeError: bad arguments (no destination, unknown ``staging``, a
            ``timeout`` that is not seconds > 0 or a timedelta, ...).
        Errors of the save itself (e.g. :class:`RankFailedError`, also for a ``user_metadata``
            that is not JSON-able, checked on every rank alike) come from ``result()``.

    Example::

        resp = async_save({"model": model.state_dict(), "optim": optim.state_dict()},
                          checkpoint_id=f"/ckpt/step{step}")
        optimizer.step()          # safe: the snapshot is already taken
        ...
        resp.result()             # the checkpoint is committed
    """
    check_checkpointer_type(async_checkpointer_type)
    chosen = staging_of(async_stager, staging)
    # torch's stager, if any, decides the staging and the pinning
    request = SaveRequest.of(dict(locals(), staging=chosen.staging, pin_memory=chosen.pin_memory))
    future = (checkpointer or default_checkpointer())._start(state_dict, request)
    return AsyncSaveResponse(future) if chosen.staging_response else future


def register_optimizer_hook(
    optimizer: torch.optim.Optimizer, target: AsyncSaveFuture | AsyncSaveResponse | AsyncCheckpointer | None = None
) -> Any:
    """Make ``optimizer.step()`` wait until lazy snapshots are taken, before it changes anything.

    With a checkpointer (default: :func:`default_checkpointer`) every step waits for the
    snapshots of all saves in flight at that moment; with a response, only for that save. The
    wait returns at once when the snapshot is done, so a lazy save whose copies finish during
    forward and backward costs the step nothing.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        target: what :func:`async_save` returned, or an :class:`AsyncCheckpointer`.

    Returns:
        The hook's handle; ``handle.remove()`` uninstalls it.

    Example::

        register_optimizer_hook(optimizer)             # once
        for step in range(steps):
            loss = model(batch).sum(); loss.backward()
            if step % 100 == 0:
                async_save(state, f"/ckpt/{step}", staging="lazy")
            optimizer.step()                           # waits only if the copies are not done
    """
    waiter = (target if target is not None else default_checkpointer()).wait_staged

    def wait_for_snapshot(opt: Any, args: Any, kwargs: Any) -> None:
        waiter()

    return optimizer.register_step_pre_hook(wait_for_snapshot)
