"""Layouts and strategies (seed path ``distributed_checkpoint.layout``).

A face over :mod:`.sharding.layout`, :mod:`.sharding.strategy` and :mod:`.sharding.layout_files`.

``get_current_layout`` answers both of its callers: given a state dict or a ``torch.nn.Module``
it is ours (:func:`.sharding.strategy.get_current_layout`: every DTensor's layout by checkpoint
key); given anything else, a HyperParallel "cell" whose parameters carry a ``layout``, it is
HyperParallel's (:func:`.sharding.strategy.rank_layout_map`: ``{str(rank): {name: info or None}}``),
asking this module's ``platform`` for the rank and the cell's parameters and telling
``logger`` which parameters have no layout, all read at call time as HyperParallel's tests patch
them (``layout.platform.get_rank``, ``layout.platform.parameters_dict``, ``layout.logger``).
``save_layout``/``load_layout`` also write and read HyperParallel's plain layout maps as the
JSON they are.
"""

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ...platform import get_platform
from .sharding.layout import Layout, TensorLayout
from .sharding.layout_files import load_layout, save_layout
from .sharding.strategy import LayoutStrategy, match_layout, rank_layout_map
from .sharding.strategy import get_current_layout as _current_strategy

__all__ = ["Layout", "TensorLayout", "LayoutStrategy", "save_layout", "load_layout", "get_current_layout",
           "match_layout"]

platform = get_platform()
logger = logging.getLogger(__name__)


def get_current_layout(state_dict_or_cell: Any) -> LayoutStrategy | dict[str, dict[str, Any]]:
    """The layouts a model has now.

    A state dict or ``torch.nn.Module``: a :class:`LayoutStrategy` of every DTensor by its
    flattened key. Any other object (HyperParallel's cell): ``{str(rank): {name: info or None}}``
    over ``platform.parameters_dict(cell)``, ``info`` being the parameter's
    ``layout.to_dict()`` with ``mesh_shape`` named ``device_matrix``, its ``type`` and
    ``full_shape``.

    Example::

        save_layout(get_current_layout(model), "current.json")
    """
    if isinstance(state_dict_or_cell, (Mapping, torch.nn.Module)):
        return _current_strategy(state_dict_or_cell)
    rank = platform.get_rank()
    return rank_layout_map(platform.parameters_dict(state_dict_or_cell), rank, logger.info)
