"""torch DCP's default planners as plain configuration: the stand-ins of ours, and the mapping.

The ``default_planner`` face exports torch's own classes. :class:`DefaultSavePlanner` /
:class:`DefaultLoadPlanner` here are what they stand for on our fast path:
:class:`~.standard_planner.StandardPlanner` with torch's constructor signature and defaults
(plan caching off, as in torch).
:func:`as_our_planner` turns what a caller passes as ``planner=`` into a planner of ours: an
instance of torch's own ``DefaultSavePlanner``/``DefaultLoadPlanner`` (or of a subclass that
only sets options in ``__init__``) becomes ours with the same options; a torch planner that
carries code of its own (a subclass overriding torch's hooks, or torch's other planners) is
left as it is for ``save``/``load``, which run it on torch's protocol, and refused, naming the class
and what to override here instead, by callers that do not (``async_save``).

What it is not: the planner protocol (:mod:`.planner`) nor the refusal of torch hook names on
our own planners' subclasses (:mod:`.per_call`).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint import default_planner as _torch_default
from torch.distributed.checkpoint import planner as _torch_planner

from ..base.errors import UnsupportedValueError
from ..base.overrides import foreign_base, own_methods
from .per_call import TORCH_HOOKS
from .standard_planner import StandardPlanner

__all__ = ["DefaultSavePlanner", "DefaultLoadPlanner", "as_our_planner", "leave_set_up"]

# torch DCP's planner hooks beyond those of per_call.TORCH_HOOKS, and what to override instead
_MORE_HOOKS = {
    "transform_object": "transform_state_dict (change values before they are saved)",
    "lookup_object": "resolve_data",
    "resolve_data": "resolve_data (ours takes a WriteItem of this library and returns a tensor or bytes)",
    "resolve_tensor": "nothing: change the tensors after load() returns",
    "_dedup_save_plans": "create_global_save_plan",
    "_create_global_plan": "create_global_save_plan",
}
_HOOKS = {**TORCH_HOOKS, **_MORE_HOOKS}


class DefaultSavePlanner(StandardPlanner):
    """torch DCP's ``DefaultSavePlanner``, with its signature: the standard planner with
    torch's defaults (see :class:`StandardPlanner` for what each option does here).

    Example::

        save(sd, checkpoint_id=path, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 dedup_replicated_tensors: bool | None = None, dedup_save_to_lowest_rank: bool = False,
                 enable_plan_caching: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                         dedup_replicated_tensors=dedup_replicated_tensors,
                         dedup_save_to_lowest_rank=dedup_save_to_lowest_rank, enable_plan_caching=enable_plan_caching)


class DefaultLoadPlanner(StandardPlanner):
    """torch DCP's ``DefaultLoadPlanner``, with its signature. ``allow_partial_load=True``:
    keys of the target missing from the checkpoint are left as they are (``load(strict=False)``).

    Example::

        load(sd, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    """

    def __init__(self, flatten_state_dict: bool = True, flatten_sharded_tensors: bool = True,
                 allow_partial_load: bool = False) -> None:
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=allow_partial_load)


def as_our_planner(planner: Any, what: str, foreign_ok: bool = False) -> Any:
    """The planner of ours that ``planner`` (``what``: "save" or "load") stands for.

    torch's ``DefaultSavePlanner``/``DefaultLoadPlanner`` (or a subclass adding nothing but
    ``__init__``) -> ours with the same options; any other torch planner -> itself with
    ``foreign_ok`` (``save``/``load`` run it on torch's protocol: :mod:`..engine.protocol_run`),
    else an error that names it and says what to use; anything else is returned as it is.

    Raises:
        UnsupportedValueError: a torch planner with code of its own (unless ``foreign_ok``).
    """
    if planner is None:
        return None
    cls = type(planner)
    if foreign_base(cls, "torch.distributed.checkpoint") is None:
        return planner  # ours, or a duck-typed planner (the protocol checks it)
    torch_save, torch_load = _torch_default.DefaultSavePlanner, _torch_default.DefaultLoadPlanner
    base = foreign_base(cls)  # the torch class it extends
    own = own_methods(cls)
    if base is torch_save and not own:
        return DefaultSavePlanner(
            flatten_state_dict=planner.flatten_state_dict, flatten_sharded_tensors=planner.flatten_sharded_tensors,
            dedup_save_to_lowest_rank=planner.dedup_save_to_lowest_rank,
            enable_plan_caching=bool(getattr(planner, "_enable_plan_caching", False)))
    if base is torch_load and not own:
        ours = DefaultLoadPlanner(flatten_state_dict=planner.flatten_state_dict,
                                  flatten_sharded_tensors=planner.flatten_sharded_tensors,
                                  allow_partial_load=planner.allow_partial_load)
        ours.stands_for = planner  # the caller's object, set up after the load (leave_set_up)
        return ours
    if foreign_ok:
        return planner
    name = f"{cls.__module__}.{cls.__qualname__}"
    saving = isinstance(planner, _torch_planner.SavePlanner) or (
        what == "save" and not isinstance(planner, _torch_planner.LoadPlanner))
    ours = "DefaultSavePlanner" if saving else "DefaultLoadPlanner"
    if not own:  # torch's other planners (e.g. _EmptyStateDictLoadPlanner), the bare ABCs, or their subclasses
        raise UnsupportedValueError(
            f"planner={name}: only torch.distributed.checkpoint's DefaultSavePlanner and DefaultLoadPlanner are "
            f"taken as configuration; {base.__qualname__} has behaviour of its own that this library cannot run. "
            f"Pass hyper_parallel's {ours}() (or a subclass of StandardPlanner) instead")
    hooks = "; ".join(f"{h} -> {_HOOKS.get(h, 'one of the SavePlanner/LoadPlanner protocol methods')}" for h in own)
    raise UnsupportedValueError(
        f"planner={name} subclasses torch.distributed.checkpoint's {base.__qualname__} and overrides "
        f"{', '.join(own)}: async_save runs this library's planners, never torch's planner hooks (save and load "
        f"do), so that code would be silently skipped. Subclass hyper_parallel's {ours} (or StandardPlanner) and "
        f"override instead: {hooks}")


def leave_set_up(planner: Any, state_dict: Any, metadata: Any, is_coordinator: bool) -> None:
    """Leave the caller's torch planner that ``planner`` stood in for (see :func:`as_our_planner`)
    as torch's ``load`` leaves it: set up with the loaded state dict and the checkpoint's
    ``Metadata`` (torch code reads ``planner.metadata``/``planner.state_dict`` after a load).
    Nothing for any other planner. ``metadata``: a callable giving the ``Metadata``, asked only
    when there is a planner to set up."""
    caller = getattr(planner, "stands_for", None)
    if caller is not None and state_dict is not None:
        caller.set_up_planner(state_dict, metadata(), is_coordinator)
