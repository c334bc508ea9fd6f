"""Strategies: parameter names (exact or glob patterns) -> tensor layouts, the first match wins.

A strategy is what a job's layouts are as a whole: :class:`LayoutStrategy` holds one,
:func:`match_layout` finds a name's entry in any such mapping, and
:func:`get_current_layout` captures the one a model's DTensors have now. Not here: storing a
strategy in a file (``layout_files.py``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ..state.flatten import flatten
from .layout import TensorLayout

__all__ = ["LayoutStrategy", "match_layout", "get_current_layout"]


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
