"""Nested state dicts <-> flat ``{key: value}`` maps, and back.

A key is the dot-joined path to a leaf (``"model.layers.0.weight"``, ``"optim.state.3.exp_avg"``).
Leaves are tensors, DTensors, numpy arrays, bytes, and any container holding none of those
(kept whole as one value, e.g. an optimizer's ``param_groups``; on load, keys a target dict
has and the saved one lacks are still missing keys). Containers that hold data are
descended. Objects with ``state_dict()``/``load_state_dict()`` (Stateful) are expanded
through their ``state_dict()`` on save, and given their filled state back on load.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..base.errors import UnsupportedValueError

PathPart = Any  # str (dict key) | ("i", n) list index | ("t", n) tuple index | ("k", n) int key


def is_stateful(v: Any) -> bool:
    return (
        not isinstance(v, (torch.Tensor, dict, list, tuple))
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
    )


def _is_data(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray, bytes, bytearray)) or is_stateful(v)


MAX_DEPTH = 100  # containers nested in containers: far beyond any real state dict


def _holds_data(v: Any, memo: dict[int, bool | None], where: str, depth: int = 0) -> bool:
    """Whether a tensor, array, bytes or Stateful sits anywhere inside ``v``. Each container is
    scanned once (``memo`` by id: a list shared 45 levels deep is not 2**45 lists). A container
    met again inside itself, or nesting past :data:`MAX_DEPTH`, is refused naming ``where``."""
    if _is_data(v):
        return True
    if not isinstance(v, (dict, list, tuple)):
        return False
    if id(v) in memo:
        if memo[id(v)] is None:  # still being scanned: we came back round
            raise UnsupportedValueError(f"{where!r} contains itself: a state dict must be a tree")
        return bool(memo[id(v)])
    if depth >= MAX_DEPTH:
        raise UnsupportedValueError(f"{where!r} nests containers more than {MAX_DEPTH} levels deep")
    memo[id(v)] = None
    found = any(_holds_data(x, memo, where, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    memo[id(v)] = found
    return found


def update_in_place(old: dict, new: dict) -> None:
    """Make the dict ``old`` hold ``new``, keeping its nested dicts (a training loop may hold
    ``extra["data"]`` and advance it): a dict in both is updated, not replaced."""
    for k in [k for k in old if k not in new]:
        del old[k]
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict) and old[k] is not v:
            update_in_place(old[k], v)
        else:
            old[k] = v


def path_from_parts(parts: Any) -> tuple[PathPart, ...] | None:
    """A path recorded the way torch DCP (and HyperParallel) record them, dict keys as str
    and list indices as int, in our form (indices as ``("i", n)``); None if it is not one."""
    if not isinstance(parts, tuple) or not parts or not all(
            (isinstance(x, str) and x) or (type(x) is int and x >= 0) for x in parts):
        return None
    return tuple(("i", x) if isinstance(x, int) else x for x in parts)


def prefixed_path(prefix: str, name: str) -> tuple[str, ...]:
    """``("model", "layers.0.weight")`` for prefix ``"model."``: flat names stay one key."""
    return (*(p for p in prefix.split(".") if p), name)


def key_of(path: tuple[PathPart, ...]) -> str:
    return ".".join(p if isinstance(p, str) else str(p[1]) for p in path)


def renamed_path(path: tuple[PathPart, ...], new_key: str) -> tuple[PathPart, ...]:
    """Where a leaf at ``path`` sits once its key is renamed to ``new_key``.

    The dict keys at the start and at the end of ``path`` that ``new_key`` still starts and
    ends with are kept; what lies between becomes one name. ``("optim", "state",
    "layers.0.weight", "exp_avg")`` renamed to ``"optim.state.layers.4.weight.exp_avg"``
    keeps its nesting; ``("model", "layers.0.weight")`` renamed to ``"layers.4.weight"``
    becomes the one flat key of ``model.state_dict()`` style.
    """
    if key_of(path) == new_key:
        return path
    head: list[PathPart] = []
    rest = new_key
    for part in path[:-1]:
        if not isinstance(part, str) or not rest.startswith(part + "."):
            break
        head.append(part)
        rest = rest[len(part) + 1:]
    tail: list[PathPart] = []
    for part in reversed(path[len(head) + 1:]):
        if not isinstance(part, str) or not rest.endswith("." + part) or len(rest) <= len(part) + 1:
            break
        tail.insert(0, part)
        rest = rest[:-len(part) - 1]
    return (*head, rest, *tail)


@dataclass
class Leaf:
    """One flattened value; ``set`` writes a new value back where it came from;
    ``via_stateful``: it came from a Stateful object's ``state_dict()``, not from the
    containers of the state dict itself."""

    path: tuple[PathPart, ...]
    value: Any
    set: Callable[[Any], None] | None = None
    via_stateful: bool = False


@dataclass
class FlatLeaves:
    """What :func:`flatten` returns: every leaf of a state dict by its dotted key (with where it
    sat and how to set it back), plus the Stateful objects found in it (outermost last).

    Not :class:`FlatStateDict`, the ``{key: value}`` dict planners receive, which is built from it.
    """

    leaves: dict[str, Leaf]
    statefuls: list[tuple[Any, Any]]  # (object, the state dict it produced)


class FlatStateDict(dict):
    """``{key: value}`` as planners receive it; ``paths`` remembers where each key sat.

    ``save`` accepts one directly (already flat: no Stateful calls, no re-flattening), which
    is how a staged snapshot keeps the exact keys of the state dict it was taken from (an
    async save's snapshot carries its staging's side data on a subclass of its own, in the
    asynchronous layer).
    """

    paths: dict[str, tuple[PathPart, ...]]

    @classmethod
    def of(cls, flat: FlatLeaves) -> FlatStateDict:
        return cls.from_items({k: (leaf.path, leaf.value) for k, leaf in flat.leaves.items()})

    @classmethod
    def from_items(cls, items: dict[str, tuple[tuple[PathPart, ...], Any]]) -> FlatStateDict:
        out = cls((k, v) for k, (_, v) in items.items())
        out.paths = {k: p for k, (p, _) in items.items()}
        return out


def flatten(state_dict: Any) -> FlatLeaves:
    """Flatten a (nested) state dict; raises on keys that collide once joined by dots."""
    if not isinstance(state_dict, dict):
        raise UnsupportedValueError(
            f"a state dict must be a dict, found {type(state_dict).__name__}"
        )
    leaves: dict[str, Leaf] = {}
    statefuls: list[tuple[Any, Any]] = []
    scanned: dict[int, bool | None] = {}  # container id -> holds data (every one stays alive meanwhile)
    inside: set[int] = set()  # the containers being walked: meeting one again is a cycle
    in_stateful = [0]  # how many Stateful objects' state dicts are being walked

    def holds_data(path: tuple[PathPart, ...], value: Any) -> bool:
        return _holds_data(value, scanned, key_of(path) or "state_dict")

    def add(path: tuple[PathPart, ...], value: Any, setter: Callable[[Any], None] | None) -> None:
        key = key_of(path)
        if key in leaves:
            raise UnsupportedValueError(
                f"two values flatten to the same key {key!r} (paths {leaves[key].path} and "
                f"{path}); rename one of them"
            )
        leaves[key] = Leaf(path, value, setter, in_stateful[0] > 0)

    def walk(path: tuple[PathPart, ...], value: Any, setter: Callable[[Any], None] | None) -> None:
        if not isinstance(value, (dict, list, tuple)):
            return descend(path, value, setter)
        if id(value) in inside:
            raise UnsupportedValueError(f"{key_of(path)!r} contains itself: a state dict must be a tree")
        inside.add(id(value))
        try:
            descend(path, value, setter)
        finally:
            inside.discard(id(value))

    def descend(path: tuple[PathPart, ...], value: Any, setter: Callable[[Any], None] | None) -> None:
        if is_stateful(value):
            inner = value.state_dict()
            if not isinstance(inner, dict):
                raise UnsupportedValueError(
                    f"{key_of(path)!r}: state_dict() of {type(value).__name__} returned "
                    f"{type(inner).__name__}, expected a dict"
                )
            in_stateful[0] += 1
            try:
                for k, v in inner.items():
                    walk_item(path, inner, k, v)
            finally:
                in_stateful[0] -= 1
            statefuls.append((value, inner))
            return
        if isinstance(value, dict) and value and holds_data(path, value):
            for k, v in value.items():
                walk_item(path, value, k, v)
            return
        if isinstance(value, list) and holds_data(path, value):
            for i, v in enumerate(value):
                walk(path + (("i", i),), v, lambda x, c=value, j=i: c.__setitem__(j, x))
            return
        if isinstance(value, tuple) and holds_data(path, value):
            # a tuple cannot change: a new value of an item puts a new tuple where this one sat
            items = list(value)

            def item_setter(x: Any, j: int, items: list = items, like: tuple = value,
                            up: Callable[[Any], None] | None = setter) -> None:
                items[j] = x
                if up is not None:
                    up(like._make(items) if hasattr(like, "_make") else type(like)(items))

            for i, v in enumerate(value):
                walk(path + (("t", i),), v, functools.partial(item_setter, j=i) if setter is not None else None)
            return
        add(path, value, setter)

    def walk_item(path: tuple[PathPart, ...], container: dict, k: Any, v: Any) -> None:
        if isinstance(k, str):
            part: PathPart = k
        elif type(k) is int:
            part = ("k", k)
        else:
            raise UnsupportedValueError(
                f"{key_of(path) or '<root>'!r}: dict key {k!r} must be str or int"
            )
        walk(path + (part,), v, lambda x, c=container, kk=k: c.__setitem__(kk, x))

    for k, v in state_dict.items():
        walk_item((), state_dict, k, v)
    return FlatLeaves(leaves, statefuls)


def unflatten(items: dict[tuple[PathPart, ...], Any]) -> dict[str, Any]:
    """Rebuild the nested structure from ``{path: value}`` (paths as recorded on save)."""
    root: dict[Any, Any] = {}
    for path, value in items.items():
        set_at(root, path, value)
    return _restore_tuples(items, root)


def set_at(root: Any, path: tuple[PathPart, ...], value: Any) -> None:
    """Put ``value`` at ``path`` inside ``root``, making the dicts and lists on the way (a list
    for an index part, padded with None up to the index; tuples stay lists: see :func:`unflatten`)."""
    node: Any = root
    for part, nxt in zip(path[:-1], path[1:], strict=False):
        k = _container_key(part)
        if isinstance(node, dict):
            if k not in node:
                node[k] = [] if isinstance(nxt, tuple) and nxt[0] in ("i", "t") else {}
            node = node[k]
        else:
            while len(node) <= k:
                node.append(None)
            if node[k] is None:
                node[k] = [] if isinstance(nxt, tuple) and nxt[0] in ("i", "t") else {}
            node = node[k]
    k = _container_key(path[-1])
    if isinstance(node, dict):
        node[k] = value
    else:
        while len(node) <= k:
            node.append(None)
        node[k] = value


def _container_key(part: PathPart) -> Any:
    return part if isinstance(part, str) else part[1]


def _restore_tuples(items: dict[tuple[PathPart, ...], Any], nested: dict[str, Any]) -> dict[str, Any]:
    # Lists whose children were recorded as ("t", n) were tuples on save; innermost first.
    tuple_prefixes = {
        path[:i] for path in items for i, p in enumerate(path) if isinstance(p, tuple) and p[0] == "t"
    }
    for prefix in sorted(tuple_prefixes, key=len, reverse=True):
        parent: Any = nested
        for part in prefix[:-1]:
            parent = parent[_container_key(part)]
        k = _container_key(prefix[-1])
        parent[k] = tuple(parent[k])
    return nested
