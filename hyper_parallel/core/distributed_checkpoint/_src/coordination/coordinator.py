"""Cross-rank exchanges of save and load, where a failure on one rank fails all ranks.

Every phase that can fail on a rank ends in :meth:`Coordinator.exchange`: each rank sends
either its result or its error, and every rank raises the same :class:`RankFailedError`
naming the failing ranks and causes, instead of leaving the others blocked in the next
collective. The exchanges run on a gloo group (the caller's, when it is gloo; otherwise one
made once per process group) so they need no accelerator and never share a communicator
with training collectives.

Objects travel pickled in uint8 tensors (peers of one job trust each other; nothing read
from a checkpoint is unpickled). Every exchange returns only after gloo's worker threads have
let go of its tensors: a worker dropping the last C++ reference to a tensor made in Python
must take the GIL, and if that happens while the interpreter is finalizing, the process
aborts ("terminate called without an active exception") - a script whose last act is a
save would crash at exit now and then.
"""

from __future__ import annotations

import math
import pickle
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .....platform import member_group
from ..base.errors import CheckpointError, LostContactError, RankFailedError, RankFailure
from ..base.priority import lower_priority, thread_ids

T = TypeVar("T")

_GLOO_GROUPS: dict[Any, Any] = {}
# Groups a collective failed on (a timeout, a lost peer): gloo cannot use them again. Held by
# id with the group itself, so an id is never reused while it is listed.
_BROKEN: dict[int, Any] = {}


def is_broken(group: Any) -> bool:
    """Whether a checkpoint exchange failed on ``group`` (it must be replaced before reuse)."""
    return group is not None and _BROKEN.get(id(group)) is group


def group_timeout(group: Any) -> timedelta | None:
    """The timeout of ``group``'s CPU backend (None where this torch does not expose it)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except Exception:
        return None
DEFAULT_TIMEOUT = timedelta(minutes=30)


def as_timeout(value: Any, name: str = "timeout") -> timedelta | None:
    """``value`` (a number of seconds > 0, a positive timedelta, or None for the default) as a
    timedelta. Checked before any collective, so a bad value is the same error on every rank,
    not a gloo failure on some of them that blames a lost rank."""
    if value is None:
        return None
    accepted = (f"{name} must be a number of seconds > 0, a positive datetime.timedelta, or None (the default, "
                "30 min)")
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"{accepted}; got {type(value).__name__} {value!r:.60}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{accepted}; got {value!r}")
    if isinstance(value, timedelta):
        return value
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError(f"{accepted} that a timedelta can hold; got {value!r}") from None


# gloo tries to connect a pair this many times, each waiting the group's timeout (torch 2.13:
# a peer that stops or dies halfway through making a group surfaces at 5x the timeout)
_GLOO_CONNECT_TRIES = 5
_RENDEZVOUS: dict[tuple[int, ...], tuple[Any, int]] = {}  # members -> (world, groups made so far)


def new_gloo_group(ranks: Sequence[int] | None = None, timeout: timedelta | None = None, *, nice: int = 0) -> Any:
    """A new gloo process group of ``ranks`` (None: every rank) whose collectives time out after
    ``timeout`` (default 30 min); the one way this package makes a gloo group.

    Collective over ``ranks`` alone (ranks outside a subgroup need not call it); every member
    makes the same calls in the same order. It waits about ``timeout`` at most: first every
    member checks in through the default store (a rank that never comes fails the others
    after ``timeout``); then the members connect with a fifth of it, since gloo tries a
    connection five times, each waiting the group's timeout (a peer that stops or dies while
    connecting would otherwise surface only at 5x the timeout), and the group gets its full
    ``timeout`` for collectives once made. ``nice`` > 0 lowers the priority of the group's own
    I/O threads (see :mod:`..base.priority`).

    Raises:
        RuntimeError: a member did not come, or was lost while connecting (torch's
            ``DistStoreError`` or gloo's error; callers turn it into their own words).
    """
    timeout = timeout or DEFAULT_TIMEOUT
    world_size = dist.get_world_size()
    members = tuple(sorted(int(r) for r in ranks)) if ranks is not None else tuple(range(world_size))
    _rendezvous(members, timeout)
    before = thread_ids() if nice else set()
    connect = timeout / _GLOO_CONNECT_TRIES
    try:
        if len(members) == world_size:
            group = dist.new_group(list(members), backend="gloo", timeout=connect)
        else:  # created by its members alone
            group = member_group(members, backend="gloo", timeout=connect, cached=False)
        dist.distributed_c10d._set_pg_timeout(timeout, group)
    finally:
        if nice:
            lower_priority(thread_ids(gloo_only=True) - before, nice)
    return group


def _rendezvous(members: tuple[int, ...], timeout: timedelta) -> None:
    """Wait (at most ``timeout``) until every member has called :func:`new_gloo_group` for this group."""
    world = dist.group.WORLD
    made_in, count = _RENDEZVOUS.get(members, (None, 0))
    n = count if made_in is world else 0  # a new world (destroy, init again): a new store
    _RENDEZVOUS[members] = (world, n + 1)  # holds the world, so its id is not reused meanwhile
    store = dist.distributed_c10d._get_default_store()
    tag = f"hyper_parallel/dcp/gloo_group/{'_'.join(map(str, members))}/{n}"
    store.set(f"{tag}/{dist.get_rank()}", "1")
    store.wait([f"{tag}/{r}" for r in members], timeout)


def _is_gloo(group: Any) -> bool:
    return "gloo" in str(dist.get_backend(group)).lower()


def _gloo_group(group: Any, timeout: timedelta | None) -> tuple[Any, str]:
    """The group checkpoint exchanges run on, and a token naming it for plan caches.

    For the whole world (``group`` None) a dedicated gloo group is made once per timeout, so
    checkpoint traffic never interleaves with training collectives and a stuck rank turns
    into an error after ``timeout``. A caller's gloo subgroup is used as it is. Any other
    subgroup gets a gloo twin created by its members alone (ranks outside it need not call
    save/load).

    The token is unique per (world, group) for the life of the process: entries hold their
    world and group, so ``id()``s in the key cannot be reused by other objects meanwhile.
    """
    # Keyed by the world group object too: after destroy_process_group() and a new
    # init_process_group() in the same process, groups of the old world are dead.
    world = dist.group.WORLD
    use_as_is = group is not None and _is_gloo(group) and timeout is None
    key = (id(world), None if group is None else id(group), None if use_as_is else timeout or DEFAULT_TIMEOUT)
    cached = _GLOO_GROUPS.get(key)
    if cached is None or cached[0] is not world or cached[1] is not group:
        if use_as_is:
            made = group
        else:
            made = new_gloo_group(None if group is None else dist.get_process_group_ranks(group), timeout)
        _GLOO_GROUPS[key] = cached = (world, group, made, uuid.uuid4().hex)
    return cached[2], cached[3]


class Coordinator:
    """Rank, world size and status-checked collectives of one save or load.

    With ``no_dist=True``, or when no process group is initialised, it is a single rank and
    every exchange is local. ``timeout`` bounds every exchange (default 30 minutes): a rank
    that never arrives becomes an error on all the others.
    """

    def __init__(
        self,
        process_group: Any = None,
        no_dist: bool = False,
        coordinator_rank: int = 0,
        timeout: timedelta | float | None = None,
    ):
        timeout = as_timeout(timeout)
        self.distributed = not no_dist and dist.is_available() and dist.is_initialized()
        if not no_dist and process_group is not None and not self.distributed:
            # a group without a default one: destroyed (an async save outliving
            # dist.destroy_process_group()); saving alone would commit one rank's view as the whole
            raise LostContactError(
                "the process group was destroyed (dist.destroy_process_group()) before this collective "
                "call ran; nothing was committed. Wait for saves in flight first (resp.result(), "
                "CheckpointManager.wait())")
        self.timeout = timeout or DEFAULT_TIMEOUT
        if self.distributed:
            self.global_rank = dist.get_rank()
            self.group, self.group_token = self._collective("setup", lambda: _gloo_group(process_group, timeout))
            if timeout is None and self.group is process_group:  # a caller's gloo group: its own timeout
                self.timeout = group_timeout(process_group) or DEFAULT_TIMEOUT
            self.rank = dist.get_rank(self.group)
            self.world_size = dist.get_world_size(self.group)
        else:
            self.group, self.rank, self.world_size, self.global_rank = None, 0, 1, 0
            self.group_token = "local"
        self.coordinator_rank = coordinator_rank
        self.is_coordinator = self.rank == coordinator_rank

    def _collective(self, phase: str, op: Callable[[], T]) -> T:
        try:
            return op()
        except RuntimeError as exc:
            # A dead or stuck peer; gloo groups are unusable after this, so forget ours, and
            # mark it for those holding it (a manager, the async checkpointer) to replace.
            group = getattr(self, "group", None)
            for k, cached in list(_GLOO_GROUPS.items()):
                if cached[2] is group:
                    del _GLOO_GROUPS[k]
            if group is not None:
                _BROKEN[id(group)] = group
            raise LostContactError(
                f"checkpoint {phase}: lost contact with the other ranks on rank {self.global_rank} "
                f"({exc}). A rank crashed, did not call save/load (a load with an empty target, "
                f"{{}}, takes no part), or stalled longer than the timeout ({self.timeout})"
            ) from exc

    @property
    def broken(self) -> bool:
        """Whether an exchange on this coordinator's group failed (see :func:`is_broken`)."""
        return self.distributed and is_broken(self.group)

    def _all_gather(self, phase: str, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        return self._collective(phase, lambda: _all_gather_object(obj, self.world_size, self.group))

    def statuses(self, phase: str, fn: Callable[[], T]) -> tuple[list[tuple[str, Any]], BaseException | None]:
        """Run ``fn`` here and learn every rank's outcome, without raising for failures.

        Returns ``([(kind, payload_or_failure) per rank], own exception or None)``: kind is
        ``"ok"`` (payload is ``fn``'s result) or ``"error"`` (a :class:`~..base.errors.RankFailure`:
        the exception, its stack and a one-line description). Any
        ``BaseException`` of ``fn`` counts (a KeyboardInterrupt on one rank must not leave
        the others waiting). Raises LostContactError when the exchange itself fails.
        """
        own: BaseException | None = None
        try:
            status: tuple[str, Any] = ("ok", fn())
        except BaseException as exc:  # reported to every rank; the caller re-raises
            own = exc
            status = ("error", rank_failure(exc))
        try:
            gathered = self._all_gather(phase, (*status, phase.split(" ", 1)[0]))
        except LostContactError as lost:
            if own is not None and not isinstance(own, Exception):
                raise own from lost  # KeyboardInterrupt/SystemExit stay what they are
            raise lost from own
        calls = [call for _, _, call in gathered]
        if len(set(calls)) > 1:  # e.g. rank 0 in save, rank 1 in load: their payloads do not match
            shown = ", ".join(f"rank {self._name(r)} in {c!r}" for r, c in enumerate(calls[:8]))
            raise CheckpointError(
                f"checkpoint {phase}: the ranks of one group are in different calls ({shown}); every rank "
                "must make the same save/load call, in the same order") from own
        return [(kind, payload) for kind, payload, _ in gathered], own

    def exchange(self, phase: str, fn: Callable[[], T]) -> list[T]:
        """Run ``fn`` here, share its result with every rank, or fail everywhere.

        Returns every rank's result in rank order. If ``fn`` raised on any rank, every rank
        raises RankFailedError naming each failing rank and its error; a rank's own
        exception is chained as the cause on that rank (a KeyboardInterrupt or SystemExit is
        re-raised as itself on its own rank, after the others were told).
        """
        results, own = self.statuses(phase, fn)
        self.raise_failures(phase, results, own)
        return [payload for _, payload in results]

    def raise_failures(self, phase: str, results: list[tuple[str, Any]], own: BaseException | None) -> None:
        """Raise (on every rank) if any rank's status in ``results`` is an error."""
        failures = {r: msg for r, (kind, msg) in enumerate(results) if kind == "error"}
        if not failures:
            return
        if own is not None and (not self.distributed or not isinstance(own, Exception)):
            raise own
        raise RankFailedError(phase, {self._name(r): m for r, m in failures.items()}) from own

    def gather_to_coordinator(self, phase: str, fn: Callable[[], T]) -> list[T] | None:
        """Like :meth:`exchange`, but only the coordinator gets the payloads.

        Statuses still reach every rank (one all-gather), so every rank fails together.
        Payloads travel once, to the coordinator only, via gather.
        """
        own: BaseException | None = None
        try:
            payload, status = fn(), "ok"
        except BaseException as exc:
            own, payload, status = exc, None, rank_failure(exc)
        if not self.distributed:
            if own is not None:
                raise own
            return [payload]
        gathered: list[Any] | None = None
        try:
            gathered = self._collective(phase, lambda: _gather_object(
                (status, payload), self.world_size, self._global(self.coordinator_rank), self.group))
            # The coordinator learned every status; share only the failures with everyone.
            verdict = None
            if self.is_coordinator:
                verdict = {r: s for r, (s, _) in enumerate(gathered) if isinstance(s, RankFailure)}
            verdict = self.broadcast(verdict, phase)
        except LostContactError as lost:
            if own is not None and not isinstance(own, Exception):
                raise own from lost
            raise lost from own
        if verdict:
            if own is not None and not isinstance(own, Exception):
                raise own
            raise RankFailedError(phase, {self._name(r): m for r, m in verdict.items()}) from own
        return [p for _, p in gathered] if self.is_coordinator else None

    def scatter(self, objs: Sequence[Any] | None, phase: str = "scatter") -> Any:
        """The coordinator's ``objs[r]`` on each group rank ``r`` (``objs``: one per rank, given on
        the coordinator, ignored elsewhere). Each rank receives only its own object."""
        if not self.distributed:
            return objs[0] if objs is not None else None
        if self.is_coordinator and (objs is None or len(objs) != self.world_size):
            raise CheckpointError(f"checkpoint {phase}: the coordinator has {len(objs or ())} objects to scatter "
                                  f"to {self.world_size} ranks")
        return self._collective(phase, lambda: _scatter_object(
            objs if self.is_coordinator else None, self.world_size, self.rank, self._global(self.coordinator_rank),
            self.group))

    def broadcast(self, obj: Any, phase: str = "broadcast") -> Any:
        """The coordinator's ``obj`` on every rank."""
        return self.broadcast_from(self.coordinator_rank, obj, phase)

    def broadcast_from(self, src: int, obj: Any, phase: str = "broadcast") -> Any:
        """Group rank ``src``'s ``obj`` on every rank."""
        if not self.distributed:
            return obj
        return self._collective(phase, lambda: _broadcast_object(obj, self.rank == src, self._global(src), self.group))

    @property
    def group_ranks(self) -> list[int]:
        """The global rank of each group rank (identity without a process group)."""
        if not self.distributed:
            return [self.global_rank]
        return list(dist.get_process_group_ranks(self.group))

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank) if self.group is not None else group_rank

    def _name(self, group_rank: int) -> int:
        return self._global(group_rank) if self.distributed else group_rank


# ----------------------------------------------------------------------------- object collectives


def _settle(tensors: list[torch.Tensor], limit_s: float = 5.0) -> None:
    """Wait until no C++ holder but our own Python object references each of ``tensors``.

    A collective's ``wait()`` returns when the data arrived, a moment before gloo's worker
    thread drops its work (and with it the tensors). Sleeping releases the GIL, which that
    drop may need. Bounded: a holder that never lets go costs ``limit_s``, not a hang.
    """
    deadline = time.monotonic() + limit_s
    for t in tensors:
        while t._use_count() > 1 and time.monotonic() < deadline:
            time.sleep(1e-4)


def _to_bytes_tensor(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def _from_bytes_tensor(t: torch.Tensor, size: int) -> Any:
    return pickle.loads(t[:size].numpy().tobytes())


def _sizes(mine: int, world_size: int, group: Any) -> list[int]:
    local = torch.tensor([mine], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, local, group=group)
    _settle([local, *sizes])
    return [int(s.item()) for s in sizes]


def _padded(t: torch.Tensor, size: int) -> torch.Tensor:
    if t.numel() == size:
        return t
    out = torch.zeros(size, dtype=torch.uint8)
    out[: t.numel()] = t
    return out


def _padded_payload(obj: Any, world_size: int, group: Any) -> tuple[torch.Tensor, list[int], int]:
    """``obj`` pickled and zero-padded to the widest rank's payload; every rank's size; the width."""
    mine = _to_bytes_tensor(obj)
    sizes = _sizes(mine.numel(), world_size, group)
    width = max(sizes)
    return _padded(mine, width), sizes, width


# Bytes of each rank's slot in the first collective of an all-gather: its pickled object's
# length (8 bytes) and, when it fits, the object itself. The statuses every save and load
# exchange at each phase ("ok" and a small payload) then take one collective instead of two.
SLOT_BYTES = 128


def _all_gather_object(obj: Any, world_size: int, group: Any) -> list[Any]:
    """Every rank's ``obj``: one collective when every rank's pickled object fits in
    :data:`SLOT_BYTES` (with its length), else a second one with them all, padded to the
    widest."""
    mine = _to_bytes_tensor(obj)
    n = mine.numel()
    slot = torch.zeros(SLOT_BYTES, dtype=torch.uint8)
    slot[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
    if n <= SLOT_BYTES - 8:
        slot[8:8 + n] = mine
    slots = [torch.empty(SLOT_BYTES, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(slots, slot, group=group)
    _settle([slot, *slots])
    sizes = [int(s[:8].view(torch.int64).item()) for s in slots]
    width = max(sizes)
    if width <= SLOT_BYTES - 8:
        return [_from_bytes_tensor(s[8:], size) for s, size in zip(slots, sizes, strict=True)]
    mine = _padded(mine, width)
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(outs, mine, group=group)
    _settle([mine, *outs])
    return [_from_bytes_tensor(o, size) for o, size in zip(outs, sizes, strict=True)]


def _gather_object(obj: Any, world_size: int, dst: int, group: Any) -> list[Any] | None:
    """Every rank's ``obj`` on global rank ``dst`` (None elsewhere)."""
    mine, sizes, width = _padded_payload(obj, world_size, group)
    here = dist.get_rank() == dst
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(world_size)] if here else None
    dist.gather(mine, outs, dst=dst, group=group)
    _settle([mine, *(outs or [])])
    return [_from_bytes_tensor(o, n) for o, n in zip(outs, sizes, strict=True)] if outs is not None else None


def _scatter_object(objs: Sequence[Any] | None, world_size: int, rank: int, src: int, group: Any) -> Any:
    """``objs[rank]`` of global rank ``src`` on each group rank (every payload padded to the widest)."""
    payloads = [_to_bytes_tensor(o) for o in objs] if objs is not None else None
    sizes = (torch.tensor([p.numel() for p in payloads], dtype=torch.int64) if payloads is not None
             else torch.zeros(world_size, dtype=torch.int64))
    dist.broadcast(sizes, src=src, group=group)
    _settle([sizes])
    width = int(sizes.max().item())
    out = torch.empty(width, dtype=torch.uint8)
    ins = [_padded(p, width) for p in payloads] if payloads is not None else None
    dist.scatter(out, ins, src=src, group=group)
    _settle([out, *(ins or [])])
    return _from_bytes_tensor(out, int(sizes[rank].item()))


def _broadcast_object(obj: Any, is_src: bool, src: int, group: Any) -> Any:
    """Global rank ``src``'s ``obj`` on every rank of ``group``."""
    payload = _to_bytes_tensor(obj) if is_src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    _settle([size])
    if payload is None:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(payload, src=src, group=group)
    _settle([payload])
    return obj if is_src else _from_bytes_tensor(payload, payload.numel())


def rank_failure(exc: BaseException) -> RankFailure:
    """``exc`` as it travels to the other ranks: torch's (exception, stack) pair and our line of text."""
    return RankFailure.of(exc, _describe(exc))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, CheckpointError):
        return f"{type(exc).__name__}: {exc}"
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
    return f"{type(exc).__name__}: {exc}{where}"


def all_gather_object(obj: Any, world_size: int, use_collectives: bool) -> list[Any]:
    """Every rank's ``obj``, in rank order (HyperParallel's ``utils.all_gather_object``).

    With ``use_collectives`` and more than one rank it is ``torch.distributed.all_gather_object``
    on the default group; otherwise ``[obj]``, so a rank-local step can run the same code
    without a process group. Unlike :meth:`Coordinator.exchange` it carries no errors: a rank
    that raises before calling it leaves the others waiting, as any plain collective does.

    Example::

        plans = all_gather_object(local_plan, dist.get_world_size(), use_collectives=True)
    """
    if not use_collectives or world_size <= 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj)
    return out
