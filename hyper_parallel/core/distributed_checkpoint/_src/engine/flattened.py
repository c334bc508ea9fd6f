"""A call's state dict, flattened once, before its group is known.

A save or load flattens its state dict once, at its start: the leaves serve every step after
it (the group a mesh over some ranks chooses, the planner's view of the state, the load
target filled in place), instead of each step walking the nested state dict again.

Flattening can fail on one rank (a key that is not a string, a Stateful whose
``state_dict()`` raises). Such a failure must fail every rank at once, so it happens inside
the call's first exchange, as if the state were flattened there: :class:`Flattened` holds the
error, and :meth:`Flattened.leaves` raises it where the first phase asks for the leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..state.flatten import FlatLeaves, flatten

__all__ = ["Flattened", "flatten_once"]


@dataclass(frozen=True)
class Flattened:
    """The state dict flattened (``flat``), or the error flattening it raised (``error``)."""

    flat: FlatLeaves | None
    error: BaseException | None

    def leaves(self) -> FlatLeaves:
        """The flattened state; raises what flattening raised (call it inside an exchange)."""
        if self.error is not None:
            raise self.error
        assert self.flat is not None
        return self.flat


def flatten_once(state_dict: Any) -> Flattened:
    """``state_dict`` flattened, its error (any: a KeyboardInterrupt too) kept for the first exchange."""
    try:
        return Flattened(flatten(state_dict), None)
    except BaseException as exc:  # raised again inside the first exchange, where every rank learns of it
        return Flattened(None, exc)
