"""Which of several save plans writes an item they all hold (HyperParallel's
``utils.plan_ownership_masks``).

Ranks that hold the same item (a replicated tensor, a value every rank has) each put it in
their local plan; exactly one of them should write it. The rule, which every rank computes
alike from the gathered plans: items held by one plan stay there; shared items go, largest
first, to the holder with the fewest bytes so far (ties: the lowest plan index), or always to
the lowest holder with ``save_to_minimum_rank``. Our own global plan applies the same rule to
its entries (:class:`.global_plan.GlobalPlan`); this one works on any plans whose items have an
identity: a seed- or torch-form item's ``index``, or our item's key, box and band.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["plan_ownership_masks"]


def _identity(item: Any) -> Any:
    index = getattr(item, "index", None)
    return index if index is not None else (item.key, item.box, getattr(item, "sub", 0))


def _size(item: Any) -> int:
    sizer = getattr(item, "tensor_storage_size", None)
    size = sizer() if callable(sizer) else getattr(item, "nbytes", None)
    return int(size) if size else 1  # an item without a size (bytes, objects) still counts


def plan_ownership_masks(all_plans: Sequence[Any], save_to_minimum_rank: bool = False) -> list[bytearray]:
    """One mask per plan, parallel to its ``items``: 1 where that plan writes the item, 0 where
    another holder of the same item writes it.

    Args:
        all_plans: the local plans of every rank, in rank order (anything with ``items``).
        save_to_minimum_rank: give a shared item to its lowest plan index instead of the
            least-loaded holder.

    Example::

        masks = plan_ownership_masks([plan0, plan1])   # an item in both: [1] and [0], or [0] and [1]
        plan0_writes = [it for it, keep in zip(plan0.items, masks[0]) if keep]
    """
    holders: dict[Any, list[tuple[int, int]]] = {}  # identity -> [(plan index, position)]
    sizes: dict[Any, int] = {}
    for p, plan in enumerate(all_plans):
        for pos, item in enumerate(plan.items):
            key = _identity(item)
            if key not in holders:
                holders[key], sizes[key] = [], _size(item)
            holders[key].append((p, pos))
    masks = [bytearray(len(plan.items)) for plan in all_plans]
    load = [0] * len(all_plans)
    shared = []
    for key, where in holders.items():
        if len(where) == 1:
            p, pos = where[0]
            masks[p][pos] = 1
            load[p] += sizes[key]
        else:
            shared.append(key)
    if not save_to_minimum_rank:
        shared.sort(key=lambda k: sizes[k], reverse=True)  # stable: equal sizes keep plan order
    for key in shared:
        where = holders[key]
        p, pos = where[0] if save_to_minimum_rank else min(where, key=lambda w: (load[w[0]], w[0]))
        masks[p][pos] = 1
        load[p] += sizes[key]
    return masks
