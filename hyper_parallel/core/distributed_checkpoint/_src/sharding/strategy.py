"""Strategies: parameter names (exact or glob patterns) -> tensor layouts, the first match wins.

A strategy is what a job's layouts are as a whole: :class:`LayoutStrategy` holds one,
:func:`match_layout` finds a name's entry in any such mapping, and
:func:`get_current_layout` captures the one a model's DTensors have now.
:func:`rank_layout_map` is HyperParallel's older record of the same thing for one rank (plain
dicts, what its ``get_current_layout(cell)`` returns). Not here: storing a strategy in a file
(``layout_files.py``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..state.flatten import flatten
from .layout import TensorLayout

__all__ = ["LayoutStrategy", "match_layout", "get_current_layout", "rank_layout_map"]


class LayoutStrategy(dict):
    """Parameter names (exact or glob patterns) -> :class:`TensorLayout`; the first match wins.

    Example::

        mesh = Layout((4,), ("tp",))
        strategy = LayoutStrategy({"*.wq.weight": mesh("tp", "None"), "*.wo.weight": mesh("None", "tp")})
        strategy.match("layers.0.wq.weight")   # mesh("tp", "None")
    """

    def match(self, name: str) -> TensorLayout | None:
        """The layout of the first key equal to, or glob-matching, ``name``; None if none does."""
        return match_layout(self, name)


def match_layout(strategy: Mapping[str, Any], name: str) -> Any:
    """The value of the first key of ``strategy`` equal to or glob-matching ``name`` (else None)."""
    for pattern, value in strategy.items():
        if pattern == name or fnmatch.fnmatchcase(name, pattern):
            return value
    return None


def get_current_layout(state_dict_or_module: Any) -> LayoutStrategy:
    """The layout of every DTensor in a state dict or module, by flattened key.

    Keys are the checkpoint's keys (nested dicts joined with dots, as :func:`save` names
    them); plain tensors and other values are left out.

    Args:
        state_dict_or_module: a (nested) state dict, or a ``torch.nn.Module`` (its ``state_dict()``).

    Example::

        save_layout(get_current_layout(model), "current.json")
    """
    sd = state_dict_or_module
    if isinstance(sd, torch.nn.Module):
        sd = sd.state_dict()
    out = LayoutStrategy()
    for key, leaf in flatten(sd).leaves.items():
        if isinstance(leaf.value, DTensor):
            out[key] = TensorLayout.from_dtensor(leaf.value)
    return out


def rank_layout_map(named_parameters: Iterable[tuple[str, Any]] | Mapping[str, Any], rank: int,
                    note_missing: Callable[[str, list[str]], Any] | None = None) -> dict[str, dict[str, Any]]:
    """HyperParallel's layout record of one rank: ``{str(rank): {name: info or None}}``.

    ``info`` is a copy of ``param.layout.to_dict()`` with ``mesh_shape`` renamed
    ``device_matrix``, plus ``type`` (``str(param.dtype)``) and ``full_shape``
    (``param.shape``); a parameter whose ``layout`` is empty, or that has no ``layout``
    attribute, maps to None. The names of the latter are passed once to ``note_missing``
    (``note_missing("... %s", names)``, a logger's ``info``).

    Args:
        named_parameters: ``(name, parameter)`` pairs, or a ``{name: parameter}`` mapping.
        rank: the rank the record is for.
        note_missing: told the parameters that have no ``layout`` attribute.

    Raises:
        RuntimeError: a name appears twice.
    """
    pairs = named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters
    out: dict[str, Any] = {}
    missing: list[str] = []
    for name, param in pairs:
        if name in out:
            raise RuntimeError(f"parameter name {name!r} appears twice; each parameter needs its own name")
        if not hasattr(param, "layout"):
            missing.append(name)
        layout = getattr(param, "layout", None)
        if not layout:
            out[name] = None
            continue
        info = dict(layout.to_dict())
        if "mesh_shape" in info:
            info["device_matrix"] = info.pop("mesh_shape")
        info["type"] = str(param.dtype)
        info["full_shape"] = param.shape
        out[name] = info
    if missing and note_missing is not None:
        note_missing("The following parameters have no layout attribute (layout entry is None): %s", missing)
    return {str(rank): out}
