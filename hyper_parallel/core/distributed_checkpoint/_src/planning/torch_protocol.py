"""torch DCP's planner protocol as ``save``/``load`` run it: which planners speak it, which torch
planner stands for ours, our ``strict`` on torch's load planner, and torch's byte loading made safe.

A planner "speaks torch's protocol" when it is an instance of torch's ``SavePlanner``/``LoadPlanner``
ABC or has its methods (``set_up_planner``, ``create_local_plan``, ``create_global_plan``,
``finish_plan`` and ``resolve_data``, or ``resolve_tensor``/``commit_tensor``/``load_bytes``): the
engine then runs it through :mod:`..engine.protocol_run`, calling its hooks. Where that procedure
runs with a planner of ours (a torch-protocol storage object, or a checkpoint in torch's format),
:func:`torch_save_planner`/:func:`torch_load_planner` give torch's default planner with the same
options; our planners' own hooks (a subclass overriding ``transform_state_dict`` ...) cannot run
on torch's plans and are refused, naming them.

:class:`StrictLoadPlanner` is torch's ``DefaultLoadPlanner`` with this library's ``strict``:
``True`` fails naming every key the target asks for that the checkpoint lacks
(:class:`~..base.errors.StateDictMismatchError`), ``False`` loads the rest and warns, ``"all"``
also fails when a checkpoint key is asked for by no rank; a size mismatch names the key.

:func:`safe_byte_loads`: torch's ``DefaultLoadPlanner.load_bytes`` unpickles byte items with
``weights_only=False``; while a load runs, a planner that inherits it (torch's own, a subclass
that does not override ``load_bytes``) gets one that decodes with ``weights_only=True``
instead (``allow_pickle=True``: the caller's opt-in to torch's way).

What it is not: the mapping of torch's unmodified planners onto our fast path
(:mod:`.torch_planners`), HyperParallel's newer protocol names (:mod:`.hyper_parallel_protocol`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import default_planner as _torch_default
from torch.distributed.checkpoint import planner as _torch_planner
from torch.distributed.checkpoint._traverse import set_element

from ..base.errors import StateDictMismatchError, UnsupportedValueError
from ..base.overrides import own_methods
from ..format.torch_pickles import load_bytes_item
from .load_planner import BoxLoadPlanner
from .save_planner import BoxSavePlanner

__all__ = ["is_torch_planner", "torch_save_planner", "torch_load_planner", "StrictLoadPlanner", "safe_byte_loads"]

_COMMON = ("set_up_planner", "create_local_plan", "create_global_plan", "finish_plan")
_SAVE = (*_COMMON, "resolve_data")
_LOAD = (*_COMMON, "resolve_tensor", "commit_tensor", "load_bytes")


def is_torch_planner(planner: Any, what: str) -> bool:
    """Whether ``planner`` speaks torch's planner protocol for ``what`` ("save" or "load"): an
    instance of torch's ABC, or an object with every method of it."""
    if planner is None:
        return False
    abc = _torch_planner.SavePlanner if what == "save" else _torch_planner.LoadPlanner
    if isinstance(planner, abc):
        return True
    return all(callable(getattr(planner, m, None)) for m in (_SAVE if what == "save" else _LOAD))


def _refuse_own_code(planner: Any, what: str) -> None:
    """Our planner's hooks or options that torch's default planner cannot carry out are refused."""
    own = own_methods(type(planner), "hyper_parallel.")
    options = [o for o, unset in (("topology_mapper", None), ("convert_dtype", True))
               if getattr(planner, o, unset) != unset]
    if options:
        raise UnsupportedValueError(
            f"planner={type(planner).__qualname__}({', '.join(f'{o}=...' for o in options)}): this {what} runs on "
            "torch DCP's planner protocol (a torch-protocol storage object, or a checkpoint in torch's format), where "
            "torch's default planner stands for ours and has no such option. Rename keys with a planner on torch's "
            "protocol (override set_up_planner), or convert the checkpoint once with import_torch_dcp")
    if own:
        raise UnsupportedValueError(
            f"planner={type(planner).__qualname__} overrides {', '.join(own)} of this library's planner, whose hooks "
            f"cannot run on torch's plans; this {what} runs on torch DCP's planner protocol (a torch-protocol "
            "storage object, or a checkpoint in torch's format). Pass a planner on torch's protocol (a subclass of "
            "torch's DefaultSavePlanner/DefaultLoadPlanner), or none")


def torch_save_planner(planner: Any) -> Any:
    """The torch-protocol save planner for ``planner``: itself when it speaks torch's protocol;
    torch's ``DefaultSavePlanner`` for None or for this library's planner (with its options:
    ``flatten_state_dict``, ``dedup_save_to_lowest_rank``).

    Raises UnsupportedValueError: a planner of ours with hooks of its own."""
    if is_torch_planner(planner, "save"):
        return planner
    if planner is None:
        return _torch_default.DefaultSavePlanner()
    if not isinstance(planner, BoxSavePlanner):
        raise UnsupportedValueError(f"planner={type(planner).__qualname__} speaks neither torch DCP's SavePlanner "
                                    "protocol nor this library's; pass one of either")
    _refuse_own_code(planner, "save")
    return _torch_default.DefaultSavePlanner(
        flatten_state_dict=getattr(planner, "flatten_state_dict", True),
        dedup_save_to_lowest_rank=getattr(planner, "dedup_save_to_lowest_rank", False))


def torch_load_planner(planner: Any, *, whole: bool, strict: bool | str = True) -> Any:
    """The torch-protocol load planner for ``planner``: itself when it speaks torch's protocol;
    for None or this library's planner, torch's ``_EmptyStateDictLoadPlanner`` when ``whole``
    (no target: everything the checkpoint holds, nested as saved), else a :class:`StrictLoadPlanner`
    with ``strict`` (``allow_partial_load=True`` on ours reads as ``strict=False``).

    Raises UnsupportedValueError: a planner of ours with hooks of its own."""
    if is_torch_planner(planner, "load"):
        return planner
    if planner is not None:
        if not isinstance(planner, BoxLoadPlanner):
            raise UnsupportedValueError(f"planner={type(planner).__qualname__} speaks neither torch DCP's LoadPlanner "
                                        "protocol nor this library's; pass one of either")
        _refuse_own_code(planner, "load")
        if getattr(planner, "allow_partial_load", False) and strict is True:
            strict = False
    if whole:
        return _torch_default._EmptyStateDictLoadPlanner()
    flat = getattr(planner, "flatten_state_dict", True) if planner is not None else True
    return StrictLoadPlanner(strict=strict, flatten_state_dict=flat)


class StrictLoadPlanner(_torch_default.DefaultLoadPlanner):
    """torch's ``DefaultLoadPlanner`` with this library's ``strict`` (see the module docstring).

    Example::

        load(sd, checkpoint_id=torch_dir, planner=StrictLoadPlanner(strict=False))
    """

    def __init__(self, strict: bool | str = True, flatten_state_dict: bool = True,
                 flatten_sharded_tensors: bool = True) -> None:
        if strict not in (True, False, "all"):
            raise ValueError(f"strict must be True, False or 'all', found {strict!r}")
        super().__init__(flatten_state_dict=flatten_state_dict, flatten_sharded_tensors=flatten_sharded_tensors,
                         allow_partial_load=True)
        self.strict = strict

    def create_local_plan(self) -> _torch_planner.LoadPlan:
        try:
            plan = super().create_local_plan()
        except ValueError as exc:  # torch's size check: name it as ours does
            raise StateDictMismatchError(f"load: {exc}; the target's shape must be the saved one") from None
        saved = self.metadata.state_dict_metadata
        missing = [k for k in self.state_dict if k not in saved]
        if missing:
            shown = ", ".join(map(repr, missing[:20])) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
            if self.strict:
                raise StateDictMismatchError("Missing key in checkpoint state_dict: the target asks for key(s) the "
                                             f"checkpoint does not hold: {shown}. "
                                             "Pass strict=False to load only the keys that exist")
            warnings.warn(f"load(strict=False) skipped key(s) the checkpoint does not hold: {shown}", stacklevel=2)
        if self.strict == "all":
            plan = dataclasses.replace(plan, planner_data=sorted(k for k in self.state_dict if k in saved))
        return plan

    def create_global_plan(self, global_plan: list[_torch_planner.LoadPlan]) -> list[_torch_planner.LoadPlan]:
        if self.strict == "all":
            asked = set().union(*(p.planner_data or () for p in global_plan))
            left = sorted(k for k in self.metadata.state_dict_metadata if k not in asked)
            if left:
                raise StateDictMismatchError(
                    f"load(strict='all'): {len(left)} checkpoint key(s) were asked for by no rank: "
                    f"{', '.join(map(repr, left[:20]))}{' ...' if len(left) > 20 else ''}")
            global_plan = [dataclasses.replace(p, planner_data=None) for p in global_plan]
        return super().create_global_plan(global_plan)


def _decoded_bytes(planner: Any, allow_pickle: bool) -> Any:
    """``load_bytes`` doing what torch's default does with the value, decoded safely."""
    def load_bytes(read_item: Any, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        obj = load_bytes_item(value.getbuffer(), key, "byte item", allow_pickle)
        if planner.flatten_state_dict:
            set_element(planner.original_state_dict, planner.mappings[key], obj)
        else:
            planner.state_dict[key] = obj

    return load_bytes


@contextlib.contextmanager
def safe_byte_loads(planner: Any, allow_pickle: bool = False) -> Iterator[Any]:
    """While the block runs, ``planner`` (when it inherits torch's ``DefaultLoadPlanner.load_bytes``,
    which unpickles with ``weights_only=False``) decodes byte items with ``weights_only=True``
    (numpy arrays admitted; ``allow_pickle``: plainly). A planner's own ``load_bytes`` is the
    caller's code and runs as written. Restored afterwards; yields ``planner``."""
    inherited = getattr(type(planner), "load_bytes", None) is _torch_default.DefaultLoadPlanner.load_bytes
    if not inherited or "load_bytes" in vars(planner):
        yield planner
        return
    planner.load_bytes = _decoded_bytes(planner, allow_pickle)
    try:
        yield planner
    finally:
        with contextlib.suppress(AttributeError):
            del planner.load_bytes
