"""The load target: checked against the checkpoint, prepared, and filled.

Before reading: the keys the target asks for must exist (:func:`check_keys`; ``strict``), and
targets on the meta device get memory of their own, as the target is flattened once into the
planner's view of it (:func:`prepare_target`). After
reading: ``strict="all"`` checks that every checkpoint key was asked for by some rank
(:func:`asked_for`, :func:`check_all_asked_for`), and the loaded values are put back where the
target's leaves came from, then Stateful objects load (:func:`apply_loaded`).

What it is not: the per-entry checks of shapes, dtypes and kinds, which the planner makes
while planning (:mod:`..planning.standard_planner`, :mod:`..planning.leaves`).
"""

from __future__ import annotations

import warnings
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..base.errors import StateDictMismatchError, UnsupportedValueError
from ..format import metadata as md
from ..sharding.sharded_tensor import local_tensors
from ..state.flatten import FlatLeaves, FlatStateDict, Leaf, is_stateful, update_in_place
from ..state.version_stamp import mark_written

__all__ = ["Target", "prepare_target", "check_keys", "asked_for", "check_all_asked_for", "apply_loaded", "assign_back"]


@dataclass
class Target:
    """A load target, flattened once: ``flat`` its leaves (where loaded values go back, and its
    Stateful objects), ``view`` the ``{key: value}`` the planner plans against, and
    ``materialized`` the leaves (by key) whose meta-device tensors were replaced."""

    flat: FlatLeaves
    view: FlatStateDict
    materialized: dict[str, Leaf]


def prepare_target(flat: FlatLeaves) -> Target:
    """The target ready to plan against, in one pass over its leaves.

    Targets on the meta device (a model built under ``torch.device("meta")``) hold no memory
    to load into: each such leaf gets an empty tensor of its shape and dtype instead (a DTensor
    keeps its mesh and placements, on the mesh's device; a plain tensor goes to the CPU), as
    torch DCP does. The caller's containers receive them only once the load succeeded
    (:func:`apply_loaded`); the caller then puts them into the model
    (``model.load_state_dict(sd, assign=True)``)."""
    view = FlatStateDict()
    view.paths = {}
    materialized: dict[str, Leaf] = {}
    for key, leaf in flat.leaves.items():
        value = leaf.value
        if isinstance(value, torch.Tensor) and value.device.type == "meta":
            _materialize(key, leaf)
            materialized[key] = leaf
        view[key] = leaf.value
        view.paths[key] = leaf.path
    return Target(flat, view, materialized)


def _materialize(key: str, leaf: Leaf) -> None:
    value = leaf.value
    if leaf.set is None:
        raise UnsupportedValueError(f"{key!r}: the target is on the meta device and cannot be replaced "
                                    "where it sits; materialize it first (model.to_empty(device=...))")
    if isinstance(value, DTensor):
        local = torch.empty_like(value._local_tensor, device=value.device_mesh.device_type)
        leaf.value = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                        shape=value.shape, stride=value.stride())
    else:
        leaf.value = torch.empty_like(value, device="cpu")


def asked_for(meta: md.Metadata, planner: Any) -> bytes:
    """A bitmap over the checkpoint's sorted keys: those this rank's target asked for."""
    keys = sorted(meta.entries)
    asked = set(meta.entries) - set(getattr(planner, "unexpected_keys", []))
    bits = bytearray(-(-len(keys) // 8))
    for i, k in enumerate(keys):
        if k in asked:
            bits[i // 8] |= 1 << (i % 8)
    return bytes(bits)


def check_all_asked_for(meta: md.Metadata, bitmaps: list[bytes]) -> None:
    """``strict="all"``: every checkpoint key must be asked for by some rank (the union of
    every rank's :func:`asked_for` bitmap)."""
    keys = sorted(meta.entries)
    union = bytearray(-(-len(keys) // 8))
    for b in bitmaps:
        for i, x in enumerate(b):
            union[i] |= x
    left = [k for i, k in enumerate(keys) if not union[i // 8] >> (i % 8) & 1]
    if left:
        raise StateDictMismatchError(
            f"load(strict='all'): {len(left)} checkpoint key(s) were asked for by no rank: "
            f"{', '.join(map(repr, left[:20]))}{' ...' if len(left) > 20 else ''}")


def apply_loaded(target: Target, values: dict[str, Any], planner: Any) -> None:
    """Put loaded values where the target's leaves came from, then call Stateful loads.

    Keys are the planner's; ``planner.original_key`` maps each back to the target's key
    (planners that rename keys on load implement it). One pass over ``values``; the target's
    leaves are looked up by key, not walked.
    """
    flat = target.flat
    original = getattr(planner, "original_key", None)
    own: set[int] | None = None  # the targets' values, by id: needed only for a key no target name maps to
    filled: set[int] = set()
    for key, value in values.items():
        name = original(key) if original is not None else key
        leaf = flat.leaves.get(name) if name is not None else None
        if leaf is None:
            if name is None:
                own = {id(leaf.value) for leaf in flat.leaves.values()} if own is None else own
                if id(value) not in own:
                    raise StateDictMismatchError(
                        f"{key!r}: the planner's transform_state_dict renamed a target key to it, and which one "
                        "cannot be told (several keys hold the same value); override transform_key instead so "
                        "the loaded value can be put back")
            continue
        if id(leaf) not in filled:  # filled in place, some straight from storage: torch must know
            filled.add(id(leaf))
            for tensor in local_tensors(leaf.value):  # a ShardedTensor's data lives in its local shards
                mark_written(tensor)
        if value is leaf.value:
            continue
        if isinstance(leaf.value, dict) and isinstance(value, dict):  # a plain dict stored whole
            update_in_place(leaf.value, value)  # the caller may hold it (a data position)
        elif leaf.set is not None:
            leaf.set(value)
    missing = {(original(k) if original is not None else k) or k for k in getattr(planner, "missing_keys", ())}
    for key, leaf in target.materialized.items():  # the tensors that replace meta targets, loaded in place
        local = leaf.value._local_tensor if isinstance(leaf.value, DTensor) else leaf.value
        # one strict=False skipped stays on meta; an empty shard (a rank holding none of an
        # uneven Shard, a size-0 tensor) had nothing to read but is loaded all the same
        if id(leaf) in filled or (not local.numel() and key not in missing):
            leaf.set(leaf.value)
    for obj, inner in flat.statefuls:
        obj.load_state_dict(inner)


def assign_back(state_dict: Any) -> None:
    """End a load as torch's does: each top-level value that is not ``Stateful`` is assigned
    back (``state_dict[key] = loaded``), so a mapping that watches its assignments (a dict
    subclass, a trainer's state container) sees the load. The values were loaded in place, so
    each key gets the object it already holds; ``Stateful`` values were loaded through
    ``load_state_dict`` and are left, as torch leaves them."""
    if isinstance(state_dict, MutableMapping):
        for key, value in list(state_dict.items()):
            if not is_stateful(value):  # the flattening's rule (not the Protocol check: 15 us a value)
                state_dict[key] = value


def check_keys(planner: Any, strict: bool | str) -> None:
    """Keys the target asks for must exist (unless strict=False, which warns); checkpoint keys
    nobody asks for are fine (``strict="all"`` checks those across ranks, after reading)."""
    missing = list(getattr(planner, "missing_keys", []))
    if not missing:
        return
    original = getattr(planner, "original_key", None)

    def named(key: str) -> str:  # a key the planner renamed (topology_mapper) shows both names
        name = original(key) if original is not None else key
        return repr(key) if name in (None, key) else f"{name!r} (checkpoint key {key!r})"

    shown = ", ".join(map(named, missing[:20])) + (f" and {len(missing) - 20} more" if len(missing) > 20 else "")
    if strict:
        raise StateDictMismatchError(
            f"Missing key in checkpoint state_dict: the target asks for key(s) the checkpoint does not hold: "
            f"{shown}. Pass strict=False to load "
            "only the keys that exist")
    warnings.warn(f"load(strict=False) skipped key(s) the checkpoint does not hold: {shown}", stacklevel=3)
