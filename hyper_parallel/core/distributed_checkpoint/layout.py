"""Layouts and strategies (seed path ``distributed_checkpoint.layout``).

A face over :mod:`.sharding.layout`, :mod:`.sharding.strategy` and :mod:`.sharding.layout_files`.
"""

from .sharding.layout import Layout, TensorLayout
from .sharding.layout_files import load_layout, save_layout
from .sharding.strategy import LayoutStrategy, get_current_layout, match_layout

__all__ = ["Layout", "TensorLayout", "LayoutStrategy", "save_layout", "load_layout", "get_current_layout",
           "match_layout"]
