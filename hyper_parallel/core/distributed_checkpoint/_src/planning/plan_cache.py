"""The save-plan cache: plans kept from one save to the next, and the planner hooks that see it.

Here too: the calls a save makes around the cache (:func:`cache_scope`, :func:`cached_plans`,
:func:`announce_plan`, :func:`remember_plan`), so the hooks' order is written once, beside
its description below.

What it is: one map per process, :data:`PLAN_CACHE`, from an entry key to a
:class:`CachedSaveResult` (one rank's plan of one save).
It is bounded (the least recently used entry goes first) and thread-safe (``async_save``'s
writer thread saves while the caller may save too). ``StandardPlanner._cached_save_result``
and ``StandardPlanner.cached_save_result`` are this same object (HyperParallel's names), so
``StandardSavePlanner._cached_save_result.clear()`` empties the cache.

What it is not: the decision to use an entry. That is :func:`~..engine.checkpoint.save`'s, made by every rank
together: a cached plan is used only when EVERY rank of the save has one for the exact same set
of local plans, since ranks working from different plans would run different collectives.

An entry key is ``"<scope>:<fingerprint>"``: the scope names where a plan may be reused (the
planner's kind and :meth:`cache_key`, the group, the rank; by a digest of its ``repr``), the
fingerprint is a digest of every rank's local plan structure.

The hooks, for planners that have them (:class:`~.standard_planner.StandardPlanner` does), in
the order save calls them, only while plan caching is on for the planner:

1. ``planner._cached_plans_key`` is set to the save's entry key; then ``planner.get_cached()``
   is called once, after the ranks agreed whether the cached plan is used, inside the
   exchange that writes the data (so an exception from it fails every rank alike). It returns
   non-None exactly when the cached plan is used; its value changes nothing (the ranks have
   decided): to stop caching, pass ``enable_plan_caching=False``.
2. On a miss, once the new checkpoint is committed: ``planner.cache_result(final_plan,
   metadata)`` with this rank's plan and the committed :class:`~.metadata.Metadata`. Its base
   implementation is what stores the entry (the plan only: the metadata holds the save's plain
   values, the caller's objects, which the cache would keep alive); an override that does not
   call it caches nothing
   (the next save misses again). It runs after the commit, so only plans that made a
   committed checkpoint are kept, and an exception from it is a warning: the save succeeded.

Both hooks run under one process-wide lock, held from the moment ``_cached_plans_key`` is set
until the hook returns: an async save's copy of a planner calls the hooks of the caller's
object, which a save in the caller's thread may be using at the same time.

A planner without the hooks (another :class:`~.planner.SavePlanner` with a ``cache_key``) has
its plan stored directly at step 2.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from ..coordination.coordinator import Coordinator
from ..format.metadata import Metadata
from .planner import SavePlan

__all__ = ["PLAN_CACHE", "CachedSaveResult", "PlanCache", "entry_key", "entry_prefix", "plan_digest",
           "cache_scope", "cached_plans", "announce_plan", "remember_plan"]

DEFAULT_SIZE = 8


@dataclass(frozen=True)
class CachedSaveResult:
    """One cached plan: this rank's part of a save's global plan (what it writes, with every
    key's entry). ``metadata`` is HyperParallel's field; the entries stored here leave it None
    (a save reusing the plan builds its own metadata from what it writes)."""

    final_plan: SavePlan
    metadata: Metadata | None


class PlanCache(MutableMapping):
    """A bounded, thread-safe ``{entry key: CachedSaveResult}`` map; storing beyond ``size``
    entries drops the least recently stored or used (:meth:`touch`) one."""

    def __init__(self, size: int = DEFAULT_SIZE):
        self.size = size
        self._entries: OrderedDict[str, CachedSaveResult] = OrderedDict()
        self._lock = threading.Lock()

    def __getitem__(self, key: str) -> CachedSaveResult:
        with self._lock:
            return self._entries[key]

    def __setitem__(self, key: str, value: CachedSaveResult) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > max(self.size, 0):
                self._entries.popitem(last=False)

    def __delitem__(self, key: str) -> None:
        with self._lock:
            del self._entries[key]

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __iter__(self) -> Iterator[str]:
        with self._lock:
            return iter(list(self._entries))  # a snapshot: another thread may store meanwhile

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def touch(self, key: str) -> None:
        """Mark an entry as just used, so it is dropped last."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)

    def under(self, prefix: str) -> dict[str, CachedSaveResult]:
        """The entries whose key starts with ``prefix``, by the rest of the key (a snapshot)."""
        with self._lock:
            return {k[len(prefix):]: v for k, v in self._entries.items() if k.startswith(prefix)}

    def __repr__(self) -> str:
        return f"PlanCache(size={self.size}, entries={len(self)})"


#: The process-wide plan cache (``StandardPlanner._cached_save_result``).
PLAN_CACHE = PlanCache()


def entry_prefix(scope: Any) -> str:
    """The start of every entry key of ``scope``."""
    return hashlib.sha256(repr(scope).encode()).hexdigest()[:16] + ":"


def entry_key(scope: Any, fingerprint: str) -> str:
    """The entry key of one scope's plan for one set of local plans."""
    return entry_prefix(scope) + fingerprint


def plan_digest(plan: SavePlan) -> str:
    """A fingerprint of a local plan's structure (keys, kinds, dtypes, shapes, boxes), for a
    planner without ``structure_digest``; every rank's together make an entry's fingerprint."""
    h = hashlib.sha256()
    h.update(repr(sorted(plan.entries.items())).encode())
    h.update(repr([(i.key, i.box) for i in plan.items]).encode())
    h.update(repr(plan.objects).encode())
    return h.hexdigest()


# Held from setting a planner's ``_cached_plans_key`` until its hook returns: an async save's
# copy of a planner calls the hooks of the caller's object, which a save of the caller's own
# may be using at the same time (reentrant: a hook may save).
_HOOKS_LOCK = threading.RLock()


def cache_scope(planner: Any, coord: Coordinator) -> tuple | None:
    """Where a planner's plans may be reused: same planner kind and options (``cache_key()``,
    told apart by its ``repr``), same group (by a token that is never reused), same rank.
    None: this planner is not cached."""
    key = getattr(planner, "cache_key", None)
    if key is None or not getattr(planner, "enable_plan_caching", True):
        return None
    return (type(planner).__module__, type(planner).__qualname__, key(), coord.group_token, coord.rank)


def cached_plans(scope: tuple | None) -> dict[str, CachedSaveResult]:
    """This rank's cached plans for ``scope``, by fingerprint (a snapshot)."""
    return {} if scope is None else PLAN_CACHE.under(entry_prefix(scope))


def announce_plan(planner: Any, scope: tuple | None, fingerprint: str, used: CachedSaveResult | None) -> None:
    """Hook 1: tell the planner what the ranks agreed: ``_cached_plans_key``, then
    ``get_cached()`` once, returning ``used`` (None: a new plan)."""
    if scope is None:
        return
    key = entry_key(scope, fingerprint)
    if used is not None:
        PLAN_CACHE.touch(key)
    planner = getattr(planner, "_plan_cache_owner", planner)
    if not hasattr(planner, "get_cached"):
        return
    with _HOOKS_LOCK:  # the attributes are per call; another thread's save may share the planner
        planner._cached_plans_key = key
        planner._plan_cache_decision = (used,)
        try:
            planner.get_cached()
        finally:
            planner._plan_cache_decision = None


def remember_plan(planner: Any, scope: tuple | None, fingerprint: str, plan: SavePlan, meta: Metadata,
                  where: str | None) -> None:
    """Hook 2, after the commit of a save that made a new plan: ``planner.cache_result``
    (whose base stores it), or store it directly for a planner without that hook. The save
    has succeeded, so a hook that raises is a warning."""
    if scope is None:
        return
    key = entry_key(scope, fingerprint)
    planner = getattr(planner, "_plan_cache_owner", planner)
    hook = getattr(planner, "cache_result", None)
    if hook is None:
        PLAN_CACHE[key] = CachedSaveResult(plan, None)
        return
    try:
        with _HOOKS_LOCK:
            planner._cached_plans_key = key
            hook(plan, meta)
    except Exception as exc:
        warnings.warn(f"save to {where or 'storage'} is committed, but {type(planner).__qualname__}.cache_result "
                      f"raised {type(exc).__name__}: {exc}; the plan may not be cached", stacklevel=3)
