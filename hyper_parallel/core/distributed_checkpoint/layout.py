"""Layouts and strategies (HyperParallel's path ``distributed_checkpoint.layout``).

A face over :mod:`._src.sharding.layout`, :mod:`._src.sharding.strategy` and
:mod:`._src.interop.hyper_parallel.layout_files`.

``get_current_layout`` answers both of its callers: given a state dict or a ``torch.nn.Module``
it is ours (:func:`._src.sharding.strategy.get_current_layout`: every DTensor's layout by checkpoint
key); given anything else, a HyperParallel "cell" whose parameters carry a ``layout``, it is
HyperParallel's (:func:`._src.sharding.strategy.rank_layout_map`: ``{str(rank): {name: info or None}}``),
asking this module's ``platform`` for the rank and the cell's parameters and telling
``logger`` which parameters have no layout, all read at call time as HyperParallel's tests patch
them (``layout.platform.get_rank``, ``layout.platform.parameters_dict``, ``layout.logger``).
``save_layout``/``load_layout`` also write and read HyperParallel's plain layout maps as the
JSON they are.
"""

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch

from ...platform import get_platform
from ._src.interop.hyper_parallel.layout_files import load_layout, save_layout
from ._src.sharding.layout import Layout, TensorLayout
from ._src.sharding.strategy import LayoutStrategy, match_layout, rank_layout_map
from ._src.sharding.strategy import get_current_layout as _current_strategy

__all__ = ["Layout", "TensorLayout", "LayoutStrategy", "save_layout", "load_layout", "get_current_layout",
           "get_global_layout", "combine_layout", "match_layout"]

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


def get_global_layout(cell: Any) -> dict[str, dict[str, Any]]:
    """Every rank's :func:`get_current_layout` of a HyperParallel cell, merged: ``{str(rank): {...}}``.

    A collective: every rank of the world calls it (through this module's ``platform``, read at
    call time as HyperParallel's tests patch it).
    """
    gathered: list[Any] = [None] * platform.get_world_size()
    platform.all_gather_object(gathered, get_current_layout(cell))
    merged: dict[str, dict[str, Any]] = {}
    for one in gathered:
        merged.update(one)
    return merged


def combine_layout(directory: str | os.PathLike) -> dict[str, Any]:
    """The layout maps of every ``*.layout`` file in ``directory`` (as :func:`save_layout` wrote
    them, one or more ranks each), merged into one ``{rank: {...}}``.

    Raises:
        ValueError: two files hold the same rank (both named) or a file is not a layout map.
    """
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".layout"):
            continue
        path = os.path.join(directory, name)
        one = load_layout(path)
        if isinstance(one, LayoutStrategy) or not isinstance(one, dict):
            raise ValueError(f"{path}: a layout map ({{rank: {{name: layout}}}}) was expected, "
                             f"not a {type(one).__name__}")
        for rank, params in one.items():
            if rank in merged:
                raise ValueError(f"rank {rank} has a layout in both {source[rank]} and {path}: "
                                 "each rank must be in one .layout file")
            merged[rank], source[rank] = params, path
    return merged
