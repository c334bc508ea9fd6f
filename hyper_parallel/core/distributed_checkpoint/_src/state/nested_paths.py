"""Nested state dicts walked the way HyperParallel's and torch DCP's helpers walk them.

HyperParallel's ``utils.traverse_state_dict`` / ``flatten_state_dict`` / ``set_element`` name a
leaf by its *object path*: a tuple of dict keys (as str) and list indices (as int), e.g.
``("model", "layers", 0, "weight")``; its flat key is that path joined by dots. Their rule
for what a leaf is differs from our save's (:mod:`.flatten`): every mapping is descended,
even one without tensors (an empty one yields nothing), and a list or tuple is descended only
when it holds a tensor or a mapping somewhere; otherwise it is one leaf. Code written against
HyperParallel's DCP relies on that rule, so it is kept here; our save and load keep theirs.

:func:`set_element` shares :func:`.flatten.set_at` with our load's :func:`.flatten.unflatten`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from .flatten import PathPart, set_at

ObjPath = tuple[Any, ...]  # dict keys as str, list indices as int

__all__ = ["ObjPath", "traverse_state_dict", "flatten_state_dict", "set_element"]


def _is_leaf_sequence(value: Any) -> bool:
    """Whether a list or tuple is one leaf: nothing inside it is a tensor or a mapping."""
    for entry in value:
        if isinstance(entry, (torch.Tensor, Mapping)):
            return False
        if isinstance(entry, (list, tuple)) and not _is_leaf_sequence(entry):
            return False
    return True


def traverse_state_dict(state_dict: Mapping[Any, Any], visitor: Callable[[ObjPath, Any], None]) -> None:
    """Call ``visitor(path, value)`` for every leaf of ``state_dict``, depth first in dict order.

    Args:
        state_dict: a mapping; keys become ``str`` in paths, list positions ``int``.
        visitor: called once per leaf with its object path and value.

    Example::

        traverse_state_dict({"a": {"b": t}, "c": [1, 2]}, print)
        # ('a', 'b') t
        # ('c',) [1, 2]          (a list of plain values is one leaf)
    """

    def walk(path: ObjPath, value: Any) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(path + (str(k),), v)
        elif isinstance(value, (list, tuple)) and not _is_leaf_sequence(value):
            for i, v in enumerate(value):
                walk(path + (i,), v)
        else:
            visitor(path, value)

    for key, value in state_dict.items():
        walk((str(key),), value)


def flatten_state_dict(state_dict: Mapping[Any, Any]) -> tuple[dict[str, Any], dict[str, ObjPath]]:
    """``({dotted key: leaf}, {dotted key: object path})`` of a nested state dict.

    Raises:
        ValueError: two leaves join to the same dotted key (``{"a": {"b.c": 1}, "a.b": {"c": 2}}``);
            the message names the key and both paths, so one of them can be renamed.

    Example::

        flat, paths = flatten_state_dict({"model": {"weight": w}})
        flat["model.weight"] is w; paths["model.weight"] == ("model", "weight")
    """
    flat: dict[str, Any] = {}
    paths: dict[str, ObjPath] = {}

    def add(path: ObjPath, value: Any) -> None:
        key = ".".join(map(str, path))
        if key in flat:
            raise ValueError(f"Duplicate flattened FQN {key!r}: the paths {paths[key]} and {path} both join to it; "
                             "rename one of the keys so that the dotted names differ")
        flat[key] = value
        paths[key] = path

    traverse_state_dict(state_dict, add)
    return flat, paths


def set_element(root_dict: Any, path: ObjPath, value: Any) -> None:
    """Put ``value`` at the object ``path`` inside ``root_dict``, making missing dicts (for a
    str part) and lists (for an int part, padded with None) on the way; the inverse of
    :func:`flatten_state_dict`'s paths.

    Raises:
        ValueError: ``path`` is empty.

    Example::

        root = {}
        set_element(root, ("model", "layers", 0, "weight"), w)   # {"model": {"layers": [{"weight": w}]}}
    """
    if not path:
        raise ValueError("set_element needs a non-empty path (the keys from root_dict down to the value)")
    ours: tuple[PathPart, ...] = tuple(("i", p) if isinstance(p, int) and not isinstance(p, bool) else p
                                       for p in path)
    set_at(root_dict, ours, value)
