"""A phase's result in two parts: what stays on this rank, and what the exchange carries.

Every phase of a save or a load runs inside a cross-rank exchange
(:meth:`..coordination.coordinator.Coordinator.exchange`), so that a failure on one rank fails
every rank at once. The exchange sends what the phase returns to the other ranks; but a
phase also makes things only its own rank needs next (an open reader, this rank's plan, the
target's flattened leaves), which cannot or should not travel. A phase therefore returns a
pair ``(kept, shared)``: :class:`PhaseResult` hands ``shared`` to the exchange and holds
``kept`` for the caller, so the next phase takes it as an argument instead of reading it
from a list the previous phase appended to.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["PhaseResult"]

K = TypeVar("K")
S = TypeVar("S")

_NOT_RUN: Any = object()


class PhaseResult(Generic[K, S]):
    """``phase`` (returning ``(kept, shared)``) run by an exchange.

    ``coord.exchange(label, result.shared)`` runs the phase on this rank and returns every
    rank's ``shared``; :attr:`kept` is then this rank's ``kept``. :attr:`kept_or_none` serves
    cleanup after the exchange failed (a phase that succeeded here while a peer failed still
    holds what it opened).
    """

    def __init__(self, phase: Callable[[], tuple[K, S]]):
        self._phase = phase
        self._kept: Any = _NOT_RUN

    def shared(self) -> S:
        """Run the phase; keep its first part, return its second (for the exchange)."""
        kept, shared = self._phase()
        self._kept = kept
        return shared

    @property
    def kept(self) -> K:
        if self._kept is _NOT_RUN:
            raise RuntimeError("the phase has not run (or it raised)")
        return self._kept

    @property
    def kept_or_none(self) -> K | None:
        return None if self._kept is _NOT_RUN else self._kept
