"""What a pretrained load did: the model tensors loaded and missing, the checkpoint tensors left over.

Both loaders return a :class:`LoadReport`, and the same load gives equal reports whichever ran it.
Names are sorted as :func:`~.weight_conversion.dot_natural_key` sorts them. A model tensor
registered under several names (tied weights) counts as loaded under all of them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from .weight_conversion import dot_natural_key

__all__ = ["LoadReport", "MissingWeightsError", "sorted_names", "check_missing", "log_unexpected"]

logger = logging.getLogger(__name__)

_SHOWN = 20


@dataclass(frozen=True)
class LoadReport:
    """``loaded_keys``: model tensor names filled; ``missing_keys``: model tensor names nothing filled;
    ``unexpected_keys``: checkpoint keys (and converted names) that name no model tensor."""

    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]


class MissingWeightsError(RuntimeError):
    """A strict load would leave model tensors unloaded; ``missing`` names them all."""

    def __init__(self, missing: tuple[str, ...]) -> None:
        self.missing = missing
        shown = ", ".join(missing[:_SHOWN]) + (f", ... ({len(missing) - _SHOWN} more)" if len(missing) > _SHOWN else "")
        super().__init__(f"the checkpoint loads no value for {len(missing)} model tensor(s): {shown}. Check the "
                         "weights_mapping rules (or key_mapping renames) that should produce them, or pass "
                         "strict=False to leave them as they are")


def sorted_names(names: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted(set(names), key=dot_natural_key))


def check_missing(missing: tuple[str, ...], strict: bool) -> None:
    """Raise :class:`MissingWeightsError` for a strict load that misses model tensors."""
    if strict and missing:
        raise MissingWeightsError(missing)


def log_unexpected(unexpected: tuple[str, ...]) -> None:
    if unexpected:
        logger.warning("%d checkpoint tensor(s) name no model tensor and were not loaded: %s", len(unexpected),
                       ", ".join(unexpected[:_SHOWN]))
