"""Layouts and strategies (seed path ``distributed_checkpoint.layout``).

A face over :mod:`.sharding.layout`.
"""

from .sharding.layout import (
    Layout,
    LayoutStrategy,
    TensorLayout,
    get_current_layout,
    load_layout,
    match_layout,
    save_layout,
)

__all__ = ["Layout", "TensorLayout", "LayoutStrategy", "save_layout", "load_layout", "get_current_layout",
           "match_layout"]
