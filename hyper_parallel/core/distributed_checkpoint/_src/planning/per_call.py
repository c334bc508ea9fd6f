"""The planner one save or load call uses.

A planner object holds one call's state and may be reused by the caller, so each call gets
the planner it may use: one that overrides torch DCP's hook names (which this library's
protocol never calls) is refused, naming what to override instead; ``allow_pickle=True``
applies to the call only (a copy); and a copy (:func:`planner_copy`) keeps running its
plan-cache hooks (:mod:`.plan_cache`) on the caller's object.

What it is not: the protocols themselves (:mod:`.planner`) nor the default planner
(:mod:`.standard_planner`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

from ..base.errors import UnsupportedValueError

__all__ = ["TORCH_HOOKS", "refuse_torch_hooks", "planner_for_call", "planner_copy"]

# torch DCP's planner hooks, which our protocol does not call, and what to override instead
TORCH_HOOKS = {
    "set_up_planner": "transform_state_dict (rename or drop keys; called on save and on load)",
    "create_local_plan": "create_local_save_plan / create_local_load_plan",
    "create_global_plan": "create_global_save_plan",
    "finish_plan": "create_global_save_plan (the plan each rank writes)",
    "transform_tensor": "resolve_data (save) or transform the state dict after load",
    "lookup_tensor": "resolve_data (save) or resolve_target (load)",
    "commit_tensor": "nothing: change the tensors after load() returns",
    "resolve_bytes": "nothing: change the values after load() returns",
    "load_bytes": "nothing: change the values after load() returns",
}


def refuse_torch_hooks(planner: Any) -> None:
    """A planner subclass overriding torch DCP's hook names would be silently ignored (our
    protocol has other names): refuse it, naming the hook and what to override instead."""
    if type(planner).__module__.startswith("torch.distributed.checkpoint"):
        raise UnsupportedValueError(
            f"planner={type(planner).__name__}(): torch.distributed.checkpoint's planners do not fit this library's "
            "planner protocol; pass StandardPlanner() (or a subclass of it) instead")
    for cls in type(planner).__mro__:
        if cls.__module__.startswith(("hyper_parallel.", "torch.")) or cls is object:
            continue
        found = sorted(set(vars(cls)) & TORCH_HOOKS.keys())
        if found:
            name = found[0]
            raise UnsupportedValueError(
                f"{cls.__qualname__}.{name}: a torch.distributed.checkpoint planner hook, which this library's "
                f"planners never call (so it would be silently ignored); override {TORCH_HOOKS[name]} instead "
                "(see StandardPlanner)")


def planner_for_call(planner: Any, allow_pickle: bool) -> Any:
    """The planner to use for one call: ``allow_pickle=True`` applies to this call only, so a
    planner object reused later never inherits it."""
    refuse_torch_hooks(planner)
    if allow_pickle and hasattr(planner, "allow_pickle") and not planner.allow_pickle:
        planner = planner_copy(planner)
        planner.allow_pickle = True
    return planner


def planner_copy(planner: Any) -> Any:
    """A shallow copy of ``planner`` for one call (a planner holds one call's state, and the
    caller may use the object meanwhile) whose plan-cache hooks (:mod:`.plan_cache`) still run
    on the caller's object, where a subclass keeps its counts."""
    dup = copy.copy(planner)
    with contextlib.suppress(AttributeError, TypeError):  # a planner that takes no attributes
        dup._plan_cache_owner = getattr(planner, "_plan_cache_owner", planner)
    return dup
